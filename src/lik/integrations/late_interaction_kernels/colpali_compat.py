"""late-interaction-kernels' ``patch_colpali_engine`` / ``unpatch_colpali_engine`` on lik: lik's own
colpali-engine switch."""

from __future__ import annotations

__all__ = ["patch_colpali_engine", "unpatch_colpali_engine"]


def patch_colpali_engine() -> None:
    """Make colpali-engine score with lik: :func:`lik.integrations.colpali.enable` (``score_multi_vector`` and the
    MaxSim of the ``Colbert*Loss`` family; see its docstring for exactly what changes). Idempotent. Raises
    ImportError (naming the missing module) when colpali-engine cannot be imported."""
    from .. import colpali

    colpali.enable()


def unpatch_colpali_engine() -> None:
    """Undo :func:`patch_colpali_engine`: :func:`lik.integrations.colpali.disable`."""
    from .. import colpali

    colpali.disable()
