"""``lik.maxsim``: the autograd Function over the fused kernels, and the public entry point.

Under ``torch.compile`` the kernels are reached through custom operators (``lik::maxsim_forward``,
``lik::maxsim_backward_dq``, ``lik::maxsim_backward_dd``) with shape-only fake implementations; eager calls launch
directly. :mod:`lik._dispatch` does that choice and the route of each call (see docs/design.md).
"""

from __future__ import annotations

import torch

from ..._dispatch import kernel_op, resolve_backward, router, uses_kernels
from .backward import maxsim_backward_dd, maxsim_backward_dq
from .forward import maxsim_forward
from .reference import maxsim_reference_canonical
from .replay import REPLAYS, recorder, replay, replay_key
from .validation import MaxSimInputs

__all__ = ["maxsim", "MaxSimFunction", "uses_kernels", "scorer_uses_kernels", "resolve_backward"]


def scorer_uses_kernels(Q, D) -> bool:
    """:func:`uses_kernels` before validation: 8-bit documents decide (a float query is quantized to their
    dtype); otherwise the query does."""
    if isinstance(D, torch.Tensor) and D.dtype in (torch.int8, torch.float8_e4m3fn):
        return uses_kernels(D)
    return isinstance(Q, torch.Tensor) and uses_kernels(Q)


def _forward_fake(q, d, q_mask, d_mask, mask_mode, per_query, store_argmax, q_scale=None, d_scale=None):
    n_q, l_q, _ = q.shape
    n_docs, l_d = d.shape[1], d.shape[2]
    scores = q.new_empty((n_q, n_docs), dtype=torch.float32)
    if not store_argmax:
        return scores, q.new_empty((0,), dtype=torch.int16)
    return scores, q.new_empty((n_q, n_docs, l_q), dtype=torch.int16 if l_d < 2**15 else torch.int32)


