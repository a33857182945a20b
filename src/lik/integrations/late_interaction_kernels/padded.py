"""late-interaction-kernels' ``padded`` module on lik: :func:`maxsim_padded` (each query against its own padded
candidates) and the packing helper :func:`pack_padded` (see :mod:`lik.integrations.late_interaction_kernels` for
what differs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...ops.maxsim import maxsim

__all__ = ["PackedBatch", "pack_padded", "maxsim_padded"]


@dataclass(frozen=True)
class PackedBatch:
    """:func:`pack_padded`'s result; unpacks as the 8-tuple
    ``Q_packed, cu_seqlens_q, D_packed, cu_seqlens_d, pair_q_idx, pair_d_idx, max_seqlen_q, max_seqlen_d``."""

    Q_packed: torch.Tensor  # [sum of query lengths, d]
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    D_packed: torch.Tensor  # [sum of document lengths, d]
    cu_seqlens_d: torch.Tensor  # int32 [B * C + 1], documents row-major over (b, c)
    pair_q_idx: torch.Tensor  # int32 [B * C]: pair b * C + c is query b ...
    pair_d_idx: torch.Tensor  # int32 [B * C]: ... with document b * C + c
    max_seqlen_q: int
    max_seqlen_d: int

    def __iter__(self):
        return iter((self.Q_packed, self.cu_seqlens_q, self.D_packed, self.cu_seqlens_d, self.pair_q_idx,
                     self.pair_d_idx, self.max_seqlen_q, self.max_seqlen_d))


def _lengths(name: str, lengths, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    if not isinstance(lengths, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of integer lengths, got {type(lengths).__name__}")
    if tuple(lengths.shape) != tuple(shape) or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor of shape {list(shape)}; got {lengths.dtype} "
                         f"{tuple(lengths.shape)}")
    return lengths.to(device=device, dtype=torch.int32)


def _checked(queries, documents, query_lengths, doc_lengths) -> tuple[torch.Tensor, torch.Tensor]:
    """``(query_lengths [B], doc_lengths [B, C])`` as int32 on the inputs' device, shapes checked."""
    if not isinstance(queries, torch.Tensor) or queries.dim() != 3:
        raise ValueError(f"queries must be [B, Lq, d]; got shape {tuple(getattr(queries, 'shape', ()))}")
    if not isinstance(documents, torch.Tensor) or documents.dim() != 4:
        raise ValueError(f"documents must be [B, C, Ld, d]; got shape {tuple(getattr(documents, 'shape', ()))}")
    if queries.shape[0] != documents.shape[0]:
        raise ValueError(f"batch size mismatch: queries B={queries.shape[0]}, documents B={documents.shape[0]}")
    if queries.shape[2] != documents.shape[3]:
        raise ValueError(f"embedding dim mismatch: queries d={queries.shape[2]}, documents d={documents.shape[3]}")
    return (_lengths("query_lengths", query_lengths, queries.shape[:1], queries.device),
            _lengths("doc_lengths", doc_lengths, documents.shape[:2], queries.device))


def _check_values(q_len: torch.Tensor, d_len: torch.Tensor, q_width: int, d_width: int, *, positive: bool
                  ) -> tuple[int, int]:
    """One host read of the lengths' extremes: ``(longest query, longest document)``, after refusing a length
    past its padded width (and, with ``positive``, a length of 0)."""
    stats = [t.max() if t.numel() else t.new_zeros(()) for t in (q_len, d_len)]
    stats += [t.min() if t.numel() else t.new_ones(()) for t in (q_len, d_len)]
    q_max, d_max, q_min, d_min = torch.stack(stats).tolist()
    for name, low, high, width in (("query_lengths", q_min, q_max, q_width), ("doc_lengths", d_min, d_max, d_width)):
        if high > width:
            raise ValueError(f"{name} holds {high}, past the padded length {width}")
        if low < 0 or (positive and low <= 0):
            raise ValueError(f"{name} must all be > 0" if positive else f"{name} must all be >= 0, got {low}")
    return q_max, d_max


