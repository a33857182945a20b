"""Autograd and ``torch.compile`` plumbing of packed MaxSim, through :mod:`lik._dispatch`, and the internal scoring
entry of callers that checked a query once for many packed chunks (:func:`packed_query`, :func:`score_packed`:
``lik.Index.search``).

Under ``torch.compile`` (with the ``max_seqlen`` hints) the kernels are the custom operators
``lik::maxsim_packed_forward`` / ``lik::maxsim_packed_backward`` (shape-only fake implementations), as for
:func:`lik.maxsim`; eager calls launch directly. :data:`packed_route` picks the path of one public call.
"""

from __future__ import annotations

import torch

from typing import NamedTuple

from ..._device import current_device
from ..._dispatch import kernel_op, router, uses_kernels
from ..._replay import NEVER, allowed, file, plan_of, recording, tensor_key
from ...core.forward_launch import chunk_sums
from .packed_backward import packed_backward
from .packed_forward import packed_forward, packed_forward_problem, packed_launch
from .packing import PackedInputs
from .reference_varlen import packed_reference
from .validation import QUANTIZED_DTYPES, quantize_query

__all__ = ["MaxSimPackedFunction", "packed_route", "PackedQuery", "packed_query", "score_packed", "PACKED_CALLS"]


def _packed_forward_fake(q, d, cu_q, cu_d, q_mask, max_seqlen_q, store_argmax, q_scale=None, d_scale=None):
    n_docs = cu_d.shape[0] - 1
    if cu_q is not None:
        scores, argmax_shape = q.new_empty((n_docs,), dtype=torch.float32), (q.shape[0],)
    else:
        scores, argmax_shape = q.new_empty((q.shape[0], n_docs), dtype=torch.float32), (q.shape[0], n_docs, q.shape[1])
    return scores, q.new_empty(argmax_shape if store_argmax else (0,), dtype=torch.int32)


