"""What :func:`lik.maxsim` replays through :mod:`lik._replay`: eager inference, and eager training (its forward and
both backwards, fast and deterministic).

:func:`call_key` reads what fixes a call's checks and launches from its arguments: the current device, the mask
mode and backward strings, whether a gradient is wanted, per tensor argument (or None) :func:`lik._replay.tensor_key`,
and what else picks the path (the fp32 matmul precision for fp32 queries; the deterministic-algorithms flag for a
training call with ``backward="auto"``). Every check ``MaxSimInputs.build`` makes depends only on what the key holds,
so a call with a recorded key passed them: its checks are settled, not skipped. The caller's tensors, in this order,
are a call's sources: ``(Q, D, q_mask, d_mask, q_scale, d_scale)``.

* :class:`Inference`: the forward launch (and, for a float query against an 8-bit corpus, the query's quantization),
  with the sums allocated in the result's shape.
* :class:`Training`: the argmax forward, replayed inside :class:`~lik.ops.maxsim.function.EagerMaxSimFunction`, and
  per set of needed gradients the backward's launches (sources ``(grad, Q, D, argmax)``): dQ's gather, and dD's
  atomic scatter (one fp32 buffer cast once, or chunks through it) or sorted gather (winner keys, a stable sort and
  segment starts per chunk of documents, made again as the full path makes them).

Never replayed: CPU tensors, ``torch.compile`` tracing, a forced config, a launch hook, a Triton whose launcher the
launch cache does not replay (:func:`lik._replay.allowed`), arguments that are not tensors.
"""

from __future__ import annotations

import torch

from ..._device import current_device
from ..._replay import NEVER, allowed, file, plan_of, recording, tensor_key
from ...core.forward_launch import chunk_sums
from .backward import maxsim_backward_dd, maxsim_backward_dq

__all__ = ["CALLS", "call_key", "key_of", "Inference", "Training", "backward_plans", "record_inference"]

# call key -> Inference | Training | NEVER
CALLS: dict[tuple, object] = {}


def call_key(Q, D, q_mask, d_mask, mask_mode, backward, q_scale, d_scale) -> tuple | None:
    """The replay key of a :func:`lik.maxsim` call, or None when it may not be replayed now (not CUDA tensors,
    replays off, ``torch.compile`` tracing)."""
    if (not isinstance(Q, torch.Tensor) or not Q.is_cuda or not allowed() or torch.compiler.is_compiling()):
        return None
    return key_of(Q, D, q_mask, d_mask, mask_mode, backward, q_scale, d_scale)


def key_of(Q, D, q_mask, d_mask, mask_mode, backward, q_scale, d_scale) -> tuple | None:
    """:func:`call_key` past its gates: what fixes the call's checks and launches (None for an argument that is not
    a tensor or None, or a flag that is not a string)."""
    if not isinstance(D, torch.Tensor) or type(mask_mode) is not str or type(backward) is not str:
        return None
    grad = torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad)
    parts = [None, mask_mode, backward, grad, tensor_key(Q), tensor_key(D)]
    if q_mask is None and d_mask is None and q_scale is None and d_scale is None:  # (the common call, on every step)
        parts += (None, None, None, None)
    else:
        for x in (q_mask, d_mask, q_scale, d_scale):
            if x is None:
                parts.append(None)
            elif isinstance(x, torch.Tensor):
                parts.append(tensor_key(x))
            else:
                return None
    if Q.dtype == torch.float32:  # fp32 products follow the matmul precision (TF32 or not)
        parts.append(torch.get_float32_matmul_precision())
    if grad and backward == "auto":  # the backward "auto" resolves to
        parts.append(torch.are_deterministic_algorithms_enabled())
    parts[0] = current_device()
    return tuple(parts)


class Inference:
    """A recorded eager inference call: its plan's last buffer is the sums, made in the result's shape when the
    query has one chunk (else ``[n_chunks, Nq, B]``, added up)."""

    __slots__ = ("plan", "chunked", "squeeze")

    def __init__(self, plan, chunked: bool, squeeze: bool):
        self.plan, self.chunked, self.squeeze = plan, chunked, squeeze

    def __call__(self, Q, D, q_mask, d_mask, q_scale, d_scale) -> torch.Tensor:
        plan = self.plan
        buffers = plan.allocate()
        plan((Q, D, q_mask, d_mask, q_scale, d_scale), buffers)
        if not self.chunked:
            return buffers[-1]
        scores = buffers[-1].sum(dim=0)
        return scores[0] if self.squeeze else scores


def record_inference(key, sources: tuple, score) -> torch.Tensor:
    """Run ``score()`` (the full path: it validates and launches, returning ``(inputs, partial)``) while recording,
    file what it launched under ``key`` and return the call's scores."""
    with recording() as recorded:
        inputs, partial = score()
    scores = inputs.finish(chunk_sums(partial))
    plan = plan_of(recorded, sources)
    if plan is NEVER:
        file(CALLS, key, NEVER)
    elif plan is not None:
        chunked = partial.shape[0] > 1
        if not chunked:
            plan.reshape(-1, tuple(scores.shape))
        file(CALLS, key, Inference(plan, chunked, inputs.squeeze_query))
    return scores


