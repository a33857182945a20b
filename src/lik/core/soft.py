"""The soft reductions of MaxSim: each query token's similarities with a document's tokens reduced by a smooth
maximum (``tau * logsumexp(s / tau)``) or by the mean of its ``top_k`` largest, forward and backward.

Why not the tile loop of :mod:`lik.core.forward_kernel`: its running state is one value and one winner key per
row, and its backward is a gather of winning rows and a scatter into them. A smooth maximum carries a running
``(max, sum)`` per row and a top-k ``top_k`` values and tokens; the gradient of either spreads over many tokens
per row, so the backward is a product of a weight tile with the other side (as FlashAttention's backward), not a
gather. The layouts are the same three (:data:`~lik.core.segments.PADDED`, ``PACKED``, ``PAIRS``), addressed
through one span per side, so every scorer shares these three kernels:

* :func:`soft_fwd_kernel`: a program per (query, document, query row block) streams the document's tiles
  through the row block; per row it saves what the backward needs: the base-2 log-sum-exp (smooth) or the
  ``top_k`` chosen tokens (top-k, -1 in empty slots). Nothing of size rows x tokens leaves the chip.
* :func:`soft_bwd_dq_kernel`: a program per (query, row block, feature block) adds ``grad * W @ D``: smooth
  recomputes each tile's weights ``exp2(s * log2(e) / tau - lse2)``; top-k's are ``1 / count`` on the row's
  chosen tokens, so it gathers those ``top_k`` rows of ``D`` (no product with the other tiles).
* :func:`soft_bwd_dd_kernel`: a program per (document, token block, feature block) adds ``(grad * W)^T @ Q``
  over its queries: no atomics, so bitwise repeatable. Top-k's ``dD`` outside ``backward="deterministic"`` is
  sparse instead: the dQ kernel scatters each chosen token's ``grad / count * Q[row]`` with fp32 atomics.

Tie rule of top-k: among equal similarities the lower token index is chosen first (the reference's stable sort).
A NaN similarity of a valid token ranks above every number and makes its row NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .reductions import REDUCE_SMOOTH, nan_max
from .segments import PACKED, PADDED, PAIRS, segment

__all__ = ["soft_fwd_kernel", "soft_bwd_dq_kernel", "soft_bwd_dd_kernel", "SOFT_RUNTIME_INTS", "NO_TOKEN"]

NO_TOKEN = tl.constexpr(-1)  # an empty top-k slot (and every slot of a row that scores 0)
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# Not the row strides of Q and D: Triton's divisible-by-16 mark on them (d a multiple of 16: every batch and length)
# is what lets a tile load be 16-byte vectors and asynchronous copies; without it each element is its own load.
SOFT_RUNTIME_INTS = [
    "n_queries", "n_docs", "q_len", "doc_len", "n_q_rows", "n_d_rows", "q_blocks", "d_blocks", "n_feature_blocks",
    "stride_qmn", "stride_qml", "stride_dmn", "stride_dmb", "stride_dml", "stride_gn", "stride_gb", "stride_gq",
    "stride_tn", "stride_tb", "n_splits", "split_docs", "split_stride",
]


@triton.jit
def _query_span(cu_q_ptr, n, q_len, n_q_rows, LAYOUT: tl.constexpr):
    """First row (int64) and length of query ``n``: packed queries (``PAIRS``) from ``cu_seqlens_q``."""
    if LAYOUT == PAIRS:
        return segment(cu_q_ptr, n, n_q_rows)
    return tl.zeros((), tl.int64), q_len + tl.zeros((), tl.int32)


@triton.jit
def _doc_span(cu_d_ptr, b, doc_len, n_d_rows, LAYOUT: tl.constexpr):
    """First row (int64) and length of document ``b``: packed documents (``PACKED``, ``PAIRS``) from
    ``cu_seqlens_d``."""
    if LAYOUT == PADDED:
        return tl.zeros((), tl.int64), doc_len + tl.zeros((), tl.int32)
    return segment(cu_d_ptr, b, n_d_rows)


@triton.jit
def _rows(ptr, rows, valid, kk, stride_l, stride_k, DIM: tl.constexpr):
    """A ``[rows, features]`` tile; rows not ``valid`` (masked, padded, past the end) read as zeros, never read."""
    return tl.load(ptr + rows.to(tl.int64)[:, None] * stride_l + kk[None, :] * stride_k,
                   mask=valid[:, None] & (kk[None, :] < DIM), other=0.0)


@triton.jit
def _similarity(q_tile, d_tile, q_base, q_rows, q_ok, stride_ql, stride_qk, d_base, d_rows, d_ok, stride_dl,
                stride_dk, DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                NUM_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """fp32 ``[BLOCK_M, BLOCK_N]`` products of query rows and document rows (invalid ones read as zeros): of the
    tiles already on chip (``q_tile``, ``d_tile``) when one chunk holds every feature, else read in ``NUM_K``
    chunks of ``BLOCK_K``."""
    if NUM_K == 1:
        return tl.dot(q_tile, tl.trans(d_tile), input_precision=DOT_PRECISION)
    sim = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kc in range(NUM_K):
        kk = kc * BLOCK_K + tl.arange(0, BLOCK_K)
        a = _rows(q_base, q_rows, q_ok, kk, stride_ql, stride_qk, DIM)
        b = _rows(d_base, d_rows, d_ok, kk, stride_dl, stride_dk, DIM)
        sim = tl.dot(a, tl.trans(b), sim, input_precision=DOT_PRECISION)
    return sim


@triton.jit
def _columns(d_mask_base, cols, doc_length, stride_dml, HAS_D_MASK: tl.constexpr, EXCLUDE: tl.constexpr):
    """``(loaded, counted)`` per column: tokens whose rows are read (valid ones), and tokens that take part in
    the reduction (valid ones; in ``mask_mode="zero"`` also masked ones, at similarity 0)."""
    in_range = cols < doc_length
    loaded = in_range
    if HAS_D_MASK:
        flags = tl.load(d_mask_base + cols.to(tl.int64) * stride_dml, mask=in_range, other=0)
        loaded = in_range & (flags != 0)
    counted = in_range
    if EXCLUDE:
        counted = loaded
    return loaded, counted


@triton.jit
def _insert_top_k(x, t0, vals, toks, slots, SLOTS: tl.constexpr):
    """Merge a tile ``x [rows, BLOCK_N]`` of tokens ``t0 + 0..BLOCK_N-1`` (ranked; excluded columns -inf) into
    each row's running top-k ``(vals, toks) [rows, SLOTS]`` (slots past ``top_k`` hold +inf and are never
    replaced). The tile's best (highest value, then lowest token: one arg-max reduction) replaces the row's worst
    (lowest value, then highest token) while it is strictly higher; tiles come in token order, so an equal value
    never displaces an earlier token. A tile no row's worst is below costs the one reduction."""
    local = tl.arange(0, x.shape[1])
    v, c = tl.max(x, axis=1, return_indices=True, return_indices_tie_break_left=True)
    worst = tl.min(vals, axis=1)
    go = v > worst
    while tl.max(go.to(tl.int32), axis=0) > 0:
        worst_key = tl.max(tl.where(vals == worst[:, None], (toks + 1) * SLOTS + slots[None, :], -1), axis=1)
        put = go[:, None] & (slots[None, :] == (worst_key % SLOTS)[:, None])
        vals = tl.where(put, v[:, None], vals)
        toks = tl.where(put, (t0 + c)[:, None], toks)
        x = tl.where(go[:, None] & (local[None, :] == c[:, None]), float("-inf"), x)
        v, c = tl.max(x, axis=1, return_indices=True, return_indices_tie_break_left=True)
        worst = tl.min(vals, axis=1)
        go = v > worst
    return vals, toks