@kernel_op("lik::maxsim_forward", fake=_forward_fake)
def _forward(q: torch.Tensor, d: torch.Tensor, q_mask: torch.Tensor | None, d_mask: torch.Tensor | None,
             mask_mode: str, per_query: bool, store_argmax: bool, q_scale: torch.Tensor | None = None,
             d_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = MaxSimInputs(q, d, q_mask, d_mask, mask_mode, False, per_query, q_scale, d_scale)
    scores, argmax = maxsim_forward(inputs, store_argmax)
    # A custom operator returns tensors only: a 0-element placeholder where no argmax was stored.
    return scores, argmax if argmax is not None else q.new_empty((0,), dtype=torch.int16)


def _dq_fake(grad, q, d, argmax):
    return q.new_empty(q.shape)


@kernel_op("lik::maxsim_backward_dq", fake=_dq_fake)
def _dq(grad: torch.Tensor, q: torch.Tensor, d: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    return maxsim_backward_dq(grad, d, argmax, q.shape, q.dtype)


def _dd_fake(grad, q, d, argmax, deterministic, per_query):
    return d.new_empty(d.shape)


@kernel_op("lik::maxsim_backward_dd", fake=_dd_fake)
def _dd(grad: torch.Tensor, q: torch.Tensor, d: torch.Tensor, argmax: torch.Tensor, deterministic: bool,
        per_query: bool) -> torch.Tensor:
    return maxsim_backward_dd(grad, q, argmax, d.shape, d.dtype, deterministic=deterministic, per_query=per_query)


class MaxSimFunction(torch.autograd.Function):
    """Autograd over canonical inputs: ``q [Nq, Lq, d]``, ``d [n_sets, B, Ld, d]`` -> fp32 ``[Nq, B]``."""

    @staticmethod
    def forward(ctx, q, d, q_mask, d_mask, mask_mode, per_query, deterministic):
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        scores, argmax = _forward(q, d, q_mask, d_mask, mask_mode, per_query, needs_grad)
        if needs_grad:
            ctx.save_for_backward(q, d, argmax)
            ctx.per_query = per_query
            ctx.deterministic = deterministic
        return scores

    @staticmethod
    def backward(ctx, grad_scores):
        q, d, argmax = ctx.saved_tensors
        grad_scores = grad_scores.float().contiguous()
        dq = _dq(grad_scores, q, d, argmax) if ctx.needs_input_grad[0] else None
        dd = _dd(grad_scores, q, d, argmax, ctx.deterministic, ctx.per_query) if ctx.needs_input_grad[1] else None
        return dq, dd, None, None, None, None, None


# The four paths of a public call, each taking the validated inputs and the backward choice.
def _reference(inputs: MaxSimInputs, deterministic: bool) -> torch.Tensor:
    return maxsim_reference_canonical(inputs)


def _autograd(inputs: MaxSimInputs, deterministic: bool) -> torch.Tensor:
    return MaxSimFunction.apply(inputs.q, inputs.d, inputs.q_mask, inputs.d_mask, inputs.mask_mode,
                                inputs.per_query_documents, deterministic)


def _compiled_inference(inputs: MaxSimInputs, deterministic: bool) -> torch.Tensor:
    return _forward.op(inputs.q, inputs.d, inputs.q_mask, inputs.d_mask, inputs.mask_mode,
                       inputs.per_query_documents, False, inputs.q_scale, inputs.d_scale)[0]


def _inference(inputs: MaxSimInputs, deterministic: bool) -> torch.Tensor:
    # No autograd node, no argmax buffer.
    return maxsim_forward(inputs, store_argmax=False)[0]


_route = router(reference=_reference, autograd=_autograd, compiled=_compiled_inference, launch=_inference)


def maxsim(
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    mask_mode: str = "exclude",
    backward: str = "auto",
    q_scale: torch.Tensor | None = None,
    d_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Late-interaction (ColBERT / ColPali) scores: ``score[i, j] = sum_s max_t <Q[i, s], D[j, t]>``.

    Args:
        Q: queries, ``[Lq, d]`` or ``[Nq, Lq, d]``; float16, bfloat16 or float32 (float64 runs the reference).
        D: documents, ``[B, Ld, d]`` shared by all queries, or ``[Nq, B, Ld, d]`` (one candidate set per query,
            e.g. hard negatives for distillation). Same dtype and device as ``Q``.
        q_mask: optional bool ``[Lq]`` / ``[Nq, Lq]``, True for real query tokens (integer 0/1 accepted).
        d_mask: optional bool ``[B, Ld]`` / ``[Nq, B, Ld]``, True for real document tokens.
        mask_mode: ``"exclude"`` (default): masked document tokens never take part in the max, masked query
            tokens add 0, a document with no valid token scores 0. ``"zero"``: PyLate's convention, a masked
            position's similarity is 0 and does take part in the max.
        backward: ``"auto"`` (deterministic when ``torch.are_deterministic_algorithms_enabled()``), ``"fast"``
            (fp32 atomics for dD) or ``"deterministic"`` (no atomics; bitwise repeatable).
        q_scale, d_scale: 8-bit inputs (inference only). ``D`` int8 or float8_e4m3fn from :func:`lik.quantize`
            needs its fp32 per-token ``d_scale`` (``D.shape[:-1]``); ``Q`` of the same dtype needs ``q_scale``
            (``Q.shape[:-1]``), a float ``Q`` is quantized per token to ``D``'s dtype first. The scores equal
            MaxSim of the dequantized operands: the 8-bit products are summed exactly in int32 (int8) or in
            fp32 (float8), scaled by ``d_scale[t]``, and each query token's max is multiplied by ``q_scale[s]``,
            in fp32, on every path (CPU int8 scores equal the kernels' bit for bit up to the fp32 order of the
            sum over query tokens). Scales are non-negative, as :func:`lik.quantize` makes them: a negative
            ``q_scale`` gives its query NaN. float8 needs a GPU with FP8 (compute capability >= 8.9; use int8
            elsewhere).

    Returns:
        float32 scores, ``[B]`` for 2-D ``Q`` and ``[Nq, B]`` for 3-D ``Q`` (float64 for float64 inputs).
        Gradients flow to ``Q`` and ``D`` in their dtype; masked positions get exactly 0.

    CUDA tensors run the fused Triton kernels; CPU tensors run :func:`lik.maxsim_reference` (memory-bounded),
    or the real kernels through Triton's interpreter when ``TRITON_INTERPRET=1``. An eager inference call whose
    shapes, strides, dtypes and alignment were launched before replays that launch (:mod:`lik.ops.maxsim.replay`):
    same kernel, same scores, a fraction of the host time.

    Example:
        >>> Q = torch.nn.functional.normalize(torch.randn(32, 128), dim=-1).half().cuda()
        >>> D = torch.nn.functional.normalize(torch.randn(1000, 300, 128), dim=-1).half().cuda()
        >>> lik.maxsim(Q, D).shape          # torch.Size([1000]), float32
        >>> D_q, d_scale = lik.quantize(D, torch.int8)   # 8-bit corpus: half the memory of fp16
        >>> lik.maxsim(Q, D_q, d_scale=d_scale).shape    # Q is quantized per token to int8
    """
    key = replay_key(Q, D, q_mask, d_mask, mask_mode, backward, q_scale, d_scale)
    tensors = (Q, D, q_mask, d_mask, q_scale, d_scale)
    if key is not None:
        scores = replay(key, tensors)
        if scores is not None:  # this key was launched before: its checks passed, its launch is replayed
            return scores
    deterministic = resolve_backward(backward)
    inputs = MaxSimInputs.build(Q, D, q_mask, d_mask, mask_mode, allow_float64=True, q_scale=q_scale, d_scale=d_scale)
    needs_grad = inputs.d_scale is None and torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad)
    if key is not None and key not in REPLAYS and not needs_grad and uses_kernels(inputs.q):
        # a float Q against 8-bit D: build made q and q_scale, quantized to D's dtype
        quantized = (inputs.q, inputs.q_scale) if inputs.q.dtype != Q.dtype else None
        scores, _ = maxsim_forward(inputs, store_argmax=False,
                                   recorder=recorder(key, tensors, inputs.squeeze_query, quantized))
        return inputs.finish(scores)
    return inputs.finish(_route(uses_kernels(inputs.q), needs_grad, inputs, deterministic))
