"""``lik.ms_deform_attn_v2``: RT-DETRv2 / D-FINE's deformable attention (a number of points per level, bilinear or
nearest-pixel sampling) on the same kernels as :func:`lik.ms_deform_attn`.

transformers' ``multi_scale_deformable_attention_v2`` (RT-DETRv2, D-FINE, DEIMv2) takes the samples of all levels
flattened per head, ``[N, Lq, M, sum(num_points_list), 2]``, and a ``method``. When every level has the same count
and the method is ``"default"`` this is exactly Deformable DETR's op on a view of the samples, so the call goes to
:func:`lik.ms_deform_attn` (replays, tiles and all). Otherwise the kernels run with a point table (an int32
``[L, 2]`` of (first, count) per level, cached per device) and, for ``"discrete"``, the nearest-pixel gather; a
forward whose key was launched before replays that launch (the backward takes the full path).
"""

from __future__ import annotations

import torch

from ..._dispatch import kernel_op, router
from . import forward as forward_module
from .backward import launch_backward
from .forward import launch_forward, replayed_forward
from .function import _uses_kernels, ms_deform_attn
from .reference import ms_deform_attn_v2_reference
from .validation import check_inputs_v2, check_level_table

__all__ = ["ms_deform_attn_v2", "MSDeformAttnV2Function"]

# (counts, device) -> (int32 [L, 2] table of (first, count) on that device, largest count). A model has one or
# two point lists, so this stays tiny; building the table per call would cost a host-to-device copy each time.
_POINT_TABLES: dict[tuple, tuple[torch.Tensor, int]] = {}


def _point_table(counts: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, int]:
    key = (counts, device)
    found = _POINT_TABLES.get(key)
    if found is None:
        firsts = [sum(counts[:level]) for level in range(len(counts))]
        table = torch.tensor([[f, c] for f, c in zip(firsts, counts)], dtype=torch.int32).reshape(-1, 2)
        found = _POINT_TABLES[key] = (table.to(device), max(counts, default=0))
    return found


# Recorded forwards (lik._replay) of the point-table path, by forward_module.replay_key with the counts and method.
_REPLAYS: dict[tuple, object] = {}


def _forward_fake(value, shapes, starts, loc, attn, counts, discrete):
    return value.new_empty((value.shape[0], loc.shape[1], value.shape[2] * value.shape[3]))


@kernel_op("lik::msda_v2_forward", fake=_forward_fake)
def _forward_kernels(value: torch.Tensor, shapes: torch.Tensor, starts: torch.Tensor, loc: torch.Tensor,
                     attn: torch.Tensor, counts: list[int], discrete: bool) -> torch.Tensor:
    # As msda_forward: every kernel path checks the level table here, before any launch, and a call whose key was
    # launched before replays that launch (the point table is one of its sources: the kernel reads it).
    check_level_table(shapes, starts, value.shape[1])
    counts = tuple(counts)
    table, max_points = _point_table(counts, value.device)

    def full():
        return launch_forward(value, shapes, starts, loc, attn, table, max_points, discrete)

    key = forward_module.replay_key(value, shapes, starts, loc, attn, counts, discrete)
    if key is None:
        return full()
    return replayed_forward(_REPLAYS, key, (value, shapes, starts, loc, attn, table), full)


def _backward_fake(grad_out, value, shapes, starts, loc, attn, counts, discrete, deterministic):
    return value.new_empty(value.shape), loc.new_empty(loc.shape), attn.new_empty(attn.shape)


