"""The token-stream forward kernel of packed corpora (inference): a program walks a contiguous run of documents as
one stream of full document tiles, crossing document boundaries.

Why a kernel of its own and not a flag of :func:`~lik.core.forward_kernel.maxsim_fwd_kernel`: that loop's unit is
a document (a program, or a persistent step, per document tile), so a short packed document of 60-140 tokens is
one or two tiles with a ragged last one (about a fifth of the products wasted) and the pipeline refills per
document. Here the unit is a tile of the packed rows: one tensor-core product per ``BLOCK_T`` rows whatever
documents they belong to, then one masked row max per document that overlaps the tile (``segment_max``), a
running max carried into the next tile for the document that crosses its end. The pieces are the core's: the
query rows (:func:`~lik.core.tile.query_rows`), the product (:func:`~lik.core.tile.tile_dot`), the 8-bit scales
(:mod:`lik.core.quantized`), the NaN-propagating max (:func:`~lik.core.reductions.nan_max`) and a document's write
(:func:`~lik.core.stream.write_document`); only the walk is new. No winners (training keeps the document loop).

Programs: ``programs`` per row block, each owning the documents whose first row falls in its share of the rows
(balanced by tokens, found by a binary search of ``cu_seqlens`` on the device); the row blocks of one share are
neighbouring programs, so its tiles come from DRAM once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .division import divide
from .quantized import row_scales, scale_columns
from .reductions import nan_max
from .stream import write_document
from .tile import NO_KEY, group_offsets, query_rows, tile_dot

__all__ = ["token_stream_kernel", "lower_bound", "segment_max", "STREAM_RUNTIME_INTS"]

STREAM_RUNTIME_INTS = [
    "n_queries",
    "q_len",
    "n_docs",
    "n_d_rows",
    "n_chunks",
    "n_row_blocks",
    "programs",
    "search_steps",
    "row_blocks_multiplier",
    "row_blocks_shift",
    "chunks_multiplier",
    "chunks_shift",
    "stride_qmn",
    "stride_pn",
    "stride_pc",
]


@triton.jit
def lower_bound(cu_ptr, x, first, stop, n_steps):
    """The first ``j`` in ``[first, stop)`` with ``cu[j] >= x`` (``stop`` when none): a binary search of
    ``n_steps`` (at least ``int(stop - first).bit_length()``) runtime steps over non-decreasing offsets."""
    lo = (x * 0 + first).to(tl.int64)
    hi = (x * 0 + stop).to(tl.int64)
    for _ in range(n_steps):
        mid = (lo + hi) // 2
        below = tl.load(cu_ptr + mid, mask=mid < hi, other=0).to(tl.int64) < x
        lo = tl.where((lo < hi) & below, mid + 1, lo)
        hi = tl.where((lo < hi) & ~below, mid, hi)
    return lo


@triton.jit
def segment_max(sim, tile_lo, start, end, BLOCK_T: tl.constexpr):
    """Each row's NaN-propagating max over the columns of the tile of rows ``tile_lo ..`` that lie in rows
    ``[start, end)``; -inf when none does. (The bounds are made relative to the tile first: 32-bit column
    compares against a constant range, where absolute int64 columns held 32 registers a thread more.)"""
    first = tl.minimum(tl.maximum(start - tile_lo, 0), BLOCK_T).to(tl.int32)
    stop = tl.minimum(tl.maximum(end - tile_lo, 0), BLOCK_T).to(tl.int32)
    offs = tl.arange(0, BLOCK_T)
    inside = (offs >= first) & (offs < stop)
    return tl.reduce(tl.where(inside[None, :], sim, float("-inf")), 1, nan_max)


@triton.jit
def _document_end(cu_d_ptr, doc, doc_end, start, run_end):
    """The end row of document ``doc`` (``run_end`` past the program's last document ``doc_end - 1``), clamped to
    ``[start, run_end]`` so that unchecked offsets can give wrong numbers, never reads outside the run."""
    end = tl.load(cu_d_ptr + doc + 1, mask=doc < doc_end, other=0).to(tl.int64)
    end = tl.where(doc < doc_end, end, run_end)
    return tl.minimum(tl.maximum(end, start), run_end)


@triton.jit
def _fold_document(
    sim,
    tile_lo,
    tile_hi,
    live,
    doc,
    doc_end,
    start,
    end,
    next_end,
    best,
    run_end,
    cu_d_ptr,
    partial_ptr,
    row_valid,
    row_in_range,
    query,
    token,
    sum_offsets,
    sums_in_range,
    stride_pb,
    q_scale,
    GROUP_ROWS: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
    LOADER: tl.constexpr,
    FOLDED: tl.constexpr,
):
    """One document's step in a tile (when ``live``): fold its columns into ``best`` (done already if
    ``FOLDED``); if it ends in the tile, write its score and move to the next document. Returns the new state and
    whether the next document also overlaps the tile (one starting where the tile ends waits for the next tile)."""
    if live:
        if not FOLDED:
            best = nan_max(best, segment_max(sim, tile_lo, start, end, BLOCK_T))
        ended = end <= tile_hi
        if ended:
            write_document(
                best,
                tl.full((BLOCK_M,), NO_KEY, tl.int32),
                (end - start).to(tl.int32),
                row_valid,
                row_in_range,
                query,
                token,
                sum_offsets,
                sums_in_range,
                doc,
                partial_ptr,
                partial_ptr,
                stride_pb,
                0,
                0,
                0,
                0,
                q_scale,
                GROUP_ROWS,
                GROUPS,
                True,
                False,
                LOADER,
            )
            doc += 1
            start = end
            end = next_end
            next_end = _document_end(cu_d_ptr, doc + 1, doc_end, end, run_end)
            best = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        live = ended & (doc < doc_end) & ((start < tile_hi) | (end <= tile_hi))
    return doc, start, end, next_end, best, live


@triton.jit(do_not_specialize=STREAM_RUNTIME_INTS)
def token_stream_kernel(
    q_ptr,
    d_ptr,
    q_mask_ptr,
    cu_d_ptr,
    partial_ptr,
    q_scale_ptr,
    d_scale_ptr,
    n_queries,
    q_len,
    n_docs,
    n_d_rows,
    n_chunks,
    n_row_blocks,
    programs,
    search_steps,
    row_blocks_multiplier,
    row_blocks_shift,
    chunks_multiplier,
    chunks_shift,
    stride_qn,
    stride_ql,
    stride_qk,
    stride_dl,
    stride_dk,
    stride_qmn,
    stride_qml,
    stride_pc,
    stride_pn,
    stride_pb,
    DIM: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_Q_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LOADER: tl.constexpr,
    SEGMENTS: tl.constexpr = 3,
    DECODE: tl.constexpr = None,
    NBITS: tl.constexpr = 0,
):
    """Scores of dense queries ``q [Nq, Lq, DIM]`` against the packed corpus ``d [n_d_rows, DIM]`` (documents
    ``cu_d [n_docs + 1]``, int32): ``partial [n_chunks, Nq, n_docs]`` fp32 row sums per query chunk
    (``mask_mode="exclude"``: an empty document scores 0; a masked query row adds 0). 8-bit rows (``LOADER``)
    carry contiguous fp32 scales ``q_scale [Nq, Lq]`` and ``d_scale [n_d_rows]``. Grid:
    ``n_row_blocks * programs``; the document side needs ``DIM <= BLOCK_K`` (resident features).

    With ``NBITS`` > 0 the rows are compressed residuals, decoded per tile on chip by the jit function ``DECODE``
    (the residual loader of :mod:`lik.ops.residual.decode`, passed in so that the core imports nothing of an op):
    ``d [n_d_rows, DIM * NBITS // 8]`` uint8 the packed residuals, ``d_scale`` the int32 / int64 codes and
    ``q_scale`` the loader's decode table (the 8-bit side tables' slots: no parameter is added, so every launch
    keeps one positional form)."""
    BLOCK_M: tl.constexpr = GROUP_ROWS * GROUPS
    pid = tl.program_id(0)
    program = divide(pid, row_blocks_multiplier, row_blocks_shift)
    row_block = pid - program * n_row_blocks

    query, token, row_in_range, row_valid = query_rows(
        row_block,
        n_queries,
        q_len,
        n_chunks,
        chunks_multiplier,
        chunks_shift,
        q_mask_ptr,
        stride_qmn,
        stride_qml,
        GROUP_ROWS,
        GROUPS,
        HAS_Q_MASK,
    )
    sum_offsets, sums_in_range = group_offsets(
        row_block,
        n_queries,
        n_chunks,
        chunks_multiplier,
        chunks_shift,
        stride_pc,
        stride_pn,
        GROUPS,
    )
    offs_k = tl.arange(0, BLOCK_K)
    if DIM == BLOCK_K and not HAS_Q_MASK:
        # Rows past the query re-read a real token (no row predicate); their maxima never reach a score.
        clamped = q_ptr + tl.minimum(query, n_queries - 1) * stride_qn + tl.minimum(token, q_len - 1) * stride_ql
        q_rows = tl.load(clamped[:, None] + offs_k[None, :] * stride_qk)
    else:  # (a masked query row may hold NaN: it is never read)
        q_rows = tl.load(
            q_ptr + query[:, None] * stride_qn + token[:, None] * stride_ql + offs_k[None, :] * stride_qk,
            mask=row_valid[:, None] & (offs_k[None, :] < DIM),
            other=0.0,
        )
    q_scale = row_scales(q_scale_ptr + query * q_len + token, row_valid, LOADER)

    # The program's documents: those whose first row lies in its share of the rows (the last share takes the
    # documents that start at the end, empty ones).
    share_lo = program.to(tl.int64) * n_d_rows // programs
    share_hi = (program.to(tl.int64) + 1) * n_d_rows // programs
    first_doc = lower_bound(cu_d_ptr, share_lo, 0, n_docs, search_steps)
    doc_end = tl.where(program == programs - 1, n_docs, lower_bound(cu_d_ptr, share_hi, 0, n_docs, search_steps))
    doc_end = tl.maximum(doc_end, first_doc)
    run_start = tl.load(cu_d_ptr + first_doc, mask=first_doc < doc_end, other=0).to(tl.int64)
    run_start = tl.minimum(tl.maximum(run_start, 0), n_d_rows)
    run_end = tl.load(cu_d_ptr + doc_end, mask=first_doc < doc_end, other=0).to(tl.int64)
    run_end = tl.where(first_doc < doc_end, tl.minimum(tl.maximum(run_end, run_start), n_d_rows), run_start)

    # The running state: the current document (its rows [start, end), the next one's end, read one document
    # ahead so that its latency overlaps a tile's product) and its rows' max over the tiles seen so far.
    doc = first_doc
    start = run_start
    end = _document_end(cu_d_ptr, doc, doc_end, start, run_end)
    next_end = _document_end(cu_d_ptr, doc + 1, doc_end, end, run_end)
    best = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    no_key = tl.full((BLOCK_M,), NO_KEY, tl.int32)
    # The tile's first row is the induction variable, not a carried value: Triton 3.6's pipeliner scheduled a
    # carried one's row addresses before their operands (and gave up pipelining the loop).
    for tile_lo in tl.range(run_start, run_end, BLOCK_T):
        tile_hi = tile_lo + BLOCK_T
        # Unpredicated rows: past the run, the run's last row again (its columns belong to no document here).
        rows = tl.minimum(tile_lo + tl.arange(0, BLOCK_T), run_end - 1)
        if NBITS > 0:
            d_tile = DECODE(d_ptr, d_scale_ptr, q_scale_ptr, rows, stride_dl, DIM, NBITS, BLOCK_K).to(q_rows.dtype)
        elif DIM == BLOCK_K:
            d_tile = tl.load(d_ptr + rows[:, None] * stride_dl + offs_k[None, :] * stride_dk)
        else:
            d_tile = tl.load(
                d_ptr + rows[:, None] * stride_dl + offs_k[None, :] * stride_dk, mask=offs_k[None, :] < DIM, other=0.0
            )
        col_scale = row_scales(d_scale_ptr + rows, rows >= 0, LOADER)
        sim = scale_columns(tile_dot(q_rows, tl.trans(d_tile), None, DOT_PRECISION, LOADER), col_scale, LOADER)
        # Every document that overlaps the tile, in order: fold its columns, write it where it ends. The first
        # SEGMENTS in unrolled passes; the rest (short documents) in a loop of the count a binary search gives.
        # (A `while` here would stop Triton's pipeliner from prefetching the tiles: sm_90 TTGIR.) A tile starts only
        # while documents remain, so its first is live: folded here, outside any `if`, because Triton 3.6's
        # pipeliner fails (TritonGPUPipeline) on an asynchronous product whose first use lies inside an `if`.
        best = nan_max(best, segment_max(sim, tile_lo, start, end, BLOCK_T))
        live = doc < doc_end
        for _pass in tl.static_range(SEGMENTS):
            doc, start, end, next_end, best, live = _fold_document(
                sim,
                tile_lo,
                tile_hi,
                live,
                doc,
                doc_end,
                start,
                end,
                next_end,
                best,
                run_end,
                cu_d_ptr,
                partial_ptr,
                row_valid,
                row_in_range,
                query,
                token,
                sum_offsets,
                sums_in_range,
                stride_pb,
                q_scale,
                GROUP_ROWS,
                GROUPS,
                BLOCK_M,
                BLOCK_T,
                LOADER,
                _pass == 0,
            )
        if live:
            # documents [doc, last) end in the tile; `last` itself (if any) crosses its end
            last = lower_bound(cu_d_ptr + 1, tile_hi + 1, doc, doc_end, search_steps)
            for _more in range(doc, tl.minimum(last + 1, doc_end)):
                doc, start, end, next_end, best, live = _fold_document(
                    sim,
                    tile_lo,
                    tile_hi,
                    live,
                    doc,
                    doc_end,
                    start,
                    end,
                    next_end,
                    best,
                    run_end,
                    cu_d_ptr,
                    partial_ptr,
                    row_valid,
                    row_in_range,
                    query,
                    token,
                    sum_offsets,
                    sums_in_range,
                    stride_pb,
                    q_scale,
                    GROUP_ROWS,
                    GROUPS,
                    BLOCK_M,
                    BLOCK_T,
                    LOADER,
                    False,
                )
    # A run of empty documents takes no tile: each scores 0.
    while doc < doc_end:
        write_document(
            best,
            no_key,
            (doc * 0).to(tl.int32),
            row_valid,
            row_in_range,
            query,
            token,
            sum_offsets,
            sums_in_range,
            doc,
            partial_ptr,
            partial_ptr,
            stride_pb,
            0,
            0,
            0,
            0,
            q_scale,
            GROUP_ROWS,
            GROUPS,
            True,
            False,
            LOADER,
        )
        doc += 1
