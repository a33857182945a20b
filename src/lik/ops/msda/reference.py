"""Pure-PyTorch multi-scale deformable attention over ``grid_sample``: the specification and the CPU path.

Each level's value map is sampled with ``grid_sample(bilinear, zeros, align_corners=False)``, so a location
``(x, y)`` in [0, 1] lands on pixel ``(x * W - 0.5, y * H - 0.5)`` and every bilinear corner outside the map reads
zero. Unlike the Deformable-DETR original, levels are accumulated one at a time (no ``[N*M, D, Lq, L*P]`` stack)
and each level is read through ``value_level_start_index``, exactly as the kernels read it. Arithmetic is float32
(float64 when any input is float64) and the result is cast to ``value``'s dtype; autograd flows through it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .validation import check_inputs, check_inputs_v2, level_table

__all__ = ["ms_deform_attn_reference", "ms_deform_attn_v2_reference", "nearest_sample"]


def _zero_of(*tensors: torch.Tensor) -> torch.Tensor:
    # An empty sum is an exact 0 that stays on the autograd graph without touching (possibly NaN) data.
    return sum(t.reshape(-1)[:0].sum() for t in tensors)


def ms_deform_attn_reference(
    value: torch.Tensor,
    value_spatial_shapes: torch.Tensor,
    value_level_start_index: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
    im2col_step: int = 64,
) -> torch.Tensor:
    """Multi-scale deformable attention through ``torch.nn.functional.grid_sample``.

    Args:
        value: ``[N, S, M, D]``, the flattened maps of every level (S = sum of H * W), M heads of D channels.
        value_spatial_shapes: int ``[L, 2]``, (H, W) of each level.
        value_level_start_index: int ``[L]``, offset of each level along S.
        sampling_locations: ``[N, Lq, M, L, P, 2]``, (x, y) in [0, 1] of each sampling point.
        attention_weights: ``[N, Lq, M, L, P]``.
        im2col_step: accepted for compatibility and ignored.

    Returns:
        ``[N, Lq, M * D]`` in ``value``'s dtype.

    Example:
        >>> out = ms_deform_attn_reference(value, shapes, starts, loc, weights)   # any device, any float dtype
    """
    check_inputs(value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
                 im2col_step)
    n, n_pixels, heads, dim = value.shape
    _, n_queries, _, _, n_points, _ = sampling_locations.shape
    levels = level_table(value_spatial_shapes, value_level_start_index, n_pixels)
    dtypes = (value.dtype, sampling_locations.dtype, attention_weights.dtype)
    acc = torch.float64 if torch.float64 in dtypes else torch.float32

    out = torch.zeros(n * heads, dim, n_queries, dtype=acc, device=value.device)
    out = out + _zero_of(value, sampling_locations, attention_weights)
    if out.numel() == 0 or n_points == 0:
        return out.view(n, heads, dim, n_queries).permute(0, 3, 1, 2).reshape(n, n_queries, heads * dim).to(value.dtype)

    grids = 2 * sampling_locations.to(acc) - 1  # grid_sample's [-1, 1] frame
    for level, (height, width, start) in enumerate(levels):
        if height * width == 0:
            continue  # an empty map: every corner is outside it
        v = value[:, start:start + height * width].to(acc)  # [N, H*W, M, D]
        v = v.permute(0, 2, 3, 1).reshape(n * heads, dim, height, width)
        grid = grids[:, :, :, level].transpose(1, 2).reshape(n * heads, n_queries, n_points, 2)
        sampled = F.grid_sample(v, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        w = attention_weights[:, :, :, level].to(acc).transpose(1, 2).reshape(n * heads, 1, n_queries, n_points)
        out = out + (sampled * w).sum(-1)  # [N*M, D, Lq]
    return out.view(n, heads, dim, n_queries).permute(0, 3, 1, 2).reshape(n, n_queries, heads * dim).to(value.dtype)


def nearest_sample(v: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
    """RT-DETRv2's discrete sampling: ``v [B, D, H, W]`` read at the nearest pixel of each ``loc [B, Q, P, 2]``
    (normalised x, y), ``int(loc * size + 0.5)`` clamped to the map; NaN reads pixel 0 and an infinite coordinate
    the border (as transformers' ``.to(torch.int64)`` and ``clamp`` do on a GPU). Returns ``[B, D, Q, P]``."""
    batch, dim, height, width = v.shape
    _, n_queries, n_points, _ = loc.shape
    size = torch.tensor([width, height], dtype=loc.dtype, device=loc.device)
    pixel = torch.nan_to_num(loc.detach() * size + 0.5, nan=0.0).floor()
    x = pixel[..., 0].clamp(0, width - 1).long()
    y = pixel[..., 1].clamp(0, height - 1).long()
    index = (y * width + x).reshape(batch, 1, n_queries * n_points).expand(batch, dim, -1)
    return torch.gather(v.reshape(batch, dim, height * width), 2, index).reshape(batch, dim, n_queries, n_points)


def ms_deform_attn_v2_reference(
    value: torch.Tensor,
    value_spatial_shapes: torch.Tensor,
    value_level_start_index: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
    num_points_list,
    method: str = "default",
) -> torch.Tensor:
    """RT-DETRv2 / D-FINE's deformable attention (``deformable_attention_core_func_v2``) in PyTorch: each level
    has its own number of points, and ``method="discrete"`` reads the nearest pixel instead of sampling bilinearly.

    Args:
        value: ``[N, S, M, D]``, as for :func:`ms_deform_attn_reference`.
        value_spatial_shapes: int ``[L, 2]``, (H, W) of each level.
        value_level_start_index: int ``[L]``, offset of each level along S.
        sampling_locations: ``[N, Lq, M, T, 2]``, (x, y) in [0, 1], level 0's points first
            (``T = sum(num_points_list)``).
        attention_weights: ``[N, Lq, M, T]``.
        num_points_list: L ints, the points of each level.
        method: ``"default"`` (``grid_sample`` bilinear, zeros outside) or ``"discrete"`` (nearest pixel, clamped
            to the map; no gradient reaches the locations).

    Returns:
        ``[N, Lq, M * D]`` in ``value``'s dtype (float32 arithmetic, float64 when an input is float64).

    Example:
        >>> out = ms_deform_attn_v2_reference(value, shapes, starts, loc, weights, [3, 6, 3], "discrete")
    """
    counts = check_inputs_v2(value, value_spatial_shapes, value_level_start_index, sampling_locations,
                             attention_weights, num_points_list, method)
    n, n_pixels, heads, dim = value.shape
    n_queries = sampling_locations.shape[1]
    levels = level_table(value_spatial_shapes, value_level_start_index, n_pixels)
    dtypes = (value.dtype, sampling_locations.dtype, attention_weights.dtype)
    acc = torch.float64 if torch.float64 in dtypes else torch.float32

    out = torch.zeros(n * heads, dim, n_queries, dtype=acc, device=value.device)
    out = out + _zero_of(value, sampling_locations, attention_weights)
    first = 0
    for (height, width, start), count in zip(levels, counts):
        points = slice(first, first + count)
        first += count
        if height * width == 0 or count == 0 or out.numel() == 0:
            continue  # an empty map reads nothing
        v = value[:, start:start + height * width].to(acc)
        v = v.permute(0, 2, 3, 1).reshape(n * heads, dim, height, width)
        loc = sampling_locations[:, :, :, points].to(acc).transpose(1, 2).reshape(n * heads, n_queries, count, 2)
        if method == "discrete":
            sampled = nearest_sample(v, loc)
        else:
            sampled = F.grid_sample(v, 2 * loc - 1, mode="bilinear", padding_mode="zeros", align_corners=False)
        w = attention_weights[:, :, :, points].to(acc).transpose(1, 2).reshape(n * heads, 1, n_queries, count)
        out = out + (sampled * w).sum(-1)
    return out.view(n, heads, dim, n_queries).permute(0, 3, 1, 2).reshape(n, n_queries, heads * dim).to(value.dtype)