class Training:
    """A recorded eager training call: the argmax forward's plan (buffers: winners, then sums) and the canonical
    layout its backward views the caller's tensors in; :attr:`backward` fills in per ``(need_dq, need_dd)``."""

    __slots__ = ("forward_plan", "chunked", "squeeze", "per_query", "deterministic", "backward")

    def __init__(self, forward_plan, chunked: bool, squeeze: bool, per_query: bool, deterministic: bool):
        self.forward_plan, self.chunked, self.squeeze = forward_plan, chunked, squeeze
        self.per_query, self.deterministic = per_query, deterministic
        self.backward: dict[tuple[bool, bool], object] = {}

    def forward(self, Q, D, q_mask, d_mask) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self.forward_plan
        buffers = plan.allocate()
        plan((Q, D, q_mask, d_mask), buffers)
        argmax, partial = buffers
        if not self.chunked:
            return partial, argmax
        scores = partial.sum(dim=0)
        return (scores[0] if self.squeeze else scores), argmax

    def canonical(self, Q, D) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q [Nq, Lq, d], d [n_sets, B, Ld, d])`` views of the caller's tensors."""
        return (Q.unsqueeze(0) if self.squeeze else Q), (D if self.per_query else D.unsqueeze(0))

    def gradients(self, grad, Q, D, argmax, need_dq: bool, need_dd: bool):
        """``(dQ, dD)`` shaped like ``Q`` and ``D`` (None where not needed): replayed when recorded, else the full
        backward, recorded for the next call."""
        if grad.dtype != torch.float32 or not grad.is_contiguous():  # (cross-entropy's gradient is both)
            grad = grad.float().contiguous()
        plans = self.backward.get((need_dq, need_dd))
        if plans is None or plans is NEVER:
            dq, dd, plans = backward_plans(grad, Q, D, argmax, need_dq, need_dd, self, record=plans is None)
            if plans is not None:
                file(self.backward, (need_dq, need_dd), plans)
            return dq, dd
        dq_plan, dd_plan = plans
        sources = (grad, Q, D, argmax)
        dq = dd = None
        if dq_plan is not None:
            (dq,) = buffers = dq_plan.allocate()
            dq_plan(sources, buffers)
        if dd_plan is not None:
            dd = _replay_dd(dd_plan, sources, D)
        return dq, dd


def backward_plans(grad, Q, D, argmax, need_dq, need_dd, training: Training, record: bool):
    """The full backward: ``(dQ, dD, plans)``, plans being ``(dq_plan, dd_plan)`` when ``record`` and both were
    recorded, :data:`NEVER` when one cannot be replayed, else None."""
    q, d = training.canonical(Q, D)
    grad2d = grad.view(q.shape[0], d.shape[1])
    sources = (grad, Q, D, argmax)
    plans, dq, dd = [None, None], None, None
    if need_dq:
        with recording() if record else _off() as recorded:
            dq = maxsim_backward_dq(grad2d, d, argmax, q.shape, q.dtype).view(Q.shape)
        plans[0] = plan_of(recorded, sources)
        if plans[0] is not None and plans[0] is not NEVER:
            plans[0].reshape(0, tuple(Q.shape))
    if need_dd:
        with recording() if record else _off() as recorded:
            dd = maxsim_backward_dd(grad2d, q, argmax, d.shape, d.dtype, deterministic=training.deterministic,
                                    per_query=training.per_query).view(D.shape)
        plans[1] = plan_of(recorded, sources)
        if plans[1] is not None and plans[1] is not NEVER and plans[1].notes["dd"][0] == "atomic":
            plans[1].reshape(0, tuple(D.shape))
    if not record or (need_dq and plans[0] is None) or (need_dd and plans[1] is None):
        return dq, dd, None
    return dq, dd, (NEVER if NEVER in plans else tuple(plans))


class _off:
    """A recording context that records nothing."""

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _replay_dd(plan, sources, D) -> torch.Tensor:
    """dD by a recorded plan, each buffer made again as the full path made it (:func:`maxsim_backward_dd`)."""
    route, step = plan.notes["dd"]
    steps, specs, device = plan.steps, plan.buffers, plan.device
    if route == "atomic":  # one fp32 buffer, zeroed, scattered into, cast once
        shape, dtype = specs[0]
        dd32 = torch.zeros(shape, dtype=dtype, device=device)
        steps[0](sources, (dd32,))
        return dd32 if D.dtype == torch.float32 else dd32.to(D.dtype)
    if route == "chunked":  # chunks of `step` documents through one fp32 buffer
        dd, buffer = buffers = plan.allocate()
        n_docs = dd.shape[1]
        for launch, first in zip(steps, range(0, n_docs, step)):
            chunk = buffer[:, :min(step, n_docs - first)]
            chunk.zero_()
            launch(sources, buffers)
            dd[:, first:first + chunk.shape[1]].copy_(chunk)
        return dd.view(D.shape)
    # sorted: per chunk, the winners' keys, their stable sort and the segment starts, then the ordered gather
    shape, dtype = specs[0]
    dd = torch.empty(shape, dtype=dtype, device=device)
    buffers = [dd]
    for chunk in range(len(steps) // 2):
        (keys_shape, key_dtype), _, (starts_shape, _) = specs[1 + 3 * chunk:4 + 3 * chunk]
        keys = torch.empty(keys_shape, dtype=key_dtype, device=device)
        buffers.append(keys)
        steps[2 * chunk](sources, buffers)
        sorted_keys, order = torch.sort(keys, stable=True)
        starts = torch.searchsorted(sorted_keys, torch.arange(starts_shape[0], device=device, dtype=key_dtype))
        buffers += [order, starts]
        steps[2 * chunk + 1](sources, buffers)
    return dd.view(D.shape)
