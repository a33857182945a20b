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

from .validation import check_inputs, level_table

__all__ = ["ms_deform_attn_reference"]


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
