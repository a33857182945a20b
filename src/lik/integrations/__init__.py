"""lik inside the libraries people already use: one module per host library, each importing its host lazily.

* :mod:`lik.integrations.pylate` -- PyLate's ``colbert_scores`` / ``colbert_kd_scores`` / ``colbert_scores_pairwise``
  / ``ColBERTScores`` drop-ins, and ``enable()`` (every PyLate scoring call site: losses, rerank, retrieval).
* :mod:`lik.integrations.colpali` -- colpali-engine's ``score_multi_vector`` and the in-batch / KD MaxSim of its
  ``ColbertLoss`` family, and ``enable()``.
* :mod:`lik.integrations.sentence_transformers` -- ``util.maxsim`` / ``maxsim_pairwise`` (and the MeanMaxSim
  forms) of sentence-transformers 6, and ``enable()``.
* :mod:`lik.integrations.transformers` -- the ``MultiScaleDeformableAttention`` module of Deformable DETR,
  Grounding DINO, RT-DETR..., and ``enable()`` so every such model uses it (RT-DETRv2, D-FINE and DEIMv2's
  variant too).
* :mod:`lik.integrations.hf_kernels` -- the same layer served to Hugging Face ``kernels.kernelize`` (a kernel
  mapping and a local kernel repository), so a transformers model picks lik without patching.
* :mod:`lik.integrations.flash_maxsim` / :mod:`lik.integrations.late_interaction_kernels` -- the public functions
  of the two peer libraries, for people migrating.

Each switch is one line, undone by ``disable()`` or scoped with ``with <module>.enabled(): ...``. A switch rebinds
no name: it switches the host's own functions in place (:mod:`lik.integrations._patching`), so every object follows
it whenever it was built, ``disable()`` reaches them all, and a model pickled meanwhile names only the host::

    import lik.integrations.pylate as lik_pylate
    lik_pylate.enable()

Importing this package imports no host library; a submodule imports its host only when a switch is thrown.
"""

from __future__ import annotations

import importlib

__all__ = ["pylate", "colpali", "sentence_transformers", "transformers", "hf_kernels", "flash_maxsim",
           "late_interaction_kernels"]


def __getattr__(name: str):
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
