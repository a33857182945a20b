"""late-interaction-kernels' ``score_pairs.score_pairs_packed`` on lik: MaxSim of a list of (query, document)
pairs drawn from packed queries and documents, through :func:`lik.maxsim_varlen`."""

from __future__ import annotations

import torch

from ...ops.maxsim import maxsim_varlen

__all__ = ["score_pairs_packed"]


def _pair_rows(cu_seqlens: torch.Tensor, index: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the sequences ``index`` picks (in order, repeats allowed) and their offsets ``[P + 1]``."""
    cu = cu_seqlens.to(device=index.device, dtype=torch.int64)
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be a 1-D offsets tensor [N + 1]")
    starts = cu[:-1][index]
    lengths = cu[1:][index] - starts
    offsets = torch.zeros(index.numel() + 1, dtype=torch.int64, device=index.device)
    offsets[1:] = lengths.cumsum(0)
    total = int(offsets[-1]) if index.numel() else 0
    pair_of_row = torch.repeat_interleave(torch.arange(index.numel(), device=index.device), lengths,
                                          output_size=total)
    rows = starts[pair_of_row] + torch.arange(total, device=index.device) - offsets[pair_of_row]
    return rows, offsets.to(torch.int32)


def score_pairs_packed(Q_packed: torch.Tensor, D_packed: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_d: torch.Tensor, pair_q_idx: torch.Tensor, pair_d_idx: torch.Tensor, *,
                       max_seqlen_q: int | None = None, max_seqlen_d: int | None = None) -> torch.Tensor:
    """MaxSim of arbitrary (query, document) pairs (late-interaction-kernels' ``score_pairs_packed``).

    Args:
        Q_packed: ``[sum Lq_i, d]``; D_packed: ``[sum Ld_j, d]``.
        cu_seqlens_q: ``[Nq + 1]``; cu_seqlens_d: ``[Nd + 1]`` offsets.
        pair_q_idx, pair_d_idx: ``[P]`` integer indices: pair ``k`` is query ``pair_q_idx[k]`` with document
            ``pair_d_idx[k]``.
        max_seqlen_q, max_seqlen_d: the longest query / document (hints: lik finds them when omitted).

    Returns:
        float32 ``[P]``, differentiable: each pair's rows are gathered (a copy; gradients flow back to
        ``Q_packed`` / ``D_packed`` through the gather) and scored by :func:`lik.maxsim_varlen`.

    Example:
        >>> q, cu_q, _ = lik.pack([torch.randn(5, 64), torch.randn(7, 64)])
        >>> d, cu_d, _ = lik.pack([torch.randn(30, 64), torch.randn(9, 64), torch.randn(4, 64)])
        >>> score_pairs_packed(q, d, cu_q, cu_d, torch.tensor([0, 0, 1]), torch.tensor([2, 1, 2])).shape
        torch.Size([3])
    """
    for name, x in (("Q_packed", Q_packed), ("D_packed", D_packed)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"Q_packed / D_packed must be 2-D [sum(L), d]; got {name} of shape "
                             f"{tuple(getattr(x, 'shape', ()))}.")
    if Q_packed.shape[1] != D_packed.shape[1]:
        raise ValueError(f"Q / D embedding dims mismatch: {Q_packed.shape[1]} vs {D_packed.shape[1]}.")
    if (not isinstance(pair_q_idx, torch.Tensor) or not isinstance(pair_d_idx, torch.Tensor)
            or pair_q_idx.shape != pair_d_idx.shape or pair_q_idx.dim() != 1):
        raise ValueError(f"pair_q_idx / pair_d_idx must be matching 1-D tensors; got "
                         f"{tuple(getattr(pair_q_idx, 'shape', ()))} vs {tuple(getattr(pair_d_idx, 'shape', ()))}.")
    pairs_q = pair_q_idx.to(device=Q_packed.device, dtype=torch.int64)
    pairs_d = pair_d_idx.to(device=D_packed.device, dtype=torch.int64)
    q_rows, cu_q = _pair_rows(cu_seqlens_q, pairs_q, "cu_seqlens_q")
    d_rows, cu_d = _pair_rows(cu_seqlens_d, pairs_d, "cu_seqlens_d")
    return maxsim_varlen(Q_packed[q_rows], D_packed[d_rows], cu_q, cu_d, max_seqlen_q, max_seqlen_d)
