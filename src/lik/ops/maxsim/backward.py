"""MaxSim backward from the argmax saved by the forward.

With ``w[n, j] = dL/dscore[n, j]`` and ``t* = argmax[n, j, s]`` (-1: no gradient):

* ``dQ[n, s] = sum_j w[n, j] * D[set(n), j, t*]`` -- a gather; each program owns a block of query rows, so it
  is deterministic.
* ``dD[set, j, t] = sum_{n, s : t* = t} w[n, j] * Q[n, s]`` -- a scatter. Two ways:

  - ``"fast"``: one fp32 atomic add per (row, feature) into an fp32 buffer, cast to the input dtype after;
  - ``"deterministic"``: each program owns a tile of document rows and sums, query by query, a one-hot
    product ``onehot(t* == t)^T @ Q`` (exact: the one-hot is 0/1 in the input dtype, accumulation is fp32),
    scaled by ``w`` in fp32. No atomics, the same bits on every run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._config import maxsim_backward_config, next_power_of_2
from .backward_sorted import launch_dd_sorted
from .forward import dot_precision, set_strides

__all__ = [
    "maxsim_bwd_dq_kernel",
    "maxsim_bwd_dd_atomic_kernel",
    "maxsim_bwd_dd_owned_kernel",
    "maxsim_bwd_dd_onehot_kernel",
    "winners_sum",
    "feature_blocks",
    "maxsim_backward_dq",
    "maxsim_backward_dd",
    "BACKWARD_MODES",
]

BACKWARD_MODES = ("auto", "fast", "deterministic")
# dD routes (``MaxSimBackwardConfig.fast_dd`` / ``deterministic_dd``); the deterministic ones use no atomics.
FAST_DD = ("atomic", "sorted")
DETERMINISTIC_DD = ("sorted", "onehot", "loop")


# Strides that follow a batch size or a length are not specialised either (a stride's divisibility by 16
# would otherwise pick a new variant when B or Lq changes). Embedding strides (Lq * d, Ld * d) stay specialised:
# they keep their divisibility when d does, and without it Triton cannot prove rows 16-byte aligned and loads
# them element by element (see benchmarks/NOTES.md, version 6).
_BATCH_STRIDES = ["stride_gn", "stride_an", "stride_ab"]


@triton.jit(do_not_specialize=["q_len", "n_docs", "n_row_blocks", "n_k_blocks", *_BATCH_STRIDES])
def maxsim_bwd_dq_kernel(
    d_ptr, grad_ptr, argmax_ptr, dq_ptr,
    q_len, n_docs, n_row_blocks, n_k_blocks,
    stride_dn, stride_db, stride_dl, stride_dk,
    stride_gn, stride_gb,
    stride_an, stride_ab, stride_al,
    stride_dqn, stride_dql, stride_dqk,
    DIM: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOCS: tl.constexpr = 1,
):
    pid = tl.program_id(0).to(tl.int64)
    k_block = pid % n_k_blocks
    row_block = (pid // n_k_blocks) % n_row_blocks
    query = pid // (n_k_blocks * n_row_blocks)
    tokens = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    token_ok = tokens < q_len
    kk = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = kk < DIM
    # Pointers advance by DOCS documents per step: 64-bit arithmetic, no doc * stride product that could wrap.
    # The DOCS documents of a step are unrolled, so all their winner loads and row gathers are in flight at
    # once; they are still added in document order (the same bits as one document per step).
    # (A stride equal to 1 arrives as a Python int: add it to an int64 zero rather than calling .to on it.)
    zero64 = pid * 0
    stride_db64 = zero64 + stride_db
    stride_ab64 = zero64 + stride_ab
    stride_gb64 = zero64 + stride_gb
    doc_ptr = d_ptr + query * stride_dn
    winner_ptrs = argmax_ptr + query * stride_an + tokens * stride_al
    weight_ptr = grad_ptr + query * stride_gn
    acc = tl.zeros((BLOCK_ROWS, BLOCK_K), tl.float32)
    for start in range(0, n_docs, DOCS):
        for u in tl.static_range(DOCS):
            # Past the last document (a partial step): no winners, weight 0 (read from the last document).
            doc_ok = (start + u) < n_docs
            winner = tl.load(winner_ptrs + u * stride_ab64, mask=tokens < tl.where(doc_ok, q_len, 0), other=-1)
            weight = tl.load(weight_ptr + tl.minimum(n_docs - 1 - start, u) * stride_gb64)
            weight = tl.where(doc_ok, weight, 0.0)
            has_grad = winner >= 0
            rows = tl.load(
                doc_ptr + u * stride_db64 + winner.to(tl.int64)[:, None] * stride_dl + kk[None, :] * stride_dk,
                mask=has_grad[:, None] & k_ok[None, :],
                other=0.0,
            )
            acc += weight * rows.to(tl.float32)
        doc_ptr += DOCS * stride_db64
        winner_ptrs += DOCS * stride_ab64
        weight_ptr += DOCS * stride_gb64
    tl.store(
        dq_ptr + query * stride_dqn + tokens[:, None] * stride_dql + kk[None, :] * stride_dqk,
        acc.to(dq_ptr.dtype.element_ty),
        mask=token_ok[:, None] & k_ok[None, :],
    )


@triton.jit(do_not_specialize=["q_len", "n_docs", "n_row_blocks", "n_k_blocks", *_BATCH_STRIDES])
def maxsim_bwd_dd_atomic_kernel(
    q_ptr, grad_ptr, argmax_ptr, dd_ptr,
    q_len, n_docs, n_row_blocks, n_k_blocks,
    stride_qn, stride_ql, stride_qk,
    stride_gn, stride_gb,
    stride_an, stride_ab, stride_al,
    stride_ddn, stride_ddb, stride_ddl, stride_ddk,
    DIM: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    k_block = pid % n_k_blocks
    rest = pid // n_k_blocks
    doc = rest % n_docs
    row_block = (rest // n_docs) % n_row_blocks
    query = rest // (n_docs * n_row_blocks)
    tokens = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    token_ok = tokens < q_len
    kk = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = kk < DIM
    winner = tl.load(argmax_ptr + query * stride_an + doc * stride_ab + tokens * stride_al, mask=token_ok, other=-1)
    has_grad = winner >= 0
    weight = tl.load(grad_ptr + query * stride_gn + doc * stride_gb)
    rows = tl.load(
        q_ptr + query * stride_qn + tokens[:, None] * stride_ql + kk[None, :] * stride_qk,
        mask=has_grad[:, None] & k_ok[None, :],
        other=0.0,
    )
    tl.atomic_add(
        dd_ptr + query * stride_ddn + doc * stride_ddb + winner.to(tl.int64)[:, None] * stride_ddl
        + kk[None, :] * stride_ddk,
        weight * rows.to(tl.float32),
        mask=has_grad[:, None] & k_ok[None, :],
        sem="relaxed",
    )


@triton.jit
def winners_sum(
    q_base, winner_base, seq_len, positions, kk, stride_ql, stride_qk, stride_al,
    DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_DOC_ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``sum_{s : winner[s] = p} q[s, kk]`` for each document row ``p`` in ``positions``, over one query's tokens.

    A one-hot product on the tensor cores: the one-hot is 0/1 in the input dtype, so the sum is exact in fp32,
    and each call owns its output rows (no atomics). Rows without a winner (-1) are never read."""
    k_ok = kk < DIM
    part = tl.zeros((BLOCK_DOC_ROWS, BLOCK_K), tl.float32)
    for start in range(0, seq_len, BLOCK_ROWS):
        tokens = start + tl.arange(0, BLOCK_ROWS)
        winner = tl.load(winner_base + tokens * stride_al, mask=tokens < seq_len, other=-1)
        rows = tl.load(
            q_base + tokens[:, None] * stride_ql + kk[None, :] * stride_qk,
            mask=(winner >= 0)[:, None] & k_ok[None, :],
            other=0.0,
        )
        one_hot = (positions[:, None] == winner[None, :]).to(rows.dtype)
        part = tl.dot(one_hot, rows, part, input_precision=DOT_PRECISION)
    return part


