"""Backward of packed MaxSim: kernels and launchers.

The forward saved each query row's winner as an *absolute* row of the packed ``d`` (-1: no gradient), so no
document offsets are needed here: ``dQ`` is a gather and ``dD`` a scatter into ``[Td, dim]``.

* pairs: one kernel over blocks of packed query tokens gives ``dQ[t] = w * d[winner]`` (a gather) and, on the
  fast path, ``dD[winner] += w * q[t]`` (fp32 atomics) in one pass;
* corpus (dense queries): the padded backward's ``dQ`` gather and atomic scatter on a ``[1, B, Td, dim]`` view;
* deterministic ``dD`` (both): each program owns a block of packed ``d`` rows and sums one-hot products over
  the queries that scored them, in a fixed order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._config import cdiv, maxsim_backward_config
from ..._launch import launch
from ...core.segments import find_segment, search_steps, segment
from .backward import feature_blocks, launch_dd_atomic, maxsim_backward_dq, winners_sum
from .forward import dot_precision
from .packing import PackedInputs

__all__ = [
    "maxsim_varlen_bwd_tokens_kernel",
    "maxsim_varlen_bwd_dd_owned_kernel",
    "packed_backward",
    "packed_backward_dq",
    "packed_backward_dd",
]


@triton.jit(do_not_specialize=["n_tokens", "n_pairs", "n_steps", "n_k_blocks"])
def maxsim_varlen_bwd_tokens_kernel(
    q_ptr, d_ptr, grad_ptr, cu_q_ptr, argmax_ptr, dq_ptr, dd_ptr,
    n_tokens, n_pairs, n_steps, n_k_blocks,
    stride_ql, stride_qk,
    stride_dl, stride_dk,
    stride_g, stride_a,
    stride_dql, stride_dqk,
    stride_ddl, stride_ddk,
    DIM: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COMPUTE_DQ: tl.constexpr,
    ATOMIC_DD: tl.constexpr,
):
    """Pairs backward over blocks of packed query tokens: each token has one winner row of ``d`` and one weight
    (its pair's output gradient), so ``dQ[t] = w * d[winner]`` (a gather: deterministic) and, for the fast path,
    ``dD[winner] += w * q[t]`` (fp32 atomics) come out of one pass."""
    pid = tl.program_id(0).to(tl.int64)
    k_block = pid % n_k_blocks
    tokens = (pid // n_k_blocks) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    token_ok = tokens < n_tokens
    kk = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = kk < DIM
    winner = tl.load(argmax_ptr + tokens * stride_a, mask=token_ok, other=-1).to(tl.int64)
    has_grad = winner >= 0
    pair = find_segment(cu_q_ptr, tokens, n_pairs, n_steps)
    weight = tl.load(grad_ptr + pair * stride_g, mask=has_grad, other=0.0)
    grad_mask = has_grad[:, None] & k_ok[None, :]
    if COMPUTE_DQ:
        rows = tl.load(d_ptr + winner[:, None] * stride_dl + kk[None, :] * stride_dk, mask=grad_mask, other=0.0)
        tl.store(
            dq_ptr + tokens[:, None] * stride_dql + kk[None, :] * stride_dqk,
            (weight[:, None] * rows.to(tl.float32)).to(dq_ptr.dtype.element_ty),
            mask=token_ok[:, None] & k_ok[None, :],
        )
    if ATOMIC_DD:
        rows = tl.load(q_ptr + tokens[:, None] * stride_ql + kk[None, :] * stride_qk, mask=grad_mask, other=0.0)
        tl.atomic_add(
            dd_ptr + winner[:, None] * stride_ddl + kk[None, :] * stride_ddk,
            weight[:, None] * rows.to(tl.float32),
            mask=grad_mask,
            sem="relaxed",
        )


@triton.jit(
    do_not_specialize=[
        "n_queries", "q_len", "n_q_rows", "n_d_rows", "n_docs", "n_steps", "n_k_blocks",
        "stride_gn", "stride_an", "stride_ab",
    ]
)
def maxsim_varlen_bwd_dd_owned_kernel(
    q_ptr, grad_ptr, cu_q_ptr, cu_d_ptr, argmax_ptr, dd_ptr,
    n_queries, q_len, n_q_rows, n_d_rows, n_docs, n_steps, n_k_blocks,
    stride_qn, stride_ql, stride_qk,
    stride_gn, stride_gb,
    stride_an, stride_ab, stride_al,
    stride_ddl, stride_ddk,
    DIM: tl.constexpr,
    PAIRS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_DOC_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Deterministic ``dD``: each program owns a block of packed ``d`` rows (which may span several documents,
    found by binary search) and sums, document by document and query by query, ``w * onehot(winner == row)^T @ q``
    in a fixed order: no atomics, the same bits on every run. The one-hot is exact in the input dtype and the
    products accumulate in fp32."""
    pid = tl.program_id(0).to(tl.int64)
    k_block = pid % n_k_blocks
    first_row = (pid // n_k_blocks) * BLOCK_DOC_ROWS
    positions = first_row + tl.arange(0, BLOCK_DOC_ROWS)
    kk = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = kk < DIM
    first_doc = find_segment(cu_d_ptr, first_row, n_docs, n_steps)
    last_doc = find_segment(cu_d_ptr, tl.minimum(first_row + BLOCK_DOC_ROWS, n_d_rows) - 1, n_docs, n_steps)
    acc = tl.zeros((BLOCK_DOC_ROWS, BLOCK_K), tl.float32)
    for doc in range(first_doc, last_doc + 1):
        if PAIRS:  # the document's one query: rows [q_start, q_start + seq_len) of the packed q, argmax [Tq]
            q_start, seq_len = segment(cu_q_ptr, doc, n_q_rows)
            n_slots = 1
        else:  # every query scored the document
            q_start = 0
            seq_len = q_len
            n_slots = n_queries
        for slot in range(0, n_slots):
            part = winners_sum(
                q_ptr + slot * stride_qn + q_start * stride_ql,
                argmax_ptr + slot * stride_an + doc * stride_ab + q_start * stride_al, seq_len, positions, kk,
                stride_ql, stride_qk, stride_al, DIM, BLOCK_ROWS, BLOCK_DOC_ROWS, BLOCK_K, DOT_PRECISION,
            )
            acc += tl.load(grad_ptr + slot * stride_gn + doc * stride_gb) * part
    tl.store(
        dd_ptr + positions[:, None] * stride_ddl + kk[None, :] * stride_ddk,
        acc.to(dd_ptr.dtype.element_ty),
        mask=(positions < n_d_rows)[:, None] & k_ok[None, :],
    )



def packed_backward_dq(grad: torch.Tensor, inputs: PackedInputs, argmax: torch.Tensor) -> torch.Tensor:
    """Gradient of the packed (pairs) or dense (corpus) queries, in their dtype; a gather, deterministic."""
    q, d = inputs.q, inputs.d
    if not inputs.pairs:
        # The winners are absolute rows of d, so the documents are a [1, B, Td, dim] view with document stride 0.
        docs = d.unsqueeze(0).unsqueeze(0).expand(1, grad.shape[1], *d.shape)
        return maxsim_backward_dq(grad, docs, argmax, q.shape, q.dtype)
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
    _launch_tokens(grad, inputs, argmax, dq=dq, dd32=None)
    return dq


def _launch_tokens(grad, inputs: PackedInputs, argmax, *, dq, dd32) -> None:
    """Pairs backward kernel: writes ``dq`` and / or accumulates into the fp32 ``dd32`` (both pre-zeroed)."""
    q, d = inputs.q, inputs.d
    dim = q.shape[1]
    if q.numel() == 0 or d.numel() == 0 or grad.numel() == 0:
        return
    cfg = maxsim_backward_config(dim=dim, dtype=q.dtype, device=q.device)
    block_k, n_k_blocks = feature_blocks(dim, cfg.block_k)
    n_pairs = grad.shape[0]
    dq_arg, dq_strides = (dq, dq.stride()) if dq is not None else (grad, (0, 0))
    dd_arg, dd_strides = (dd32, dd32.stride()) if dd32 is not None else (grad, (0, 0))
    launch(
        maxsim_varlen_bwd_tokens_kernel, (cdiv(q.shape[0], cfg.block_rows) * n_k_blocks,),
        q, d, grad, inputs.cu_q, argmax, dq_arg, dd_arg,
        q.shape[0], n_pairs, search_steps(n_pairs), n_k_blocks,
        *q.stride(), *d.stride(), grad.stride(0), argmax.stride(0), *dq_strides, *dd_strides,
        DIM=dim, BLOCK_ROWS=cfg.block_rows, BLOCK_K=block_k,
        COMPUTE_DQ=dq is not None, ATOMIC_DD=dd32 is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def packed_backward_dd(
    grad: torch.Tensor, inputs: PackedInputs, argmax: torch.Tensor, *, deterministic: bool
) -> torch.Tensor:
    """Gradient of the packed documents ``[Td, dim]`` in their dtype: owned rows (``deterministic``) or fp32
    atomics."""
    q, d = inputs.q, inputs.d
    dim = d.shape[1]
    n_docs = inputs.cu_d.numel() - 1
    if d.numel() == 0 or q.numel() == 0 or n_docs == 0:
        return torch.zeros_like(d, memory_format=torch.contiguous_format)
    cfg = maxsim_backward_config(dim=dim, dtype=d.dtype, device=d.device)
    block_k, n_k_blocks = feature_blocks(dim, cfg.block_k)
    if deterministic:
        dd = torch.empty_like(d, memory_format=torch.contiguous_format)
        if inputs.pairs:
            q_strides, grad_strides, argmax_strides, l_q = (0, *q.stride()), (0, grad.stride(0)), (0, 0, 1), 0
        else:
            q_strides, grad_strides, argmax_strides, l_q = q.stride(), grad.stride(), argmax.stride(), q.shape[1]
        launch(
            maxsim_varlen_bwd_dd_owned_kernel, (cdiv(d.shape[0], cfg.block_doc_rows) * n_k_blocks,),
            q, grad, inputs.cu_q if inputs.pairs else inputs.cu_d, inputs.cu_d, argmax, dd,
            q.shape[0] if not inputs.pairs else 1, l_q, q.shape[0] if inputs.pairs else 0, d.shape[0], n_docs,
            search_steps(n_docs), n_k_blocks,
            *q_strides, *grad_strides, *argmax_strides, *dd.stride(),
            DIM=dim, PAIRS=inputs.pairs, BLOCK_ROWS=max(16, cfg.block_rows), BLOCK_DOC_ROWS=cfg.block_doc_rows,
            BLOCK_K=block_k, DOT_PRECISION=dot_precision(d.dtype),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        return dd
    dd32 = torch.zeros(d.shape, dtype=torch.float32, device=d.device)
    if inputs.pairs:
        _launch_tokens(grad, inputs, argmax, dq=None, dd32=dd32)
    else:
        # The padded atomic scatter as is: absolute winners and a [1, B, Td, dim] view of dd32 (strides 0).
        launch_dd_atomic(grad, q, argmax, dd32.expand(1, n_docs, *dd32.shape), cfg=cfg, block_k=block_k,
                         n_k_blocks=n_k_blocks)
    return dd32.to(d.dtype)



def packed_backward(grad_scores, q, d, cu_q, cu_d, argmax, max_seqlen_q, need_dq, need_dd, deterministic):
    """``(dq, dd)`` of the packed scores (None where not needed), each in its input's dtype."""
    inputs = PackedInputs(q, d, cu_q, cu_d, None, max_seqlen_q, False, True)
    grad_scores = grad_scores.float().contiguous()
    if inputs.pairs and need_dq and need_dd and not deterministic:
        # One pass over the query tokens gives both: dQ by gather, dD by atomics.
        dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        dd32 = torch.zeros(d.shape, dtype=torch.float32, device=d.device)
        _launch_tokens(grad_scores, inputs, argmax, dq=dq, dd32=dd32)
        return dq, dd32.to(d.dtype)
    dq = packed_backward_dq(grad_scores, inputs, argmax) if need_dq else None
    dd = packed_backward_dd(grad_scores, inputs, argmax, deterministic=deterministic) if need_dd else None
    return dq, dd

