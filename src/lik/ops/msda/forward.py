"""Fused deformable-attention forward: bilinear gathers, weighted and summed in registers.

A program owns ``BLOCK_R`` consecutive queries of one head (rows ordered (batch, head, query)) and ``BLOCK_D``
channels. It walks the L * P sampling points in blocks of ``BLOCK_P``: each block's locations and weights are
loaded as one ``[rows, points]`` tile, and the four corners of every point are gathered as
``[rows, points, channels]`` tiles whose loads are all independent (many in flight per thread, which is what a
gather-bound kernel needs). The only write is the ``[N, Lq, M*D]`` result: nothing of the size
``N * Lq * M * L * P * D`` that ``grid_sample`` materialises ever exists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._config import cdiv, msda_forward_config
from .sampling import corner_setup, gather_corners, gather_pairs, load_sample, point_block, query_rows, x_weights

__all__ = ["msda_fwd_kernel", "msda_forward", "transposed_value", "RUNTIME_INTS"]

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
    PAIR: tl.constexpr,
):
    row_ok, batch, query, head = query_rows(tl.program_id(0), n_rows, n_queries, n_heads, BLOCK_R)
    chan = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    chan_ok = chan < DIM
    value_rows = value_ptr + batch * stride_vn + head * stride_vm
    chan_off = chan.to(tl.int64) * stride_vd
    loc_rows = loc_ptr + batch * stride_ln + query * stride_lq + head * stride_lm
    attn_rows = attn_ptr + batch * stride_an + query * stride_aq + head * stride_am
    n_samples = n_levels * n_points

    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    acc2 = tl.zeros((BLOCK_R, 2, BLOCK_D), tl.float32)
    for first in range(0, n_samples, BLOCK_P):
        _, j_ok, level, point, height, width, start = point_block(
            first, n_points, n_samples, shapes_ptr, starts_ptr, stride_sl, stride_sc, stride_st, BLOCK_P
        )
        live = row_ok[:, None] & j_ok[None, :]
        loc_x, loc_y, weight = load_sample(
            loc_rows[:, None] + (level * stride_ll + point * stride_lp)[None, :],
            attn_rows[:, None] + (level * stride_al + point * stride_ap)[None, :],
            live, stride_lc,
        )
        x0, y0, fx, fy, in_x0, in_x1, in_y0, in_y1 = corner_setup(loc_x, loc_y, height[None, :], width[None, :], live)
        if PAIR:
            # x-neighbours as one [rows, points, 2, channels] tile per corner row; the two halves are added once
            # at the end.
            top, bottom = gather_pairs(
                value_rows, chan_off, chan_ok, x0, y0, in_x0, in_x1, in_y0, in_y1, width, start, stride_vs
            )
            wx = (weight[:, :, None] * x_weights(fx))[:, :, :, None]
            gy = fy[:, :, None, None]
            acc2 += tl.sum(wx * (top + gy * (bottom - top)), axis=1)
        else:
            v00, v01, v10, v11 = gather_corners(
                value_rows, chan_off, chan_ok, x0, y0, in_x0, in_x1, in_y0, in_y1, width, start, stride_vs
            )
            gx = fx[:, :, None]
            top = v00 + gx * (v01 - v00)
            bottom = v10 + gx * (v11 - v10)
            acc += tl.sum(weight[:, :, None] * (top + fy[:, :, None] * (bottom - top)), axis=1)
    if PAIR:
        acc = tl.sum(acc2, axis=1)

    out = out_ptr + batch * stride_on + query * stride_oq + (head * DIM) * stride_oc
    tl.store(out[:, None] + (chan * stride_oc)[None, :], acc, mask=row_ok[:, None] & chan_ok[None, :])


def transposed_value(value: torch.Tensor) -> torch.Tensor:
    """``value`` copied into the ``[N, M, S, D]`` layout and viewed as ``[N, S, M, D]`` again: each head's map is
    one contiguous block, its pixels ``D`` apart, so a corner pair is one contiguous span and neighbouring
    samples share cache lines. Costs one copy of ``value`` per call, worth it when the points read each pixel
    of a head about once or more (an encoder: L * P reads per pixel)."""
    return value.transpose(1, 2).contiguous().transpose(1, 2)


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
    n, _, heads, dim = value.shape
    _, n_queries, _, n_levels, n_points, _ = loc.shape
    out = torch.empty((n, n_queries, heads * dim), dtype=value.dtype, device=value.device)
    n_rows = n * n_queries * heads
    if n_rows == 0 or dim == 0:
        return out.zero_()
    cfg = msda_forward_config(n_rows=n_rows, dim=dim, n_samples=n_levels * n_points, dtype=value.dtype,
                              device=value.device, n_queries=n_queries, n_pixels=value.shape[1])
    if cfg.transpose:
        value = transposed_value(value)
    grid = (cdiv(n_rows, cfg.block_rows), cdiv(dim, cfg.block_d))
    msda_fwd_kernel[grid](
        value, shapes, starts, loc, attn, out,
        n_rows, n_queries, heads, n_levels, n_points,
        *value.stride(), *level_strides(shapes, starts), *loc.stride(), *attn.stride(), *out.stride(),
        DIM=dim,
        BLOCK_R=cfg.block_rows,
        BLOCK_P=cfg.block_points,
        BLOCK_D=cfg.block_d,
        PAIR=cfg.pair,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
