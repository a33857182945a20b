"""The fused head's forward kernel: hidden states projected on chip, normalised, and scored against the queries.

One program per (document set, document, row split). It streams the document in tiles of ``BLOCK_N`` tokens;
for each tile it projects the hidden rows on chip (``H_tile @ W.T``, a ``k`` loop over ``d_model`` in fp32
accumulation), adds ``b``, L2-normalises each row (F.normalize: ``x / max(|x|, 1e-12)``), rounds the rows once to
the input dtype and then scores them against *every* query row of the program, a row block at a time, with the
MaxSim tile fold (a NaN-propagating max, the lowest winning token, masked tokens dropped or zeroed by
``mask_mode``). The projection of a tile is therefore computed once however many queries score it, and nothing of
the projected documents leaves the chip. Many queries against few documents (in-batch training: 128 queries x 32
tokens against 128 documents, or 32 x 1024 against 32 pages) would leave most of the GPU idle at one program per
document, so the query rows are split over ``n_splits`` programs per document, each projecting the tiles again
for its share; the host keeps every share at least a few hundred rows, so the projection stays a fraction of the
scoring work.

Why this is its own kernel rather than a loader of :mod:`lik.core.forward_kernel`: the core loop holds a block of
query rows and streams the documents through it, one program per (row block, document). Here the expensive
operand is the document tile (``2 * d_model * d_out`` FLOPs per token against ``2 * d_out`` per query row), so the
loop is turned inside out: the document tile stays on chip and the query row blocks stream through it, their
running maxima kept per row in a small buffer (``[n_sets, B, rows]``: the rows' partial results, read back by the
same program; the buffer then holds each row's final max, summed per query on the host, and the winners). The
pieces it shares with the core are imported: ``tile_dot`` (the tensor-core product and its precision),
``nan_max``, ``NO_KEY`` and the packed layout's ``segment``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...core.reductions import nan_max
from ...core.segments import PADDED, segment
from ...core.tile import NO_KEY, tile_dot

__all__ = ["fused_head_forward_kernel", "project_tile"]


@triton.jit
def project_tile(
    row_ptrs, load_ok, stride_hk, w_ptr, stride_wo, stride_wk, b_ptr, stride_b,
    D_MODEL: tl.constexpr, D_OUT: tl.constexpr, D_OUT_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """``[BLOCK_N, D_OUT_PAD]`` fp32: the hidden rows at ``row_ptrs`` projected by ``W`` (+ ``b``), L2-normalised
    with F.normalize's eps when ``NORMALIZE``. Rows with ``load_ok`` False are read as zeros (never loaded), columns
    past ``D_OUT`` are 0."""
    outs = tl.arange(0, D_OUT_PAD)
    out_ok = outs < D_OUT
    acc = tl.zeros((BLOCK_N, D_OUT_PAD), tl.float32)
    for k_start in range(0, D_MODEL, BLOCK_K):
        kk = k_start + tl.arange(0, BLOCK_K)
        k_ok = kk < D_MODEL
        h = tl.load(row_ptrs[:, None] + kk[None, :] * stride_hk, mask=load_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + outs[None, :] * stride_wo + kk[:, None] * stride_wk, mask=out_ok[None, :] & k_ok[:, None],
                    other=0.0)
        acc = tile_dot(h, w, acc, DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + outs * stride_b, mask=out_ok, other=0.0).to(tl.float32)[None, :]
    if NORMALIZE:
        norm = tl.sqrt(tl.sum(acc * acc, axis=1))
        acc = acc / tl.maximum(norm, 1e-12)[:, None]
    return acc


@triton.jit(do_not_specialize=["n_queries", "q_len", "n_docs", "doc_len", "n_h_rows", "rows_per_set", "n_splits",
                               "split_rows",
                               "stride_hs", "stride_hb", "stride_dms", "stride_dmb", "stride_rs", "stride_rb"])
def fused_head_forward_kernel(
    q_ptr, h_ptr, w_ptr, b_ptr, q_mask_ptr, d_mask_ptr, cu_ptr, best_ptr, key_ptr,
    n_queries, q_len, n_docs, doc_len, n_h_rows, rows_per_set, n_splits, split_rows,
    stride_qn, stride_ql, stride_qk,
    stride_hs, stride_hb, stride_hl, stride_hk,
    stride_wo, stride_wk, stride_b,
    stride_qmn, stride_qml,
    stride_dms, stride_dmb, stride_dml,
    stride_rs, stride_rb,
    D_MODEL: tl.constexpr, D_OUT: tl.constexpr, D_OUT_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_Q_MASK: tl.constexpr, HAS_D_MASK: tl.constexpr, EXCLUDE: tl.constexpr,
    NORMALIZE: tl.constexpr, TRACK_ARGMAX: tl.constexpr, PER_QUERY: tl.constexpr, LAYOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Writes, for program (set, doc, split) and each of its ``split_rows`` of the set's ``rows_per_set`` query rows
    (query-major, ``q_len`` tokens each; ``split_rows`` a multiple of ``BLOCK_M``): ``best[set, doc, row]``, the
    row's max (0 where the row does not count: a masked query token, or under "exclude" a document without a valid
    token), and with ``TRACK_ARGMAX`` ``key[set, doc, row]``, the winning token (-1: no gradient)."""
    pid = tl.program_id(0).to(tl.int64)
    split = pid % n_splits
    doc = (pid // n_splits) % n_docs
    doc_set = pid // (n_splits * n_docs)
    row_lo = split * split_rows
    row_hi = tl.minimum(row_lo + split_rows, rows_per_set)
    first_query = doc_set if PER_QUERY else doc_set * 0
    if LAYOUT == PADDED:
        doc_ptr = h_ptr + doc_set * stride_hs + doc * stride_hb
        length = doc_len
    else:
        start_row, length = segment(cu_ptr, doc, n_h_rows)
        doc_ptr = h_ptr + start_row * stride_hl
    mask_ptr = d_mask_ptr + doc_set * stride_dms + doc * stride_dmb
    best_base = best_ptr + doc_set * stride_rs + doc * stride_rb
    key_base = key_ptr + doc_set * stride_rs + doc * stride_rb
    outs = tl.arange(0, D_OUT_PAD)
    n_valid = tl.zeros((), tl.int32)
    for start in range(0, length, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        in_doc = tokens < length
        col_valid = in_doc
        if HAS_D_MASK:
            col_valid = in_doc & (tl.load(mask_ptr + tokens.to(tl.int64) * stride_dml, mask=in_doc, other=0) != 0)
        n_valid += tl.sum(col_valid.to(tl.int32), axis=0)
        proj = project_tile(doc_ptr + tokens.to(tl.int64) * stride_hl, col_valid, stride_hk, w_ptr, stride_wo,
                            stride_wk, b_ptr, stride_b, D_MODEL, D_OUT, D_OUT_PAD, BLOCK_N, BLOCK_K, HAS_BIAS,
                            NORMALIZE, DOT_PRECISION).to(q_ptr.dtype.element_ty)
        col_key = tl.where(in_doc, tokens * 2 + (1 - col_valid.to(tl.int32)), NO_KEY).to(tl.int32)
        for row_start in range(row_lo, row_hi, BLOCK_M):
            rows = row_start + tl.arange(0, BLOCK_M)
            row_ok = rows < row_hi
            query = first_query + rows // q_len
            token = rows % q_len
            q = tl.load(q_ptr + query[:, None] * stride_qn + token[:, None] * stride_ql + outs[None, :] * stride_qk,
                        mask=row_ok[:, None] & (outs[None, :] < D_OUT), other=0.0)
            sim = tile_dot(q, tl.trans(proj), None, DOT_PRECISION)
            if EXCLUDE:
                sim = tl.where(col_valid[None, :], sim, float("-inf"))
            else:
                sim = tl.where(col_valid[None, :], sim, tl.where(in_doc[None, :], 0.0, float("-inf")))
            tile_best = tl.reduce(sim, 1, nan_max)
            # Make the previous tile's stores of these rows visible to every thread before they are read back.
            tl.debug_barrier()
            # (tl.where rather than `&` with a scalar: the interpreter widens a vector & scalar to int32)
            seen = tl.where(start > 0, row_ok, False)
            best = tl.load(best_base + rows, mask=seen, other=float("-inf"))
            if TRACK_ARGMAX:
                # The first maximal token, or the first NaN where the max is NaN (the reference's torch.max).
                winner = (sim == tile_best[:, None]) | (sim != sim)
                tile_key = tl.min(tl.where(winner, col_key[None, :], NO_KEY), axis=1)
                key = tl.load(key_base + rows, mask=seen, other=NO_KEY)
                # Strictly greater keeps the earlier tile on ties; a first NaN replaces a number, never a NaN.
                take = (tile_best > best) | (key == NO_KEY) | ((tile_best != tile_best) & (best == best))
                tl.store(key_base + rows, tl.where(take, tile_key, key), mask=row_ok)
            tl.store(best_base + rows, nan_max(best, tile_best), mask=row_ok)
    # Each row's result: its max where it counts, else 0; the winner where it counts and is a valid token.
    for row_start in range(row_lo, row_hi, BLOCK_M):
        rows = row_start + tl.arange(0, BLOCK_M)
        row_ok = rows < row_hi
        counted = row_ok
        if HAS_Q_MASK:
            query = first_query + rows // q_len
            flags = tl.load(q_mask_ptr + query * stride_qmn + (rows % q_len) * stride_qml, mask=row_ok, other=0)
            counted = counted & (flags != 0)
        if EXCLUDE:
            counted = tl.where(n_valid > 0, counted, False)
        else:
            counted = tl.where(length > 0, counted, False)
        tl.debug_barrier()
        best = tl.load(best_base + rows, mask=counted, other=0.0)
        if TRACK_ARGMAX:
            key = tl.load(key_base + rows, mask=counted, other=NO_KEY)
            has_winner = counted & (key != NO_KEY) & ((key & 1) == 0)
            tl.store(key_base + rows, tl.where(has_winner, key >> 1, -1), mask=row_ok)
        tl.store(best_base + rows, tl.where(counted, best, 0.0), mask=row_ok)
