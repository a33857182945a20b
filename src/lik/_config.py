"""The former home of the launch heuristics, kept so that ``lik._config.override(...)`` and the names below still
work. New code imports :mod:`lik.config` (heuristics, :func:`lik.config.override`) and :mod:`lik._device` (device
queries).

Older tests pretend to be on another GPU by setting ``interpreting`` / ``_arch`` on this module; such a setting is
passed on to :mod:`lik._device`, where the heuristics read them.
"""

from __future__ import annotations

import sys
import types

from . import _device
from ._device import cdiv, interpreting, next_power_of_2, shared_memory, sm_count
from .config import *  # noqa: F403
from .config import __all__ as _config_names
from .config.forced import FORCED as _OVERRIDES  # noqa: F401 (read by older code)
from .config.maxsim import EIGHT_BIT_DTYPES, STREAMED_FIXED_BYTES

__all__ = [*_config_names, "EIGHT_BIT_DTYPES", "STREAMED_FIXED_BYTES", "interpreting", "sm_count", "shared_memory",
           "cdiv", "next_power_of_2"]

_arch = _device.arch
_PASSED_ON = {"interpreting": "interpreting", "_arch": "arch"}  # name here -> name in lik._device


class _PassingOn(types.ModuleType):
    def __setattr__(self, name, value):
        if name in _PASSED_ON:
            setattr(_device, _PASSED_ON[name], value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _PassingOn
