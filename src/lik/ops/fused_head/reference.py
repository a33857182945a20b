"""Pure-PyTorch ``maxsim_from_hidden``: the specification the kernels are tested against, and the CPU path.

``score = lik.maxsim(Q, F.normalize(F.linear(H, W, b), dim=-1), q_mask, d_mask)`` (without ``F.normalize`` when
``normalize=False``), with the masking rules of docs/design.md. Masked hidden rows are replaced by zeros before the
projection, so garbage there (inf, NaN) reaches neither the scores nor any gradient (``W``'s and ``b``'s included).
Documents are projected and scored a chunk at a time, so no more than ``budget_bytes`` of projected rows exist at
once outside autograd; autograd flows through it (F.normalize's ``eps = 1e-12`` included: a projected row of norm
below it is divided by ``eps``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...core.precision import accumulation_dtype
from ..maxsim.reference import DEFAULT_BUDGET_BYTES, connected_zeros, maxsim_reference_canonical
from ..maxsim.validation import MaxSimInputs
from .validation import FusedHeadInputs

__all__ = [
    "maxsim_from_hidden_reference", "fused_head_reference_canonical", "padded_view", "packed_bounds", "NORMALIZE_EPS",
]

NORMALIZE_EPS = 1e-12  # F.normalize's default


def packed_bounds(inputs: FusedHeadInputs) -> tuple[list[int], list[int]]:
    """``(bounds, lengths)`` of packed hidden states, read from ``cu_seqlens`` on the host (one synchronisation) and
    checked: non-decreasing offsets within ``H``'s rows, else a ``ValueError`` naming ``cu_seqlens``."""
    bounds = inputs.cu_seqlens.tolist()
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    if any(n < 0 for n in lengths) or (bounds and (bounds[0] < 0 or bounds[-1] > inputs.h.shape[0])):
        raise ValueError(f"cu_seqlens must be non-decreasing within [0, {inputs.h.shape[0]}] (H's rows)")
    return bounds, lengths


def padded_view(inputs: FusedHeadInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(h [n_sets, B, Ld, d_model], d_mask)``: packed hidden states padded to their longest document (reads
    ``cu_seqlens`` on the host; rows past a document are zeros and masked), padded ones as they are."""
    if not inputs.packed:
        return inputs.h, inputs.d_mask
    bounds, lengths = packed_bounds(inputs)
    l_d = max(lengths, default=0)
    rows = torch.arange(l_d, device=inputs.h.device)
    starts = torch.tensor(bounds[:-1], dtype=torch.long, device=inputs.h.device)
    mask = rows[None, :] < torch.tensor(lengths, dtype=torch.long, device=inputs.h.device)[:, None]
    index = torch.where(mask, starts[:, None] + rows[None, :], 0)
    h = inputs.h[index.reshape(-1)].reshape(len(lengths), l_d, inputs.h.shape[-1]) if inputs.h.shape[0] else (
        inputs.h.new_zeros((len(lengths), l_d, inputs.h.shape[-1])))
    return h[None], mask[None]


def fused_head_reference_canonical(inputs: FusedHeadInputs, budget_bytes: int = DEFAULT_BUDGET_BYTES
                                   ) -> torch.Tensor:
    """Reference on canonical inputs; returns ``[Nq, B]`` in the accumulation dtype (float64 for float64)."""
    h, d_mask = padded_view(inputs)
    acc = accumulation_dtype(inputs.q.dtype)
    w = inputs.w.to(acc)
    b = None if inputs.b is None else inputs.b.to(acc)
    n_sets, n_docs, l_d, d_model = h.shape
    n_q = inputs.q.shape[0]
    if n_docs == 0 or n_q == 0:
        return connected_zeros((n_q, n_docs), acc, inputs.q, inputs.h, inputs.w)
    per_doc = max(1, n_sets * l_d * (w.shape[0] + d_model) * torch.finfo(acc).bits // 8)
    chunk = max(1, min(n_docs, budget_bytes // per_doc))
    # Packed documents have no masked tokens, only an end: the padding of their padded view never competes, in
    # either mode ("zero" and "exclude" agree where no token is masked).
    mask_mode = "exclude" if inputs.packed else inputs.mask_mode
    out = []
    for start in range(0, n_docs, chunk):
        docs = slice(start, min(n_docs, start + chunk))
        h_chunk = h[:, docs].to(acc)
        mask = None if d_mask is None else d_mask[:, docs]
        if mask is not None:
            h_chunk = torch.where(mask[..., None], h_chunk, 0)
        d = F.linear(h_chunk, w, b)
        if inputs.normalize:
            d = F.normalize(d, dim=-1, eps=NORMALIZE_EPS)
        scores = maxsim_reference_canonical(MaxSimInputs(
            inputs.q, d, inputs.q_mask, mask, mask_mode, False, inputs.per_query_documents), budget_bytes)
        out.append(scores)
    return torch.cat(out, dim=1)


def maxsim_from_hidden_reference(
    Q: torch.Tensor,
    H: torch.Tensor,
    W: torch.Tensor,
    b: torch.Tensor | None = None,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    normalize: bool = True,
    mask_mode: str = "exclude",
    cu_seqlens: torch.Tensor | None = None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> torch.Tensor:
    """:func:`lik.maxsim_from_hidden` in plain PyTorch (same arguments, shapes and semantics).

    Returns:
        ``[B]`` for 2-D ``Q`` else ``[Nq, B]``; float32, or float64 for float64 inputs.

    Example:
        >>> Q = torch.nn.functional.normalize(torch.randn(32, 128), dim=-1)
        >>> H, W = torch.randn(10, 300, 768), torch.randn(128, 768) / 768**0.5
        >>> maxsim_from_hidden_reference(Q, H, W).shape
        torch.Size([10])
    """
    inputs = FusedHeadInputs.build(Q, H, W, b, q_mask, d_mask, normalize=normalize, mask_mode=mask_mode,
                                   cu_seqlens=cu_seqlens)
    return inputs.finish(fused_head_reference_canonical(inputs, budget_bytes))