def pack_padded(queries: torch.Tensor, documents: torch.Tensor, query_lengths: torch.Tensor,
                doc_lengths: torch.Tensor, *, validate: bool = False) -> PackedBatch:
    """Padded reranking inputs to the packed layout (late-interaction-kernels' ``pack_padded``).

    Args:
        queries: ``[B, Lq, d]``; documents: ``[B, C, Ld, d]``.
        query_lengths: integer ``[B]``; doc_lengths: integer ``[B, C]``: valid prefixes, at most the padded
            lengths (checked in the one host read the packing makes anyway; a length past it raises ValueError).
        validate: also refuse zero lengths.

    Returns:
        :class:`PackedBatch`: the valid tokens packed in order, int32 offsets, the row-major pair list and the
        longest lengths.

    Example:
        >>> batch = pack_padded(torch.randn(2, 8, 16), torch.randn(2, 3, 12, 16), torch.tensor([8, 5]),
        ...                     torch.tensor([[12, 3, 7], [1, 12, 12]]))
        >>> batch.cu_seqlens_q.tolist(), batch.D_packed.shape
        ([0, 8, 13], torch.Size([47, 16]))
    """
    q_len, d_len = _checked(queries, documents, query_lengths, doc_lengths)
    n_queries, q_width, dim = queries.shape
    n_candidates, d_width = documents.shape[1], documents.shape[2]
    device = queries.device
    max_q, max_d = _check_values(q_len, d_len, q_width, d_width, positive=validate)
    q_valid = torch.arange(q_width, device=device) < q_len[:, None]
    d_valid = torch.arange(d_width, device=device) < d_len[..., None]
    cu_q = torch.zeros(n_queries + 1, dtype=torch.int32, device=device)
    cu_d = torch.zeros(n_queries * n_candidates + 1, dtype=torch.int32, device=device)
    cu_q[1:] = q_len.cumsum(0)
    cu_d[1:] = d_len.reshape(-1).cumsum(0)
    pairs = torch.arange(n_queries * n_candidates, dtype=torch.int32, device=device)
    return PackedBatch(
        Q_packed=queries.reshape(-1, dim)[q_valid.reshape(-1)],
        cu_seqlens_q=cu_q,
        D_packed=documents.reshape(-1, dim)[d_valid.reshape(-1)],
        cu_seqlens_d=cu_d,
        pair_q_idx=torch.div(pairs, max(n_candidates, 1), rounding_mode="floor"),
        pair_d_idx=pairs,
        max_seqlen_q=int(max_q),
        max_seqlen_d=int(max_d),
    )


def maxsim_padded(queries: torch.Tensor, documents: torch.Tensor, query_lengths: torch.Tensor,
                  doc_lengths: torch.Tensor, *, validate: bool = False) -> torch.Tensor:
    """Each query against its own ``C`` padded candidates (late-interaction-kernels' ``maxsim_padded``).

    Args:
        queries: ``[B, Lq, d]``; documents: ``[B, C, Ld, d]``.
        query_lengths: integer ``[B]``; doc_lengths: integer ``[B, C]``: the valid prefixes. Without
            ``validate`` nothing is read on the host: a length past the padded one counts as all of it, a length
            of 0 scores 0. ``validate``: one host read that refuses lengths of 0 or past the padding.

    Returns:
        float32 ``[B, C]``, differentiable: one lik call on the padded tensors with prefix masks (no packing).

    Example:
        >>> maxsim_padded(torch.randn(2, 8, 16), torch.randn(2, 3, 12, 16), torch.tensor([8, 5]),
        ...               torch.tensor([[12, 3, 7], [1, 12, 12]])).shape
        torch.Size([2, 3])
    """
    q_len, d_len = _checked(queries, documents, query_lengths, doc_lengths)
    if validate:
        _check_values(q_len, d_len, queries.shape[1], documents.shape[2], positive=True)
    q_mask = torch.arange(queries.shape[1], device=queries.device) < q_len[:, None]
    d_mask = torch.arange(documents.shape[2], device=queries.device) < d_len[..., None]
    return maxsim(queries, documents, q_mask, d_mask)
