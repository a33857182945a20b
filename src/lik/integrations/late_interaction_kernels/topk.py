"""late-interaction-kernels' ``topk.maxsim_topk`` on lik: :func:`retrieve` without its normalisation default."""

from __future__ import annotations

import torch

from .scoring import top_documents

__all__ = ["maxsim_topk"]


def maxsim_topk(Q: torch.Tensor, D: torch.Tensor, k: int, q_mask: torch.Tensor | None = None,
                d_mask: torch.Tensor | None = None, *, normalize: bool = False, chunk_size: int | None = None,
                largest: bool = True, sorted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` documents per query (late-interaction-kernels' ``maxsim_topk``), inference only.

    Args:
        Q: ``[Nq, Lq, d]`` or ``[Lq, d]``; D: ``[Nd, Ld, d]`` or ``[Ld, d]``.
        k: results per query, clamped to ``Nd``; must be positive.
        q_mask, d_mask: optional bool masks. normalize: L2-normalise first (default False, as the peer).
        chunk_size: documents scored at once; None: lik's own memory budget.
        largest: the highest scores (True) or the lowest. sorted: accepted; results are always sorted.

    Returns:
        ``(scores float32 [Nq, k], indices int64 [Nq, k])`` (``[k]`` for 2-D ``Q``), ties by lower index.

    Example:
        >>> scores, ids = maxsim_topk(torch.randn(2, 32, 128), torch.randn(1000, 180, 128), k=10)
    """
    return top_documents(Q, D, k, q_mask, d_mask, normalize=normalize, chunk=chunk_size, largest=largest,
                         k_name="k")
