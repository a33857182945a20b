"""late-interaction-kernels' ``patch_pylate`` / ``unpatch_pylate`` on lik: lik's own PyLate switch."""

from __future__ import annotations

__all__ = ["patch_pylate", "unpatch_pylate"]


def patch_pylate() -> None:
    """Make PyLate score with lik: :func:`lik.integrations.pylate.enable` (every PyLate scoring call site:
    ``pylate.scores``, the losses, ``rank.rerank``, ``retrieve.ColBERT``; see its docstring for exactly what
    changes). Idempotent. Raises ImportError (with the pip command) when PyLate is not installed."""
    from .. import pylate

    pylate.enable()


def unpatch_pylate() -> None:
    """Undo :func:`patch_pylate`: :func:`lik.integrations.pylate.disable`."""
    from .. import pylate

    pylate.disable()
