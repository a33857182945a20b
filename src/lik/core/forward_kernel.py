"""The forward kernel of the tile loop: query rows against streamed document tiles; only the row sums (and the
winners) are written. MaxSim scores with it in every layout, and Chamfer's nearest neighbours on feature sets run
through its argmax forward; :mod:`lik.core.forward_launch` describes its launch.

Query rows are addressed as *groups*: a group is ``group_rows`` consecutive tokens of one query (the power-of-two
bucket of ``Lq``, capped by the config), so a short query is one padded group and a long one is several groups
whose partial sums are added afterwards (exact: the score is a sum over query tokens). A program owns ``groups``
consecutive groups (several short queries stacked into one tall tile when documents are shared) and one document.
With ``programs_per_sm`` set (a persistent launch), a program keeps its query rows and walks documents
``doc``, ``doc + doc_programs``, ...: the query block is loaded once per program instead of once per document,
and the documents' tiles follow each other in one pipelined loop.
Lengths and batch sizes are runtime arguments and are not specialised on, so they never trigger a recompile.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .division import divide
from .pairs import score_pairs
from .quantized import FLOAT, INT8, reset_similarity, row_scales, scale_similarity, zero_similarity
from .reductions import nan_max
from .segments import PACKED, PAIRS, document_scales, document_span, program_tiles, segment
from .stream import document_tile, finish_tile, settle_nan_winners, stream_document, write_document
from .tile import (
    NO_KEY, REDUCE_MAX, ROW_MAX_CLASSES, chunk_similarity, fresh_rows, group_offsets, query_rows, tile_scales,
)

__all__ = ["maxsim_fwd_kernel", "score_documents", "RUNTIME_INTS"]


# Lengths, counts and the strides that follow them are not specialised on (Triton would otherwise compile a new
# variant when one of them becomes 1 or changes its divisibility by 16). The embedding strides stay specialised:
# Lq * d and Ld * d keep their divisibility for any length when d does, and knowing the rows are 16-byte aligned
# is what lets Triton load them with wide vector loads (measured on the H200: the query block loaded element by
# element cost ColPali 0.58 -> 0.70 ms).
RUNTIME_INTS = [
    "n_queries", "q_len", "n_docs", "doc_len", "n_q_rows", "n_d_rows", "n_chunks", "n_row_blocks", "doc_programs",
    "row_blocks_multiplier", "row_blocks_shift", "chunks_multiplier", "chunks_shift",
    "stride_qmn", "stride_dmn", "stride_dmb", "stride_pc", "stride_pn", "stride_an", "stride_ab",
]



@triton.jit(do_not_specialize=RUNTIME_INTS)
def maxsim_fwd_kernel(
    q_ptr,
    d_ptr,
    q_mask_ptr,
    d_mask_ptr,
    cu_q_ptr,  # int32 [N + 1] (PAIRS) or unused
    cu_d_ptr,  # int32 [B + 1] (PACKED, PAIRS) or unused
    partial_ptr,  # fp32 [n_chunks, Nq, B] ([n_row_blocks, 1, N] for PAIRS)
    argmax_ptr,  # int16 / int32 [Nq, B, Lq] (int32 absolute packed rows: PACKED [Nq, B, Lq], PAIRS [Tq])
    q_scale_ptr,  # fp32 contiguous per-row scales of 8-bit queries ([Nq, Lq]; PAIRS [Tq]); unused for float rows
    d_scale_ptr,  # fp32 contiguous scales of 8-bit documents ([n_sets, B, Ld]; packed [Td]); unused for float rows
    n_queries,
    q_len,
    n_docs,
    doc_len,  # PADDED only: packed documents have their own lengths
    n_q_rows,  # PAIRS: rows of the packed queries
    n_d_rows,  # PACKED, PAIRS: rows of the packed documents
    n_chunks,
    n_row_blocks,
    doc_programs,  # programs per row block; each takes every doc_programs-th document
    row_blocks_multiplier, row_blocks_shift,  # divide by n_row_blocks (lik.core.division)
    chunks_multiplier, chunks_shift,  # divide by n_chunks
    stride_qn, stride_ql, stride_qk,
    stride_dn, stride_db, stride_dl, stride_dk,
    stride_qmn, stride_qml,
    stride_dmn, stride_dmb, stride_dml,
    stride_pc, stride_pn, stride_pb,
    stride_an, stride_ab, stride_al,
    DIM: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_K: tl.constexpr,
    HAS_Q_MASK: tl.constexpr,
    HAS_D_MASK: tl.constexpr,
    EXCLUDE: tl.constexpr,
    STORE_ARGMAX: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PERSISTENT: tl.constexpr,
    LAYOUT: tl.constexpr = 0,  # PADDED, PACKED or PAIRS (lik.core.segments)
    FLAT_K: tl.constexpr = 1,  # wide embeddings: one flat (tile, chunk) loop, or a chunk loop nested per tile
    REDUCTION: tl.constexpr = 0,  # the running reduction (tile.py: REDUCE_MAX, MaxSim's max)
    LOADER: tl.constexpr = 0,  # FLOAT, or INT8 / FP8 rows with per-row scales (lik.core.quantized)
    WHOLE_TILES: tl.constexpr = False,  # long queries, PADDED, unmasked: whole tiles read as they are (tile.py)
    TAIL_N: tl.constexpr = 0,  # with WHOLE_TILES: the width of the tiles after them (tile.stream_document)
):
    BLOCK_M: tl.constexpr = GROUP_ROWS * GROUPS
    # 32-bit indices (the grid has fewer than 2**31 programs) divided with the host's multipliers: a division by a
    # runtime count is ~20 instructions, a visible share of a long query's short program (lik.core.division).
    pid = tl.program_id(0)
    first_doc = divide(pid, row_blocks_multiplier, row_blocks_shift)
    row_block = pid - first_doc * n_row_blocks
    first_doc = first_doc.to(tl.int64)
    if LAYOUT == PAIRS:
        score_pairs(
            q_ptr, d_ptr, cu_q_ptr, cu_d_ptr, partial_ptr, argmax_ptr, row_block.to(tl.int64), first_doc, n_row_blocks,
            n_q_rows, n_d_rows, stride_ql, stride_qk, stride_dl, stride_dk, stride_pc, stride_pb, stride_al,
            q_scale_ptr, d_scale_ptr,
            DIM, BLOCK_M, BLOCK_N, BLOCK_K, NUM_K, STORE_ARGMAX, DOT_PRECISION, REDUCTION, LOADER,
        )
    else:
        score_documents(
            q_ptr, d_ptr, q_mask_ptr, d_mask_ptr, cu_d_ptr, partial_ptr, argmax_ptr, row_block, first_doc,
            n_queries, q_len, n_docs, doc_len, n_d_rows, n_chunks, chunks_multiplier, chunks_shift, doc_programs,
            stride_qn, stride_ql, stride_qk, stride_dn, stride_db, stride_dl, stride_dk, stride_qmn, stride_qml,
            stride_dmn, stride_dmb, stride_dml, stride_pc, stride_pn, stride_pb, stride_an, stride_ab, stride_al,
            q_scale_ptr, d_scale_ptr,
            DIM, GROUP_ROWS, GROUPS, BLOCK_N, BLOCK_K, NUM_K, HAS_Q_MASK, HAS_D_MASK, EXCLUDE, STORE_ARGMAX,
            DOT_PRECISION, PERSISTENT, LAYOUT, FLAT_K, REDUCTION, LOADER, WHOLE_TILES, TAIL_N,
        )


@triton.jit
def score_documents(
    q_ptr, d_ptr, q_mask_ptr, d_mask_ptr, cu_d_ptr, partial_ptr, argmax_ptr, row_block, first_doc,
    n_queries, q_len, n_docs, doc_len, n_d_rows, n_chunks, chunks_multiplier, chunks_shift, doc_programs,
    stride_qn, stride_ql, stride_qk, stride_dn, stride_db, stride_dl, stride_dk, stride_qmn, stride_qml,
    stride_dmn, stride_dmb, stride_dml, stride_pc, stride_pn, stride_pb, stride_an, stride_ab, stride_al,
    q_scale_ptr, d_scale_ptr,
    DIM: tl.constexpr, GROUP_ROWS: tl.constexpr, GROUPS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_K: tl.constexpr, HAS_Q_MASK: tl.constexpr, HAS_D_MASK: tl.constexpr,
    EXCLUDE: tl.constexpr, STORE_ARGMAX: tl.constexpr, DOT_PRECISION: tl.constexpr, PERSISTENT: tl.constexpr,
    LAYOUT: tl.constexpr, FLAT_K: tl.constexpr, REDUCTION: tl.constexpr, LOADER: tl.constexpr,
    WHOLE_TILES: tl.constexpr, TAIL_N: tl.constexpr,
):
    """A program's query rows (``row_block``) against its documents ``first_doc``, ``first_doc + doc_programs``,
    ...: the documents come from :func:`~lik.core.segments.document_span` (padded or packed), the rest is one
    loop whatever the layout."""
    BLOCK_M: tl.constexpr = GROUP_ROWS * GROUPS

    query, token, row_in_range, row_valid = query_rows(
        row_block, n_queries, q_len, n_chunks, chunks_multiplier, chunks_shift, q_mask_ptr, stride_qmn, stride_qml,
        GROUP_ROWS, GROUPS, HAS_Q_MASK,
    )
    sum_offsets, sums_in_range = group_offsets(
        row_block, n_queries, n_chunks, chunks_multiplier, chunks_shift, stride_pc, stride_pn, GROUPS,
    )
    q_row_ptrs = q_ptr + query * stride_qn + token * stride_ql
    # 8-bit scales are contiguous (the launchers make them so), so their strides follow the shapes: the query's
    # [Nq, Lq], the documents' [n_sets, B, Ld] (one set when shared: stride_dn == 0) or packed rows.
    stride_dsb = doc_len
    stride_dsl = 1
    q_scale_ptrs = q_scale_ptr + query * q_len + token
    offs_k = tl.arange(0, BLOCK_K)
    if NUM_K == 1 and DIM == BLOCK_K and not HAS_Q_MASK:
        # Rows past the query (a short group's padding, a last block's missing queries) re-read a real token
        # instead of loading under a row predicate: their maxima never reach a score or a winner (row_valid,
        # row_in_range). (A masked query keeps the predicate: its masked tokens may hold NaN.)
        if WHOLE_TILES:
            # The launcher's promise covers the query too (forward.whole_tiles): rows back to back and fewer than
            # 2**31 elements, so rows are addressed with 32-bit offsets and the compile-time width as row stride.
            # The element offsets are summed in 32 bits before the one 64-bit pointer add per vector.
            query_32, token_32 = query.to(tl.int32), token.to(tl.int32)
            q_scale_ptrs = q_scale_ptr + (query_32 * q_len + token_32)
            row_offsets = (tl.minimum(query_32, n_queries - 1) * q_len + tl.minimum(token_32, q_len - 1)) * DIM
            q_rows = tl.load(q_ptr + (row_offsets[:, None] + offs_k[None, :]))
        else:
            clamped_rows = (
                q_ptr + tl.minimum(query, n_queries - 1) * stride_qn + tl.minimum(token, q_len - 1) * stride_ql
            )
            q_rows = tl.load(clamped_rows[:, None] + offs_k[None, :] * stride_qk)
    elif NUM_K == 1:
        q_rows = tl.load(
            q_row_ptrs[:, None] + offs_k[None, :] * stride_qk,
            mask=row_valid[:, None] & (offs_k[None, :] < DIM),
            other=0.0,
        )
    else:
        q_rows = tl.zeros((BLOCK_M, BLOCK_K), q_ptr.dtype.element_ty)
    q_scale = row_scales(q_scale_ptrs, row_valid, LOADER)

    # Shared documents have stride_dn == 0; per-query documents run with GROUPS == 1, so the first group's
    # query is every row's query.
    doc_set = divide(row_block * GROUPS, chunks_multiplier, chunks_shift).to(tl.int64)
    doc_base = d_ptr + doc_set * stride_dn
    doc_mask_base = d_mask_ptr + doc_set * stride_dmn
    doc_scale_base = d_scale_ptr + tl.where(stride_dn == 0, 0, doc_set * n_docs * doc_len)
    # A program's documents share one length when padded; a packed program has one document (doc_programs ==
    # n_docs), so the flat loops below see one length either way, except the persistent loop over packed
    # documents, which carries each document's rows and length itself.
    doc_ptr, doc_mask_ptr, length, row_offset = document_span(
        first_doc, doc_base, doc_mask_base, cu_d_ptr, doc_len, n_d_rows, stride_db, stride_dl, stride_dmb, LAYOUT,
    )
    doc_scale_ptr = document_scales(first_doc, doc_scale_base, row_offset, stride_dsb, stride_dsl, LAYOUT)
    my_docs = tl.cdiv(n_docs - first_doc, doc_programs).to(tl.int32)
    tiles = tl.cdiv(length, BLOCK_N)
    best, key, n_valid = fresh_rows(BLOCK_M)
    nan_rows = tl.zeros((BLOCK_M,), tl.int32)
    doc = first_doc
    start = 0
    if NUM_K > 1:
        # Wide embeddings: neither the query block nor a document tile fits on chip whole, so both stream through
        # in feature chunks, one flat loop over (document, tile, chunk) steps (the pipeline never drains between
        # tiles or documents); a tile is folded into the running max on its last chunk.
        q_load_ptrs = (
            q_ptr + tl.minimum(query, n_queries - 1) * stride_qn + tl.minimum(token, q_len - 1) * stride_ql
        )
        if not FLAT_K:  # a tile per outer step, its chunks in an inner pipelined loop (a GEMM's main loop)
            for _ in tl.range(0, my_docs * tiles, num_stages=1):
                cols = start + tl.arange(0, BLOCK_N)
                col_ptrs = (
                    doc_ptr + (doc - first_doc) * stride_db + tl.minimum(cols, length - 1).to(tl.int64) * stride_dl
                )
                sim = zero_similarity(BLOCK_M, BLOCK_N, LOADER)
                for kc in tl.range(0, NUM_K):
                    sim = chunk_similarity(
                        sim, q_load_ptrs, stride_qk, col_ptrs, stride_dk, kc * BLOCK_K, DIM, BLOCK_K, DOT_PRECISION,
                        LOADER,
                    )
                sim = scale_similarity(
                    sim, doc_scale_ptr + (doc - first_doc) * stride_dsb + cols.to(tl.int64) * stride_dsl,
                    cols < length, LOADER,
                )
                last_tile = start + BLOCK_N >= length
                best, key, n_valid, nan_rows = finish_tile(
                    sim, start, length, last_tile, doc, doc_mask_ptr + (doc - first_doc) * stride_dmb, stride_dml,
                    best, key, n_valid, nan_rows, row_valid, row_in_range, query, token, sum_offsets,
                    sums_in_range, partial_ptr, argmax_ptr, stride_pb, stride_an, stride_ab, stride_al,
                    row_offset, q_scale, BLOCK_N, GROUP_ROWS, GROUPS, HAS_D_MASK, EXCLUDE, STORE_ARGMAX, REDUCTION,
                    LOADER,
                )
                doc = tl.where(last_tile, doc + doc_programs, doc)
                start = tl.where(last_tile, 0, start + BLOCK_N)
        else:
            sim = zero_similarity(BLOCK_M, BLOCK_N, LOADER)
            chunk = 0
            for _ in tl.range(0, my_docs * tiles * NUM_K):
                cols = start + tl.arange(0, BLOCK_N)
                col_ptrs = (
                    doc_ptr + (doc - first_doc) * stride_db + tl.minimum(cols, length - 1).to(tl.int64) * stride_dl
                )
                sim = chunk_similarity(
                    sim, q_load_ptrs, stride_qk, col_ptrs, stride_dk, chunk * BLOCK_K, DIM, BLOCK_K, DOT_PRECISION,
                    LOADER,
                )
                last_chunk = chunk == NUM_K - 1
                last_tile = start + BLOCK_N >= length
                if last_chunk:
                    tile_sim = scale_similarity(
                        sim,
                        doc_scale_ptr + (doc - first_doc) * stride_dsb + cols.to(tl.int64) * stride_dsl,
                        cols < length, LOADER,
                    )
                    best, key, n_valid, nan_rows = finish_tile(
                        tile_sim, start, length, last_tile, doc, doc_mask_ptr + (doc - first_doc) * stride_dmb,
                        stride_dml, best, key, n_valid, nan_rows, row_valid, row_in_range, query, token, sum_offsets,
                        sums_in_range, partial_ptr, argmax_ptr, stride_pb, stride_an,
                        stride_ab, stride_al, row_offset, q_scale, BLOCK_N, GROUP_ROWS, GROUPS, HAS_D_MASK, EXCLUDE,
                        STORE_ARGMAX, REDUCTION, LOADER,
                    )
                sim = reset_similarity(sim, last_chunk, LOADER)
                doc = tl.where(last_chunk & last_tile, doc + doc_programs, doc)
                start = tl.where(last_chunk, tl.where(last_tile, 0, start + BLOCK_N), start)
                chunk = tl.where(last_chunk, 0, chunk + 1)
        if tiles == 0:  # an empty packed document: scores 0, no winner
            nan_rows = write_document(
                best, key, n_valid, row_valid, row_in_range, query, token, sum_offsets, sums_in_range, first_doc,
                partial_ptr, argmax_ptr, stride_pb, stride_an, stride_ab, stride_al,
                row_offset, q_scale, GROUP_ROWS, GROUPS, EXCLUDE, STORE_ARGMAX, LOADER,
            )
    elif PERSISTENT:
        # One flat loop over (document, tile) steps: the pipeliner then prefetches the next document's first
        # tiles while the current one finishes, instead of draining and refilling at every document (short
        # documents are a few tiles long). A document is written from inside the loop, on its last tile only.
        # Its last tile ends at the document's end (document_tile's WINDOW): rows are clamped once, not per tile.
        # (The long-query loop, stream_document, keeps the clamp: the window cost it registers and a program per
        # SM, benchmarks/NOTES.md.)
        # Packed documents (stacked rows, inference): each has its own rows and length, looked up one document
        # ahead and carried (a lookup feeding the same step's tile address is an indirect load to Triton's
        # pipeliner, which then splits its stages between lookup and tiles); every document, even an empty one,
        # takes at least one step, in which it is written.
        AHEAD: tl.constexpr = (LOADER != FLOAT and not HAS_D_MASK) and GROUPS == 1  # (tile_scales says why)
        AHEAD_LOADER: tl.constexpr = LOADER if AHEAD else FLOAT
        col_scale = tile_scales(doc_scale_base + doc * stride_dsb, 0, doc_len, stride_dsl, BLOCK_N, AHEAD_LOADER, True)
        # Without winners, stacked rows keep a document's row maxima per column class until its last tile
        # (tile.class_tile_max). One short query's tile spreads its columns over the warps, so a row max per tile
        # would cross them through shared memory on every tile: an unmasked int8 tile of up to 32 rows keeps the
        # elementwise max of its whole tile instead and reduces the rows once per document. Float8's 64-row tile
        # and a masked document's tile would lose a program per SM to the registers (benchmarks/NOTES.md).
        CLASS_MAX: tl.constexpr = not STORE_ARGMAX and REDUCTION == REDUCE_MAX and GROUPS > 1 and BLOCK_N % 8 == 0
        TILE_MAX: tl.constexpr = (not STORE_ARGMAX and REDUCTION == REDUCE_MAX and GROUPS == 1 and LOADER == INT8
                                  and BLOCK_M <= 32 and not HAS_D_MASK)
        running = best
        if CLASS_MAX:
            running = tl.full((BLOCK_M, ROW_MAX_CLASSES), float("-inf"), tl.float32)
        if TILE_MAX:
            running = tl.full((BLOCK_M, BLOCK_N), float("-inf"), tl.float32)
        steps = my_docs * tiles
        doc_rows, doc_length = row_offset, length  # (the first document's, from document_span)
        next_rows, next_length = row_offset, length
        if LAYOUT == PACKED:
            steps = program_tiles(cu_d_ptr, first_doc, n_docs, doc_programs, n_d_rows, BLOCK_N)
            ahead = first_doc + doc_programs
            next_rows, next_length = segment(cu_d_ptr, ahead, n_d_rows, ahead < n_docs)
        for _ in tl.range(0, steps):
            first_tile = start == 0
            if not TILE_MAX:  # (a whole tile is reset on the document's last tile instead: once, not per tile)
                running = tl.where(first_tile, float("-inf"), running)
            key = tl.where(first_tile, NO_KEY, key)
            n_valid = tl.where(first_tile, 0, n_valid)
            if LAYOUT == PACKED:
                length = doc_length
                # An empty document's tile reads its clamped row -1 (document_tile: rows up to length - 1) at row 0
                # of the packed rows (in bounds: the launch has rows), every column masked.
                tile_doc_ptr = doc_base + tl.where(doc_length > 0, doc_rows, 1) * stride_dl
            else:
                length = doc_len
                tile_doc_ptr = doc_base + doc * stride_db
            last_tile = start + BLOCK_N >= length
            next_doc = tl.where(last_tile, doc + doc_programs, doc)
            next_start = tl.where(last_tile, 0, start + BLOCK_N)
            next_scale = tile_scales(  # (past the program's last document: nothing loaded)
                doc_scale_base + next_doc * stride_dsb, next_start, tl.where(next_doc < n_docs, doc_len, 0), stride_dsl,
                BLOCK_N, AHEAD_LOADER, True,
            )
            running, key, n_valid = document_tile(
                q_rows, q_row_ptrs, row_valid, stride_qk, tile_doc_ptr, doc_mask_base + doc * stride_dmb,
                start, length, stride_dl, stride_dk, stride_dml, running, key, n_valid,
                doc_scale_base + doc * stride_dsb, stride_dsl, col_scale,
                DIM, BLOCK_M, BLOCK_N, BLOCK_K, NUM_K, HAS_D_MASK, EXCLUDE, STORE_ARGMAX, False, DOT_PRECISION,
                REDUCTION, LOADER, AHEAD, True, False, CLASS_MAX, TILE_MAX,
            )
            if last_tile:
                if CLASS_MAX or TILE_MAX:
                    row_max = tl.reduce(running, 1, nan_max)
                else:
                    row_max = running
                nan_rows |= write_document(
                    row_max, key, n_valid, row_valid, row_in_range, query, token, sum_offsets, sums_in_range, doc,
                    partial_ptr, argmax_ptr, stride_pb, stride_an, stride_ab, stride_al,
                    0, q_scale, GROUP_ROWS, GROUPS, EXCLUDE, STORE_ARGMAX, LOADER,
                )
                if TILE_MAX:
                    running = tl.full((BLOCK_M, BLOCK_N), float("-inf"), tl.float32)
            if LAYOUT == PACKED:
                after = next_doc + doc_programs
                fetched_rows, fetched_length = segment(cu_d_ptr, after, n_d_rows, last_tile & (after < n_docs))
                doc_rows = tl.where(last_tile, next_rows, doc_rows)
                doc_length = tl.where(last_tile, next_length, doc_length)
                next_rows = tl.where(last_tile, fetched_rows, next_rows)
                next_length = tl.where(last_tile, fetched_length, next_length)
            doc = next_doc
            start = next_start
            col_scale = next_scale
    else:
        best, key, n_valid = stream_document(
            q_rows, q_row_ptrs, row_valid, stride_qk, doc_ptr, doc_mask_ptr, length, stride_dl, stride_dk, stride_dml,
            best, key, doc_scale_ptr, stride_dsl,
            DIM, BLOCK_M, BLOCK_N, BLOCK_K, NUM_K, HAS_D_MASK, EXCLUDE, STORE_ARGMAX, False, DOT_PRECISION,
            REDUCTION, LOADER, WHOLE_TILES, TAIL_N,
        )
        nan_rows = write_document(
            best, key, n_valid, row_valid, row_in_range, query, token, sum_offsets, sums_in_range, first_doc,
            partial_ptr, argmax_ptr, stride_pb, stride_an, stride_ab, stride_al, row_offset, q_scale,
            GROUP_ROWS, GROUPS, EXCLUDE, STORE_ARGMAX, LOADER,
        )
    if STORE_ARGMAX:
        if tl.max(nan_rows, axis=0) != 0:
            settle_nan_winners(
                q_rows, q_row_ptrs, row_valid, row_in_range, query, token, first_doc, n_docs, doc_programs,
                doc_base, doc_mask_base, cu_d_ptr, argmax_ptr, doc_len, n_d_rows, stride_qk,
                stride_db, stride_dl, stride_dk, stride_dmb, stride_dml, stride_an, stride_ab, stride_al,
                doc_scale_base, stride_dsb, stride_dsl,
                DIM, BLOCK_M, BLOCK_K, NUM_K, HAS_D_MASK, EXCLUDE, DOT_PRECISION, LAYOUT, LOADER,
            )
