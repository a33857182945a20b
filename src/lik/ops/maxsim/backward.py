"""MaxSim backward from the argmax saved by the forward: one family of kernels for every layout.

With ``w[n, j] = dL/dscore[n, j]`` and ``t* = argmax[n, j, s]`` (-1: no gradient):

* ``dQ[n, s] = sum_j w[n, j] * D[set(n), j, t*]`` -- a gather; each program owns a block of query rows, so it
  is deterministic.
* ``dD[set, j, t] = sum_{n, s : t* = t} w[n, j] * Q[n, s]`` -- a scatter. Two ways:

  - the atomic scatter (``"fast"``): one fp32 atomic add per (row, feature) into an L2-sized fp32 buffer, a
    chunk of documents at a time, each chunk cast to the input dtype;
  - the sorted-winners gather (``"deterministic"``; ``backward_sorted.py``): the winners sorted by document
    row, each row summed by the one program that owns it, in a fixed order. No atomics, the same bits on
    every run.

The layouts (``LAYOUT``, :mod:`lik.core.segments`) differ only in how a winner is addressed. Padded documents
``[n_sets, B, Ld, d]``: ``t*`` is a row of document ``j``. Packed documents (``PACKED``, ``PAIRS``): the forward
saved *absolute* rows of the packed ``[Td, d]``, so the same kernels read the documents through a view with
document stride 0. Packed pairs are one query made of all packed query tokens against that view, each token
weighted by its own pair's gradient (found in ``cu_seqlens_q``); see ``packed_backward.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..._device import cdiv, next_power_of_2
from ...config.maxsim import maxsim_backward_config
from ..._dispatch import BACKWARD_MODES
from ..._launch import launch
from ..._replay import made, note
from ...core.forward_launch import set_strides
from ...core.segments import PADDED, PAIRS, find_segment, search_steps
from .backward_sorted import launch_dd_sorted

__all__ = [
    "maxsim_bwd_dq_kernel",
    "maxsim_bwd_dd_atomic_kernel",
    "PairWeights",
    "feature_blocks",
    "maxsim_backward_dq",
    "maxsim_backward_dd",
    "scatter_dd_atomic",
    "BACKWARD_MODES",
]

# dD routes (``MaxSimBackwardConfig.fast_dd`` / ``deterministic_dd``); the deterministic ones use no atomics.
FAST_DD = ("atomic", "sorted")
DETERMINISTIC_DD = ("sorted",)


# Strides that follow a batch size or a length are not specialised either (a stride's divisibility by 16
# would otherwise pick a new variant when B or Lq changes). Embedding strides (Lq * d, Ld * d) stay specialised:
# they keep their divisibility when d does, and without it Triton cannot prove rows 16-byte aligned and loads
# them element by element (benchmarks/NOTES.md, "Aligned embedding strides").
_BATCH_STRIDES = ["stride_gn", "stride_an", "stride_ab"]


@triton.jit
def token_weights(grad_ptr, cu_q_ptr, tokens, token_ok, n_pairs, n_pair_steps, stride_gb):
    """Packed pairs: each query token's weight, the gradient of the pair its row lies in."""
    pair = find_segment(cu_q_ptr, tokens, n_pairs, n_pair_steps)
    return tl.load(grad_ptr + pair * stride_gb, mask=token_ok, other=0.0)


# Pair counts are runtime values (no recompile when the batch changes).
_PAIR_ARGS = ["n_pairs", "n_pair_steps"]


