"""``lik.ms_deform_attn``: the autograd Function over the kernels and its Deformable-DETR / mmcv aliases (the
transformers-style module lives in :mod:`lik.integrations.transformers`).

Under ``torch.compile`` the Function reaches the kernels through two custom operators (``lik::msda_forward``,
``lik::msda_backward``) with shape-only fake implementations, so Dynamo traces the whole call without a graph break;
eager calls launch directly. :mod:`lik._dispatch` does that choice and the route of each call (see docs/design.md).
"""

from __future__ import annotations

import torch

from ..._device import interpreting
from ..._dispatch import kernel_op, router
from ..._replay import file
from . import forward as forward_module
from .backward import msda_backward
from .forward import msda_forward
from .reference import ms_deform_attn_reference
from .validation import KERNEL_DTYPES, check_inputs, check_level_table

__all__ = [
    "ms_deform_attn",
    "MSDeformAttnFunction",
    "MultiScaleDeformableAttnFunction",
]


_KERNEL_DTYPES = frozenset(KERNEL_DTYPES)


def _uses_kernels(value: torch.Tensor, loc: torch.Tensor, attn: torch.Tensor) -> bool:
    """CUDA tensors run the kernels, CPU tensors under ``TRITON_INTERPRET=1`` too; float64 is reference-only,
    and so is CPU bfloat16 (Triton's interpreter has no bfloat16 arithmetic)."""
    if value.dtype not in _KERNEL_DTYPES or loc.dtype not in _KERNEL_DTYPES or attn.dtype not in _KERNEL_DTYPES:
        return False
    if value.is_cuda:
        return True
    return (value.device.type == "cpu" and interpreting()
            and torch.bfloat16 not in (value.dtype, loc.dtype, attn.dtype))


def _forward_fake(value, shapes, starts, loc, attn):
    return value.new_empty((value.shape[0], loc.shape[1], value.shape[2] * value.shape[3]))


@kernel_op("lik::msda_forward", fake=_forward_fake)
def _forward_kernels(value: torch.Tensor, shapes: torch.Tensor, starts: torch.Tensor, loc: torch.Tensor,
                     attn: torch.Tensor) -> torch.Tensor:
    return msda_forward(value, shapes, starts, loc, attn)


def _backward_fake(grad_out, value, shapes, starts, loc, attn, deterministic):
    return value.new_empty(value.shape), loc.new_empty(loc.shape), attn.new_empty(attn.shape)


