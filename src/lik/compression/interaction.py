"""PLAID's centroid interaction (stage 3 of :mod:`lik.compression.candidates`) as one Triton kernel.

Each (query, document) pair's approximate score is ``sum_s max_t S[q, codes[t], s]``. Gathered in PyTorch every
document token becomes a row of ``Lq`` scores written to memory and read back by a segmented max (``8 * Lq`` bytes
of DRAM traffic per token: 131 GB for 256 queries of 32 tokens against 20 000 candidates of 100 tokens). Here a
program walks one pair's tokens, reads each token's row of the query's centroid scores (one query's table,
``C * Lq * 4`` bytes, stays in L2 while the programs of its pairs run: pairs come sorted by query) and keeps the
running max in registers: the DRAM traffic is the codes, 4 bytes per token, and one float per pair.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._device import next_power_of_2
from .._launch import launch
from ..core.reductions import nan_max

__all__ = ["centroid_interaction", "centroid_interaction_torch"]

_BLOCK_T = 32  # document tokens per step
_MAX_BLOCK_L = 64  # query tokens per pass (longer queries take several passes over the document)


@triton.jit(do_not_specialize=["n_pairs", "C", "Lq"])
def _interaction_kernel(
    scores_ptr,
    keep_ptr,
    valid_ptr,
    codes_ptr,
    cu_ptr,
    pair_q_ptr,
    pair_doc_ptr,
    out_ptr,
    n_pairs,
    C,
    Lq,
    HAS_KEEP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    pair = tl.program_id(0)
    q = tl.load(pair_q_ptr + pair).to(tl.int64)
    doc = tl.load(pair_doc_ptr + pair).to(tl.int64)
    start = tl.load(cu_ptr + doc).to(tl.int64)
    end = tl.load(cu_ptr + doc + 1).to(tl.int64)
    table = scores_ptr + q * C * Lq
    total = tl.zeros((BLOCK_L,), tl.float32)
    for l0 in range(0, Lq, BLOCK_L):
        cols = l0 + tl.arange(0, BLOCK_L)
        col_ok = cols < Lq
        best = tl.full((BLOCK_L,), float("-inf"), tl.float32)
        for t0 in range(start, end, BLOCK_T):
            tokens = t0 + tl.arange(0, BLOCK_T)
            token_ok = tokens < end
            code = tl.load(codes_ptr + tokens, mask=token_ok, other=0).to(tl.int64)
            if HAS_KEEP:
                # A pruned centroid reads nothing: its token is out of the max.
                token_ok = token_ok & (tl.load(keep_ptr + q * C + code, mask=token_ok, other=0) != 0)
            rows = tl.load(
                table + code[:, None] * Lq + cols[None, :],
                mask=token_ok[:, None] & col_ok[None, :],
                other=float("-inf"),
            )
            best = nan_max(best, tl.reduce(rows, 0, nan_max))
        valid = tl.load(valid_ptr + q * Lq + cols, mask=col_ok, other=0) != 0
        # A masked query token adds 0 (its -inf or NaN never enters the sum).
        total += tl.where(valid, best, 0.0)
    tl.store(out_ptr + pair, tl.sum(total, axis=0))


def centroid_interaction(St, valid, keep, pair_q, pair_doc, codes, cu) -> torch.Tensor:
    """Approximate scores of (query, document) pairs.

    Args:
        St: fp32 ``[nq, C, Lq]`` contiguous centroid scores (centroid-major). valid: bool ``[nq, Lq]``.
        keep: bool ``[nq, C]`` (centroids left in the max) or None. pair_q / pair_doc: int64 ``[P]``, queries in
        ``[0, nq)`` and documents of at least one token. codes: int ``[T]``; cu: int64 ``[N + 1]``.

    Returns:
        fp32 ``[P]``: ``sum over valid s of max over the document's kept tokens t of St[q, codes[t], s]`` (-inf
        when no token is kept, NaN when a kept score is NaN).

    Example::

        >>> St = torch.tensor([[[1.0], [3.0]]])  # one query, two centroids, one query token
        >>> centroid_interaction(St, torch.ones(1, 1, dtype=torch.bool), None, torch.tensor([0]),
        ...                      torch.tensor([0]), torch.tensor([0, 1, 0]), torch.tensor([0, 3])).tolist()
        [3.0]
    """
    nq, C, Lq = St.shape
    out = torch.empty(pair_q.numel(), dtype=torch.float32, device=St.device)
    if pair_q.numel() == 0:
        return out
    valid8 = valid.to(torch.int8).contiguous()
    keep8 = valid8 if keep is None else keep.to(torch.int8).contiguous()  # any pointer when there is no keep
    block_l = min(next_power_of_2(max(Lq, 1)), _MAX_BLOCK_L)
    launch(
        _interaction_kernel,
        (pair_q.numel(),),
        St.contiguous(),
        keep8,
        valid8,
        codes.contiguous(),
        cu.contiguous(),
        pair_q.contiguous(),
        pair_doc.contiguous(),
        out,
        pair_q.numel(),
        C,
        Lq,
        HAS_KEEP=keep is not None,
        BLOCK_T=_BLOCK_T,
        BLOCK_L=block_l,
        num_warps=4 if block_l >= 64 else 2,
    )
    return out


def centroid_interaction_torch(St, valid, keep, pair_q, pair_doc, codes, cu, block_bytes: int) -> torch.Tensor:
    """:func:`centroid_interaction` in PyTorch ops (the CPU path): each block of pairs gathers its tokens' score
    rows (``12 * Lq`` bytes per token, blocks of about ``block_bytes``) and reduces them with a scatter max."""
    nq, C, Lq = St.shape
    rows = St.reshape(nq * C, Lq)
    tokens = (cu[1:] - cu[:-1])[pair_doc]
    out = torch.empty(pair_q.numel(), dtype=torch.float32, device=St.device)
    cum = tokens.cumsum(0)
    total = int(cum[-1]) if cum.numel() else 0
    max_tokens = max(1, block_bytes // (12 * max(Lq, 1)))
    targets = torch.arange(1, (total - 1) // max_tokens + 1, device=cum.device) * max_tokens
    bounds = torch.searchsorted(cum, targets, right=True)
    edges = [0] + sorted(set(bounds.tolist()) - {0, pair_q.numel()}) + [pair_q.numel()]
    for p0, p1 in zip(edges[:-1], edges[1:]):
        q, n = pair_q[p0:p1], tokens[p0:p1]
        count = int(n.sum())
        owner = torch.repeat_interleave(torch.arange(p1 - p0, device=St.device), n, output_size=count)
        before = n.cumsum(0) - n
        where = torch.repeat_interleave(cu[pair_doc[p0:p1]] - before, n, output_size=count)
        code = codes[where + torch.arange(count, device=St.device)].long()
        vals = rows[q[owner] * C + code]  # [tokens, Lq]
        if keep is not None:
            vals = vals.masked_fill(~keep[q[owner], code].unsqueeze(1), float("-inf"))
        best = torch.full((p1 - p0, Lq), float("-inf"), device=St.device)
        best.scatter_reduce_(0, owner.unsqueeze(1).expand(-1, Lq), vals, "amax")
        out[p0:p1] = torch.where(valid[q], best, 0.0).sum(1)
    return out
