"""The MaxSim tile loop shared by every forward variant.

A program holds a block of query-token rows (already loaded, or reloaded per ``k`` chunk for wide embeddings)
and streams document tokens through it in tiles of ``BLOCK_N``: one tensor-core product per tile, a
masked row-wise max that propagates NaN, and, when a gradient will be needed, the index of the winning token
(lowest index on ties; the first NaN where the max is NaN). Nothing of size ``rows x tokens`` ever leaves the chip.

The winner is tracked as a *key* ``2 * token + masked``: one integer min-reduction gives both the lowest
winning index and whether that token is masked (in ``mask_mode="zero"`` a masked 0 may win the max; it must
then receive no gradient).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...core.division import divide
from ...core.quantized import FLOAT, FP8, INT8, row_scales, scale_columns, zero_similarity
from ...core.reductions import nan_max

__all__ = [
    "query_rows", "group_offsets", "counted_rows", "store_group_sums", "similarity_tile", "absorb_tile",
    "absorb_nan_tile", "document_tile", "stream_document", "chunk_similarity", "fold_tile", "first_nan_keys",
    "nan_winner_keys", "maxsim_doc_rows", "fresh_rows", "reduce_tile", "tile_dot", "REDUCE_MAX", "NO_KEY",
    "NAN_PASS_BLOCK_N", "FP8_PROMOTION_K", "tile_scales", "tile_window", "class_tile_max", "ROW_MAX_CLASSES",
]

NO_KEY = tl.constexpr(2147483647)  # int32 max: "no token chosen yet"
# float8 products: partial sums promoted to fp32 after every 128-deep run of tensor-core instructions (one resident
# d <= 128 block; Hopper's fp8 accumulator is narrower than fp32 within it). Promoting every 32 (one wgmma k) cost
# 1.3x at ColPali B = 1 000 for no visible change in the scores (BENCHMARKS.md, "8-bit corpora"); 0 would fall
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


@triton.jit
def document_tile(
    q_rows, q_row_ptrs, row_valid, stride_qk, doc_ptr, doc_mask_ptr, start, doc_len, stride_dl, stride_dk, stride_dml,
    best, key, n_valid, doc_scale_ptr, stride_dsl, col_scale,
    DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr,
    HAS_D_MASK: tl.constexpr, EXCLUDE: tl.constexpr, TRACK_ARGMAX: tl.constexpr, NAN_PASS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, REDUCTION: tl.constexpr = REDUCE_MAX, LOADER: tl.constexpr = FLOAT,
    SCALES_AHEAD: tl.constexpr = False, WINDOW: tl.constexpr = False, WHOLE_TILES: tl.constexpr = False,
    CLASS_MAX: tl.constexpr = False, TILE_MAX: tl.constexpr = False,
):
    """One step of every tile loop: the similarities of the document tokens ``start .. start + BLOCK_N``, masked,
    folded into ``(best, key)`` by :func:`absorb_tile` (or by :func:`absorb_nan_tile` in the NaN pass), and the
    tile's valid tokens added to ``n_valid``. Returns ``(best, key, n_valid)``.

    With an 8-bit ``LOADER``, ``doc_scale_ptr`` (row stride ``stride_dsl``) holds the document's scales (the
    query rows' scales multiply the row maxima afterwards); it is unused for float rows. With ``SCALES_AHEAD``,
    ``col_scale`` holds this tile's scales, which the loop loaded one tile ahead
    (:func:`tile_scales`); otherwise they are loaded here, before the product. With ``WINDOW``, an unmasked
    document's ragged last tile is read as its last ``BLOCK_N`` tokens (:func:`tile_window`). ``WHOLE_TILES``
    promises that this tile of an unmasked document lies within it (:func:`stream_document`'s whole tiles): it is
    read as it is, with neither a row clamp nor a last-tile select, and promises rows stored back to back
    (``stride_dl == DIM``, ``stride_dk == 1``). With ``CLASS_MAX`` (no winner tracked), ``best`` holds the rows'
    maxima per column class (:func:`class_tile_max`, ``[BLOCK_M, ROW_MAX_CLASSES]``) and ``key`` is passed through;
    with ``TILE_MAX`` (no winner tracked), ``best`` is the elementwise max of the tiles so far
    (``[BLOCK_M, BLOCK_N]``, NaN-propagating; its row max is the rows' max, exactly)."""
    if HAS_D_MASK:
        cols = start + tl.arange(0, BLOCK_N)
        in_range = cols < doc_len
        flags = tl.load(doc_mask_ptr + cols.to(tl.int64) * stride_dml, mask=in_range, other=0)
        col_valid = in_range & (flags != 0)
        # 8-bit scales are loaded before the product, not after it: their latency then overlaps the product's.
        col_scale = row_scales(doc_scale_ptr + cols.to(tl.int64) * stride_dsl, col_valid, LOADER)
        sim = similarity_tile(
            q_rows, q_row_ptrs, row_valid, stride_qk, doc_ptr + cols.to(tl.int64) * stride_dl, col_valid,
            DIM, BLOCK_M, BLOCK_N, BLOCK_K, NUM_K, stride_dk, DOT_PRECISION, LOADER,
        )
        sim = scale_columns(sim, col_scale, LOADER)
        # "exclude": a masked token never competes; "zero": it competes with similarity 0 (it was loaded as 0).
        if EXCLUDE:
            sim = tl.where(col_valid[None, :], sim, float("-inf"))
        else:
            sim = tl.where(in_range[None, :], sim, float("-inf"))
        col_key = tl.where(in_range, cols * 2 + (1 - col_valid.to(tl.int32)), NO_KEY).to(tl.int32)
        n_valid += tl.sum(col_valid.to(tl.int32), axis=0)
    else:
        # An unmasked document without load predicates: the ragged tail re-reads the last token (clamped rows) and
        # its extra columns are set to -inf. Predicate-free loads let the pipeliner issue plain cp.async (H200:
        # ColPali 0.58 -> 0.50 ms); no separate checked tail loop keeps the registers of a persistent launch down.
        # With WINDOW the last tile of a document of at least BLOCK_N tokens ends at its end instead, so rows are
        # clamped once per document, not per tile (benchmarks/NOTES.md, "Predicate-free full tiles", "One loop,
        # no checked tail loop", "The last tile ends at the document's end").
        if WHOLE_TILES:
            # Rows back to back (the launcher's promise): a compile-time row stride makes each row address shifts
            # and adds, not a 64-bit multiply per row and tile (benchmarks/NOTES.md "Whole tiles addressed ...").
            first = start
            cols = start + tl.arange(0, BLOCK_N)
            col_ptrs = doc_ptr + cols.to(tl.int64) * DIM
        elif WINDOW:
            first = tile_window(start, doc_len, BLOCK_N)
            rows = tl.minimum(tl.arange(0, BLOCK_N), doc_len - 1).to(tl.int64) * stride_dl
            col_ptrs = doc_ptr + first.to(tl.int64) * stride_dl + rows
            cols = first + tl.arange(0, BLOCK_N)
        else:
            first = start
            cols = start + tl.arange(0, BLOCK_N)
            col_ptrs = doc_ptr + tl.minimum(cols, doc_len - 1).to(tl.int64) * stride_dl
        in_range = cols < doc_len
        if not SCALES_AHEAD:  # (loaded before the product, as above)
            col_scale = tile_scales(doc_scale_ptr, start, doc_len, stride_dsl, BLOCK_N, LOADER, WINDOW, WHOLE_TILES)
        if NUM_K == 1 and DIM == BLOCK_K:
            offs_k = tl.arange(0, BLOCK_K)
            d_tile = tl.load(col_ptrs[:, None] + offs_k[None, :] * stride_dk)
            sim = tile_dot(q_rows, tl.trans(d_tile), None, DOT_PRECISION, LOADER)
        else:
            sim = similarity_tile(
                q_rows, q_row_ptrs, row_valid, stride_qk, col_ptrs, in_range,
                DIM, BLOCK_M, BLOCK_N, BLOCK_K, NUM_K, stride_dk, DOT_PRECISION, LOADER,
            )
        sim = scale_columns(sim, col_scale, LOADER)
        col_key = (cols * 2).to(tl.int32)
        if not WHOLE_TILES:
            if first + BLOCK_N > doc_len:  # only the last tile (WINDOW: of a document shorter than a tile) selects
                if not NAN_PASS:  # (that pass ignores the clamped columns by their key alone)
                    sim = tl.where(in_range[None, :], sim, float("-inf"))
                col_key = tl.where(in_range, col_key, NO_KEY)
        n_valid += tl.minimum(doc_len - start, BLOCK_N)
    if NAN_PASS:
        key = absorb_nan_tile(sim, col_key, key)
    elif CLASS_MAX:
        best = nan_max(best, class_tile_max(sim, BLOCK_M, BLOCK_N))
    elif TILE_MAX:
        best = nan_max(best, sim)
    else:
        best, key = reduce_tile(sim, col_key, best, key, TRACK_ARGMAX, REDUCTION)
    return best, key, n_valid


@triton.jit
def stream_document(
    q_rows, q_row_ptrs, row_valid, stride_qk, doc_ptr, doc_mask_ptr, doc_len, stride_dl, stride_dk, stride_dml,
    best, key, doc_scale_ptr, stride_dsl,
    DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr,
    HAS_D_MASK: tl.constexpr, EXCLUDE: tl.constexpr, TRACK_ARGMAX: tl.constexpr, NAN_PASS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, REDUCTION: tl.constexpr = REDUCE_MAX, LOADER: tl.constexpr = FLOAT,
    WHOLE_TILES: tl.constexpr = False, TAIL_N: tl.constexpr = 0,
):
    """The tile loop over one document (:func:`document_tile` per tile). Returns ``(best, key, n_valid)``.

    With ``WHOLE_TILES`` (an unmasked document), its whole ``BLOCK_N``-token tiles are read as they are, with
    neither row clamp nor last-tile select, and the tokens after them, if any, in unpipelined tiles of ``TAIL_N``
    (a 1 030-token ColPali page: eight 128-token tiles and one of 16, instead of nine of 128); the launcher
    (``forward.last_tiles``) sets ``TAIL_N`` > 0 exactly when there are such tokens, and
    only when they are few. Otherwise every tile is ``BLOCK_N`` wide and the ragged last one clamped and
    selected."""
    n_valid = tl.zeros((), tl.int32)
    # The NaN pass is rare: unpipelined, so its loop adds no shared-memory stages and few registers.
    STAGES: tl.constexpr = 1 if NAN_PASS else None
    # Without winners, rows keep their maxima per column class over the document (class_tile_max).
    CLASS_MAX: tl.constexpr = (not TRACK_ARGMAX and not NAN_PASS and REDUCTION == REDUCE_MAX and BLOCK_N % 8 == 0
                               and TAIL_N % 8 == 0)
    running = best
    if CLASS_MAX:
        running = tl.full((BLOCK_M, ROW_MAX_CLASSES), float("-inf"), tl.float32)
    # (tile_scales says why; float8 whole tiles load their unmasked scales before the product instead: the product
    # hides that load's latency too, in fewer instructions than a masked load a tile ahead)
    AHEAD: tl.constexpr = LOADER != FLOAT and not HAS_D_MASK and not (WHOLE_TILES and LOADER == FP8)
    AHEAD_LOADER: tl.constexpr = LOADER if AHEAD else FLOAT
    col_scale = tile_scales(doc_scale_ptr, 0, doc_len, stride_dsl, BLOCK_N, AHEAD_LOADER)
    tiled_end = doc_len
    if TAIL_N > 0:
        tiled_end = (doc_len // BLOCK_N) * BLOCK_N
    for start in tl.range(0, tiled_end, BLOCK_N, num_stages=STAGES):
        next_scale = tile_scales(doc_scale_ptr, start + BLOCK_N, doc_len, stride_dsl, BLOCK_N, AHEAD_LOADER)
        running, key, n_valid = document_tile(
            q_rows, q_row_ptrs, row_valid, stride_qk, doc_ptr, doc_mask_ptr, start, doc_len, stride_dl, stride_dk,
            stride_dml, running, key, n_valid, doc_scale_ptr, stride_dsl, col_scale,
            DIM, BLOCK_M, BLOCK_N, BLOCK_K, NUM_K, HAS_D_MASK, EXCLUDE, TRACK_ARGMAX, NAN_PASS, DOT_PRECISION,
            REDUCTION, LOADER, AHEAD, False, WHOLE_TILES, CLASS_MAX,
        )
        col_scale = next_scale
    if TAIL_N > 0:
        # (after the whole tiles, so a tie keeps the earlier token as in the one-width loop)
        for start in tl.range(tiled_end, doc_len, TAIL_N, num_stages=1):
            running, key, n_valid = document_tile(
                q_rows, q_row_ptrs, row_valid, stride_qk, doc_ptr, doc_mask_ptr, start, doc_len, stride_dl, stride_dk,
                stride_dml, running, key, n_valid, doc_scale_ptr, stride_dsl, col_scale,
                DIM, BLOCK_M, TAIL_N, BLOCK_K, NUM_K, HAS_D_MASK, EXCLUDE, TRACK_ARGMAX, NAN_PASS, DOT_PRECISION,
                REDUCTION, LOADER, False, False, False, CLASS_MAX,
            )
    if CLASS_MAX:
        best = nan_max(best, tl.reduce(running, 1, nan_max))
    else:
        best = running
    return best, key, n_valid


@triton.jit
def first_nan_keys(
    q_rows, q_row_ptrs, row_valid, stride_qk, doc_ptr, doc_mask_ptr, doc_len, stride_dl, stride_dk, stride_dml,
    doc_scale_ptr, stride_dsl,
    DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr,
    HAS_D_MASK: tl.constexpr, EXCLUDE: tl.constexpr, DOT_PRECISION: tl.constexpr, LOADER: tl.constexpr = FLOAT,
):
    """The NaN pass: each row's key of its first NaN similarity in the document (``NO_KEY`` where it has none, i.e.
    where its max is not NaN), and the document's valid token count. Returns ``(key, n_valid)``."""
    _, nan_key, n_valid = stream_document(
        q_rows, q_row_ptrs, row_valid, stride_qk, doc_ptr, doc_mask_ptr, doc_len, stride_dl, stride_dk, stride_dml,
        tl.full((BLOCK_M,), float("-inf"), tl.float32), tl.full((BLOCK_M,), NO_KEY, tl.int32),
        doc_scale_ptr, stride_dsl,
        DIM, BLOCK_M, NAN_PASS_BLOCK_N, BLOCK_K, NUM_K, HAS_D_MASK, EXCLUDE, True, True, DOT_PRECISION,
        REDUCE_MAX, LOADER,
    )
    return nan_key, n_valid


@triton.jit
def nan_winner_keys(
    q_rows, q_row_ptrs, row_valid, stride_qk, doc_ptr, doc_mask_ptr, doc_len, stride_dl, stride_dk, stride_dml,
    best, key, doc_scale_ptr, stride_dsl,
    DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr,
    HAS_D_MASK: tl.constexpr, EXCLUDE: tl.constexpr, DOT_PRECISION: tl.constexpr, LOADER: tl.constexpr = FLOAT,
):
    """Give every row whose max is NaN the key of its first NaN similarity, as ``torch.max`` picks it.

    The document is streamed a second time only when a row of the block has a NaN max (a NaN or inf in the
    inputs), so clean inputs pay one block-wide test per document."""
    is_nan = best != best
    if tl.max(is_nan.to(tl.int32), axis=0) != 0:
        nan_key, _ = first_nan_keys(
            q_rows, q_row_ptrs, row_valid, stride_qk, doc_ptr, doc_mask_ptr, doc_len, stride_dl, stride_dk,
            stride_dml, doc_scale_ptr, stride_dsl, DIM, BLOCK_M, BLOCK_K, NUM_K, HAS_D_MASK, EXCLUDE,
            DOT_PRECISION, LOADER,
        )
        key = tl.where(is_nan, nan_key, key)
    return key


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
    doc_scale_ptr,  # pointer to the document's first row scale (8-bit LOADER only)
    stride_dsl,
    DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_K: tl.constexpr,
    HAS_D_MASK: tl.constexpr,
    EXCLUDE: tl.constexpr,
    TRACK_ARGMAX: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    REDUCTION: tl.constexpr = REDUCE_MAX,
    LOADER: tl.constexpr = FLOAT,
):
    """Stream one document through a block of query rows.

    Returns ``(best [BLOCK_M] fp32, key [BLOCK_M] int32, n_valid int32)``: the max per row (``-inf`` when
    nothing valid was seen), the winner key (meaningful only with ``TRACK_ARGMAX``), and the number of valid
    document tokens (used by ``mask_mode="exclude"`` to score an all-masked document 0).
    """
    best, key, _ = fresh_rows(BLOCK_M)
    best, key, n_valid = stream_document(
        q_rows, q_row_ptrs, row_valid, stride_qk, doc_ptr, doc_mask_ptr, doc_len, stride_dl, stride_dk, stride_dml,
        best, key, doc_scale_ptr, stride_dsl,
        DIM, BLOCK_M, BLOCK_N, BLOCK_K, NUM_K, HAS_D_MASK, EXCLUDE, TRACK_ARGMAX, False, DOT_PRECISION,
        REDUCTION, LOADER,
    )
    if TRACK_ARGMAX:
        key = nan_winner_keys(
            q_rows, q_row_ptrs, row_valid, stride_qk, doc_ptr, doc_mask_ptr, doc_len, stride_dl, stride_dk,
            stride_dml, best, key, doc_scale_ptr, stride_dsl,
            DIM, BLOCK_M, BLOCK_K, NUM_K, HAS_D_MASK, EXCLUDE, DOT_PRECISION, LOADER,
        )
    return best, key, n_valid