@triton.jit(do_not_specialize=SOFT_RUNTIME_INTS)
def soft_fwd_kernel(
    q_ptr, d_ptr, q_mask_ptr, d_mask_ptr, cu_q_ptr, cu_d_ptr, scores_ptr, stats_ptr,
    n_queries, n_docs, q_len, doc_len, n_q_rows, n_d_rows, q_blocks, scale2, out_scale,
    stride_qn, stride_ql, stride_qk, stride_dn, stride_db, stride_dl, stride_dk,
    stride_qmn, stride_qml, stride_dmn, stride_dmb, stride_dml, stride_gn, stride_gb, stride_gq, stride_tn,
    stride_tb,
    DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr,
    REDUCTION: tl.constexpr, TOP_K: tl.constexpr, SLOTS: tl.constexpr, HAS_Q_MASK: tl.constexpr,
    HAS_D_MASK: tl.constexpr, EXCLUDE: tl.constexpr, PER_QUERY: tl.constexpr, LAYOUT: tl.constexpr,
    STORE_STATS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Scores ``[Nq, B]`` (``scores_ptr`` with strides ``stride_gn, stride_gb``; pairs ``[N]``) of the soft
    reduction, one program per (pair, query row block): each row block's sum at ``+ block * stride_gq`` (0 with
    one block; else the launcher adds the ``q_blocks`` partials). ``scale2 = log2(e) / tau`` (smooth),
    ``out_scale = tau * ln(2)``. Stats per (query token, document), row ``n * stride_tn + b * stride_tb + first
    query row + s``: fp32 base-2 log-sum-exp of ``s * log2(e) / tau`` (+inf where the row scores 0), or int32
    ``[.., TOP_K]`` chosen tokens (-1: none). A row block per program, not a loop over them: the tile loop is then
    the only loop (software-pipelined), and a ColPali page's 16 row blocks spread over 16 programs."""
    pid = tl.program_id(0).to(tl.int64)
    block = pid % q_blocks
    pid = pid // q_blocks
    if LAYOUT == PAIRS:
        n = pid
        b = pid
    else:
        n = pid // n_docs
        b = pid - n * n_docs
    q_start, q_length = _query_span(cu_q_ptr, n, q_len, n_q_rows, LAYOUT)
    d_start, d_length = _doc_span(cu_d_ptr, b, doc_len, n_d_rows, LAYOUT)
    doc_set = n * 0
    if PER_QUERY:
        doc_set = n
    q_base = q_ptr + n * stride_qn + q_start * stride_ql
    d_base = d_ptr + doc_set * stride_dn + b * stride_db + d_start * stride_dl
    d_mask_base = d_mask_ptr + doc_set * stride_dmn + b * stride_dmb
    stats_base = n * stride_tn + b * stride_tb + q_start
    slots = tl.arange(0, SLOTS)
    s0 = block * BLOCK_M
    rows = s0 + tl.arange(0, BLOCK_M)
    row_ok = rows < q_length
    if HAS_Q_MASK:
        row_ok &= tl.load(q_mask_ptr + n * stride_qmn + rows.to(tl.int64) * stride_qml, mask=row_ok, other=0) != 0
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    acc = tl.zeros((BLOCK_M,), tl.float32)
    vals = tl.where(slots[None, :] < TOP_K, float("-inf"), float("inf")) + tl.zeros((BLOCK_M, SLOTS), tl.float32)
    toks = tl.full((BLOCK_M, SLOTS), -1, tl.int32)
    has_nan = tl.zeros((BLOCK_M,), tl.int1)
    n_counted = tl.zeros((), tl.int32)
    kk = tl.arange(0, BLOCK_K)
    q_tile = _rows(q_base, rows, row_ok, kk, stride_ql, stride_qk, DIM)  # (read once per row block: d fits)
    for t0 in range(0, tl.where(s0 < q_length, d_length, 0), BLOCK_N):  # (pairs: past a short query, none)
        cols = t0 + tl.arange(0, BLOCK_N)
        loaded, counted = _columns(d_mask_base, cols, d_length, stride_dml, HAS_D_MASK, EXCLUDE)
        d_tile = q_tile
        if NUM_K == 1:
            d_tile = _rows(d_base, cols, loaded, kk, stride_dl, stride_dk, DIM)
        sim = _similarity(q_tile, d_tile, q_base, rows, row_ok, stride_ql, stride_qk, d_base, cols, loaded,
                          stride_dl, stride_dk, DIM, BLOCK_M, BLOCK_N, BLOCK_K, NUM_K, DOT_PRECISION)
        sim = tl.where(counted[None, :], sim, float("-inf"))
        n_counted += tl.sum(counted.to(tl.int32), axis=0)
        if REDUCTION == REDUCE_SMOOTH:
            x = sim * scale2
            m_new = nan_max(m, tl.reduce(x, 1, nan_max))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # (all excluded so far: nothing to rescale)
            acc = acc * tl.exp2(m - m_safe) + tl.sum(tl.exp2(x - m_safe[:, None]), axis=1)
            m = m_new
        else:
            nan = sim != sim
            has_nan |= tl.max(nan.to(tl.int32), axis=1) != 0
            vals, toks = _insert_top_k(tl.where(nan, float("inf"), sim), t0, vals, toks, slots, SLOTS)
    scored = row_ok & (n_counted > 0)
    if REDUCTION == REDUCE_SMOOTH:
        lse2 = m + tl.log2(tl.where(acc > 0, acc, 1.0))  # (a row with no token: masked out below)
        value = lse2 * out_scale
        if STORE_STATS:
            tl.store(stats_ptr + stats_base + rows, tl.where(scored, lse2, float("inf")), mask=rows < q_length)
    else:
        filled = (slots[None, :] < TOP_K) & (toks >= 0)
        count = tl.sum(filled.to(tl.int32), axis=1)
        value = tl.sum(tl.where(filled, vals, 0.0), axis=1) / tl.maximum(count, 1).to(tl.float32)
        value = tl.where(has_nan, float("nan"), value)
        if STORE_STATS:
            chosen = tl.where(scored[:, None], toks, -1)
            tl.store(stats_ptr + (stats_base + rows)[:, None] * TOP_K + slots[None, :], chosen,
                     mask=(rows < q_length)[:, None] & (slots[None, :] < TOP_K))
    total = tl.sum(tl.where(scored, value, 0.0), axis=0)
    tl.store(scores_ptr + n * stride_gn + b * stride_gb + block * stride_gq, total)


