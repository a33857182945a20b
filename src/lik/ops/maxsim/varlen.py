"""Packed variable-length MaxSim: ragged pair lists and ragged corpora with no padding.

Two entry points share one forward kernel (``PAIRS`` selects the query addressing):

* :func:`maxsim_varlen` scores ``N`` pairs ``(query i, document i)`` of packed queries ``q [Tq, dim]`` and packed
  documents ``d [Td, dim]``. A program owns one pair and one chunk of its query rows;
* :func:`maxsim_packed` scores dense queries ``[Nq, Lq, dim]`` against every document of a packed corpus. A
  program owns one document and a block of query-row groups (short queries stacked, as in the padded kernel).

Either way the document is streamed through :func:`~lik.ops.maxsim.tile.maxsim_doc_rows` over its true length,
read from ``cu_seqlens`` on the device: no padding is read, computed or stored, and no length is specialised on.
The saved argmax holds *absolute* rows of the packed ``d`` (-1: no gradient), so the backward needs no document
offsets: ``dQ`` is a gather and ``dD`` a scatter into ``[Td, dim]``.

``cu_seqlens`` offsets read by the kernels are clamped to the packed tensors, so inputs whose values were not
checked (hints given) may give wrong numbers but never an out-of-bounds access.

Under ``torch.compile`` (with the ``max_seqlen`` hints) the kernels are the custom operators
``lik::maxsim_packed_forward`` / ``lik::maxsim_packed_backward``, as for :func:`lik.maxsim`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._config import cdiv, feature_chunks, maxsim_backward_config, maxsim_varlen_config
from ..._launch import launch
from .backward import feature_blocks, launch_dd_atomic, maxsim_backward_dq, winners_sum
from .forward import dot_precision
from .function import resolve_backward, uses_kernels
from .packing import PackedInputs
from .reference_varlen import packed_reference
from .tile import NO_KEY, counted_rows, maxsim_doc_rows, query_rows, store_group_sums

__all__ = [
    "maxsim_varlen",
    "maxsim_packed",
    "MaxSimPackedFunction",
    "maxsim_varlen_fwd_kernel",
    "maxsim_varlen_bwd_tokens_kernel",
    "maxsim_varlen_bwd_dd_owned_kernel",
    "packed_forward",
    "packed_backward_dq",
    "packed_backward_dd",
]


# --------------------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def segment(cu_ptr, index, n_rows):
    """Rows ``[start, start + length)`` of sequence ``index``, clamped to ``[0, n_rows]`` (see module doc)."""
    start = tl.load(cu_ptr + index).to(tl.int64)
    end = tl.load(cu_ptr + index + 1).to(tl.int64)
    start = tl.minimum(tl.maximum(start, 0), n_rows)
    end = tl.minimum(tl.maximum(end, start), n_rows)
    return start, (end - start).to(tl.int32)


@triton.jit
def find_segment(cu_ptr, rows, n_segments, n_steps):
    """The sequence holding each of ``rows``: the largest ``j < n_segments`` with ``cu[j] <= row``.

    A branch-free binary search of ``n_steps = ceil(log2(n_segments))`` runtime steps (no recompile per ``N``);
    empty sequences (equal neighbours in ``cu``) are skipped by construction.
    """
    lo = (rows * 0).to(tl.int64)
    hi = lo + n_segments
    for _ in range(n_steps):
        mid = (lo + hi) // 2
        right = tl.load(cu_ptr + mid).to(tl.int64) <= rows
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def _score_rows(
    q_row_ptrs, row_in_range, row_valid, argmax_ptrs, stride_qk,
    doc_ptr, doc_start, doc_len, stride_dl, stride_dk,
    DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr,
    STORE_ARGMAX: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Best similarity of each query row against one packed document (0 where the row adds nothing), and the
    winner's absolute packed row stored at ``argmax_ptrs`` (-1: masked row, empty document, NaN-free nothing)."""
    offs_k = tl.arange(0, BLOCK_K)
    if NUM_K == 1:
        q_rows = tl.load(
            q_row_ptrs[:, None] + offs_k[None, :] * stride_qk,
            mask=row_valid[:, None] & (offs_k[None, :] < DIM),
            other=0.0,
        )
    else:  # wide embeddings: the tile loop reloads the query per k chunk
        q_rows = tl.zeros((BLOCK_M, BLOCK_K), q_row_ptrs.dtype.element_ty)
    # A packed document has no padding and no mask: every in-range token is valid ("exclude" semantics, where an
    # empty document has no valid token and scores 0).
    best, key, n_valid = maxsim_doc_rows(
        q_rows, q_row_ptrs, row_valid, stride_qk,
        doc_ptr + doc_start * stride_dl, doc_ptr, doc_len, stride_dl, stride_dk, 0,
        DIM, BLOCK_M, BLOCK_N, BLOCK_K, NUM_K, False, True, STORE_ARGMAX, DOT_PRECISION,
    )
    counted = counted_rows(row_valid, n_valid, True)
    if STORE_ARGMAX:
        winner = tl.where(counted & (key != NO_KEY), doc_start + (key >> 1), -1)
        tl.store(argmax_ptrs, winner.to(tl.int32), mask=row_in_range)
    return tl.where(counted, best, 0.0)