@triton.jit(do_not_specialize=["q_len", "n_docs", "n_row_blocks", "n_k_blocks", *_BATCH_STRIDES, *_PAIR_ARGS])
def maxsim_bwd_dq_kernel(
    d_ptr, grad_ptr, argmax_ptr, dq_ptr, cu_q_ptr,
    d_scale_ptr,  # SCALED: fp32 per-row scales of int8 rows (lik.maxsim's save_d_as), contiguous; else unread
    q_len, n_docs, n_row_blocks, n_k_blocks, n_pairs, n_pair_steps,
    stride_dn, stride_db, stride_dl, stride_dk,
    stride_gn, stride_gb,
    stride_an, stride_ab, stride_al,
    stride_dqn, stride_dql, stride_dqk,
    stride_sn, stride_sb,
    DIM: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOCS: tl.constexpr = 1,
    LAYOUT: tl.constexpr = 0,  # PADDED, PACKED or PAIRS (lik.core.segments)
    SCALED: tl.constexpr = False,  # int8 rows times their scales: the gathered rows dequantized on chip
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
    stride_sb64 = zero64 + stride_sb
    doc_ptr = d_ptr + query * stride_dn
    scale_ptr = d_scale_ptr + query * stride_sn
    winner_ptrs = argmax_ptr + query * stride_an + tokens * stride_al
    weight_ptr = grad_ptr + query * stride_gn
    if LAYOUT == PAIRS:  # one document (the packed view); each token weighted by its own pair
        pair_weight = token_weights(grad_ptr, cu_q_ptr, tokens, token_ok, n_pairs, n_pair_steps, stride_gb)[:, None]
    acc = tl.zeros((BLOCK_ROWS, BLOCK_K), tl.float32)
    for start in range(0, n_docs, DOCS):
        for u in tl.static_range(DOCS):
            # Past the last document (a partial step): no winners, weight 0 (read from the last document).
            doc_ok = (start + u) < n_docs
            winner = tl.load(winner_ptrs + u * stride_ab64, mask=tokens < tl.where(doc_ok, q_len, 0), other=-1)
            if LAYOUT == PAIRS:
                weight = pair_weight
            else:
                weight = tl.load(weight_ptr + tl.minimum(n_docs - 1 - start, u) * stride_gb64)
                weight = tl.where(doc_ok, weight, 0.0)
            has_grad = winner >= 0
            rows = tl.load(
                doc_ptr + u * stride_db64 + winner.to(tl.int64)[:, None] * stride_dl + kk[None, :] * stride_dk,
                mask=has_grad[:, None] & k_ok[None, :],
                other=0.0,
            )
            rows = rows.to(tl.float32)
            if SCALED:
                rows *= tl.load(scale_ptr + u * stride_sb64 + winner.to(tl.int64), mask=has_grad, other=0.0)[:, None]
            acc += weight * rows
        doc_ptr += DOCS * stride_db64
        scale_ptr += DOCS * stride_sb64
        winner_ptrs += DOCS * stride_ab64
        weight_ptr += DOCS * stride_gb64
    tl.store(
        dq_ptr + query * stride_dqn + tokens[:, None] * stride_dql + kk[None, :] * stride_dqk,
        acc.to(dq_ptr.dtype.element_ty),
        mask=token_ok[:, None] & k_ok[None, :],
    )


@triton.jit(do_not_specialize=["q_len", "n_docs", "n_row_blocks", "n_k_blocks", *_BATCH_STRIDES, *_PAIR_ARGS])
def maxsim_bwd_dd_atomic_kernel(
    q_ptr, grad_ptr, argmax_ptr, dd_ptr, cu_q_ptr,
    q_len, n_docs, n_row_blocks, n_k_blocks, n_pairs, n_pair_steps,
    stride_qn, stride_ql, stride_qk,
    stride_gn, stride_gb,
    stride_an, stride_ab, stride_al,
    stride_ddn, stride_ddb, stride_ddl, stride_ddk,
    DIM: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LAYOUT: tl.constexpr = 0,  # PADDED, PACKED or PAIRS (lik.core.segments)
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
    if LAYOUT == PAIRS:
        weight = token_weights(grad_ptr, cu_q_ptr, tokens, token_ok, n_pairs, n_pair_steps, stride_gb)[:, None]
    else:
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


class PairWeights(NamedTuple):
    """Packed pairs' query offsets: the backward kernels weight each query token by its pair's gradient."""

    cu_q: torch.Tensor
    n_pairs: int


def _pair_args(pairs: PairWeights | None, fallback: torch.Tensor) -> tuple:
    """``(cu_q, n_pairs, n_pair_steps, layout)`` launch arguments: unread placeholders unless pairs."""
    if pairs is None:
        return fallback, 0, 0, PADDED
    return pairs.cu_q, pairs.n_pairs, search_steps(pairs.n_pairs), PAIRS


def feature_blocks(dim: int, block_k: int) -> tuple[int, int]:
    """``(block_k, n_blocks)``: the feature tile (at least 16 wide, at most the padded ``dim``) and how many."""
    block_k = min(block_k, max(16, next_power_of_2(dim)))
    return block_k, cdiv(dim, block_k)


def maxsim_backward_dq(grad: torch.Tensor, d: torch.Tensor, argmax: torch.Tensor, q_shape, dtype, *,
                       pairs: PairWeights | None = None, d_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``dQ [Nq, Lq, dim]`` in the input dtype from ``grad [Nq, B]`` (fp32) and the saved argmax ``[Nq, B, Lq]``.

    ``pairs``: packed pairs as one query of every packed token (``grad [1, n_pairs]``, one document).
    ``d_scale``: ``d`` is int8 rows with these contiguous fp32 scales ``[n_sets, B, Ld]`` (each gathered row is
    dequantized on chip: no dequantized copy of ``d``)."""
    n_q, l_q, dim = q_shape
    n_docs = d.shape[1]
    if n_q * l_q * dim == 0 or n_docs == 0:
        return torch.zeros((n_q, l_q, dim), dtype=dtype, device=grad.device)
    # Every element is stored by the kernel (rows with no winner as 0): no fill launch.
    dq = made(torch.empty((n_q, l_q, dim), dtype=dtype, device=grad.device))
    cfg = maxsim_backward_config(dim=dim, dtype=dtype, device=grad.device)
    block_k, n_k_blocks = feature_blocks(dim, cfg.block_k)
    n_row_blocks = cdiv(l_q, cfg.block_rows)
    cu_q, n_pairs, n_pair_steps, layout = _pair_args(pairs, argmax)
    launch(
        maxsim_bwd_dq_kernel, (n_q * n_row_blocks * n_k_blocks,),
        d, grad, argmax, dq, cu_q, d_scale if d_scale is not None else grad,
        l_q, n_docs, n_row_blocks, n_k_blocks, n_pairs, n_pair_steps,
        # Pairs: the one query's stride would follow Tq (a new variant per parity of Tq * dim); 0 reads the same.
        *set_strides(d), *grad.stride(), *argmax.stride(), *(set_strides(dq) if pairs else dq.stride()),
        *(set_strides(d_scale)[:2] if d_scale is not None else (0, 0)),
        DIM=dim, BLOCK_ROWS=cfg.block_rows, BLOCK_K=block_k, DOCS=1 if pairs else cfg.dq_docs, LAYOUT=layout.value,
        SCALED=d_scale is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return dq


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

    ``per_query``: documents were ``[Nq, B, Ld, d]`` (set ``n`` is scored by query ``n`` only). A recorded call
    notes its route as ``"dd"`` (:mod:`lik.ops.maxsim.replay` makes its buffers again by it)."""
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
        return scatter_dd_atomic(grad, q, argmax, d_shape, dtype, cfg=cfg, block_k=block_k, n_k_blocks=n_k_blocks)
    note("dd", ("sorted", 0))
    dd = made(torch.empty(d_shape, dtype=dtype, device=grad.device))
    launch_dd_sorted(grad, q, argmax, dd, per_query=per_query, cfg=cfg, block_k=block_k, n_k_blocks=n_k_blocks)
    return dd


def scatter_dd_atomic(grad, q, argmax, d_shape, dtype, *, cfg, block_k: int, n_k_blocks: int) -> torch.Tensor:
    """dD by fp32 atomics, a chunk of documents at a time through an fp32 buffer of at most
    ``cfg.atomic_workspace_bytes`` (at least one document), each chunk cast into the input-dtype result.

    The buffer stays L2-sized whatever ``B`` (the atomics land in L2, and the step's peak memory does not grow
    by ``4 B Ld d`` bytes); fp32 inputs accumulate straight into the result, and a gradient that fits the buffer
    whole is cast once."""
    n_sets, n_docs, l_d, dim = d_shape
    step = n_docs
    if dtype != torch.float32:
        step = max(1, min(n_docs, cfg.atomic_workspace_bytes // (4 * n_sets * l_d * dim)))
    if step == n_docs:
        note("dd", ("atomic", step))
        dd32 = made(torch.zeros(d_shape, dtype=torch.float32, device=grad.device))
        launch_dd_atomic(grad, q, argmax, dd32, cfg=cfg, block_k=block_k, n_k_blocks=n_k_blocks)
        return dd32 if dtype == torch.float32 else dd32.to(dtype)
    note("dd", ("chunked", step))
    dd = made(torch.empty(d_shape, dtype=dtype, device=grad.device))
    buffer = made(torch.empty((n_sets, step, l_d, dim), dtype=torch.float32, device=grad.device))
    for first in range(0, n_docs, step):
        chunk = buffer[:, :min(step, n_docs - first)]
        chunk.zero_()
        docs = slice(first, first + chunk.shape[1])
        launch_dd_atomic(grad[:, docs], q, argmax[:, docs], chunk, cfg=cfg, block_k=block_k, n_k_blocks=n_k_blocks)
        dd[:, docs].copy_(chunk)
    return dd


def launch_dd_atomic(grad, q, argmax, dd32, *, cfg, block_k: int, n_k_blocks: int,
                     pairs: PairWeights | None = None):
    """The per-(query row, feature) fp32 atomic scatter into the pre-zeroed ``dd32 [n_sets, B, Ld, dim]`` (a
    document-stride-0 view of ``[Td, dim]`` for packed documents; ``pairs`` as in :func:`maxsim_backward_dq`)."""
    n_q, l_q, dim = q.shape
    n_docs = argmax.shape[1]
    n_row_blocks = cdiv(l_q, cfg.block_rows)
    cu_q, n_pairs, n_pair_steps, layout = _pair_args(pairs, argmax)
    launch(
        maxsim_bwd_dd_atomic_kernel, (n_q * n_row_blocks * n_docs * n_k_blocks,),
        q, grad, argmax, dd32, cu_q,
        l_q, n_docs, n_row_blocks, n_k_blocks, n_pairs, n_pair_steps,
        *q.stride(), *grad.stride(), *argmax.stride(), *set_strides(dd32),
        DIM=dim, BLOCK_ROWS=cfg.block_rows, BLOCK_K=block_k, LAYOUT=layout.value,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
