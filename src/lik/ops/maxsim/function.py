"""``lik.maxsim``: the public entry point, its autograd Functions and :func:`score_canonical`, the internal scoring
entry that every caller holding validated inputs uses (``lik.search``, the integrations).

The call path (docs/design.md, "The host path"): a call whose replay key was recorded replays its launches
(:mod:`.replay`); otherwise its inputs are validated once into :class:`~.validation.MaxSimInputs` and routed
(:mod:`lik._dispatch`): the reference, eager inference (the launch itself), eager training
(:class:`EagerMaxSimFunction`, over the caller's tensors, replaying its launches from the second call), or, under
``torch.compile``, the custom operators ``lik::maxsim_forward`` / ``lik::maxsim_backward_dq`` /
``lik::maxsim_backward_dd`` (shape-only fake implementations) inside :class:`MaxSimFunction`.
"""

from __future__ import annotations

import torch

from ..._dispatch import kernel_op, resolve_backward, router, uses_kernels
from ...core.forward_launch import chunk_sums, launch_forward
from ..._replay import NEVER, file, plan_of, recording
from .backward import maxsim_backward_dd, maxsim_backward_dq
from .forward import forward_problem, maxsim_forward
from .options import ScoreOptions, check_options
from .reference import maxsim_reference_canonical
from .replay import CALLS, Training, call_key, record_inference
from .soft import apply_soft, StoredDocuments, inverse_counts, padded_layout
from .validation import QUANTIZED_DTYPES, MaxSimInputs

__all__ = [
    "maxsim", "score_canonical", "MaxSimFunction", "EagerMaxSimFunction", "uses_kernels", "scorer_uses_kernels",
    "resolve_backward",
]


def scorer_uses_kernels(Q, D) -> bool:
    """:func:`uses_kernels` before validation: 8-bit documents decide (a float query is quantized to their
    dtype); otherwise the query does."""
    if isinstance(D, torch.Tensor) and D.dtype in QUANTIZED_DTYPES:
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
    # The operator's arguments are the canonical bundle's fields (a custom operator takes tensors and scalars).
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
    """Autograd over canonical inputs: ``q [Nq, Lq, d]``, ``d [n_sets, B, Ld, d]`` -> fp32 ``[Nq, B]``, through the
    custom operators (what ``torch.compile`` traces)."""

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


class EagerMaxSimFunction(torch.autograd.Function):
    """Eager training over the caller's ``Q`` and ``D`` as passed (gradients come back in their shapes, with no
    autograd node for the canonical views): ``run`` is the call's :class:`~.replay.Training` (a recorded call:
    its launches are replayed) or a :class:`_FullTraining` (the full path, recorded when the call has a key).
    ``scale`` (length normalisation: one over each query's token count, shaped like the scores' rows) multiplies
    the scores and the incoming gradient; ``save_d_as=torch.int8`` keeps ``D`` as int8 rows and fp32 scales until
    the backward, whose ``dQ`` gathers the dequantized rows (``dD`` needs only ``Q`` and the winners)."""

    @staticmethod
    def forward(ctx, Q, D, q_mask, d_mask, run, scale=None, save_d_as=None):
        scores, argmax = run.forward(Q, D, q_mask, d_mask)
        if scale is not None:
            scores = scores * scale
        if save_d_as is not None:
            d_q, d_scale = StoredDocuments.store(D)
            ctx.save_for_backward(Q, d_q, d_scale, argmax, scale)
            # Only the backward's choices: the full run's validated inputs are views of D and would keep it alive.
            ctx.d_meta, ctx.training = (D.shape, D.dtype), run.training
        else:
            ctx.save_for_backward(Q, D, argmax, scale)
            ctx.run = run
        ctx.stored = save_d_as is not None
        return scores

    @staticmethod
    def backward(ctx, grad_scores):
        if ctx.stored:
            Q, d_q, d_scale, argmax, scale = ctx.saved_tensors
        else:
            Q, D, argmax, scale = ctx.saved_tensors
        if scale is not None:
            grad_scores = grad_scores * scale
        need_dq, need_dd = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.stored:
            dq, dd = _stored_gradients(grad_scores, Q, d_q, d_scale, ctx.d_meta, argmax, ctx.training, need_dq,
                                       need_dd)
        else:
            dq, dd = ctx.run.gradients(grad_scores, Q, D, argmax, need_dq, need_dd)
        return dq, dd, None, None, None, None, None