# Sizes, and the strides that scale with the number of queries, documents or pairs: never specialised on (a
# stride of 1 or a multiple of 16 would otherwise compile a new variant, e.g. for N = 1).
_FWD_RUNTIME_INTS = [
    "n_queries", "q_len", "n_q_rows", "n_d_rows", "n_chunks", "n_row_blocks",
    "stride_qmn", "stride_pc", "stride_pn", "stride_an", "stride_ab",
]


@triton.jit(do_not_specialize=_FWD_RUNTIME_INTS)
def maxsim_varlen_fwd_kernel(
    q_ptr,
    d_ptr,
    cu_q_ptr,  # int32 [N + 1] (PAIRS) or unused
    cu_d_ptr,  # int32 [number of documents + 1]
    q_mask_ptr,  # uint8 [Nq, Lq] (corpus with HAS_Q_MASK) or unused
    partial_ptr,  # fp32 [n_chunks, Nq, B] (corpus) or [n_row_blocks, 1, N] (PAIRS)
    argmax_ptr,  # int32 [Nq, B, Lq] (corpus) or [Tq] (PAIRS): absolute packed rows of d
    n_queries,
    q_len,
    n_q_rows,
    n_d_rows,
    n_chunks,
    n_row_blocks,
    stride_qn, stride_ql, stride_qk,
    stride_dl, stride_dk,
    stride_qmn, stride_qml,
    stride_pc, stride_pn, stride_pb,
    stride_an, stride_ab, stride_al,
    DIM: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_K: tl.constexpr,
    PAIRS: tl.constexpr,
    HAS_Q_MASK: tl.constexpr,
    STORE_ARGMAX: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    BLOCK_M: tl.constexpr = GROUP_ROWS * GROUPS
    pid = tl.program_id(0).to(tl.int64)
    row_block = pid % n_row_blocks
    doc = pid // n_row_blocks
    doc_start, doc_len = segment(cu_d_ptr, doc, n_d_rows)
    rows = tl.arange(0, BLOCK_M)
    if PAIRS:
        # GROUPS == 1. Program `row_block` takes chunks row_block, row_block + n_row_blocks, ... of its query,
        # so a max_seqlen_q hint below the true longest query costs speed, never tokens.
        q_start, pair_len = segment(cu_q_ptr, doc, n_q_rows)
        total = tl.zeros((BLOCK_M,), tl.float32)
        for first in range(row_block * BLOCK_M, pair_len, n_row_blocks * BLOCK_M):
            in_range = first + rows < pair_len
            token = q_start + first + rows
            total += _score_rows(
                q_ptr + token * stride_ql, in_range, in_range, argmax_ptr + token * stride_al, stride_qk,
                d_ptr, doc_start, doc_len, stride_dl, stride_dk,
                DIM, BLOCK_M, BLOCK_N, BLOCK_K, NUM_K, STORE_ARGMAX, DOT_PRECISION,
            )
        tl.store(partial_ptr + row_block * stride_pc + doc * stride_pb, tl.sum(total, axis=0))
    else:
        # Row r is token `token` of query `query`: groups of GROUP_ROWS consecutive tokens, n_chunks per query,
        # GROUPS consecutive groups per program (several short queries share one pass over the document).
        query, token, in_range, valid = query_rows(
            row_block, n_queries, q_len, n_chunks, q_mask_ptr, stride_qmn, stride_qml, GROUP_ROWS, GROUPS, HAS_Q_MASK,
        )
        best = _score_rows(
            q_ptr + query * stride_qn + token * stride_ql, in_range, valid,
            argmax_ptr + query * stride_an + doc * stride_ab + token * stride_al, stride_qk,
            d_ptr, doc_start, doc_len, stride_dl, stride_dk,
            DIM, BLOCK_M, BLOCK_N, BLOCK_K, NUM_K, STORE_ARGMAX, DOT_PRECISION,
        )
        store_group_sums(
            partial_ptr, best, row_block, n_chunks, n_queries, doc, stride_pc, stride_pn, stride_pb, GROUP_ROWS, GROUPS,
        )


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


# --------------------------------------------------------------------------------------------------------------
# Host launchers
# --------------------------------------------------------------------------------------------------------------


def _search_steps(n_segments: int) -> int:
    return max(0, n_segments - 1).bit_length()


def packed_forward(inputs: PackedInputs, store_argmax: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the forward kernel.

    Returns fp32 scores (pairs ``[N]``, corpus ``[Nq, B]``) and, with ``store_argmax``, the int32 winners as
    absolute rows of ``d`` (pairs ``[Tq]``, corpus ``[Nq, B, Lq]``; -1 where a row gets no gradient).
    """
    q, d, device = inputs.q, inputs.d, inputs.q.device
    dim = d.shape[1]
    n_docs = inputs.cu_d.numel() - 1
    if inputs.pairs:
        n_q, l_q, score_shape, argmax_shape = 1, inputs.max_seqlen_q, (n_docs,), (q.shape[0],)
    else:
        n_q, l_q = q.shape[0], q.shape[1]
        score_shape, argmax_shape = (n_q, n_docs), (n_q, n_docs, l_q)
    argmax = None
    if store_argmax:
        # Pairs: -1 everywhere first, since with unchecked cu_seqlens some packed query rows may belong to no
        # pair and the backward must see "no gradient" there, not garbage. The corpus kernel writes every entry.
        fill = inputs.pairs or q.numel() == 0 or d.numel() == 0 or n_docs == 0
        argmax = torch.empty(argmax_shape, dtype=torch.int32, device=device)
        if fill:
            argmax.fill_(-1)
    if q.numel() == 0 or d.numel() == 0 or n_docs == 0:  # no token, no document or dim == 0: every score is 0
        return torch.zeros(score_shape, dtype=torch.float32, device=device), argmax

    cfg = maxsim_varlen_config(
        q_len=max(1, l_q), n_queries=n_q, dim=dim, dtype=q.dtype, pairs=inputs.pairs, device=device
    )
    block_k, num_k = feature_chunks(dim, cfg.block_k)
    if inputs.pairs:
        # At least one program per pair: the hint only sizes the grid (see the kernel).
        n_chunks = n_row_blocks = max(1, cdiv(l_q, cfg.group_rows))
        partial = torch.empty((n_chunks, 1, n_docs), dtype=torch.float32, device=device)
        q_strides = (0, *q.stride())
        argmax_strides = (0, 0, 1)
    else:
        n_chunks = cdiv(l_q, cfg.group_rows)
        n_row_blocks = cdiv(n_q * n_chunks, cfg.groups)
        partial = torch.empty((n_chunks, n_q, n_docs), dtype=torch.float32, device=device)
        q_strides = q.stride()
        argmax_strides = argmax.stride() if argmax is not None else (0, 0, 0)
    q_mask = inputs.q_mask
    q_mask_arg, q_mask_strides = (q, (0, 0)) if q_mask is None else (q_mask.view(torch.uint8), q_mask.stride())
    launch(
        maxsim_varlen_fwd_kernel, (n_row_blocks * n_docs,),
        q, d, inputs.cu_q if inputs.pairs else inputs.cu_d, inputs.cu_d, q_mask_arg, partial,
        argmax if argmax is not None else partial,
        n_q, l_q, q.shape[0] if inputs.pairs else 0, d.shape[0], n_chunks, n_row_blocks,
        *q_strides, *d.stride(), *q_mask_strides, *partial.stride(), *argmax_strides,
        DIM=dim,
        GROUP_ROWS=cfg.group_rows,
        GROUPS=1 if inputs.pairs else cfg.groups,
        BLOCK_N=cfg.block_n,
        BLOCK_K=block_k,
        NUM_K=num_k,
        PAIRS=inputs.pairs,
        HAS_Q_MASK=q_mask is not None,
        STORE_ARGMAX=store_argmax,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    scores = partial[0] if n_chunks == 1 else partial.sum(dim=0)
    return (scores[0] if inputs.pairs else scores), argmax


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
        q.shape[0], n_pairs, _search_steps(n_pairs), n_k_blocks,
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
            _search_steps(n_docs), n_k_blocks,
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


# --------------------------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------------------------


def _packed_backward(grad_scores, q, d, cu_q, cu_d, argmax, max_seqlen_q, need_dq, need_dd, deterministic):
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


# Under torch.compile the packed kernels are custom operators (shape-only fake implementations), as in
# function.py: Dynamo traces the call as one graph; eager calls launch directly.
@torch.library.custom_op("lik::maxsim_packed_forward", mutates_args=())
def _packed_forward_op(q: torch.Tensor, d: torch.Tensor, cu_q: torch.Tensor | None, cu_d: torch.Tensor,
                       q_mask: torch.Tensor | None, max_seqlen_q: int, store_argmax: bool
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    scores, argmax = packed_forward(PackedInputs(q, d, cu_q, cu_d, q_mask, max_seqlen_q, False, True), store_argmax)
    return scores, argmax if argmax is not None else q.new_empty((0,), dtype=torch.int32)


@_packed_forward_op.register_fake
def _packed_forward_fake(q, d, cu_q, cu_d, q_mask, max_seqlen_q, store_argmax):
    n_docs = cu_d.shape[0] - 1
    if cu_q is not None:
        scores, argmax_shape = q.new_empty((n_docs,), dtype=torch.float32), (q.shape[0],)
    else:
        scores, argmax_shape = q.new_empty((q.shape[0], n_docs), dtype=torch.float32), (q.shape[0], n_docs, q.shape[1])
    return scores, q.new_empty(argmax_shape if store_argmax else (0,), dtype=torch.int32)


@torch.library.custom_op("lik::maxsim_packed_backward", mutates_args=())
def _packed_backward_op(grad_scores: torch.Tensor, q: torch.Tensor, d: torch.Tensor, cu_q: torch.Tensor | None,
                        cu_d: torch.Tensor, argmax: torch.Tensor, max_seqlen_q: int, need_dq: bool, need_dd: bool,
                        deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    dq, dd = _packed_backward(grad_scores, q, d, cu_q, cu_d, argmax, max_seqlen_q, need_dq, need_dd, deterministic)
    # A gradient that is not needed comes back as a 0-element placeholder (custom operators return tensors).
    return (dq if dq is not None else q.new_empty((0,)), dd if dd is not None else d.new_empty((0,)))


@_packed_backward_op.register_fake
def _packed_backward_fake(grad_scores, q, d, cu_q, cu_d, argmax, max_seqlen_q, need_dq, need_dd, deterministic):
    return q.new_empty(q.shape if need_dq else (0,)), d.new_empty(d.shape if need_dd else (0,))


class MaxSimPackedFunction(torch.autograd.Function):
    """Autograd over validated packed inputs (see :class:`~lik.ops.maxsim.pack.PackedInputs`): pairs ``[N]`` or
    corpus ``[Nq, B]`` fp32 scores; gradients to ``q`` and ``d`` in their dtype."""

    @staticmethod
    def forward(ctx, q, d, cu_q, cu_d, q_mask, max_seqlen_q, deterministic):
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        if torch.compiler.is_compiling():
            scores, argmax = _packed_forward_op(q, d, cu_q, cu_d, q_mask, max_seqlen_q, needs_grad)
        else:
            inputs = PackedInputs(q, d, cu_q, cu_d, q_mask, max_seqlen_q, False, True)
            scores, argmax = packed_forward(inputs, store_argmax=needs_grad)
        if needs_grad:
            ctx.save_for_backward(q, d, cu_q, cu_d, argmax)
            ctx.max_seqlen_q = max_seqlen_q
            ctx.deterministic = deterministic
        return scores

    @staticmethod
    def backward(ctx, grad_scores):
        q, d, cu_q, cu_d, argmax = ctx.saved_tensors
        need_dq, need_dd = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if torch.compiler.is_compiling():
            dq, dd = _packed_backward_op(grad_scores, q, d, cu_q, cu_d, argmax, ctx.max_seqlen_q, need_dq, need_dd,
                                         ctx.deterministic)
            dq, dd = (dq if need_dq else None), (dd if need_dd else None)
        else:
            dq, dd = _packed_backward(grad_scores, q, d, cu_q, cu_d, argmax, ctx.max_seqlen_q, need_dq, need_dd,
                                      ctx.deterministic)
        return dq, dd, None, None, None, None, None


# --------------------------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------------------------


def _inference(inputs: PackedInputs) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _packed_forward_op(inputs.q, inputs.d, inputs.cu_q, inputs.cu_d, inputs.q_mask, inputs.max_seqlen_q,
                                  False)[0]
    return packed_forward(inputs, store_argmax=False)[0]


def _needs_grad(inputs: PackedInputs) -> bool:
    # Inference skips the autograd node and the argmax buffer (host time: these calls are launch-bound).
    return torch.is_grad_enabled() and (inputs.q.requires_grad or inputs.d.requires_grad)


def maxsim_varlen(
    q: torch.Tensor,
    d: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_d: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_d: int | None = None,
    *,
    backward: str = "auto",
) -> torch.Tensor:
    """MaxSim of ``N`` packed ``(query i, document i)`` pairs (FlashAttention varlen layout), no padding.

    ``score[i] = sum_{s in query i} max_{t in document i} <q[s], d[t]>``; an empty query or document scores 0.

    Args:
        q: packed query tokens ``[total_q_tokens, dim]``; float16, bfloat16 or float32 (float64 runs the
            reference). Non-contiguous views work.
        d: packed document tokens ``[total_d_tokens, dim]``, same dtype and device.
        cu_seqlens_q, cu_seqlens_d: int32 ``[N + 1]`` offsets (int64 accepted): start at 0, non-decreasing, end
            at the row count (:func:`lik.pack` builds them).
        max_seqlen_q, max_seqlen_d: the longest query / document, as returned by :func:`lik.pack`. With both
            given no host synchronisation happens and the ``cu_seqlens`` values are not checked (bad values give
            wrong scores, never an out-of-bounds access); otherwise they are read once (one sync) and checked.
            A ``max_seqlen_q`` below the truth is still exact, only slower (it sizes the launch grid).
        backward: ``"auto"`` (deterministic when ``torch.are_deterministic_algorithms_enabled()``), ``"fast"``
            (fp32 atomics for the document gradient) or ``"deterministic"`` (bitwise repeatable).

    Returns:
        float32 ``[N]`` (float64 for float64 inputs). Gradients flow to ``q`` and ``d`` in their dtype.

    Masks do not apply: a packed sequence has no padding (``mask_mode`` is moot; every token is real).

    Example:
        >>> q, cu_q, max_q = lik.pack([torch.randn(32, 128), torch.randn(20, 128)])
        >>> d, cu_d, max_d = lik.pack([torch.randn(300, 128), torch.randn(57, 128)])
        >>> lik.maxsim_varlen(q.cuda().half(), d.cuda().half(), cu_q.cuda(), cu_d.cuda(), max_q, max_d).shape
        torch.Size([2])
    """
    deterministic = resolve_backward(backward)
    kernels = isinstance(q, torch.Tensor) and uses_kernels(q)
    inputs = PackedInputs.build_pairs(
        q, d, cu_seqlens_q, cu_seqlens_d, max_seqlen_q, max_seqlen_d, read_values=not kernels, allow_float64=True
    )
    if not kernels:
        return packed_reference(inputs)
    if not _needs_grad(inputs):
        return _inference(inputs)
    return MaxSimPackedFunction.apply(
        inputs.q, inputs.d, inputs.cu_q, inputs.cu_d, None, inputs.max_seqlen_q, deterministic
    )


def maxsim_packed(
    Q: torch.Tensor,
    d: torch.Tensor,
    cu_seqlens_d: torch.Tensor,
    q_mask: torch.Tensor | None = None,
    max_seqlen_d: int | None = None,
    *,
    backward: str = "auto",
) -> torch.Tensor:
    """MaxSim of dense queries against every document of a packed (ragged, unpadded) corpus.

    Args:
        Q: ``[Lq, dim]`` or ``[Nq, Lq, dim]``; float16, bfloat16 or float32 (float64 runs the reference).
        d: packed document tokens ``[total_d_tokens, dim]``, same dtype and device.
        cu_seqlens_d: int32 ``[B + 1]`` offsets (int64 accepted): start at 0, non-decreasing, end at the row count.
        q_mask: optional bool ``[Lq]`` / ``[Nq, Lq]`` (True: real token); a masked query token adds 0
            (``mask_mode="exclude"``; documents need no mask, they have no padding).
        max_seqlen_d: the longest document (from :func:`lik.pack`). Given, no host synchronisation happens and
            the ``cu_seqlens_d`` values are not checked (bad values give wrong scores, never an out-of-bounds
            access); omitted, they are read once and checked.
        backward: ``"auto"``, ``"fast"`` or ``"deterministic"``, as in :func:`lik.maxsim`.

    Returns:
        float32 ``[B]`` for 2-D ``Q``, ``[Nq, B]`` for 3-D (float64 for float64 inputs); an empty document
        scores 0. Gradients flow to ``Q`` and ``d`` in their dtype.

    Example:
        >>> docs = [torch.randn(n, 128) for n in (300, 57, 512)]
        >>> d, cu_d, max_d = lik.pack(docs)
        >>> Q = torch.randn(32, 128)
        >>> lik.maxsim_packed(Q.cuda().half(), d.cuda().half(), cu_d.cuda(), max_seqlen_d=max_d).shape
        torch.Size([3])
    """
    deterministic = resolve_backward(backward)
    kernels = isinstance(Q, torch.Tensor) and uses_kernels(Q)
    inputs = PackedInputs.build_corpus(
        Q, d, cu_seqlens_d, q_mask, max_seqlen_d, read_values=not kernels, allow_float64=True
    )
    if not kernels:
        return inputs.finish(packed_reference(inputs))
    if not _needs_grad(inputs):
        return inputs.finish(_inference(inputs))
    scores = MaxSimPackedFunction.apply(
        inputs.q, inputs.d, None, inputs.cu_d, inputs.q_mask, inputs.max_seqlen_q, deterministic
    )
    return inputs.finish(scores)
