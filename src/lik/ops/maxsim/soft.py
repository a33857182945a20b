"""Launchers and the autograd Function of the soft reductions (``reduction="smooth"`` / ``"topk"``) for every
layout: padded (:func:`lik.maxsim`), a packed corpus (:func:`lik.maxsim_packed`) and packed pairs
(:func:`lik.maxsim_varlen`). The kernels are :mod:`lik.core.soft`; the PyTorch form is
:func:`~.options.reduce_similarities` inside the references.

One autograd node per call (:class:`SoftMaxSimFunction`): the forward saves ``q``, ``d`` (or, with
``save_d_as=torch.int8``, ``d`` as int8 and its fp32 per-token scales) and the per-row stats; the backward runs
the dQ and dD kernels (deterministic: no atomics; top-k's dD outside ``backward="deterministic"`` is a
sparse fp32-atomic scatter from the dQ launch); length normalisation is a multiply of the scores and of
the incoming gradient inside the node.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ... import _device
from ..._device import cdiv, next_power_of_2
from ..._launch import launch
from ...config.maxsim import maxsim_soft_config
from ...core.forward_launch import dot_precision
from ...core.segments import PACKED as _PACKED_FLAG
from ...core.segments import PADDED as _PADDED_FLAG
from ...core.segments import PAIRS as _PAIRS_FLAG
from ...core.soft import soft_bwd_dd_kernel, soft_bwd_dq_kernel, soft_fwd_kernel
from .options import ScoreOptions, query_token_counts

__all__ = ["SoftLayout", "padded_layout", "packed_layout", "soft_forward", "soft_backward", "SoftMaxSimFunction",
           "StoredDocuments", "inverse_counts", "apply_soft"]

_FLAGS = {"smooth": 1, "topk": 2}
# The layout flags as plain ints (a launch's constants must be, for Triton's cache key and for JSON).
PADDED, PACKED, PAIRS = _PADDED_FLAG.value, _PACKED_FLAG.value, _PAIRS_FLAG.value


class SoftLayout(NamedTuple):
    """Everything but ``q`` and ``d`` the soft kernels read: the layout flag, masks / offsets, the counts, and the
    longest document (the dD grid)."""

    layout: int
    q_mask: torch.Tensor | None
    d_mask: torch.Tensor | None
    cu_q: torch.Tensor | None
    cu_d: torch.Tensor | None
    n_queries: int  # queries (pairs: N)
    n_docs: int  # documents per set (pairs: N)
    n_sets: int
    q_len: int  # padded query length (pairs: the longest query)
    doc_len: int  # padded document length (packed: 0)
    max_doc_len: int
    exclude: bool
    per_query: bool


def padded_layout(inputs) -> SoftLayout:
    """The layout of canonical :class:`~.validation.MaxSimInputs`."""
    q, d = inputs.q, inputs.d
    return SoftLayout(PADDED, inputs.q_mask, inputs.d_mask, None, None, q.shape[0], d.shape[1], d.shape[0],
                      q.shape[1], d.shape[2], d.shape[2], inputs.mask_mode == "exclude", inputs.per_query_documents)


def packed_layout(inputs, max_doc_len: int | None) -> SoftLayout:
    """The layout of :class:`~.packing.PackedInputs` (pairs or corpus); ``max_doc_len`` None reads it (one sync)."""
    if max_doc_len is None:
        cu = inputs.cu_d.to(torch.int64)
        max_doc_len = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    n_docs = inputs.cu_d.shape[0] - 1
    if inputs.pairs:
        return SoftLayout(PAIRS, None, None, inputs.cu_q, inputs.cu_d, n_docs, n_docs, 1, inputs.max_seqlen_q, 0,
                          max_doc_len, True, False)
    return SoftLayout(PACKED, inputs.q_mask, None, None, inputs.cu_d, inputs.q.shape[0], n_docs, 1,
                      inputs.q.shape[1], 0, max_doc_len, True, False)


def _query_strides(q: torch.Tensor, lay: SoftLayout) -> tuple[int, int, int]:
    return (0, *q.stride()) if lay.layout == PAIRS else tuple(q.stride())


def _doc_strides(d: torch.Tensor, lay: SoftLayout) -> tuple[int, int, int, int]:
    return tuple(d.stride()) if lay.layout == PADDED else (0, 0, *d.stride())


def _mask_strides(lay: SoftLayout) -> tuple[int, ...]:
    qm = lay.q_mask.stride() if lay.q_mask is not None else (0, 0)
    dm = lay.d_mask.stride() if lay.d_mask is not None else (0, 0, 0)
    return (*qm, *dm)


def _score_shape(lay: SoftLayout) -> tuple[tuple[int, ...], tuple[int, int], tuple[int, int]]:
    """Scores' shape, their strides (n, b) and the stats' strides (n, b) (a row is then ``+ first row + s``)."""
    if lay.layout == PAIRS:
        return (lay.n_queries,), (1, 0), (0, 0)
    return (lay.n_queries, lay.n_docs), (lay.n_docs, 1), (lay.n_docs * lay.q_len, lay.q_len)


def _common(q, d, lay: SoftLayout, options: ScoreOptions):
    cfg = maxsim_soft_config(dim=q.shape[-1], dtype=q.dtype, device=q.device, q_len=lay.q_len)
    dim = q.shape[-1]
    num_k = cdiv(dim, cfg.block_k)
    dummy = q  # never read: the flags say which pointers are real
    ptrs = (lay.q_mask if lay.q_mask is not None else dummy, lay.d_mask if lay.d_mask is not None else dummy,
            lay.cu_q if lay.cu_q is not None else dummy, lay.cu_d if lay.cu_d is not None else dummy)
    scale2 = math.log2(math.e) / options.tau
    keywords = dict(DIM=dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_K=num_k,
                    REDUCTION=_FLAGS[options.reduction], TOP_K=options.top_k,
                    SLOTS=max(2, next_power_of_2(options.top_k)), HAS_D_MASK=lay.d_mask is not None,
                    EXCLUDE=lay.exclude, PER_QUERY=lay.per_query, LAYOUT=lay.layout,
                    # (fp32 top-k: IEEE products, so TF32 rounding does not choose the tokens)
                    DOT_PRECISION="ieee" if options.reduction == "topk" else dot_precision(q.dtype),
                    num_warps=cfg.num_warps)
    return cfg, num_k, ptrs, scale2, keywords


def _dq_splits(cfg, programs: int, lay: SoftLayout, device) -> int:
    """Document ranges per dQ row block: enough programs for about four per SM (one per (query, row block) leaves
    most SMs idle at in-batch training shapes: ColBERT B 128 is 128 programs), at most one per document."""
    if lay.layout == PAIRS or programs == 0:
        return 1
    if cfg.dq_splits:
        return max(1, min(cfg.dq_splits, lay.n_docs))
    if _device.interpreting():
        return 1
    return max(1, min(lay.n_docs, cdiv(4 * _device.sm_count(device), programs)))


def soft_forward(q: torch.Tensor, d: torch.Tensor, lay: SoftLayout, options: ScoreOptions, store_stats: bool):
    """fp32 scores (``[Nq, B]``, pairs ``[N]``) and, with ``store_stats``, the stats the backward needs (fp32
    lse2 per query row and document, or int32 ``[.., top_k]`` chosen tokens)."""
    shape, (s_n, s_b), (t_n, t_b) = _score_shape(lay)
    scores = torch.empty(shape, dtype=torch.float32, device=q.device)
    n_rows = q.shape[0] if lay.layout == PAIRS else lay.n_queries * lay.n_docs * lay.q_len
    if lay.layout == PAIRS:  # a row's stats are at its packed query row (there is one document per query)
        n_rows = q.shape[0]
    stats_shape = (n_rows, options.top_k) if options.reduction == "topk" else (n_rows,)
    stats_dtype = torch.int32 if options.reduction == "topk" else torch.float32
    stats = torch.empty(stats_shape if store_stats else (1,), dtype=stats_dtype, device=q.device)
    programs = lay.n_queries if lay.layout == PAIRS else lay.n_queries * lay.n_docs
    if programs == 0:
        return scores, stats
    cfg, _, ptrs, scale2, kw = _common(q, d, lay, options)
    q_blocks = max(1, cdiv(lay.q_len, cfg.block_m))  # (an empty query: one block that writes 0)
    out, s_q = scores, 0
    if q_blocks > 1:  # one partial per row block, added here in a fixed order
        out = torch.empty((*shape, q_blocks), dtype=torch.float32, device=q.device)
        s_n, s_b, s_q = s_n * q_blocks, s_b * q_blocks, 1
    launch(soft_fwd_kernel, (programs * q_blocks,), q, d, *ptrs, out, stats,
           lay.n_queries, lay.n_docs, lay.q_len, lay.doc_len, q.shape[0], d.shape[0], q_blocks, scale2,
           options.tau * math.log(2.0), *_query_strides(q, lay), *_doc_strides(d, lay), *_mask_strides(lay),
           s_n, s_b, s_q, t_n, t_b, HAS_Q_MASK=lay.q_mask is not None, STORE_STATS=store_stats,
           num_stages=cfg.num_stages, **kw)
    return (out.sum(dim=-1) if q_blocks > 1 else scores), stats


def soft_backward(grad: torch.Tensor, q: torch.Tensor, d: torch.Tensor, lay: SoftLayout, options: ScoreOptions,
                  stats: torch.Tensor, need_dq: bool, need_dd: bool, deterministic: bool = True):
    """``(dq, dd)`` in ``q`` / ``d``'s shapes and dtypes (None where not needed) of ``sum(grad * scores)``.
    Top-k's ``dd`` without ``deterministic``: fp32 atomics from the dQ launch (no dD launch; the sum's order
    varies), else the dD kernel's products (bitwise repeatable)."""
    grad = grad.float().contiguous()
    _, (s_n, s_b), (t_n, t_b) = _score_shape(lay)
    dq = dd = None
    cfg, num_k, ptrs, scale2, kw = _common(q, d, lay, options)
    counts = (lay.n_queries, lay.n_docs, lay.q_len, lay.doc_len, q.shape[0], d.shape[0])
    strides = (*_query_strides(q, lay), *_doc_strides(d, lay), *_mask_strides(lay), s_n, s_b, t_n, t_b)
    scatter = need_dd and options.reduction == "topk" and not deterministic
    if scatter:
        dd32 = torch.zeros(d.shape, dtype=torch.float32, device=d.device)
    if need_dq or scatter:
        q_blocks = cdiv(lay.q_len, cfg.block_m)
        programs = lay.n_queries * q_blocks * num_k
        splits = _dq_splits(cfg, programs, lay, q.device)
        split_docs = cdiv(lay.n_docs, splits)
        # Several document ranges per row block: fp32 partials, added in order afterwards (deterministic). fp32 for
        # one range too: the output's type is part of the kernel's signature, and the batch must not choose it.
        # (the kernel writes every row of every query; packed pairs' rows outside all pairs, if any, are not)
        alloc = torch.zeros if lay.layout == PAIRS else torch.empty
        out = alloc((splits, *q.shape) if need_dq else (1,), dtype=torch.float32, device=q.device)
        if programs:
            dq_kw = kw
            if scatter and cfg.block_m >= 64:  # (the gather's tiles, out and Q's rows for the scatter: 4 warps spill)
                dq_kw = dict(kw, num_warps=max(8, kw["num_warps"]))
            launch(soft_bwd_dq_kernel, (programs * splits,), grad, q, d, *ptrs, stats, out,
                   dd32 if scatter else out, *counts, q_blocks, num_k, scale2, splits, split_docs, q.numel(),
                   *strides, HAS_Q_MASK=lay.q_mask is not None, STORE_DQ=need_dq, DD_ATOMIC=scatter, **dq_kw)
        if need_dq:
            dq = (out.sum(dim=0) if splits > 1 else out[0]).to(q.dtype)
    if scatter:
        dd = dd32 if d.dtype == torch.float32 else dd32.to(d.dtype)
    elif need_dd:  # (padded: the kernel writes every token, 0 where masked; packed rows outside all documents: 0)
        dd = (torch.empty if lay.layout == PADDED else torch.zeros)(d.shape, dtype=d.dtype, device=d.device)
        d_blocks = cdiv(lay.max_doc_len, cfg.block_n)
        programs = lay.n_sets * lay.n_docs * d_blocks * num_k
        if programs:
            launch(soft_bwd_dd_kernel, (programs,), grad, q, d, *ptrs, stats, dd, *counts, d_blocks, num_k, scale2,
                   *strides, HAS_Q_MASK=lay.q_mask is not None, **kw)
    return dq, dd