@kernel_op("lik::msda_backward", fake=_backward_fake)
def _backward_kernels(grad_out: torch.Tensor, value: torch.Tensor, shapes: torch.Tensor, starts: torch.Tensor,
                      loc: torch.Tensor, attn: torch.Tensor, deterministic: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return msda_backward(grad_out, value, shapes, starts, loc, attn, deterministic=deterministic)


def _forward(ctx, value, shapes, starts, loc, attn):
    ctx.kernels = _uses_kernels(value, loc, attn)
    ctx.save_for_backward(value, shapes, starts, loc, attn)
    if ctx.kernels:
        return _forward_kernels(value, shapes, starts, loc, attn)
    return ms_deform_attn_reference(value, shapes, starts, loc, attn)


class MSDeformAttnFunction(torch.autograd.Function):
    """``MSDeformAttnFunction.apply(value, value_spatial_shapes, value_level_start_index, sampling_locations,
    attention_weights, im2col_step)``: the Deformable-DETR autograd Function, drop-in.

    Inputs the kernels do not take (float64, or CPU without the interpreter) run the ``grid_sample`` reference,
    whose backward is recomputed under autograd; everything else runs the Triton kernels. The backward is the
    deterministic, atomic-free one when ``torch.are_deterministic_algorithms_enabled()``.
    """

    @staticmethod
    def forward(ctx, value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
                im2col_step=64):
        check_inputs(value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
                     im2col_step)
        return _forward(ctx, value, value_spatial_shapes, value_level_start_index, sampling_locations,
                        attention_weights)

    @staticmethod
    def backward(ctx, grad_output):
        value, shapes, starts, loc, attn = ctx.saved_tensors
        wanted = ctx.needs_input_grad
        if ctx.kernels:
            grads = _backward_kernels(grad_output, value, shapes, starts, loc, attn,
                                      torch.are_deterministic_algorithms_enabled())
        else:
            with torch.enable_grad():
                inputs = [t.detach().requires_grad_(w) for t, w in ((value, wanted[0]), (loc, wanted[3]),
                                                                   (attn, wanted[4]))]
                out = ms_deform_attn_reference(inputs[0], shapes, starts, inputs[1], inputs[2])
                leaves = [t for t in inputs if t.requires_grad]
                found = iter(torch.autograd.grad(out, leaves, grad_output, allow_unused=True))
                grads = [next(found) if t.requires_grad else None for t in inputs]
        grad_value, grad_loc, grad_attn = grads
        return (grad_value if wanted[0] else None, None, None, grad_loc if wanted[3] else None,
                grad_attn if wanted[4] else None, None)


# mmcv's name for the same Function.
MultiScaleDeformableAttnFunction = MSDeformAttnFunction


class _CheckedInputsFunction(MSDeformAttnFunction):
    """The same Function for inputs :func:`ms_deform_attn` has just checked and routed to the kernels: skips both
    tests (host time counts on decoder-sized calls)."""

    @staticmethod
    def forward(ctx, value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
                im2col_step=64):
        # Routed here only when the kernels take the inputs, so the kernel test is not repeated either.
        ctx.kernels = True
        ctx.save_for_backward(value, value_spatial_shapes, value_level_start_index, sampling_locations,
                              attention_weights)
        return _forward_kernels(value, value_spatial_shapes, value_level_start_index, sampling_locations,
                                attention_weights)


class _ReplayedFunction(MSDeformAttnFunction):
    """The same Function for a call :func:`ms_deform_attn` found among its checked keys: the forward replays the
    recorded launch it is given (``plan``, after the inputs, with its replay ``key``); the atomic backward keys its
    replay from ``key`` instead of keying the five saved tensors again."""

    @staticmethod
    def forward(ctx, value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
                plan, key):
        ctx.key = key
        ctx.save_for_backward(value, value_spatial_shapes, value_level_start_index, sampling_locations,
                              attention_weights)
        return forward_module.replay(plan, value, value_spatial_shapes, value_level_start_index,
                                     sampling_locations, attention_weights)

    @staticmethod
    def backward(ctx, grad_output):
        if torch.compiler.is_compiling() or torch.are_deterministic_algorithms_enabled():
            ctx.kernels = True
            return (*MSDeformAttnFunction.backward(ctx, grad_output), None)
        value, shapes, starts, loc, attn = ctx.saved_tensors
        grad_value, grad_loc, grad_attn = msda_backward(grad_output, value, shapes, starts, loc, attn,
                                                        deterministic=False, forward_key=ctx.key)
        wanted = ctx.needs_input_grad
        return (grad_value if wanted[0] else None, None, None, grad_loc if wanted[3] else None,
                grad_attn if wanted[4] else None, None, None)


# Calls of ms_deform_attn that passed check_inputs and whose forward was recorded, by the forward's replay key, with
# that recording. A call with such a key has the shapes, strides, dtypes and devices of one that passed every check,
# so the checks are settled, not skipped (only the level table's values are read, through its cached check), and it
# goes straight to the replay: ~6 us less host time per call on a decoder layer, whose kernel takes ~20 us.
_CHECKED: dict[tuple, object] = {}


def _checked_key(value, shapes, starts, loc, attn, im2col_step) -> tuple | None:
    """The forward's replay key of a call (:func:`lik.ops.msda.forward.replay_key`: None unless every input is a
    CUDA tensor and replays are on) when it may skip the checks on a hit: eager, ``im2col_step`` an int; else None."""
    if type(im2col_step) is not int or torch.compiler.is_compiling():
        return None
    try:
        return forward_module.replay_key(value, shapes, starts, loc, attn)
    except (AttributeError, TypeError):  # not tensors: check_inputs names the argument
        return None


# The four paths of a public call that is not a checked key's, each taking the five checked tensors. Inference
# skips the autograd Function's bookkeeping (~25 us of host time per call, which a decoder-sized call, ~20 us on the
# GPU, would otherwise wait on).
def _autograd(value, shapes, starts, loc, attn):
    return _CheckedInputsFunction.apply(value, shapes, starts, loc, attn, 64)  # im2col_step: ignored


_route = router(reference=ms_deform_attn_reference, autograd=_autograd, compiled=_forward_kernels.op,
                launch=msda_forward)


def ms_deform_attn(
    value: torch.Tensor,
    value_spatial_shapes: torch.Tensor,
    value_level_start_index: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
    im2col_step: int = 64,
) -> torch.Tensor:
    """Multi-scale deformable attention (Deformable DETR, DINO, Mask2Former, RT-DETR, BEVFormer), differentiable.

    ``out[n, q, m*D:(m+1)*D] = sum_{l, p} attention_weights[n, q, m, l, p] * bilinear(value_l[n, :, m, :],
    sampling_locations[n, q, m, l, p])`` with ``grid_sample(bilinear, zeros, align_corners=False)`` semantics:
    pixel = location * size - 0.5, each corner outside its map reads zero.

    Args:
        value: ``[N, S, M, D]`` float16 / bfloat16 / float32 (float64 runs the reference), S = sum of H * W
            (the kernels take S < 2**31 and raise ``ValueError`` beyond).
        value_spatial_shapes: int32 or int64 ``[L, 2]``, (H, W) of each level.
        value_level_start_index: int32 or int64 ``[L]``, offset of each level along S. The table must fit
            ``value`` (H, W and starts non-negative, ``start + H * W <= S`` per level, ``sum(H * W) <= S``), else
            ``ValueError``; it is read once per table (a synchronisation for a CUDA table) and the check cached
            until the table changes (docs/design.md, "Deformable attention semantics").
        sampling_locations: ``[N, Lq, M, L, P, 2]``, normalised (x, y), any float dtype.
        attention_weights: ``[N, Lq, M, L, P]``, any float dtype (mixed dtypes as autocast produces them work).
        im2col_step: accepted for compatibility and ignored (no divisibility rule).

    Returns:
        ``[N, Lq, M * D]`` in ``value``'s dtype. Coordinates and accumulation are fp32 whatever the dtypes;
        gradients come back in each input's dtype. Under ``torch.use_deterministic_algorithms(True)`` the backward
        uses no atomics and is bitwise repeatable. Any strides are accepted (a non-contiguous input is copied once);
        addressing is 64-bit.

    CUDA tensors run the Triton kernels; CPU tensors run the ``grid_sample`` reference (or the kernels through
    Triton's interpreter when ``TRITON_INTERPRET=1``).

    Example:
        >>> shapes = torch.tensor([[100, 167], [50, 84], [25, 42], [13, 21]], device="cuda")
        >>> starts = torch.cat([shapes.new_zeros(1), shapes.prod(1).cumsum(0)[:-1]])
        >>> value = torch.randn(4, int(shapes.prod(1).sum()), 8, 32, device="cuda")
        >>> loc = torch.rand(4, 300, 8, 4, 4, 2, device="cuda")
        >>> weights = torch.rand(4, 300, 8, 4, 4, device="cuda").softmax(-1)
        >>> lik.ms_deform_attn(value, shapes, starts, loc, weights).shape     # torch.Size([4, 300, 256])
    """
    key = _checked_key(value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
                       im2col_step)
    plan = None if key is None else _CHECKED.get(key)
    if plan is None:
        check_inputs(value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
                     im2col_step)
    needs_grad = torch.is_grad_enabled() and (
        value.requires_grad or sampling_locations.requires_grad or attention_weights.requires_grad
    )
    if plan is not None:
        check_level_table(value_spatial_shapes, value_level_start_index, value.shape[1])
        if needs_grad:
            return _ReplayedFunction.apply(value, value_spatial_shapes, value_level_start_index, sampling_locations,
                                           attention_weights, plan, key)
        return forward_module.replay(plan, value, value_spatial_shapes, value_level_start_index,
                                     sampling_locations, attention_weights)
    out = _route(_uses_kernels(value, sampling_locations, attention_weights), needs_grad,
                 value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights)
    if key is not None:
        # The forward (msda_forward) recorded its launch under the same key, or declined to.
        plan = forward_module.recorded_plan(key)
        if plan is not None:
            file(_CHECKED, key, plan)
    return out