@triton.jit
def _weights(sim, row_stat, toks, cols, counted, grad, scale2, REDUCTION: tl.constexpr, TOP_K: tl.constexpr,
             SLOTS: tl.constexpr):
    """``grad * d score / d s`` of a tile: the softmax weights ``exp2(s * scale2 - lse2)`` (smooth; ``row_stat``
    the rows' lse2) or ``1 / count`` on each row's chosen tokens (top-k; ``row_stat`` the rows' ``1 / count``),
    0 on columns outside the reduction."""
    if REDUCTION == REDUCE_SMOOTH:
        w = tl.exp2(sim * scale2 - row_stat[:, None])
    else:
        # One [rows, BLOCK_N] compare per slot (a [rows, slots, BLOCK_N] one would not fit in registers at 16 slots).
        slots = tl.arange(0, SLOTS)
        hits = tl.zeros(sim.shape, tl.float32)
        for j in tl.static_range(TOP_K):
            token = tl.sum(tl.where(slots[None, :] == j, toks, 0), axis=1)
            hits += (token[:, None] == cols[None, :]).to(tl.float32)
        w = hits * row_stat[:, None]
    return tl.where(counted[None, :], w * grad, 0.0)


@triton.jit
def _row_stats(stats_ptr, stats_base, rows, row_ok, slots, REDUCTION: tl.constexpr, TOP_K: tl.constexpr):
    """A row block's saved stats: ``(lse2 or 1 / count, chosen tokens)`` (rows outside get weight 0)."""
    # (one return: the compiler types every return statement, a constexpr branch's included)
    toks = tl.full((rows.shape[0], slots.shape[0]), -1, tl.int32)
    if REDUCTION == REDUCE_SMOOTH:
        row_stat = tl.load(stats_ptr + stats_base + rows, mask=row_ok, other=float("inf"))
    else:
        toks = tl.load(stats_ptr + (stats_base + rows)[:, None] * TOP_K + slots[None, :],
                       mask=row_ok[:, None] & (slots[None, :] < TOP_K), other=-1)
        count = tl.sum((toks >= 0).to(tl.int32), axis=1)
        row_stat = 1.0 / tl.maximum(count, 1).to(tl.float32)
    return row_stat, toks