class StoredDocuments:
    """``save_d_as=torch.int8``: ``D`` between forward and backward as int8 rows and fp32 per-token scales
    (:func:`lik.quantize`), dequantized to ``D``'s dtype when the backward needs it."""

    @staticmethod
    def store(D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from ..quantization.function import quantize

        return quantize(D.detach(), torch.int8)

    @staticmethod
    def load(d_q: torch.Tensor, d_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (d_q.to(torch.float32) * d_scale[..., None]).to(dtype)


def inverse_counts(q_mask: torch.Tensor | None, n_queries: int, q_len: int, device) -> torch.Tensor:
    """fp32 ``[Nq, 1]``: one over each query's valid token count (:func:`~.options.query_token_counts`)."""
    mask = None if q_mask is None else q_mask != 0
    return (1.0 / query_token_counts(mask, n_queries, q_len, device))[:, None]


@torch.compiler.disable
def apply_soft(q, d, lay: SoftLayout, options: ScoreOptions, scale, deterministic: bool | None = None):
    """:class:`SoftMaxSimFunction` over ``q`` and ``d``; under ``torch.compile`` a graph break (the soft kernels
    have no custom operators yet), run eagerly with its autograd node. Half inputs stay half (tensor-core
    products): top-k then chooses, among tokens within fp32 summation error of each other, as its own sums say.
    ``deterministic`` (top-k's dD without atomics): None follows ``torch.are_deterministic_algorithms_enabled()``."""
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    return SoftMaxSimFunction.apply(q, d, lay, options, scale, deterministic)


class SoftMaxSimFunction(torch.autograd.Function):
    """``q``, ``d`` as the layout reads them -> fp32 scores of the soft reduction, times ``scale`` (one over each
    query's token count, or None), in one autograd node."""

    @staticmethod
    def forward(ctx, q, d, lay, options, scale, deterministic=True):
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        scores, stats = soft_forward(q, d, lay, options, needs_grad)
        if scale is not None:
            scores = scores * (scale if lay.layout != PAIRS else scale[:, 0])
        if needs_grad:
            if options.save_d_as is not None:
                d_q, d_scale = StoredDocuments.store(d)
                ctx.save_for_backward(q, d_q, d_scale, stats, scale)
            else:
                ctx.save_for_backward(q, d, stats, scale)
            ctx.lay, ctx.options, ctx.d_dtype, ctx.deterministic = lay, options, d.dtype, deterministic
        return scores

    @staticmethod
    def backward(ctx, grad):
        if ctx.options.save_d_as is not None:
            q, d_q, d_scale, stats, scale = ctx.saved_tensors
            d = StoredDocuments.load(d_q, d_scale, ctx.d_dtype)
        else:
            q, d, stats, scale = ctx.saved_tensors
        if scale is not None:
            grad = grad * (scale if ctx.lay.layout != PAIRS else scale[:, 0])
        dq, dd = soft_backward(grad, q, d, ctx.lay, ctx.options, stats, ctx.needs_input_grad[0],
                               ctx.needs_input_grad[1], ctx.deterministic)
        return dq, dd, None, None, None, None
