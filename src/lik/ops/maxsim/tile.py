"""The MaxSim tile loop shared by every forward variant.

A program holds a block of query-token rows (already loaded, or reloaded per ``k`` chunk for wide embeddings)
and streams one document's tokens through it in tiles of ``BLOCK_N``: one tensor-core product per tile, a
masked row-wise max that propagates NaN, and, when a gradient will be needed, the index of the winning token
(lowest index on ties). Nothing of size ``rows x tokens`` ever leaves the chip.

The winner is tracked as a *key* ``2 * token + masked``: one integer min-reduction gives both the lowest
winning index and whether that token is masked (in ``mask_mode="zero"`` a masked 0 may win the max; it must
then receive no gradient).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["nan_max", "maxsim_doc_rows", "NO_KEY"]

NO_KEY = tl.constexpr(2147483647)  # int32 max: "no token chosen yet"


@triton.jit
def nan_max(a, b):
    """Maximum that returns NaN if either side is NaN (the reference's ``torch.max`` behaviour)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def maxsim_doc_rows(
    q_rows,  # [BLOCK_M, BLOCK_K] query tile when NUM_K == 1 (unused otherwise)
    q_row_ptrs,  # [BLOCK_M] pointers to the first element of each query row
    row_valid,  # [BLOCK_M] bool
    stride_qk,
    doc_ptr,  # pointer to token 0, feature 0 of the document
    doc_mask_ptr,  # pointer to the document's first mask byte (unused without HAS_D_MASK)
    doc_len,
    stride_dl,
    stride_dk,
    stride_dml,
    DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_K: tl.constexpr,
    HAS_D_MASK: tl.constexpr,
    EXCLUDE: tl.constexpr,
    TRACK_ARGMAX: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Stream one document through a block of query rows.

    Returns ``(best [BLOCK_M] fp32, key [BLOCK_M] int32, n_valid int32)``: the running max per row (``-inf``
    when nothing valid was seen), the winner key (meaningful only with ``TRACK_ARGMAX``), and the number of valid
    document tokens (used by ``mask_mode="exclude"`` to score an all-masked document 0).
    """
    best = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    key = tl.full((BLOCK_M,), NO_KEY, tl.int32)
    n_valid = tl.zeros((), tl.int32)
    offs_k = tl.arange(0, BLOCK_K)
    for start in range(0, doc_len, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        in_range = cols < doc_len
        col_valid = in_range
        if HAS_D_MASK:
            col_valid = in_range & (tl.load(doc_mask_ptr + cols.to(tl.int64) * stride_dml, mask=in_range, other=0) != 0)
        col_ptrs = doc_ptr + cols.to(tl.int64) * stride_dl
        if NUM_K == 1:
            d_tile = tl.load(
                col_ptrs[:, None] + offs_k[None, :] * stride_dk,
                mask=col_valid[:, None] & (offs_k[None, :] < DIM),
                other=0.0,
            )
            sim = tl.dot(q_rows, tl.trans(d_tile), input_precision=DOT_PRECISION)
        else:
            sim = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for kc in tl.static_range(NUM_K):
                kk = kc * BLOCK_K + offs_k
                q_chunk = tl.load(
                    q_row_ptrs[:, None] + kk[None, :] * stride_qk,
                    mask=row_valid[:, None] & (kk[None, :] < DIM),
                    other=0.0,
                )
                d_chunk = tl.load(
                    col_ptrs[:, None] + kk[None, :] * stride_dk,
                    mask=col_valid[:, None] & (kk[None, :] < DIM),
                    other=0.0,
                )
                sim = tl.dot(q_chunk, tl.trans(d_chunk), sim, input_precision=DOT_PRECISION)
        # "exclude": a masked token never competes; "zero": it competes with similarity 0 (it was loaded as 0).
        if EXCLUDE:
            sim = tl.where(col_valid[None, :], sim, float("-inf"))
            n_valid += tl.sum(col_valid.to(tl.int32), axis=0)
        else:
            sim = tl.where(in_range[None, :], sim, float("-inf"))
        tile_best = tl.reduce(sim, 1, nan_max)
        if TRACK_ARGMAX:
            col_key = tl.where(in_range, cols * 2 + (1 - col_valid.to(tl.int32)), NO_KEY)
            winner = (sim == tile_best[:, None]) | (sim != sim)
            tile_key = tl.min(tl.where(winner, col_key[None, :], NO_KEY), axis=1)
            # Strictly greater keeps the earlier tile on ties; the first NaN sticks.
            take = (tile_best > best) | ((tile_best != tile_best) & (best == best)) | (key == NO_KEY)
            key = tl.where(take, tile_key, key)
            best = tl.where(take, tile_best, best)
        else:
            best = nan_max(best, tile_best)
    return best, key, n_valid