def _stored_gradients(grad, Q, d_q, d_scale, d_meta, argmax, training: Training, need_dq: bool, need_dd: bool):
    """The backward of a call with ``save_d_as=torch.int8`` (never replayed): dQ gathers the winning int8 rows and
    dequantizes them on chip (no dequantized copy of ``D``); dD needs only ``Q`` and the winners."""
    shape, dtype = d_meta
    q = Q.unsqueeze(0) if training.squeeze else Q
    d = d_q if training.per_query else d_q.unsqueeze(0)
    scales = d_scale if training.per_query else d_scale.unsqueeze(0)
    grad2d = grad.float().contiguous().view(q.shape[0], d.shape[1])
    dq = dd = None
    if need_dq:
        dq = maxsim_backward_dq(grad2d, d, argmax, q.shape, Q.dtype, d_scale=scales.contiguous()).view(Q.shape)
    if need_dd:
        d_shape = (d.shape[0], *shape[-3:])
        dd = maxsim_backward_dd(grad2d, q, argmax, d_shape, dtype, deterministic=training.deterministic,
                                per_query=training.per_query).view(shape)
    return dq, dd


class _FullTraining:
    """The full path of one eager training call: the argmax forward on validated inputs (recorded under ``key``
    into a :class:`~.replay.Training`, whose backward then records itself), and the full backward."""

    __slots__ = ("inputs", "deterministic", "key", "training")

    def __init__(self, inputs: MaxSimInputs, deterministic: bool, key):
        self.inputs, self.deterministic, self.key = inputs, deterministic, key
        self.training = Training(None, False, inputs.squeeze_query, inputs.per_query_documents, deterministic)

    def forward(self, Q, D, q_mask, d_mask):
        inputs = self.inputs
        if self.key is None:
            partial, argmax = launch_forward(forward_problem(inputs), True)
            return inputs.finish(chunk_sums(partial)), argmax
        with recording() as recorded:
            partial, argmax = launch_forward(forward_problem(inputs), True)
        scores = inputs.finish(chunk_sums(partial))
        plan = plan_of(recorded, (Q, D, q_mask, d_mask))
        if plan is NEVER:
            file(CALLS, self.key, NEVER)
        elif plan is not None:
            self.training.chunked = partial.shape[0] > 1
            if not self.training.chunked:
                plan.reshape(-1, tuple(scores.shape))
            self.training.forward_plan = plan
            file(CALLS, self.key, self.training)
        return scores, argmax

    def gradients(self, grad, Q, D, argmax, need_dq, need_dd):
        if self.training.forward_plan is not None:  # filed: the backward records itself there
            return self.training.gradients(grad, Q, D, argmax, need_dq, need_dd)
        from .replay import backward_plans

        dq, dd, _ = backward_plans(grad.float().contiguous(), Q, D, argmax, need_dq, need_dd, self.training,
                                   record=False)
        return dq, dd


# The four paths of a validated call, each taking the canonical inputs and the backward choice.
def _reference(inputs: MaxSimInputs, deterministic: bool) -> torch.Tensor:
    return maxsim_reference_canonical(inputs)


def _autograd(inputs: MaxSimInputs, deterministic: bool) -> torch.Tensor:
    return MaxSimFunction.apply(inputs.q, inputs.d, inputs.q_mask, inputs.d_mask, inputs.mask_mode,
                                inputs.per_query_documents, deterministic)


