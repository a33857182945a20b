"""flash-maxsim's reranking and top-k functions on lik (see :mod:`lik.integrations.flash_maxsim` for what
differs)."""

from __future__ import annotations

import operator

import torch

from ...ops.maxsim import maxsim, maxsim_packed
from ...retrieval import search
from .scoring import _prefix_mask, _tensor

__all__ = ["flash_maxsim_rerank", "flash_maxsim_rerank_direct", "flash_maxsim_rerank_padded", "flash_maxsim_topk"]


def _lengths_mask(name: str, lengths, shape: tuple[int, ...], width: int, device: torch.device):
    """``[*shape, width]`` bool mask of the valid prefixes ``lengths`` (integers of shape ``shape``) mark."""
    if lengths is None:
        return None
    lengths = torch.as_tensor(lengths, device=device)
    if tuple(lengths.shape) != tuple(shape) or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor of shape {list(shape)}, got {lengths.dtype} "
                         f"{list(lengths.shape)}")
    return torch.arange(width, device=device) < lengths[..., None]


def flash_maxsim_rerank(Q: torch.Tensor, D_packed: torch.Tensor, cu_seqlens_d: torch.Tensor,
                        max_seqlen_d: int) -> torch.Tensor:
    """One query ``[Lq, d]`` against packed documents ``D_packed [total_d, d]`` with ``cu_seqlens_d [B + 1]``
    (flash-maxsim's ``flash_maxsim_rerank``) -> float32 ``[B]``, through :func:`lik.maxsim_packed`.

    Example:
        >>> D, cu, max_d = lik.pack([torch.randn(300, 128), torch.randn(57, 128)])
        >>> flash_maxsim_rerank(torch.randn(32, 128), D, cu, max_d).shape
        torch.Size([2])
    """
    _tensor("Q", Q, (2,))
    _tensor("D_packed", D_packed, (2,))
    with torch.no_grad():
        return maxsim_packed(Q, D_packed, cu_seqlens_d, max_seqlen_d=max_seqlen_d)


def flash_maxsim_rerank_direct(Q: torch.Tensor, batch_tensor: torch.Tensor, doc_offsets: torch.Tensor,
                               doc_lengths: torch.Tensor, max_seqlen_d: int) -> torch.Tensor:
    """One query against documents lying anywhere in a token tensor (flash-maxsim's
    ``flash_maxsim_rerank_direct``): document ``i`` is ``batch_tensor[doc_offsets[i] : doc_offsets[i] +
    doc_lengths[i]]``, at most ``max_seqlen_d`` tokens. Returns float32 ``[B]``. The documents' rows are gathered
    into a padded ``[B, max_seqlen_d, d]`` copy (flash-maxsim reads them in place).

    Example:
        >>> tokens = torch.randn(1000, 128)
        >>> flash_maxsim_rerank_direct(torch.randn(32, 128), tokens, torch.tensor([0, 500]),
        ...                            torch.tensor([300, 57]), 300).shape
        torch.Size([2])
    """
    _tensor("Q", Q, (2,))
    _tensor("batch_tensor", batch_tensor, (2,))
    width = operator.index(max_seqlen_d)
    if width < 0:
        raise ValueError(f"max_seqlen_d must be >= 0, got {width}")
    offsets = torch.as_tensor(doc_offsets, device=batch_tensor.device)
    if offsets.dim() != 1 or offsets.dtype.is_floating_point:
        raise ValueError(f"doc_offsets must be an integer tensor [B], got {offsets.dtype} {list(offsets.shape)}")
    valid = _lengths_mask("doc_lengths", doc_lengths, tuple(offsets.shape), width, batch_tensor.device)
    if valid is None:
        raise ValueError("doc_lengths is required: one length per document")
    rows = offsets.long()[:, None] + torch.arange(width, device=batch_tensor.device)
    # Rows past a document's end are masked out; clamp them into the tensor so the gather stays in bounds.
    rows = torch.where(valid, rows, 0).clamp(0, max(batch_tensor.shape[0] - 1, 0))
    with torch.no_grad():
        if batch_tensor.shape[0] == 0:
            return maxsim(Q, batch_tensor.new_zeros(offsets.shape[0], width, batch_tensor.shape[1]), None, valid)
        return maxsim(Q, batch_tensor[rows], None, valid)


def flash_maxsim_rerank_padded(queries: torch.Tensor, documents: torch.Tensor, query_lengths=None,
                               doc_lengths=None) -> torch.Tensor:
    """Each query against its own padded candidates (flash-maxsim's ``flash_maxsim_rerank_padded``):
    ``queries [B, Lq, d]``, ``documents [B, C, Ld, d]``, optional ``query_lengths [B]`` and ``doc_lengths [B, C]``
    -> float32 ``[B, C]``, one fused lik call whatever the lengths.

    Example:
        >>> flash_maxsim_rerank_padded(torch.randn(4, 32, 128), torch.randn(4, 10, 180, 128)).shape
        torch.Size([4, 10])
    """
    _tensor("queries", queries, (3,))
    _tensor("documents", documents, (4,))
    if queries.shape[0] != documents.shape[0]:
        raise ValueError(f"queries and documents must share the batch size B: queries has {queries.shape[0]}, "
                         f"documents {documents.shape[0]}")
    q_mask = _lengths_mask("query_lengths", query_lengths, queries.shape[:1], queries.shape[1], queries.device)
    d_mask = _lengths_mask("doc_lengths", doc_lengths, documents.shape[:2], documents.shape[2], documents.device)
    with torch.no_grad():
        return maxsim(queries, documents, q_mask, d_mask)


def flash_maxsim_topk(Q: torch.Tensor, D: torch.Tensor, k: int, doc_lengths=None, n_candidates: int | None = None,
                      D_int8: torch.Tensor | None = None, scales: torch.Tensor | None = None,
                      mins: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best documents of ``D [N, Ld, d]`` for one query ``Q [Lq, d]`` (flash-maxsim's
    ``flash_maxsim_topk``) -> ``(scores float32 [k], indices int64 [k])``, ``k`` clamped to ``N``.

    The result is the exact top-k (:func:`lik.search` over ``D``), ties by lower index: flash-maxsim filters with
    an 8-bit pre-scan that can miss a document of the true top-k. ``n_candidates``, ``D_int8``, ``scales`` and
    ``mins`` (the pre-scan's inputs) are accepted and not used.

    Example:
        >>> scores, ids = flash_maxsim_topk(torch.randn(32, 128), torch.randn(1000, 180, 128), k=10)
    """
    _tensor("Q", Q, (2,))
    _tensor("D", D, (3,))
    k = min(operator.index(k), D.shape[0])
    d_mask = _prefix_mask("doc_lengths", doc_lengths, D.shape[0], D.shape[1], D.device)
    with torch.no_grad():
        return search(Q, D, k, None, d_mask)
