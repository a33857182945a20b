"""The tile loop every hard-selection kernel shares (MaxSim, and Chamfer's nearest neighbours through it): the
pieces that handle one tile.

A program holds a block of query-token rows (already loaded, or reloaded per ``k`` chunk for wide embeddings)
and streams document tokens through it in tiles of ``BLOCK_N``: one tensor-core product per tile, a
masked row-wise max that propagates NaN, and, when a gradient will be needed, the index of the winning token
(lowest index on ties; the first NaN where the max is NaN). Nothing of size ``rows x tokens`` ever leaves the chip.
:mod:`lik.core.stream` walks a whole document with these pieces; :mod:`lik.core.forward_kernel` is the kernel.

The winner is tracked as a *key* ``2 * token + masked``: one integer min-reduction gives both the lowest
winning index and whether that token is masked (in ``mask_mode="zero"`` a masked 0 may win the max; it must
then receive no gradient).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .division import divide
from .quantized import FLOAT, FP8, INT8, row_scales, zero_similarity
from .reductions import nan_max

__all__ = [
    "query_rows", "group_offsets", "counted_rows", "store_group_sums", "similarity_tile", "absorb_tile",
    "absorb_nan_tile", "chunk_similarity", "fold_tile", "fresh_rows", "reduce_tile", "tile_dot", "REDUCE_MAX",
    "NO_KEY", "NAN_PASS_BLOCK_N", "FP8_PROMOTION_K", "tile_scales", "tile_window", "class_tile_max",
    "ROW_MAX_CLASSES",
]

NO_KEY = tl.constexpr(2147483647)  # int32 max: "no token chosen yet"
# float8 products: partial sums promoted to fp32 after every 128-deep run of tensor-core instructions (one resident
# d <= 128 block; Hopper's fp8 accumulator is narrower than fp32 within it). Promoting every 32 (one wgmma k) cost
# 1.3x at ColPali B = 1 000 for no visible change in the scores (benchmarks/NOTES.md, "8-bit corpora"); 0 would fall
# back to fp16 mma.sync.
FP8_PROMOTION_K = tl.constexpr(128)
# The running reduction of the tile loop, a constexpr flag passed down from the kernel: MaxSim's NaN-propagating
# max with the lowest winning token (absorb_tile). A new reduction (Chamfer's min of L2 distance) adds a value here
# and its fold in reduce_tile, with the same winner-key convention; the loop and its callers pass the flag through.
REDUCE_MAX = tl.constexpr(0)
# Document tile of the (rare) NaN pass: narrow, so that pass needs few registers next to the main loop's.
NAN_PASS_BLOCK_N = tl.constexpr(16)


@triton.jit
def fresh_rows(BLOCK_M: tl.constexpr):
    """The running state of ``BLOCK_M`` rows before any document token: ``(best = -inf, key = NO_KEY,
    n_valid = 0)``."""
    return tl.full((BLOCK_M,), float("-inf"), tl.float32), tl.full((BLOCK_M,), NO_KEY, tl.int32), tl.zeros((), tl.int32)


# A tensor-core accumulator row is spread over four lanes: column c lives in the lane of class (c // 2) % 4 (mma.sync
# and wgmma alike: pairs of columns per register, eight columns per group). A running max kept per class until the
# document ends folds each tile in registers; the four classes meet once per document, not once per tile. (Other
# layouts, such as an fp32 product on the CUDA cores, get the same maxima with a few more shuffles.)
ROW_MAX_CLASSES = tl.constexpr(4)


@triton.jit
def class_tile_max(sim, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[BLOCK_M, ROW_MAX_CLASSES]``: each row's NaN-propagating max over the tile's columns of each class
    (``(column // 2) % 4``; ``BLOCK_N`` a multiple of 8). The max over the classes is the row's max, exactly."""
    grouped = tl.reshape(sim, (BLOCK_M, BLOCK_N // 8, ROW_MAX_CLASSES, 2))  # column = 8 * group + 2 * class + pair
    return tl.reduce(tl.reduce(grouped, 3, nan_max), 1, nan_max)


@triton.jit
def query_rows(
    row_block, n_queries, q_len, n_chunks, chunks_multiplier, chunks_shift, q_mask_ptr, stride_qmn, stride_qml,
    GROUP_ROWS: tl.constexpr, GROUPS: tl.constexpr, HAS_Q_MASK: tl.constexpr,
):
    """The query tokens of row block ``row_block`` (int32): ``GROUPS`` groups of ``GROUP_ROWS`` consecutive tokens, a
    query being ``n_chunks`` groups (several short queries stacked in one block, or a long one split over blocks);
    ``chunks_multiplier`` and ``chunks_shift`` divide by ``n_chunks`` (:mod:`lik.core.division`).

    Returns ``(query, token, in_range, valid)`` per row (int64 indices); ``valid`` also honours the query mask."""
    rows = tl.arange(0, GROUP_ROWS * GROUPS)
    group = row_block * GROUPS + rows // GROUP_ROWS
    query = divide(group, chunks_multiplier, chunks_shift)
    token = ((group - query * n_chunks) * GROUP_ROWS + rows % GROUP_ROWS).to(tl.int64)
    query = query.to(tl.int64)
    in_range = (query < n_queries) & (token < q_len)
    valid = in_range
    if HAS_Q_MASK:
        flags = tl.load(q_mask_ptr + query * stride_qmn + token * stride_qml, mask=in_range, other=0)
        valid = in_range & (flags != 0)
    return query, token, in_range, valid


@triton.jit
def group_offsets(
    row_block, n_queries, n_chunks, chunks_multiplier, chunks_shift, stride_pc, stride_pn, GROUPS: tl.constexpr,
):
    """Where the ``GROUPS`` row groups of row block ``row_block`` write their sums: offsets of
    ``partial[chunk, query, 0]``, and whether the group belongs to a query (a last block may run past them).
    Made once per program, before its documents."""
    groups = row_block * GROUPS + tl.arange(0, GROUPS)
    query = divide(groups, chunks_multiplier, chunks_shift)
    chunk = groups - query * n_chunks
    return chunk.to(tl.int64) * stride_pc + query.to(tl.int64) * stride_pn, query < n_queries


@triton.jit
def counted_rows(row_valid, n_valid, EXCLUDE: tl.constexpr):
    """The rows whose max enters the score: valid query rows, and in ``mask_mode="exclude"`` only where the document
    has a valid token (an all-masked or empty document scores 0 and gives no gradient)."""
    if EXCLUDE:
        return row_valid & (n_valid > 0)
    return row_valid


@triton.jit
def store_group_sums(
    partial_ptr, values, offsets, in_range, doc, stride_pb, GROUP_ROWS: tl.constexpr, GROUPS: tl.constexpr,
):
    """Sum each row group of ``values`` and write it to ``partial[chunk, query, doc]``, the groups placed by
    :func:`group_offsets` (a long query's chunks are added on the host: exact, the score is a sum over query
    tokens)."""
    group_sums = tl.sum(tl.reshape(values, (GROUPS, GROUP_ROWS)), axis=1)
    tl.store(partial_ptr + offsets + doc * stride_pb, group_sums, mask=in_range)


@triton.jit
def tile_dot(a, b, acc, DOT_PRECISION: tl.constexpr, LOADER: tl.constexpr = FLOAT):
    """``a @ b (+ acc)`` on the tensor cores. float8 promotes its partial sums to fp32 every
    :data:`FP8_PROMOTION_K` products; int8 accumulates in int32 (exact)."""
    if LOADER == FP8:
        # the compiler caps the promotion interval at the product's own depth
        if a.shape[1] < FP8_PROMOTION_K:
            product = tl.dot(a, b, acc, max_num_imprecise_acc=a.shape[1])
        else:
            product = tl.dot(a, b, acc, max_num_imprecise_acc=FP8_PROMOTION_K)
    elif LOADER == INT8:
        # the compiler requires the accumulator's dtype to be named when it is not fp32
        product = tl.dot(a, b, acc, out_dtype=tl.int32)
    else:
        product = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return product


@triton.jit
def similarity_tile(
    q_rows, q_row_ptrs, row_valid, stride_qk, col_ptrs, col_valid,
    DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr,
    stride_dk, DOT_PRECISION: tl.constexpr, LOADER: tl.constexpr = FLOAT,
):
    """``[BLOCK_M, BLOCK_N]`` similarities of the query rows with the document rows at ``col_ptrs``: fp32, or the
    exact int32 products of int8 rows (scaled afterwards by :func:`~lik.core.quantized.scale_columns`).

    Rows with ``col_valid`` False are read as zeros (never read at all), so garbage there cannot leak in."""
    offs_k = tl.arange(0, BLOCK_K)
    if NUM_K == 1:
        d_tile = tl.load(
            col_ptrs[:, None] + offs_k[None, :] * stride_dk,
            mask=col_valid[:, None] & (offs_k[None, :] < DIM),
            other=0.0,
        )
        sim = tile_dot(q_rows, tl.trans(d_tile), None, DOT_PRECISION, LOADER)
    else:
        # A runtime loop: its shared memory is one chunk per pipeline stage whatever d (an unrolled loop keeps
        # every chunk of every stage in flight).
        sim = zero_similarity(BLOCK_M, BLOCK_N, LOADER)
        for kc in range(NUM_K):
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
            sim = tile_dot(q_chunk, tl.trans(d_chunk), sim, DOT_PRECISION, LOADER)
    return sim


@triton.jit
def chunk_similarity(
    sim, q_row_ptrs, stride_qk, col_ptrs, stride_dk, k_start,
    DIM: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, LOADER: tl.constexpr = FLOAT,
):
    """Add the product of feature chunk ``k_start .. k_start + BLOCK_K`` of the query rows and the document rows
    at ``col_ptrs`` to ``sim`` (the streamed-k loop: neither side stays on chip between chunks).

    Both pointer sets must address real rows (clamped by the caller): the loads carry no row predicate, only the
    feature bound of a ragged last chunk, so the pipeliner issues plain asynchronous copies. What clamped rows
    produce is discarded by :func:`fold_tile` and by the row bookkeeping."""
    kk = k_start + tl.arange(0, BLOCK_K)
    if DIM % BLOCK_K == 0:
        q_chunk = tl.load(q_row_ptrs[:, None] + kk[None, :] * stride_qk)
        d_chunk = tl.load(col_ptrs[:, None] + kk[None, :] * stride_dk)
    else:
        q_chunk = tl.load(q_row_ptrs[:, None] + kk[None, :] * stride_qk, mask=kk[None, :] < DIM, other=0.0)
        d_chunk = tl.load(col_ptrs[:, None] + kk[None, :] * stride_dk, mask=kk[None, :] < DIM, other=0.0)
    return tile_dot(q_chunk, tl.trans(d_chunk), sim, DOT_PRECISION, LOADER)


@triton.jit
def fold_tile(
    sim, start, doc_len, doc_mask_ptr, stride_dml, best, key, n_valid,
    BLOCK_N: tl.constexpr, HAS_D_MASK: tl.constexpr, EXCLUDE: tl.constexpr, TRACK_ARGMAX: tl.constexpr,
    REDUCTION: tl.constexpr = REDUCE_MAX,
):
    """Mask a finished tile of similarities of the tokens ``start .. start + BLOCK_N`` (computed from clamped,
    unmasked rows) and fold it into ``(best, key)``; add its valid tokens to ``n_valid``.

    Selecting (rather than zeroing the loads) keeps garbage in masked or clamped rows out: "exclude" drops a
    masked token, "zero" gives it similarity exactly 0, and columns past the document never compete."""
    cols = start + tl.arange(0, BLOCK_N)
    in_range = cols < doc_len
    if HAS_D_MASK:
        flags = tl.load(doc_mask_ptr + cols.to(tl.int64) * stride_dml, mask=in_range, other=0)
        col_valid = in_range & (flags != 0)
        if EXCLUDE:
            sim = tl.where(col_valid[None, :], sim, float("-inf"))
        else:
            sim = tl.where(col_valid[None, :], sim, tl.where(in_range[None, :], 0.0, float("-inf")))
        col_key = tl.where(in_range, cols * 2 + (1 - col_valid.to(tl.int32)), NO_KEY).to(tl.int32)
        n_valid += tl.sum(col_valid.to(tl.int32), axis=0)
    else:
        sim = tl.where(in_range[None, :], sim, float("-inf"))
        col_key = tl.where(in_range, cols * 2, NO_KEY).to(tl.int32)
        n_valid += tl.minimum(doc_len - start, BLOCK_N)
    best, key = reduce_tile(sim, col_key, best, key, TRACK_ARGMAX, REDUCTION)
    return best, key, n_valid


@triton.jit
def reduce_tile(sim, col_key, best, key, TRACK_ARGMAX: tl.constexpr, REDUCTION: tl.constexpr = REDUCE_MAX):
    """Fold one masked tile of similarities into the running ``(best, key)`` with the kernel's reduction."""
    tl.static_assert(REDUCTION == REDUCE_MAX, "unknown reduction")
    return absorb_tile(sim, col_key, best, key, TRACK_ARGMAX)


@triton.jit
def absorb_tile(sim, col_key, best, key, TRACK_ARGMAX: tl.constexpr):
    """Fold one tile of (already masked) similarities into the per-row running max (and winner key).

    The winner search tests equality with the tile's max only: a row whose max is NaN gets a meaningless key
    here, settled afterwards by a NaN pass over the document (:func:`nan_winner_keys`; the padded forward
    defers it to the end of the program). One compare, select and min per similarity instead of five
    operations: this bookkeeping, not the tensor cores, bounds the argmax forward."""
    tile_best = tl.reduce(sim, 1, nan_max)
    if TRACK_ARGMAX:
        tile_key = tl.min(tl.where(sim == tile_best[:, None], col_key[None, :], NO_KEY), axis=1)
        # Strictly greater keeps the earlier tile on ties.
        take = (tile_best > best) | (key == NO_KEY)
        key = tl.where(take, tile_key, key)
    return nan_max(best, tile_best), key


@triton.jit
def absorb_nan_tile(sim, col_key, key):
    """Lower each row's key to its first NaN similarity in this tile (the NaN pass of :func:`nan_winner_keys`)."""
    return tl.minimum(key, tl.min(tl.where(sim != sim, col_key[None, :], NO_KEY), axis=1))


@triton.jit
def tile_window(start, doc_len, BLOCK_N: tl.constexpr):
    """The first token an unmasked document's tile at ``start`` reads: ``start``, except that the ragged last tile
    of a document of at least ``BLOCK_N`` tokens ends at the document's end (it overlaps the tile before it: a
    maximum, and the first-index winner, are unchanged by tokens seen twice), and a tile of a document shorter
    than ``BLOCK_N`` starts at 0."""
    return tl.maximum(tl.minimum(start, doc_len - BLOCK_N), 0)


@triton.jit
def tile_scales(doc_scale_ptr, start, doc_len, stride_dsl, BLOCK_N: tl.constexpr, LOADER: tl.constexpr,
                WINDOW: tl.constexpr = False, WHOLE: tl.constexpr = False):
    """:func:`~lik.core.quantized.row_scales` of a document's tokens ``start .. start + BLOCK_N`` (0 past
    ``doc_len``; placeholders, never loaded, for float rows); ``WINDOW``: of the tile :func:`document_tile` reads
    with ``WINDOW``; ``WHOLE``: of a tile that lies within the document, loaded without a mask.

    The single-query loops load an unmasked 8-bit document's scales one tile ahead (``SCALES_AHEAD``, passing
    ``FLOAT`` here when they do not): each load then has a whole tile's product to arrive instead of stalling the
    epilogue that multiplies by them (H100, textual: float8 4% faster at B = 10 000; int8 2% at B = 10 000 and
    2-6% at B = 1 000, with three programs per SM instead of four). Stacked short queries load them in
    :func:`document_tile`, before the product: ahead, int8 multi textual was 4% slower. A masked document's scales
    are loaded with its mask, in :func:`document_tile` (benchmarks/NOTES.md, "scales one tile ahead"), and a
    float8 long query's whole tiles load theirs there too, unmasked (``WHOLE``; H200: ColPali B = 1 000 2-3% faster
    than ahead, benchmarks/NOTES.md "Float8 whole tiles")."""
    if WINDOW:
        cols = tile_window(start, doc_len, BLOCK_N) + tl.arange(0, BLOCK_N)
    else:
        cols = start + tl.arange(0, BLOCK_N)
    in_document = cols < doc_len
    if WHOLE:  # (a constant mask: the compiler drops it)
        in_document = tl.full((BLOCK_N,), True, tl.int1)
    return row_scales(doc_scale_ptr + cols.to(tl.int64) * stride_dsl, in_document, LOADER)