@triton.jit
def _dq_tile(out, q_tile, q_base, rows, row_ok, d_base, d_mask_base, t0, d_length, ff, row_stat, toks, grad, scale2,
             stride_ql, stride_qk, stride_dl, stride_dk, stride_dml, DIM: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr, REDUCTION: tl.constexpr,
             TOP_K: tl.constexpr, SLOTS: tl.constexpr, HAS_D_MASK: tl.constexpr, EXCLUDE: tl.constexpr,
             DOT_PRECISION: tl.constexpr):
    """``out + grad * W @ D`` over one document tile (tokens ``t0 + 0..BLOCK_N-1``), ``W`` recomputed (smooth)."""
    cols = t0 + tl.arange(0, BLOCK_N)
    loaded, counted = _columns(d_mask_base, cols, d_length, stride_dml, HAS_D_MASK, EXCLUDE)
    d_tile = _rows(d_base, cols, loaded, ff, stride_dl, stride_dk, DIM)  # (with one chunk: all of d)
    sim = _similarity(q_tile, d_tile, q_base, rows, row_ok, stride_ql, stride_qk, d_base, cols, loaded,
                      stride_dl, stride_dk, DIM, BLOCK_M, BLOCK_N, BLOCK_K, NUM_K, DOT_PRECISION)
    w = _weights(sim, row_stat, toks, cols, counted, grad, scale2, REDUCTION, TOP_K, SLOTS)
    return tl.dot(w.to(d_tile.dtype), d_tile, out, input_precision=DOT_PRECISION)


