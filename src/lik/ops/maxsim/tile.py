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

__all__ = ["nan_max", "similarity_tile", "mask_tokens", "absorb_tile", "maxsim_doc_rows", "NO_KEY"]

NO_KEY = tl.constexpr(2147483647)  # int32 max: "no token chosen yet"


@triton.jit
def nan_max(a, b):
    """Maximum that returns NaN if either side is NaN (the reference's ``torch.max`` behaviour)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def similarity_tile(
    q_rows, q_row_ptrs, row_valid, stride_qk, col_ptrs, col_valid,
    DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr,
    MASK_COLS: tl.constexpr, stride_dk, DOT_PRECISION: tl.constexpr, DOC_MAJOR: tl.constexpr,
):
    """fp32 similarities of the query rows with the document rows at ``col_ptrs``: ``[BLOCK_M, BLOCK_N]``, or
    ``[BLOCK_N, BLOCK_M]`` with ``DOC_MAJOR``.

    Rows with ``col_valid`` False are read as zeros (never read at all), so garbage there cannot leak in. Full
    tiles of an unmasked document skip the predicate (``MASK_COLS=False``). ``DOC_MAJOR`` computes
    ``D_tile @ Q^T``: the document tile is the streamed A operand and the loop-invariant query block the B
    operand, which the tensor cores read from shared memory (on Hopper) instead of holding it in registers."""
    offs_k = tl.arange(0, BLOCK_K)
    if NUM_K == 1:
        d_ptrs = col_ptrs[:, None] + offs_k[None, :] * stride_dk
        if MASK_COLS:
            d_tile = tl.load(d_ptrs, mask=col_valid[:, None] & (offs_k[None, :] < DIM), other=0.0)
        elif DIM == BLOCK_K:
            d_tile = tl.load(d_ptrs)
        else:
            d_tile = tl.load(d_ptrs, mask=offs_k[None, :] < DIM, other=0.0)
        if DOC_MAJOR:
            sim = tl.dot(d_tile, tl.trans(q_rows), input_precision=DOT_PRECISION)
        else:
            sim = tl.dot(q_rows, tl.trans(d_tile), input_precision=DOT_PRECISION)
    else:
        if DOC_MAJOR:
            sim = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
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
            if DOC_MAJOR:
                sim = tl.dot(d_chunk, tl.trans(q_chunk), sim, input_precision=DOT_PRECISION)
            else:
                sim = tl.dot(q_chunk, tl.trans(d_chunk), sim, input_precision=DOT_PRECISION)
    return sim


@triton.jit
def mask_tokens(sim, keep, DOC_MAJOR: tl.constexpr):
    """``-inf`` where a document token must not take part in the max."""
    if DOC_MAJOR:
        masked = tl.where(keep[:, None], sim, float("-inf"))
    else:
        masked = tl.where(keep[None, :], sim, float("-inf"))
    return masked


@triton.jit
def absorb_tile(sim, col_key, best, key, running, TRACK_ARGMAX: tl.constexpr):
    """Fold one tile of (already masked) similarities into the running state.

    Without argmax the max is kept elementwise in ``running`` ([BLOCK_M, BLOCK_N]) and reduced across columns
    once per document: one max instruction per element and no cross-thread shuffles per tile. With argmax each
    tile is reduced to its best value and lowest winning key."""
    if TRACK_ARGMAX:
        tile_best = tl.reduce(sim, 1, nan_max)
        winner = (sim == tile_best[:, None]) | (sim != sim)
        tile_key = tl.min(tl.where(winner, col_key[None, :], NO_KEY), axis=1)
        # Strictly greater keeps the earlier tile on ties; the first NaN sticks.
        take = (tile_best > best) | ((tile_best != tile_best) & (best == best)) | (key == NO_KEY)
        key = tl.where(take, tile_key, key)
        best = tl.where(take, tile_best, best)
    else:
        running = nan_max(running, sim)
    return best, key, running


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
    DOC_MAJOR: tl.constexpr,
):
    """Stream one document through a block of query rows.

    ``DOC_MAJOR`` (inference only: the argmax path reduces each tile along its rows) transposes the product,
    see :func:`similarity_tile`.

    Returns ``(best [BLOCK_M] fp32, key [BLOCK_M] int32, n_valid int32)``: the max per row (``-inf`` when
    nothing valid was seen), the winner key (meaningful only with ``TRACK_ARGMAX``), and the number of valid
    document tokens (used by ``mask_mode="exclude"`` to score an all-masked document 0).
    """
    best = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    key = tl.full((BLOCK_M,), NO_KEY, tl.int32)
    if DOC_MAJOR:
        running = tl.full((BLOCK_N, BLOCK_M), float("-inf"), tl.float32)
    else:
        running = tl.full((BLOCK_M, BLOCK_N), float("-inf"), tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    n_valid = tl.zeros((), tl.int32)
    masked_from = 0
    if not HAS_D_MASK:
        # Full tiles of an unmasked document: no predicates, no where.
        n_valid += doc_len
        masked_from = (doc_len // BLOCK_N) * BLOCK_N
        for start in range(0, masked_from, BLOCK_N):
            cols = start + offs_n
            col_ptrs = doc_ptr + cols.to(tl.int64) * stride_dl
            sim = similarity_tile(
                q_rows, q_row_ptrs, row_valid, stride_qk, col_ptrs, cols >= 0,
                DIM, BLOCK_M, BLOCK_N, BLOCK_K, NUM_K, False, stride_dk, DOT_PRECISION, DOC_MAJOR,
            )
            best, key, running = absorb_tile(sim, cols * 2, best, key, running, TRACK_ARGMAX)
    # Every tile of a masked document, or the ragged tail of an unmasked one.
    for start in range(masked_from, doc_len, BLOCK_N):
        cols = start + offs_n
        in_range = cols < doc_len
        col_valid = in_range
        if HAS_D_MASK:
            flags = tl.load(doc_mask_ptr + cols.to(tl.int64) * stride_dml, mask=in_range, other=0)
            col_valid = in_range & (flags != 0)
            n_valid += tl.sum(col_valid.to(tl.int32), axis=0)
        col_ptrs = doc_ptr + cols.to(tl.int64) * stride_dl
        sim = similarity_tile(
            q_rows, q_row_ptrs, row_valid, stride_qk, col_ptrs, col_valid,
            DIM, BLOCK_M, BLOCK_N, BLOCK_K, NUM_K, True, stride_dk, DOT_PRECISION, DOC_MAJOR,
        )
        # "exclude": a masked token never competes; "zero": it competes with similarity 0 (it was loaded as 0).
        if EXCLUDE:
            sim = mask_tokens(sim, col_valid, DOC_MAJOR)
        else:
            sim = mask_tokens(sim, in_range, DOC_MAJOR)
        col_key = tl.where(in_range, cols * 2 + (1 - col_valid.to(tl.int32)), NO_KEY)
        best, key, running = absorb_tile(sim, col_key, best, key, running, TRACK_ARGMAX)
    if not TRACK_ARGMAX:
        best = tl.reduce(running, 0 if DOC_MAJOR else 1, nan_max)
    return best, key, n_valid