def _compiled_inference(inputs: MaxSimInputs, deterministic: bool) -> torch.Tensor:
    return _forward.op(inputs.q, inputs.d, inputs.q_mask, inputs.d_mask, inputs.mask_mode,
                       inputs.per_query_documents, False, inputs.q_scale, inputs.d_scale)[0]


def _inference(inputs: MaxSimInputs, deterministic: bool) -> torch.Tensor:
    # No autograd node, no argmax buffer; the same launch_forward as the recorded path, so one door counts both.
    return chunk_sums(launch_forward(forward_problem(inputs), False)[0])


_route = router(reference=_reference, autograd=_autograd, compiled=_compiled_inference, launch=_inference)


def score_canonical(inputs: MaxSimInputs, *, needs_grad: bool = False, deterministic: bool = False) -> torch.Tensor:
    """Scores ``[Nq, B]`` of inputs already validated into the canonical bundle (``MaxSimInputs.build``, or views of
    a bundle's tensors: a chunk of its documents): the internal entry of callers that validated once (``lik.search``
    per chunk, the integrations), with no check repeated. ``needs_grad``: the autograd path (the caller tests
    ``torch.is_grad_enabled()`` and its tensors); ``deterministic``: the backward it takes."""
    return _route(uses_kernels(inputs.q), needs_grad, inputs, deterministic)


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
    reduction: str = "max",
    tau: float | None = None,
    top_k: int | None = None,
    normalize_by: str = "none",
    save_d_as: torch.dtype | None = None,
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
        reduction: how a query token's similarities with a document's tokens are reduced: ``"max"`` (MaxSim),
            ``"smooth"`` (``tau * logsumexp(s / tau)``, ``tau`` > 0 required) or ``"topk"`` (the mean of the
            ``top_k`` largest, ``top_k`` in 1..16 required; ties: the lower token first; with fewer tokens in the
            reduction than ``top_k``, the mean of those there are). Masks and ``mask_mode`` apply as for the max;
            float inputs only. Forward and backward are fused (no ``[.., Lq, Ld]`` tensor); the backward is
            deterministic.
        normalize_by: ``"none"`` or ``"query_tokens"``: each score divided by its query's valid token count
            (``q_mask``'s True tokens, else ``Lq``; a query with none scores 0), in the same autograd node.
        save_d_as: None, or ``torch.int8`` (training): ``D`` is kept between forward and backward as int8 rows
            and fp32 per-token scales (:func:`lik.quantize`: about half of fp16's bytes). The scores are exact
            (computed from ``D`` as passed); ``dQ`` uses the dequantized copy (a relative error per gradient
            row of at most about ``0.5 / 127`` of each winning document row's largest entry) and ``dD`` is exact
            (it needs only ``Q``). CPU tensors run the reference, which ignores it.

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
        >>> lik.maxsim(Q, D, reduction="smooth", tau=0.05, normalize_by="query_tokens").shape
    """
    if reduction != "max" or normalize_by != "none" or save_d_as is not None:
        return _with_options(Q, D, q_mask, d_mask, mask_mode, backward, q_scale, d_scale,
                             check_options(reduction, tau, top_k, normalize_by, save_d_as))
    if tau is not None or top_k is not None:
        check_options(reduction, tau, top_k, normalize_by, save_d_as)  # (names the misplaced argument)
    key = call_key(Q, D, q_mask, d_mask, mask_mode, backward, q_scale, d_scale)
    if key is not None:
        recorded = CALLS.get(key)
        if recorded is not None and recorded is not NEVER:  # its checks passed for this key: replay its launches
            if type(recorded) is Training:
                return EagerMaxSimFunction.apply(Q, D, q_mask, d_mask, recorded)
            return recorded(Q, D, q_mask, d_mask, q_scale, d_scale)
        if recorded is None and not key[3]:  # inference, not yet recorded: the full path, recorded
            return record_inference(key, (Q, D, q_mask, d_mask, q_scale, d_scale), lambda: _validated_inference(
                Q, D, q_mask, d_mask, mask_mode, backward, q_scale, d_scale))
        if recorded is NEVER:
            key = None
    deterministic = resolve_backward(backward)
    inputs = MaxSimInputs.build(Q, D, q_mask, d_mask, mask_mode, allow_float64=True, q_scale=q_scale, d_scale=d_scale)
    needs_grad = inputs.d_scale is None and torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad)
    kernels = uses_kernels(inputs.q)
    if needs_grad and kernels and not torch.compiler.is_compiling():
        # (the caller's masks: a replay reads the caller's tensors, and a mask the checks copied is no view of them)
        return EagerMaxSimFunction.apply(Q, D, q_mask, d_mask, _FullTraining(inputs, deterministic, key))
    return inputs.finish(_route(kernels, needs_grad, inputs, deterministic))


def _validated_inference(Q, D, q_mask, d_mask, mask_mode, backward, q_scale, d_scale):
    """The full path of an eager inference call on CUDA: validation (with, for a float query against an 8-bit
    corpus, the query's quantization), then the launch; returns ``(inputs, partial sums)``."""
    resolve_backward(backward)
    inputs = MaxSimInputs.build(Q, D, q_mask, d_mask, mask_mode, allow_float64=True, q_scale=q_scale, d_scale=d_scale)
    if not uses_kernels(inputs.q):  # float64 on a GPU: the reference, nothing to record
        return inputs, maxsim_reference_canonical(inputs)[None]
    return inputs, launch_forward(forward_problem(inputs), False)[0]


def _with_options(Q, D, q_mask, d_mask, mask_mode, backward, q_scale, d_scale, options: ScoreOptions):
    """:func:`maxsim` with a soft reduction, length normalisation or an 8-bit stored ``D``: validated on every
    call (no replay, except the plain max's own launches under normalisation)."""
    deterministic = resolve_backward(backward)
    inputs = MaxSimInputs.build(Q, D, q_mask, d_mask, mask_mode, allow_float64=True, q_scale=q_scale, d_scale=d_scale)
    if inputs.d_scale is not None and (options.reduction != "max" or options.save_d_as is not None):
        raise ValueError(
            f"D is {D.dtype}: reduction={options.reduction!r} and save_d_as take float D only"
            if options.reduction != "max" else f"save_d_as is for a float D in training, got D {D.dtype}"
        )
    needs_grad = inputs.d_scale is None and torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad)
    kernels = uses_kernels(inputs.q)
    if not kernels:
        return inputs.finish(maxsim_reference_canonical(inputs, options=options))
    n_q, l_q = inputs.q.shape[0], inputs.q.shape[1]
    scale = inverse_counts(inputs.q_mask, n_q, l_q, inputs.q.device) if options.normalized else None
    if options.reduction != "max":
        return inputs.finish(apply_soft(inputs.q, inputs.d, padded_layout(inputs), options, scale, deterministic))
    caller_scale = None if scale is None else (scale[0] if inputs.squeeze_query else scale)
    if needs_grad and not torch.compiler.is_compiling():
        key = None
        if options.save_d_as is None:
            key = call_key(Q, D, q_mask, d_mask, inputs.mask_mode, backward, q_scale, d_scale)
            recorded = None if key is None else CALLS.get(key)
            if type(recorded) is Training:
                return EagerMaxSimFunction.apply(Q, D, q_mask, d_mask, recorded, caller_scale)
            if recorded is NEVER:
                key = None
        run = _FullTraining(inputs, deterministic, key)
        return EagerMaxSimFunction.apply(Q, D, q_mask, d_mask, run, caller_scale, options.save_d_as)
    scores = _route(kernels, needs_grad, inputs, deterministic)
    return inputs.finish(scores if scale is None else scores * scale)
