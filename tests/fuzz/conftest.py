"""Hypothesis profiles of the fuzz campaign (the property tests of this folder).

* ``ci`` (the default): few examples from a fixed seed (``derandomize=True``), so every run draws the same inputs
  and the folder stays within a few minutes under Triton's interpreter on two cores.
* ``long``: ``LIK_FUZZ_PROFILE=long`` (``make fuzz``): many examples (``LIK_FUZZ_EXAMPLES``, default 200, per
  property and path) from a fresh seed each run, the failure database kept in ``.hypothesis/`` and the
  reproduction blob printed, for a soak run by hand.

The profiles are applied per test through :func:`tests.fuzz.common.fuzz_settings`, never loaded globally, so the
other hypothesis tests of the suite keep their own settings when run in the same session.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILE_VARIABLE = "LIK_FUZZ_PROFILE"
EXAMPLES_VARIABLE = "LIK_FUZZ_EXAMPLES"
PROFILES = ("ci", "long")

# Kernel calls under the interpreter take up to a second: no deadline, and slow draws are expected.
_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

settings.register_profile("lik-fuzz-ci", max_examples=30, derandomize=True, database=None, print_blob=False,
                          **_COMMON)

_profile = os.environ.get(PROFILE_VARIABLE, "ci")
if _profile not in PROFILES:
    raise ValueError(f"{PROFILE_VARIABLE} must be one of {PROFILES}, got {_profile!r}")
_examples = os.environ.get(EXAMPLES_VARIABLE, "200")
if not _examples.isdigit() or int(_examples) < 1:
    raise ValueError(f"{EXAMPLES_VARIABLE} must be a positive integer, got {_examples!r}")

settings.register_profile("lik-fuzz-long", max_examples=int(_examples), derandomize=False, print_blob=True,
                          **_COMMON)
