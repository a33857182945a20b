"""``lik.contrastive_loss``: in-batch contrastive training on MaxSim scores as one autograd node.

Forward: MaxSim's training forward (the argmax launch :func:`lik.maxsim` makes, winners kept for the backward),
then one small kernel (:mod:`.kernel`) from the scores to the loss and the scores' gradient. Backward: that gradient
times the loss's incoming gradient, into MaxSim's own backward launches (dQ's gather; dD's atomic scatter or its
deterministic sorted gather, as :func:`lik.maxsim` picks them). No graph of small ops, no score matrix in autograd.

Host path (docs/design.md, "The host path"): a call's key is :func:`lik.maxsim`'s training key plus the labels'
tensor key and the temperature; a recorded key replays its launches (:mod:`lik._replay`): MaxSim's recorded
:class:`~lik.ops.maxsim.replay.Training` (shared with :func:`lik.maxsim`'s table: the same launches) and the
cross-entropy kernel's step. Otherwise the checks run once (:class:`~.validation.ContrastiveInputs`) and the full
path runs, recorded. CPU tensors without the interpreter, float64 and ``torch.compile`` take the composition
(MaxSim through its route, ``F.cross_entropy``), which is also the specification (:mod:`.reference`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..._dispatch import resolve_backward, uses_kernels
from ..._replay import NEVER, file, plan_of, recording, tensor_key
from ..maxsim.function import _FullTraining, score_canonical
from ..maxsim.replay import CALLS as MAXSIM_CALLS
from ..maxsim.replay import Training, call_key
from .kernel import launch_cross_entropy
from .validation import ContrastiveInputs

__all__ = ["contrastive_loss", "ContrastiveFunction", "CALLS", "Recorded"]

# call key -> Recorded | NEVER
CALLS: dict[tuple, object] = {}


class Recorded:
    """A recorded training call: MaxSim's :class:`~lik.ops.maxsim.replay.Training` (its forward, and its backward
    plans as they are recorded) and the cross-entropy step's plan (sources ``(scores, labels)``; buffers: the
    scores' gradient, then the loss, or per-program partial sums when ``partial``)."""

    __slots__ = ("training", "plan", "partial")

    def __init__(self, training: Training, plan, partial: bool):
        self.training, self.plan, self.partial = training, plan, partial

    def forward(self, Q, D, labels, q_mask, d_mask):
        scores, argmax = self.training.forward(Q, D, q_mask, d_mask)
        plan = self.plan
        buffers = plan.allocate()
        plan((scores, labels), buffers)
        grad, out = buffers
        return (out.sum() if self.partial else out), grad, argmax

    def gradients(self, grad, Q, D, argmax, need_dq: bool, need_dd: bool):
        return self.training.gradients(grad, Q, D, argmax, need_dq, need_dd)


class _FullRun:
    """The full path of one training call: MaxSim's run (a recorded ``Training`` or the full ``_FullTraining``),
    then the cross-entropy launch, recorded and filed under ``key`` when the MaxSim forward was filed too."""

    __slots__ = ("run", "temperature", "key", "maxsim_key")

    def __init__(self, run, temperature: float, key, maxsim_key):
        self.run, self.temperature, self.key, self.maxsim_key = run, temperature, key, maxsim_key

    def forward(self, Q, D, labels, q_mask, d_mask):
        scores, argmax = self.run.forward(Q, D, q_mask, d_mask)
        if self.key is None:
            loss, grad = launch_cross_entropy(scores, labels, self.temperature)
            return loss, grad, argmax
        with recording() as recorded:
            loss, grad = launch_cross_entropy(scores, labels, self.temperature)
        training = self.run if type(self.run) is Training else self.run.training
        plan = plan_of(recorded, (scores, labels))
        if plan is NEVER or MAXSIM_CALLS.get(self.maxsim_key) is NEVER:
            file(CALLS, self.key, NEVER)
        elif plan is not None and training.forward_plan is not None:
            file(CALLS, self.key, Recorded(training, plan, len(plan.buffers[1][0]) != 0))
        return loss, grad, argmax

    def gradients(self, grad, Q, D, argmax, need_dq: bool, need_dd: bool):
        return self.run.gradients(grad, Q, D, argmax, need_dq, need_dd)