@kernel_op("lik::msda_v2_backward", fake=_backward_fake)
def _backward_kernels(grad_out: torch.Tensor, value: torch.Tensor, shapes: torch.Tensor, starts: torch.Tensor,
                      loc: torch.Tensor, attn: torch.Tensor, counts: list[int], discrete: bool, deterministic: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    table, max_points = _point_table(tuple(counts), value.device)
    return launch_backward(grad_out, value, shapes, starts, loc, attn, deterministic, table, max_points, discrete)


class MSDeformAttnV2Function(torch.autograd.Function):
    """``MSDeformAttnV2Function.apply(value, shapes, starts, loc, attn, counts, discrete)`` on inputs the kernels
    take (checked by :func:`ms_deform_attn_v2`). The backward is the atomic-free one under
    ``torch.use_deterministic_algorithms(True)``; a discrete sample's location gradient is 0."""

    @staticmethod
    def forward(ctx, value, shapes, starts, loc, attn, counts, discrete):
        ctx.counts, ctx.discrete = counts, discrete
        ctx.save_for_backward(value, shapes, starts, loc, attn)
        return _forward_kernels(value, shapes, starts, loc, attn, counts, discrete)

    @staticmethod
    def backward(ctx, grad_output):
        value, shapes, starts, loc, attn = ctx.saved_tensors
        wanted = ctx.needs_input_grad
        grad_value, grad_loc, grad_attn = _backward_kernels(
            grad_output, value, shapes, starts, loc, attn, ctx.counts, ctx.discrete,
            torch.are_deterministic_algorithms_enabled())
        return (grad_value if wanted[0] else None, None, None, grad_loc if wanted[3] else None,
                grad_attn if wanted[4] else None, None, None)


def _reference(value, shapes, starts, loc, attn, counts, discrete):
    return ms_deform_attn_v2_reference(value, shapes, starts, loc, attn, list(counts),
                                       "discrete" if discrete else "default")


def _launch(value, shapes, starts, loc, attn, counts, discrete):
    return _forward_kernels.launch(value, shapes, starts, loc, attn, list(counts), discrete)


def _compiled(value, shapes, starts, loc, attn, counts, discrete):
    return _forward_kernels.op(value, shapes, starts, loc, attn, list(counts), discrete)


_route = router(reference=_reference, autograd=MSDeformAttnV2Function.apply, compiled=_compiled, launch=_launch)


def ms_deform_attn_v2(
    value: torch.Tensor,
    value_spatial_shapes: torch.Tensor,
    value_level_start_index: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
    num_points_list,
    method: str = "default",
) -> torch.Tensor:
    """RT-DETRv2 / D-FINE's multi-scale deformable attention, differentiable: level ``l`` has
    ``num_points_list[l]`` points, and ``method`` picks bilinear (``"default"``, grid_sample's, zeros outside the
    map) or nearest-pixel sampling (``"discrete"``: ``int(loc * size + 0.5)`` clamped to the map, as RT-DETRv2's
    ``deformable_attention_core_func_v2``).

    Args:
        value: ``[N, S, M, D]`` float16 / bfloat16 / float32 (float64 runs the reference).
        value_spatial_shapes: int32 or int64 ``[L, 2]``, (H, W) of each level.
        value_level_start_index: int32 or int64 ``[L]``, offset of each level along S (checked as for
            :func:`lik.ms_deform_attn`).
        sampling_locations: ``[N, Lq, M, T, 2]``, normalised (x, y), the points of level 0 first
            (``T = sum(num_points_list)``), any float dtype.
        attention_weights: ``[N, Lq, M, T]``, any float dtype.
        num_points_list: L non-negative ints.
        method: ``"default"`` or ``"discrete"``.

    Returns:
        ``[N, Lq, M * D]`` in ``value``'s dtype; coordinates and accumulation in fp32 whatever the dtypes. In the
        discrete method the location gradient is 0 (the nearest pixel is piecewise constant; transformers' op
        gives none), a NaN coordinate reads pixel 0 and an infinite one the border. Equal counts with the default
        method run :func:`lik.ms_deform_attn` on a ``[N, Lq, M, L, P, 2]`` view.

    Example:
        >>> loc = torch.rand(4, 300, 8, 12, 2, device="cuda")                  # 3 + 6 + 3 points
        >>> weights = torch.rand(4, 300, 8, 12, device="cuda").softmax(-1)
        >>> lik.ms_deform_attn_v2(value, shapes, starts, loc, weights, [3, 6, 3], "discrete").shape
        torch.Size([4, 300, 256])
    """
    counts = check_inputs_v2(value, value_spatial_shapes, value_level_start_index, sampling_locations,
                             attention_weights, num_points_list, method)
    discrete = method == "discrete"
    if not discrete and counts and min(counts) == max(counts):
        n, n_queries, heads = sampling_locations.shape[:3]
        shape = (n, n_queries, heads, len(counts), counts[0])
        return ms_deform_attn(value, value_spatial_shapes, value_level_start_index,
                              sampling_locations.reshape(*shape, 2), attention_weights.reshape(shape))
    needs_grad = torch.is_grad_enabled() and (
        value.requires_grad or sampling_locations.requires_grad or attention_weights.requires_grad
    )
    return _route(_uses_kernels(value, sampling_locations, attention_weights), needs_grad, value,
                  value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights, counts,
                  discrete)