@triton.jit(do_not_specialize=SOFT_RUNTIME_INTS)
def soft_bwd_dq_kernel(
    grad_ptr, q_ptr, d_ptr, q_mask_ptr, d_mask_ptr, cu_q_ptr, cu_d_ptr, stats_ptr, dq_ptr, dd_ptr,
    n_queries, n_docs, q_len, doc_len, n_q_rows, n_d_rows, q_blocks, n_feature_blocks, scale2,
    n_splits, split_docs, split_stride,
    stride_qn, stride_ql, stride_qk, stride_dn, stride_db, stride_dl, stride_dk,
    stride_qmn, stride_qml, stride_dmn, stride_dmb, stride_dml, stride_gn, stride_gb, stride_tn, stride_tb,
    DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr,
    REDUCTION: tl.constexpr, TOP_K: tl.constexpr, SLOTS: tl.constexpr, HAS_Q_MASK: tl.constexpr,
    HAS_D_MASK: tl.constexpr, EXCLUDE: tl.constexpr, PER_QUERY: tl.constexpr, LAYOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, STORE_DQ: tl.constexpr = True, DD_ATOMIC: tl.constexpr = False,
):
    """``dQ`` (fp32 ``[n_splits, *q.shape]``, contiguous) of one query's row block and feature block: the sum over
    its documents of ``grad[n, b] * W @ D``, with ``W`` recomputed per tile (smooth) or as a gather of each row's
    ``TOP_K`` chosen rows of ``D`` (top-k: ``W`` is sparse). Every row of the query is written, 0 where it
    scored 0. Each program takes ``split_docs`` documents and writes its fp32 partial at ``split *
    split_stride`` (the launcher adds the ``n_splits`` partials in a fixed order: deterministic).

    ``DD_ATOMIC`` (top-k only): also the sparse ``dD``, scattered with fp32 atomics into ``dd_ptr`` (pre-zeroed,
    contiguous, ``d``'s shape): each (query row, document, slot) adds ``grad * Q[row] / count`` to its chosen
    token's row, once over the grid (``STORE_DQ`` False: dD alone)."""
    pid = tl.program_id(0).to(tl.int64)
    f_block = pid % n_feature_blocks
    pid = pid // n_feature_blocks
    split = pid % n_splits
    pid = pid // n_splits
    n = pid // q_blocks
    s0 = (pid - n * q_blocks) * BLOCK_M
    q_start, q_length = _query_span(cu_q_ptr, n, q_len, n_q_rows, LAYOUT)
    rows = s0 + tl.arange(0, BLOCK_M)
    row_ok = rows < q_length
    if HAS_Q_MASK:
        row_ok &= tl.load(q_mask_ptr + n * stride_qmn + rows.to(tl.int64) * stride_qml, mask=row_ok, other=0) != 0
    q_base = q_ptr + n * stride_qn + q_start * stride_ql
    ff = f_block * BLOCK_K + tl.arange(0, BLOCK_K)
    slots = tl.arange(0, SLOTS)
    doc_set = n * 0
    if PER_QUERY:
        doc_set = n
    out = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
    q_tile = _rows(q_base, rows, row_ok, ff, stride_ql, stride_qk, DIM)  # (used by the products when d fits)
    first = split * split_docs
    last = tl.minimum(first + split_docs, n_docs)
    dq_rows = n * q_len + rows
    if LAYOUT == PAIRS:
        first = n
        last = n + 1
        dq_rows = q_start + rows
    if REDUCTION == REDUCE_SMOOTH and LAYOUT != PACKED:
        # One flat loop over (document, tile): every document of the range has the first one's length (padded Ld;
        # pairs: one document), and the pipeliner prefetches across documents (ColBERT's 180 tokens are 3 tiles).
        _, first_length = _doc_span(cu_d_ptr, first, doc_len, n_d_rows, LAYOUT)
        d_blocks = tl.cdiv(first_length, BLOCK_N)
        for step in range(0, (last - first) * d_blocks):
            b = first + step // d_blocks
            t0 = ((step - (b - first) * d_blocks) * BLOCK_N).to(tl.int32)
            grad = tl.load(grad_ptr + n * stride_gn + b * stride_gb)
            d_start, d_length = _doc_span(cu_d_ptr, b, doc_len, n_d_rows, LAYOUT)
            d_base = d_ptr + doc_set * stride_dn + b * stride_db + d_start * stride_dl
            d_mask_base = d_mask_ptr + doc_set * stride_dmn + b * stride_dmb
            row_stat = tl.load(stats_ptr + n * stride_tn + b * stride_tb + q_start + rows, mask=row_ok,
                               other=float("inf"))
            out = _dq_tile(out, q_tile, q_base, rows, row_ok, d_base, d_mask_base, t0, d_length, ff, row_stat,
                           slots[None, :] + tl.zeros((BLOCK_M, SLOTS), tl.int32), grad, scale2, stride_ql,
                           stride_qk, stride_dl, stride_dk, stride_dml, DIM, BLOCK_M, BLOCK_N, BLOCK_K, NUM_K,
                           REDUCTION, TOP_K, SLOTS, HAS_D_MASK, EXCLUDE, DOT_PRECISION)
        first = last  # (nothing left for the loop below)
    for b in range(first, last):
        grad = tl.load(grad_ptr + n * stride_gn + b * stride_gb)
        d_start, d_length = _doc_span(cu_d_ptr, b, doc_len, n_d_rows, LAYOUT)
        d_base = d_ptr + doc_set * stride_dn + b * stride_db + d_start * stride_dl
        d_mask_base = d_mask_ptr + doc_set * stride_dmn + b * stride_dmb
        row_stat, toks = _row_stats(stats_ptr, n * stride_tn + b * stride_tb + q_start, rows, row_ok, slots,
                                    REDUCTION, TOP_K)
        if REDUCTION == REDUCE_SMOOTH:
            for t0 in range(0, d_length, BLOCK_N):
                out = _dq_tile(out, q_tile, q_base, rows, row_ok, d_base, d_mask_base, t0, d_length, ff, row_stat,
                               toks, grad, scale2, stride_ql, stride_qk, stride_dl, stride_dk, stride_dml, DIM,
                               BLOCK_M, BLOCK_N, BLOCK_K, NUM_K, REDUCTION, TOP_K, SLOTS, HAS_D_MASK, EXCLUDE,
                               DOT_PRECISION)
        else:
            # Top-k: W is 1 / count on each row's chosen tokens, so dQ gathers those TOP_K rows of D per query row
            # instead of a product with every tile (a masked token chosen in mask_mode "zero" is a constant 0).
            w_row = row_stat * grad
            if LAYOUT == PADDED:
                dd_base = (doc_set * n_docs + b) * doc_len
            else:
                dd_base = d_start
            for j in range(TOP_K):  # (a loop, not unrolled: TOP_K gathers in flight spill registers)
                token = tl.sum(tl.where(slots[None, :] == j, toks, 0), axis=1)
                chosen = token >= 0
                if HAS_D_MASK:
                    chosen &= tl.load(d_mask_base + token.to(tl.int64) * stride_dml, mask=chosen, other=0) != 0
                w_chosen = tl.where(chosen, w_row, 0.0)[:, None]
                if STORE_DQ:
                    picked = _rows(d_base, token, chosen, ff, stride_dl, stride_dk, DIM)
                    out += w_chosen * picked.to(tl.float32)
                if DD_ATOMIC:
                    tl.atomic_add(dd_ptr + (dd_base + token.to(tl.int64))[:, None] * DIM + ff[None, :],
                                  w_chosen * q_tile.to(tl.float32), mask=chosen[:, None] & (ff[None, :] < DIM),
                                  sem="relaxed")
    if STORE_DQ:  # (every row of the query, 0 where masked: the launcher need not zero the buffer)
        tl.store(dq_ptr + split * split_stride + dq_rows[:, None] * DIM + ff[None, :],
                 tl.where(row_ok[:, None], out, 0.0).to(dq_ptr.dtype.element_ty),
                 mask=(rows < q_length)[:, None] & (ff[None, :] < DIM))


