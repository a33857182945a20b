"""Fused deformable-attention forward: bilinear gathers, weighted and summed in registers.

A program owns ``BLOCK_R`` consecutive queries of one head (rows ordered (batch, head, query)) and ``BLOCK_D``
channels. It walks the levels in a runtime loop; per level, the locations and weights of all its points load as one
``[rows, points]`` tile, the four corners of every point are gathered as
``[rows, points, channels]`` tiles whose loads are all independent, and each corner is multiplied by its
bilinear-times-attention weight into a ``[rows, points, channels]`` accumulator that is summed over points once,
at the end. The only write is the ``[N, Lq, M*D]`` result: nothing of the size ``N * Lq * M * L * P * D`` that
``grid_sample`` materialises ever exists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._config import cdiv, msda_forward_config
from ..._launch import launch
from .sampling import bilinear, corner_masks, corner_weights, level_shape, load_samples, query_rows

__all__ = ["msda_fwd_kernel", "msda_forward", "transposed_value", "check_pixel_count", "check_point_tile", "RUNTIME_INTS"]

# Batch, query count, heads, levels and points vary per call and never trigger a recompile.
RUNTIME_INTS = ["n_rows", "n_queries", "n_heads", "n_levels", "n_points"]


@triton.jit(do_not_specialize=RUNTIME_INTS)
def msda_fwd_kernel(
    value_ptr, shapes_ptr, starts_ptr, loc_ptr, attn_ptr, out_ptr,
    n_rows, n_queries, n_heads, n_levels, n_points,
    stride_vn, stride_vs, stride_vm, stride_vd,
    stride_sl, stride_sc, stride_st,
    stride_ln, stride_lq, stride_lm, stride_ll, stride_lp, stride_lc,
    stride_an, stride_aq, stride_am, stride_al, stride_ap,
    stride_on, stride_oq, stride_oc,
    DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row_ok, batch, query, head = query_rows(tl.program_id(0), n_rows, n_queries, n_heads, BLOCK_R)
    chan = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    if DIM % BLOCK_D == 0:
        # Every channel of every block exists: no channel predicate on the gathers.
        chan_ok = tl.full([1, 1, BLOCK_D], 1, tl.int1)
    else:
        chan_ok = (chan < DIM)[None, None, :]
    value_rows = value_ptr + batch * stride_vn + head * stride_vm
    chan_off = (chan.to(tl.int64) * stride_vd)[None, None, :]
    loc_rows = loc_ptr + batch * stride_ln + query * stride_lq + head * stride_lm
    attn_rows = attn_ptr + batch * stride_an + query * stride_aq + head * stride_am

    acc = tl.zeros((BLOCK_R, BLOCK_P, BLOCK_D), tl.float32)
    # BLOCK_P covers all points of a level (the launcher checks), so the only loop is over levels: a level's
    # shape is three scalar loads, and no inner loop costs registers (measured: a point loop inside, or one flat
    # loop over (level, point block), made the forward 12-16% slower at encoder scale; benchmarks/NOTES.md).
    point = tl.arange(0, BLOCK_P)
    for level in range(n_levels):
        height, width, start = level_shape(level, shapes_ptr, starts_ptr, stride_sl, stride_sc, stride_st)
        live = row_ok[:, None] & (point < n_points)[None, :]
        loc_x, loc_y, weight = load_samples(
            loc_rows, attn_rows, level, point, live, stride_ll, stride_lp, stride_lc, stride_al, stride_ap
        )
        x0, y0, fx, fy, in_x0, in_x1, in_y0, in_y1 = bilinear(loc_x, loc_y, height, width, live)
        w00, w01, w10, w11 = corner_weights(fx, fy, weight)
        m00, m01, m10, m11 = corner_masks(in_x0, in_x1, in_y0, in_y1, chan_ok)
        ptr = (value_rows[:, None] + (start + (y0 * width + x0)) * stride_vs)[:, :, None] + chan_off
        down = width.to(tl.int64) * stride_vs
        acc += w00[:, :, None] * tl.load(ptr, mask=m00, other=0.0).to(tl.float32)
        acc += w01[:, :, None] * tl.load(ptr + stride_vs, mask=m01, other=0.0).to(tl.float32)
        acc += w10[:, :, None] * tl.load(ptr + down, mask=m10, other=0.0).to(tl.float32)
        acc += w11[:, :, None] * tl.load(ptr + down + stride_vs, mask=m11, other=0.0).to(tl.float32)

    out = out_ptr + batch * stride_on + query * stride_oq + (head * DIM) * stride_oc
    tl.store(out[:, None] + (chan * stride_oc)[None, :], tl.sum(acc, axis=1),
             mask=row_ok[:, None] & (chan < DIM)[None, :])


def transposed_value(value: torch.Tensor) -> torch.Tensor:
    """``value`` copied into the ``[N, M, S, D]`` layout and viewed as ``[N, S, M, D]`` again: each head's map is
    one contiguous block, its pixels ``D`` apart, so a corner pair is one contiguous span and neighbouring
    samples share cache lines. Costs one copy of ``value`` per call, worth it when the points read each pixel
    of a head about once or more (an encoder: L * P reads per pixel)."""
    return value.transpose(1, 2).contiguous().transpose(1, 2)


def check_point_tile(block_points: int, n_points: int) -> None:
    """A forced tile must hold every point of a level (the kernels have no point loop)."""
    if block_points < n_points:
        raise ValueError(f"the tile holds {block_points} points but each level has {n_points}: block_points must "
                         f"be at least P")


def check_pixel_count(value: torch.Tensor) -> None:
    """The kernels index a pixel inside its level with int32 (addresses are int64): reject ``S >= 2**31``."""
    if value.shape[1] >= 2**31:
        raise ValueError(
            f"value has S = {value.shape[1]} pixels per image; the deformable-attention kernels support up to "
            f"2**31 - 1 (int32 pixel indices inside a level, int64 addresses)"
        )


def level_strides(shapes: torch.Tensor, starts: torch.Tensor) -> tuple[int, int, int]:
    return shapes.stride(0), shapes.stride(1), starts.stride(0)


def msda_forward(
    value: torch.Tensor,
    shapes: torch.Tensor,
    starts: torch.Tensor,
    loc: torch.Tensor,
    attn: torch.Tensor,
) -> torch.Tensor:
    """Launch the forward on validated inputs (any strides); returns ``[N, Lq, M*D]`` in ``value``'s dtype."""
    check_pixel_count(value)
    n, _, heads, dim = value.shape
    _, n_queries, _, n_levels, n_points, _ = loc.shape
    out = torch.empty((n, n_queries, heads * dim), dtype=value.dtype, device=value.device)
    n_rows = n * n_queries * heads
    if n_rows == 0 or dim == 0:
        return out.zero_()
    cfg = msda_forward_config(n_rows=n_rows, dim=dim, n_points=n_points, device=value.device)
    check_point_tile(cfg.block_points, n_points)
    if cfg.transpose:
        value = transposed_value(value)
    grid = (cdiv(n_rows, cfg.block_rows), cdiv(dim, cfg.block_d))
    launch(
        msda_fwd_kernel, grid,
        value, shapes, starts, loc, attn, out,
        n_rows, n_queries, heads, n_levels, n_points,
        *value.stride(), *level_strides(shapes, starts), *loc.stride(), *attn.stride(), *out.stride(),
        DIM=dim,
        BLOCK_R=cfg.block_rows,
        BLOCK_P=cfg.block_points,
        BLOCK_D=cfg.block_d,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