@kernel_op("lik::maxsim_packed_forward", fake=_packed_forward_fake)
def _packed_forward(q: torch.Tensor, d: torch.Tensor, cu_q: torch.Tensor | None, cu_d: torch.Tensor,
                    q_mask: torch.Tensor | None, max_seqlen_q: int, store_argmax: bool,
                    q_scale: torch.Tensor | None = None, d_scale: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = PackedInputs(q, d, cu_q, cu_d, q_mask, max_seqlen_q, False, True, q_scale, d_scale)
    scores, argmax = packed_forward(inputs, store_argmax)
    return scores, argmax if argmax is not None else q.new_empty((0,), dtype=torch.int32)


def _packed_backward_fake(grad_scores, q, d, cu_q, cu_d, argmax, max_seqlen_q, need_dq, need_dd, deterministic):
    return q.new_empty(q.shape if need_dq else (0,)), d.new_empty(d.shape if need_dd else (0,))


@kernel_op("lik::maxsim_packed_backward", fake=_packed_backward_fake)
def _packed_backward(grad_scores: torch.Tensor, q: torch.Tensor, d: torch.Tensor, cu_q: torch.Tensor | None,
                     cu_d: torch.Tensor, argmax: torch.Tensor, max_seqlen_q: int, need_dq: bool, need_dd: bool,
                     deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    dq, dd = packed_backward(grad_scores, q, d, cu_q, cu_d, argmax, max_seqlen_q, need_dq, need_dd, deterministic)
    # A gradient that is not needed comes back as a 0-element placeholder (custom operators return tensors).
    return (dq if dq is not None else q.new_empty((0,)), dd if dd is not None else d.new_empty((0,)))


class MaxSimPackedFunction(torch.autograd.Function):
    """Autograd over validated packed inputs (see :class:`~lik.ops.maxsim.packing.PackedInputs`): pairs ``[N]``
    or corpus ``[Nq, B]`` fp32 scores; gradients to ``q`` and ``d`` in their dtype."""

    @staticmethod
    def forward(ctx, q, d, cu_q, cu_d, q_mask, max_seqlen_q, deterministic, scale=None):
        # scale: length normalisation (one over each query's token count, shaped like the scores' rows), applied
        # to the scores and to the incoming gradient inside this node.
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        scores, argmax = _packed_forward(q, d, cu_q, cu_d, q_mask, max_seqlen_q, needs_grad)
        if scale is not None:
            scores = scores * scale
        if needs_grad:
            ctx.save_for_backward(q, d, cu_q, cu_d, argmax, scale)
            ctx.max_seqlen_q = max_seqlen_q
            ctx.deterministic = deterministic
        return scores

    @staticmethod
    def backward(ctx, grad_scores):
        q, d, cu_q, cu_d, argmax, scale = ctx.saved_tensors
        if scale is not None:
            grad_scores = grad_scores * scale
        need_dq, need_dd = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dq, dd = _packed_backward(grad_scores, q, d, cu_q, cu_d, argmax, ctx.max_seqlen_q, need_dq, need_dd,
                                  ctx.deterministic)
        # Eager calls return None for a gradient not needed, the custom operator a 0-element placeholder.
        return (dq if need_dq else None), (dd if need_dd else None), None, None, None, None, None, None


def _launch(inputs: PackedInputs, deterministic: bool) -> torch.Tensor:
    # Eager inference: no autograd node, no argmax buffer (these calls are launch-bound: host time counts).
    return packed_forward(inputs, store_argmax=False)[0]


def _compiled(inputs: PackedInputs, deterministic: bool) -> torch.Tensor:
    return _packed_forward.op(inputs.q, inputs.d, inputs.cu_q, inputs.cu_d, inputs.q_mask, inputs.max_seqlen_q,
                              False, inputs.q_scale, inputs.d_scale)[0]


def _autograd(inputs: PackedInputs, deterministic: bool) -> torch.Tensor:
    return MaxSimPackedFunction.apply(inputs.q, inputs.d, inputs.cu_q, inputs.cu_d, inputs.q_mask,
                                      inputs.max_seqlen_q, deterministic)


# route(kernels, needs_grad, inputs, deterministic): the reference, autograd, compiled or eager path.
packed_route = router(
    reference=lambda inputs, deterministic: packed_reference(inputs),
    autograd=_autograd, compiled=_compiled, launch=_launch,
)


class PackedQuery(NamedTuple):
    """A checked query for every chunk of a packed corpus: ``q [Nq, Lq, d]``, bool ``q_mask [Nq, Lq]`` or None,
    and, against an 8-bit corpus, ``q`` quantized per token with its fp32 ``q_scale [Nq, Lq]``."""

    q: torch.Tensor
    q_mask: torch.Tensor | None
    q_scale: torch.Tensor | None


def packed_query(Q: torch.Tensor, q_mask: torch.Tensor | None, d_dtype: torch.dtype) -> PackedQuery:
    """``Q [Nq, Lq, d]`` (float, in the corpus's dtype for a float corpus) and ``q_mask``, checked by the caller, made
    ready for :func:`score_packed`: quantized once to the dtype of an 8-bit corpus (as :func:`lik.maxsim_packed`
    quantizes it per call)."""
    if d_dtype in QUANTIZED_DTYPES:
        q, q_scale = quantize_query(Q, d_dtype)
        return PackedQuery(q, q_mask, q_scale)
    return PackedQuery(Q, q_mask, None)


def score_packed(query: PackedQuery, d: torch.Tensor, cu_d: torch.Tensor, d_scale: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """Scores ``[Nq, B]`` of ``query`` against a packed corpus whose arguments are known good (``d [Td, d]`` of the
    query's width, contiguous int32 ``cu_d [B + 1]`` from 0 on the same device, ``d_scale [Td]`` for 8-bit rows): a
    stored index's chunk. No check is repeated and nothing is read back from the device; inference only."""
    inputs = PackedInputs(query.q, d, None, cu_d, query.q_mask, query.q.shape[1], False, True, query.q_scale, d_scale)
    if not _replayable(d):
        kernels = uses_kernels(d) if d_scale is not None else uses_kernels(query.q)
        return packed_route(kernels, False, inputs, False)
    # A search repeats its chunks' shapes: the launch of a chunk seen before is replayed (lik._replay).
    sources = (query.q, query.q_mask, query.q_scale, d, cu_d, d_scale)
    key = (current_device(), *(None if t is None else tensor_key(t) for t in sources))
    plan = PACKED_CALLS.get(key)
    if plan is not None and plan is not NEVER:
        buffers = plan.allocate()
        plan(sources, buffers)
        return buffers[-1] if plan.notes["one chunk"] else chunk_sums(buffers[-1])
    if plan is NEVER or not uses_kernels(inputs.q):
        return packed_route(uses_kernels(inputs.q), False, inputs, False)
    with recording() as recorded:
        partial, _ = packed_launch(packed_forward_problem(inputs), False)  # the token stream where it fits
    scores = chunk_sums(partial)
    plan = plan_of(recorded, sources)
    if plan is not None and plan is not NEVER:
        plan.notes["one chunk"] = partial.shape[0] == 1
        if partial.shape[0] == 1:
            plan.reshape(-1, tuple(scores.shape))
    if plan is not None:
        file(PACKED_CALLS, key, plan)
    return scores


def _replayable(d: torch.Tensor) -> bool:
    return d.is_cuda and allowed()


# score_packed's replays: key -> lik._replay.Plan (its last buffer: the sums) or NEVER
PACKED_CALLS: dict[tuple, object] = {}