class ContrastiveFunction(torch.autograd.Function):
    """One autograd node over the caller's ``Q`` and ``D``: ``run.forward`` gives the loss, the scores' gradient
    ``[Nq, B]`` (fp32) and MaxSim's winners; the backward scales that gradient by the loss's incoming gradient and
    hands it to ``run.gradients`` (MaxSim's backward launches)."""

    @staticmethod
    def forward(ctx, Q, D, labels, q_mask, d_mask, run):
        loss, grad, argmax = run.forward(Q, D, labels, q_mask, d_mask)
        ctx.save_for_backward(Q, D, argmax, grad)
        ctx.run = run
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        Q, D, argmax, grad = ctx.saved_tensors
        dq, dd = ctx.run.gradients(grad * grad_loss, Q, D, argmax, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return dq, dd, None, None, None, None


def _call_key(Q, D, labels, temperature, q_mask, d_mask, mask_mode, backward):
    """The replay key of a training call (None when it may not be replayed: see :func:`lik.maxsim`'s
    ``call_key``; no gradient wanted; labels neither None nor a tensor; a temperature that is not a float or int)."""
    maxsim_key = call_key(Q, D, q_mask, d_mask, mask_mode, backward, None, None)
    if maxsim_key is None or not maxsim_key[3]:
        return None
    if labels is None:
        labels_key = None
    elif isinstance(labels, torch.Tensor):
        labels_key = tensor_key(labels)
    else:
        return None
    if type(temperature) is not float and type(temperature) is not int:
        return None
    return maxsim_key, labels_key, temperature


def contrastive_loss(
    Q: torch.Tensor,
    D: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    mask_mode: str = "exclude",
    backward: str = "auto",
) -> torch.Tensor:
    """In-batch contrastive loss on MaxSim scores: ``F.cross_entropy(lik.maxsim(Q, D) / temperature, labels)`` as one
    fused autograd node (MaxSim forward, one cross-entropy kernel; backward: MaxSim's backward launches).

    Args:
        Q: queries ``[Nq, Lq, d]`` (``Nq >= 1``), float16 / bfloat16 / float32 (float64 runs the reference).
        D: documents ``[B, Ld, d]`` shared by every query (in-batch negatives), or ``[Nq, B, Ld, d]``: a candidate
            set per query (hard negatives), scored as :func:`lik.maxsim` scores a 4-D ``D``. Same dtype and device.
        labels: int64 ``[Nq]``, the index of each query's positive among its ``B`` candidates, in ``[0, B)``
            (repeats allowed). None: the diagonal ``arange(Nq)`` (query ``i``'s positive is document ``i``; needs
            ``Nq <= B``), for a 4-D ``D`` too: pass ``torch.zeros(Nq, dtype=torch.long)`` when each set's positive
            comes first. A CPU tensor's values are checked; a CUDA tensor's are not read (that would
            synchronise): a label outside ``[0, B)`` makes the loss and its query's gradients NaN.
        temperature: positive finite number; the logits are ``scores / temperature``.
        q_mask, d_mask, mask_mode: as in :func:`lik.maxsim` (a document with no valid token scores 0 and still
            takes part in the softmax; it gets zero gradient).
        backward: ``"auto"`` / ``"fast"`` / ``"deterministic"``, as in :func:`lik.maxsim` (the loss itself is
            summed in a fixed order on every path).

    Returns:
        The mean loss over queries, a 0-dim float32 tensor (float64 for float64 inputs). Gradients flow to ``Q``
        and ``D`` in their dtype; they equal :func:`lik.maxsim` + ``F.cross_entropy``'s within fp32 rounding. A
        NaN score (a NaN in a valid token) makes the loss NaN and its query's row of score gradients NaN, as
        ``F.cross_entropy`` does.

    An eager training call whose shapes, strides, dtypes, alignment, labels layout and temperature were seen before
    replays its launches (:mod:`lik._replay`): three launches forward (MaxSim's and the cross-entropy kernel, two
    allocations each), MaxSim's backward launches after one multiply. CPU tensors run
    :func:`~.reference.contrastive_loss_reference`'s composition (the real kernels under ``TRITON_INTERPRET=1``);
    under ``torch.compile`` the composition is traced (MaxSim's custom operators, ``F.cross_entropy``).

    Example:
        >>> Q = torch.nn.functional.normalize(torch.randn(128, 32, 128), dim=-1).half().cuda().requires_grad_()
        >>> D = torch.nn.functional.normalize(torch.randn(128, 180, 128), dim=-1).half().cuda().requires_grad_()
        >>> loss = lik.contrastive_loss(Q, D, temperature=0.05)   # query i's positive is document i
        >>> loss.backward()                                        # Q.grad, D.grad in float16
    """
    key = _call_key(Q, D, labels, temperature, q_mask, d_mask, mask_mode, backward)
    if key is not None:
        recorded = CALLS.get(key)
        if recorded is not None and recorded is not NEVER:  # its checks passed for this key: replay its launches
            return ContrastiveFunction.apply(Q, D, labels, q_mask, d_mask, recorded)
        if recorded is NEVER:
            key = None
    checked = ContrastiveInputs.build(Q, D, labels, temperature, q_mask, d_mask, mask_mode)
    deterministic = resolve_backward(backward)
    inputs, labels, temperature = checked.maxsim, checked.labels, checked.temperature
    needs_grad = torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad)
    if not uses_kernels(inputs.q) or torch.compiler.is_compiling():
        scores = score_canonical(inputs, needs_grad=needs_grad, deterministic=deterministic)
        if labels is None:
            labels = torch.arange(scores.shape[0], device=scores.device)
        return F.cross_entropy(scores / temperature, labels)
    if not needs_grad:
        return launch_cross_entropy(score_canonical(inputs), labels, temperature, write_grad=False)[0]
    maxsim_key = None if key is None else key[0]
    recorded = None if maxsim_key is None else MAXSIM_CALLS.get(maxsim_key)
    if type(recorded) is Training:  # lik.maxsim recorded this forward already: replay it
        run = recorded
    else:
        run = _FullTraining(inputs, deterministic, maxsim_key if recorded is None else None)
    return ContrastiveFunction.apply(Q, D, labels, q_mask, d_mask, _FullRun(run, temperature, key, maxsim_key))
