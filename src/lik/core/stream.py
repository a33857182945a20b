"""The tile loop over whole documents: :func:`stream_document` walks one document's tiles through a block of query
rows (:mod:`lik.core.tile`'s pieces), the NaN passes settle rows whose max is NaN, and :func:`write_document`
stores a finished document's row sums and winners.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .quantized import FLOAT, FP8, row_scales, scale_columns, scale_rows
from .reductions import nan_max
from .segments import document_scales, document_span
from .tile import (
    NAN_PASS_BLOCK_N, NO_KEY, REDUCE_MAX, ROW_MAX_CLASSES, absorb_nan_tile, class_tile_max, counted_rows, fold_tile,
    fresh_rows, reduce_tile, similarity_tile, store_group_sums, tile_dot, tile_scales, tile_window,
)

__all__ = [
    "document_tile", "stream_document", "first_nan_keys", "nan_winner_keys", "maxsim_doc_rows", "store_winners",
    "write_document", "settle_nan_winners", "finish_tile",
]


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


@triton.jit
def store_winners(
    argmax_ptr, key, row_counts, store_mask, query, doc, token, stride_an, stride_ab, stride_al, row_offset,
):
    """Write each row's winning token for document ``doc`` (-1: no gradient; a masked winner gets none), as an
    index into the document plus ``row_offset`` (packed documents store absolute rows)."""
    has_grad = row_counts & (key != NO_KEY) & ((key & 1) == 0)
    index = tl.where(has_grad, (key >> 1) + row_offset, -1)
    tl.store(
        argmax_ptr + query * stride_an + doc * stride_ab + token * stride_al,
        index.to(argmax_ptr.dtype.element_ty),
        mask=store_mask,
    )


@triton.jit
def write_document(
    best, key, n_valid, row_valid, row_in_range, query, token, sum_offsets, sums_in_range, doc, partial_ptr,
    argmax_ptr, stride_pb, stride_an, stride_ab, stride_al, row_offset, q_scale,
    GROUP_ROWS: tl.constexpr, GROUPS: tl.constexpr, EXCLUDE: tl.constexpr, STORE_ARGMAX: tl.constexpr,
    LOADER: tl.constexpr,
):
    """Write document ``doc``'s group sums (placed by ``sum_offsets`` and ``sums_in_range``, from
    :func:`~lik.core.tile.group_offsets`) and winners (NaN rows not yet settled); 8-bit row maxima are scaled
    by their query rows' ``q_scale`` here. Returns 1 for the rows whose max is NaN."""
    row_counts = counted_rows(row_valid, n_valid, EXCLUDE)
    store_group_sums(
        partial_ptr, tl.where(row_counts, scale_rows(best, q_scale, LOADER), 0.0), sum_offsets, sums_in_range, doc,
        stride_pb, GROUP_ROWS, GROUPS,
    )
    if STORE_ARGMAX:
        store_winners(
            argmax_ptr, key, row_counts, row_in_range, query, doc, token, stride_an, stride_ab, stride_al, row_offset,
        )
    return (best != best).to(tl.int32)


@triton.jit
def settle_nan_winners(
    q_rows, q_row_ptrs, row_valid, row_in_range, query, token, first_doc, doc_end, doc_step,
    doc_base, doc_mask_base, cu_d_ptr, argmax_ptr, doc_len, n_d_rows, stride_qk,
    stride_db, stride_dl, stride_dk, stride_dmb, stride_dml, stride_an, stride_ab, stride_al,
    doc_scale_base, stride_dsb, stride_dsl,
    DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_K: tl.constexpr, HAS_D_MASK: tl.constexpr, EXCLUDE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    LAYOUT: tl.constexpr, LOADER: tl.constexpr,
):
    """Rewrite the stored winner of every row whose max over one of the program's documents is NaN with that
    row's first NaN token, as ``torch.max`` picks it (the tile loop tests equality with the max only).

    A program calls it once, after all its documents, and only when one of its rows saw a NaN max: testing after
    each document costs a block-wide reduction per document (ColBERT's 3-tile documents: 2-6% slower on the
    H200)."""
    for doc in range(first_doc, doc_end, doc_step):
        doc_ptr, doc_mask_ptr, length, row_offset = document_span(
            doc, doc_base, doc_mask_base, cu_d_ptr, doc_len, n_d_rows, stride_db, stride_dl, stride_dmb, LAYOUT,
        )
        doc_scale_ptr = document_scales(doc, doc_scale_base, row_offset, stride_dsb, stride_dsl, LAYOUT)
        nan_key, n_valid = first_nan_keys(
            q_rows, q_row_ptrs, row_valid, stride_qk, doc_ptr, doc_mask_ptr, length, stride_dl, stride_dk, stride_dml,
            doc_scale_ptr, stride_dsl, DIM, BLOCK_M, BLOCK_K, NUM_K, HAS_D_MASK, EXCLUDE, DOT_PRECISION, LOADER,
        )
        row_counts = counted_rows(row_valid, n_valid, EXCLUDE)
        # A NaN similarity makes the row's max NaN: exactly the rows with a NaN key are rewritten.
        store_winners(
            argmax_ptr, nan_key, row_counts, row_in_range & (nan_key != NO_KEY), query, doc, token,
            stride_an, stride_ab, stride_al, row_offset,
        )


@triton.jit
def finish_tile(
    sim, start, length, last_tile, doc, doc_mask_ptr, stride_dml, best, key, n_valid, nan_rows, row_valid,
    row_in_range, query, token, sum_offsets, sums_in_range, partial_ptr, argmax_ptr, stride_pb, stride_an,
    stride_ab, stride_al, row_offset, q_scale,
    BLOCK_N: tl.constexpr, GROUP_ROWS: tl.constexpr, GROUPS: tl.constexpr, HAS_D_MASK: tl.constexpr,
    EXCLUDE: tl.constexpr, STORE_ARGMAX: tl.constexpr, REDUCTION: tl.constexpr, LOADER: tl.constexpr,
):
    """A streamed tile's similarities are complete: fold them in and, on the document's last tile, write the
    document and start the next one afresh. Returns ``(best, key, n_valid, nan_rows)``."""
    best, key, n_valid = fold_tile(
        sim, start, length, doc_mask_ptr, stride_dml, best, key, n_valid, BLOCK_N, HAS_D_MASK, EXCLUDE, STORE_ARGMAX,
        REDUCTION,
    )
    if last_tile:
        nan_rows |= write_document(
            best, key, n_valid, row_valid, row_in_range, query, token, sum_offsets, sums_in_range, doc, partial_ptr,
            argmax_ptr, stride_pb, stride_an, stride_ab, stride_al, row_offset, q_scale,
            GROUP_ROWS, GROUPS, EXCLUDE, STORE_ARGMAX, LOADER,
        )
        best, key, n_valid = fresh_rows(GROUP_ROWS * GROUPS)
    return best, key, n_valid, nan_rows