@triton.jit(
    do_not_specialize=["n_queries", "q_len", "n_docs", "doc_len", "n_doc_blocks", "n_k_blocks", *_BATCH_STRIDES]
)
def maxsim_bwd_dd_owned_kernel(
    q_ptr, grad_ptr, argmax_ptr, dd_ptr,
    n_queries, q_len, n_docs, doc_len, n_doc_blocks, n_k_blocks,
    stride_qn, stride_ql, stride_qk,
    stride_gn, stride_gb,
    stride_an, stride_ab, stride_al,
    stride_ddn, stride_ddb, stride_ddl, stride_ddk,
    DIM: tl.constexpr,
    PER_QUERY: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_DOC_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    k_block = pid % n_k_blocks
    rest = pid // n_k_blocks
    doc_block = rest % n_doc_blocks
    rest = rest // n_doc_blocks
    doc = rest % n_docs
    doc_set = rest // n_docs
    positions = doc_block * BLOCK_DOC_ROWS + tl.arange(0, BLOCK_DOC_ROWS)
    kk = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = kk < DIM
    if PER_QUERY:
        first_query = doc_set
        last_query = doc_set + 1
    else:
        first_query = doc_set * 0
        last_query = n_queries
    acc = tl.zeros((BLOCK_DOC_ROWS, BLOCK_K), tl.float32)
    for query in range(first_query, last_query):
        per_query = winners_sum(
            q_ptr + query * stride_qn, argmax_ptr + query * stride_an + doc * stride_ab, q_len, positions, kk,
            stride_ql, stride_qk, stride_al, DIM, BLOCK_ROWS, BLOCK_DOC_ROWS, BLOCK_K, DOT_PRECISION,
        )
        acc += tl.load(grad_ptr + query * stride_gn + doc * stride_gb) * per_query
    tl.store(
        dd_ptr + doc_set * stride_ddn + doc * stride_ddb + positions[:, None] * stride_ddl + kk[None, :] * stride_ddk,
        acc.to(dd_ptr.dtype.element_ty),
        mask=(positions < doc_len)[:, None] & k_ok[None, :],
    )


@triton.jit(
    do_not_specialize=["n_queries", "q_len", "n_docs", "doc_len", "n_doc_blocks", "n_k_blocks", "n_tok_blocks",
                       *_BATCH_STRIDES]
)
def maxsim_bwd_dd_onehot_kernel(
    q_ptr, grad_ptr, argmax_ptr, dd_ptr,
    n_queries, q_len, n_docs, doc_len, n_doc_blocks, n_k_blocks, n_tok_blocks,
    stride_qn, stride_ql, stride_qk,
    stride_gn, stride_gb,
    stride_an, stride_ab, stride_al,
    stride_ddn, stride_ddb, stride_ddl, stride_ddk,
    DIM: tl.constexpr,
    PER_QUERY: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_DOC_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """dD by one-hot products, one flat loop over (query, query-token block) steps.

    A program owns ``BLOCK_DOC_ROWS`` rows of one document (one feature block) and sums over every query that
    scores it. Each step loads one block of query tokens and their winners, forms
    ``onehot(winner == position)`` (0/1 in the input dtype: the product is an exact selection, accumulated in
    fp32) and adds ``w[query, doc] * (onehot @ Q_block)`` in fp32. One flat loop (no nested per-query loop) lets
    the compiler pipeline the loads of the next steps behind the current product. Each program owns its rows and
    stores them in the input dtype: no atomics, bitwise repeatable.
    """
    pid = tl.program_id(0).to(tl.int64)
    k_block = pid % n_k_blocks
    rest = pid // n_k_blocks
    doc_block = rest % n_doc_blocks
    rest = rest // n_doc_blocks
    doc = rest % n_docs
    doc_set = rest // n_docs
    first_position = doc_block * BLOCK_DOC_ROWS
    positions = first_position + tl.arange(0, BLOCK_DOC_ROWS)
    kk = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = kk < DIM
    if PER_QUERY:
        first_query = doc_set
        n_own = doc_set * 0 + 1
    else:
        first_query = doc_set * 0
        n_own = n_queries
    q_base = q_ptr + first_query * stride_qn
    a_base = argmax_ptr + first_query * stride_an + doc * stride_ab
    g_base = grad_ptr + first_query * stride_gn + doc * stride_gb
    offs_rows = tl.arange(0, BLOCK_ROWS)
    acc = tl.zeros((BLOCK_DOC_ROWS, BLOCK_K), tl.float32)
    for step in range(0, n_own * n_tok_blocks):
        qi = step // n_tok_blocks
        tokens = (step - qi * n_tok_blocks) * BLOCK_ROWS + offs_rows
        qi = qi.to(tl.int64)
        winner = tl.load(a_base + qi * stride_an + tokens * stride_al, mask=tokens < q_len, other=-1)
        # Only rows whose winner lies in this block are read (a NaN elsewhere never meets a 0 of the one-hot).
        mine = (winner >= first_position) & (winner < first_position + BLOCK_DOC_ROWS)
        rows = tl.load(
            q_base + qi * stride_qn + tokens[:, None] * stride_ql + kk[None, :] * stride_qk,
            mask=mine[:, None] & k_ok[None, :],
            other=0.0,
        )
        one_hot = (positions[:, None] == winner[None, :]).to(rows.dtype)
        weight = tl.load(g_base + qi * stride_gn)
        acc += weight * tl.dot(one_hot, rows, input_precision=DOT_PRECISION)
    out = dd_ptr + doc_set * stride_ddn + doc * stride_ddb + positions[:, None] * stride_ddl + kk[None, :] * stride_ddk
    tl.store(out, acc.to(dd_ptr.dtype.element_ty), mask=(positions < doc_len)[:, None] & k_ok[None, :])


def feature_blocks(dim: int, block_k: int) -> tuple[int, int]:
    """``(block_k, n_blocks)``: the feature tile (at least 16 wide, at most the padded ``dim``) and how many."""
    block_k = min(block_k, max(16, next_power_of_2(dim)))
    return block_k, triton.cdiv(dim, block_k)


def maxsim_backward_dq(grad: torch.Tensor, d: torch.Tensor, argmax: torch.Tensor, q_shape, dtype) -> torch.Tensor:
    """``dQ [Nq, Lq, dim]`` in the input dtype from ``grad [Nq, B]`` (fp32) and the saved argmax."""
    n_q, l_q, dim = q_shape
    n_docs = d.shape[1]
    dq = torch.zeros((n_q, l_q, dim), dtype=dtype, device=grad.device)
    if dq.numel() == 0 or n_docs == 0:
        return dq
    cfg = maxsim_backward_config(dim=dim, dtype=dtype, device=grad.device)
    block_k, n_k_blocks = feature_blocks(dim, cfg.block_k)
    n_row_blocks = triton.cdiv(l_q, cfg.block_rows)
    maxsim_bwd_dq_kernel[(n_q * n_row_blocks * n_k_blocks,)](
        d, grad, argmax, dq,
        l_q, n_docs, n_row_blocks, n_k_blocks,
        *set_strides(d), *grad.stride(), *argmax.stride(), *dq.stride(),
        DIM=dim, BLOCK_ROWS=cfg.block_rows, BLOCK_K=block_k, DOCS=cfg.dq_docs,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return dq


def launch_dd_onehot(grad, q, argmax, dd, *, per_query: bool, cfg, block_k: int, n_k_blocks: int):
    """Deterministic one-hot dD into ``dd`` (input dtype, each program owns its rows)."""
    n_sets, n_docs, l_d, dim = dd.shape
    n_q, l_q, _ = q.shape
    n_doc_blocks = triton.cdiv(l_d, cfg.onehot_doc_rows)
    block_rows = max(16, min(cfg.onehot_rows, next_power_of_2(l_q)))
    maxsim_bwd_dd_onehot_kernel[(n_sets * n_docs * n_doc_blocks * n_k_blocks,)](
        q, grad, argmax, dd,
        n_q, l_q, n_docs, l_d, n_doc_blocks, n_k_blocks, triton.cdiv(l_q, block_rows),
        *q.stride(), *grad.stride(), *argmax.stride(), *dd.stride(),
        DIM=dim, PER_QUERY=per_query, BLOCK_ROWS=block_rows,
        BLOCK_DOC_ROWS=cfg.onehot_doc_rows, BLOCK_K=block_k, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=cfg.onehot_warps, num_stages=cfg.onehot_stages,
    )


def maxsim_backward_dd(
    grad: torch.Tensor,
    q: torch.Tensor,
    argmax: torch.Tensor,
    d_shape,
    dtype,
    *,
    deterministic: bool,
    per_query: bool,
) -> torch.Tensor:
    """``dD [n_sets, B, Ld, dim]`` in the input dtype; ``deterministic`` selects the atomic-free kernel.

    ``per_query``: documents were ``[Nq, B, Ld, d]`` (set ``n`` is scored by query ``n`` only).
    """
    n_sets, n_docs, l_d, dim = d_shape
    n_q, l_q, _ = q.shape
    if dim == 0 or n_docs == 0 or l_d == 0 or n_q == 0 or l_q == 0:
        return torch.zeros(d_shape, dtype=dtype, device=grad.device)
    cfg = maxsim_backward_config(dim=dim, dtype=dtype, device=grad.device)
    block_k, n_k_blocks = feature_blocks(dim, cfg.block_k)
    route = cfg.deterministic_dd if deterministic else cfg.fast_dd
    allowed = DETERMINISTIC_DD if deterministic else FAST_DD
    if route not in allowed:
        raise ValueError(f"{'deterministic' if deterministic else 'fast'} dD route must be one of {allowed}, "
                         f"got {route!r}")
    if route == "atomic":
        dd32 = torch.zeros(d_shape, dtype=torch.float32, device=grad.device)
        launch_dd_atomic(grad, q, argmax, dd32, cfg=cfg, block_k=block_k, n_k_blocks=n_k_blocks)
        return dd32.to(dtype)
    dd = torch.empty(d_shape, dtype=dtype, device=grad.device)
    launch = {"sorted": launch_dd_sorted, "onehot": launch_dd_onehot, "loop": launch_dd_owned_loop}[route]
    launch(grad, q, argmax, dd, per_query=per_query, cfg=cfg, block_k=block_k, n_k_blocks=n_k_blocks)
    return dd


def launch_dd_atomic(grad, q, argmax, dd32, *, cfg, block_k: int, n_k_blocks: int):
    """The per-(query row, feature) fp32 atomic scatter into the pre-zeroed ``dd32``."""
    n_q, l_q, dim = q.shape
    n_docs = dd32.shape[1]
    n_row_blocks = triton.cdiv(l_q, cfg.block_rows)
    maxsim_bwd_dd_atomic_kernel[(n_q * n_row_blocks * n_docs * n_k_blocks,)](
        q, grad, argmax, dd32,
        l_q, n_docs, n_row_blocks, n_k_blocks,
        *q.stride(), *grad.stride(), *argmax.stride(), *set_strides(dd32),
        DIM=dim, BLOCK_ROWS=cfg.block_rows, BLOCK_K=block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def launch_dd_owned_loop(grad, q, argmax, dd, *, per_query: bool, cfg, block_k: int, n_k_blocks: int):
    """Deterministic dD for short queries: a loop over queries, each a nested loop over its token blocks."""
    n_sets, n_docs, l_d, dim = dd.shape
    n_q, l_q, _ = q.shape
    n_doc_blocks = triton.cdiv(l_d, cfg.block_doc_rows)
    maxsim_bwd_dd_owned_kernel[(n_sets * n_docs * n_doc_blocks * n_k_blocks,)](
        q, grad, argmax, dd,
        n_q, l_q, n_docs, l_d, n_doc_blocks, n_k_blocks,
        *q.stride(), *grad.stride(), *argmax.stride(), *dd.stride(),
        DIM=dim, PER_QUERY=per_query, BLOCK_ROWS=max(16, cfg.block_rows), BLOCK_DOC_ROWS=cfg.block_doc_rows,
        BLOCK_K=block_k, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