@triton.jit(do_not_specialize=SOFT_RUNTIME_INTS)
def soft_bwd_dd_kernel(
    grad_ptr, q_ptr, d_ptr, q_mask_ptr, d_mask_ptr, cu_q_ptr, cu_d_ptr, stats_ptr, dd_ptr,
    n_queries, n_docs, q_len, doc_len, n_q_rows, n_d_rows, d_blocks, n_feature_blocks, scale2,
    stride_qn, stride_ql, stride_qk, stride_dn, stride_db, stride_dl, stride_dk,
    stride_qmn, stride_qml, stride_dmn, stride_dmb, stride_dml, stride_gn, stride_gb, stride_tn, stride_tb,
    DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr,
    REDUCTION: tl.constexpr, TOP_K: tl.constexpr, SLOTS: tl.constexpr, HAS_Q_MASK: tl.constexpr,
    HAS_D_MASK: tl.constexpr, EXCLUDE: tl.constexpr, PER_QUERY: tl.constexpr, LAYOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``dD`` (contiguous, ``d``'s shape and dtype; program id = ((set * B + b) * d_blocks + token block) *
    feature blocks + feature block) of one document's token block: the sum over its queries of
    ``(grad[n, b] * W)^T @ Q``. Masked and padded tokens get 0."""
    pid = tl.program_id(0).to(tl.int64)
    f_block = pid % n_feature_blocks
    pid = pid // n_feature_blocks
    t_block = pid % d_blocks
    pid = pid // d_blocks
    doc_set = pid // n_docs
    b = pid - doc_set * n_docs
    d_start, d_length = _doc_span(cu_d_ptr, b, doc_len, n_d_rows, LAYOUT)
    cols = t_block * BLOCK_N + tl.arange(0, BLOCK_N)
    d_base = d_ptr + doc_set * stride_dn + b * stride_db + d_start * stride_dl
    d_mask_base = d_mask_ptr + doc_set * stride_dmn + b * stride_dmb
    loaded, counted = _columns(d_mask_base, cols, d_length, stride_dml, HAS_D_MASK, EXCLUDE)
    ff = f_block * BLOCK_K + tl.arange(0, BLOCK_K)
    slots = tl.arange(0, SLOTS)
    out = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    d_tile = _rows(d_base, cols, loaded, ff, stride_dl, stride_dk, DIM)  # (used by the products when d fits)
    if LAYOUT == PAIRS:
        first = b
        last = b + 1
    elif PER_QUERY:
        first = doc_set
        last = doc_set + 1
    else:
        first = b * 0
        last = b * 0 + n_queries
    # One flat loop over (query, row block), not a loop per query: the pipeliner prefetches the next query's tile
    # (ColBERT's 32-token queries are one block each). Every query of the range has the first one's length (the
    # padded Lq; pairs: one query).
    _, first_length = _query_span(cu_q_ptr, first, q_len, n_q_rows, LAYOUT)
    q_blocks = tl.cdiv(first_length, BLOCK_M)
    for step in range(0, (last - first) * q_blocks):
        n = first + step // q_blocks
        s0 = (step - (n - first) * q_blocks) * BLOCK_M
        grad = tl.load(grad_ptr + n * stride_gn + b * stride_gb)
        q_start, q_length = _query_span(cu_q_ptr, n, q_len, n_q_rows, LAYOUT)
        q_base = q_ptr + n * stride_qn + q_start * stride_ql
        rows = s0 + tl.arange(0, BLOCK_M)
        row_ok = rows < q_length
        if HAS_Q_MASK:
            row_ok &= tl.load(q_mask_ptr + n * stride_qmn + rows.to(tl.int64) * stride_qml, mask=row_ok,
                              other=0) != 0
        row_stat, toks = _row_stats(stats_ptr, n * stride_tn + b * stride_tb + q_start, rows, row_ok, slots,
                                    REDUCTION, TOP_K)
        q_tile = _rows(q_base, rows, row_ok, ff, stride_ql, stride_qk, DIM)  # (with one chunk: all of d)
        sim = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        if REDUCTION == REDUCE_SMOOTH:
            sim = _similarity(q_tile, d_tile, q_base, rows, row_ok, stride_ql, stride_qk, d_base, cols, loaded,
                              stride_dl, stride_dk, DIM, BLOCK_M, BLOCK_N, BLOCK_K, NUM_K, DOT_PRECISION)
        w = _weights(sim, row_stat, toks, cols, counted, grad, scale2, REDUCTION, TOP_K, SLOTS)
        out = tl.dot(tl.trans(w.to(q_tile.dtype)), q_tile, out, input_precision=DOT_PRECISION)
    # (a token of mask_mode "zero"'s masked ones takes part in the reduction but is a constant 0: no gradient)
    if LAYOUT == PADDED:
        dd_rows = (doc_set * n_docs + b) * doc_len + cols
    else:
        dd_rows = d_start + cols
    tl.store(dd_ptr + dd_rows[:, None] * DIM + ff[None, :], tl.where(loaded[:, None], out, 0.0).to(
        dd_ptr.dtype.element_ty), mask=(cols < d_length)[:, None] & (ff[None, :] < DIM))
