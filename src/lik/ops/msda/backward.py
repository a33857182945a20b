"""Deformable-attention backward: sample-side gradients without atomics, value gradient two ways.

``msda_bwd_kernel`` walks the same row blocks (consecutive queries of one head) and point blocks as the forward.
Per point it re-gathers the four corners and writes the location and attention-weight gradients directly (each
point belongs to exactly one program per channel block, and the channel reduction happens in registers: no
atomics; heads wider than one channel block add fp32 partials afterwards). For ``grad_value`` it either

* scatters ``weight * bilinear_weight * grad_out`` into an fp32 buffer with relaxed-ordering atomics (fast path:
  fp32 because bf16 / fp16 atomics round at every add and, before Hopper, fall into a compare-and-swap loop), or
* writes each point's *bucket* (batch, head, level, top-left corner cell) for the deterministic path: the points
  are stably sorted by bucket and ``msda_bwd_value_kernel`` lets every value row gather, in a fixed order, from
  the (at most) four buckets whose points can reach it. No atomics, bitwise repeatable.

A corner cell is indexed on a (H + 1) x (W + 1) grid per level, since a top-left corner can be -1 in x or y.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._config import cdiv, msda_backward_config
from .forward import RUNTIME_INTS, level_strides, transposed_value
from .sampling import (
    corner_pointers, corner_setup, gather_corners, gather_pairs, load_sample, pair_pointers, point_block, query_rows,
    x_weights,
)

__all__ = ["msda_bwd_kernel", "msda_bwd_value_kernel", "msda_backward"]


@triton.jit(do_not_specialize=RUNTIME_INTS + ["n_cells", "no_bucket", "stride_gc"])
def msda_bwd_kernel(
    value_ptr, shapes_ptr, starts_ptr, cells_ptr, loc_ptr, attn_ptr, gout_ptr,
    gvalue_ptr, gloc_ptr, gattn_ptr, bucket_ptr,
    n_rows, n_queries, n_heads, n_levels, n_points, n_cells, no_bucket,
    stride_vn, stride_vs, stride_vm, stride_vd,
    stride_sl, stride_sc, stride_st,
    stride_ln, stride_lq, stride_lm, stride_ll, stride_lp, stride_lc,
    stride_an, stride_aq, stride_am, stride_al, stride_ap,
    stride_on, stride_oq, stride_oc,
    stride_gvn, stride_gvs, stride_gvm,
    stride_gc,
    DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ATOMIC_VALUE: tl.constexpr,
    WRITE_BUCKETS: tl.constexpr,
    PAIR: tl.constexpr,
):
    row_ok, batch, query, head = query_rows(tl.program_id(0), n_rows, n_queries, n_heads, BLOCK_R)
    chunk = tl.program_id(1)
    chan = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    chan_ok = chan < DIM
    value_rows = value_ptr + batch * stride_vn + head * stride_vm
    chan_off = chan.to(tl.int64) * stride_vd
    loc_rows = loc_ptr + batch * stride_ln + query * stride_lq + head * stride_lm
    attn_rows = attn_ptr + batch * stride_an + query * stride_aq + head * stride_am
    gout = gout_ptr + batch * stride_on + query * stride_oq + (head * DIM) * stride_oc
    grad = tl.load(
        gout[:, None] + (chan * stride_oc)[None, :], mask=row_ok[:, None] & chan_ok[None, :], other=0.0
    ).to(tl.float32)[:, None, :]
    gvalue_rows = gvalue_ptr + batch * stride_gvn + head * stride_gvm
    n_samples = n_levels * n_points
    # Point gradients are written contiguously as [chunk, N, Lq, M, L * P] (times 2 for locations).
    row_samples = ((batch * n_queries + query) * n_heads + head) * n_samples

    for first in range(0, n_samples, BLOCK_P):
        j, j_ok, level, point, height, width, start = point_block(
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
            top, bottom = gather_pairs(
                value_rows, chan_off, chan_ok, x0, y0, in_x0, in_x1, in_y0, in_y1, width, start, stride_vs
            )
            wx = x_weights(fx)
            gy = fy[:, :, None, None]
            grad4 = grad[:, :, None, :]
            # Per x-half (x0, x0 + 1): the vertical lerp and the vertical difference, reduced over channels.
            sampled_half = tl.sum(grad4 * (top + gy * (bottom - top)), axis=3)
            d_py_half = tl.sum(grad4 * (bottom - top), axis=3)
            g_sampled = tl.sum(wx * sampled_half, axis=2)
            g_px = tl.sum(tl.where(tl.arange(0, 2)[None, None, :] == 0, -sampled_half, sampled_half), axis=2)
            g_py = tl.sum(wx * d_py_half, axis=2)
        else:
            v00, v01, v10, v11 = gather_corners(
                value_rows, chan_off, chan_ok, x0, y0, in_x0, in_x1, in_y0, in_y1, width, start, stride_vs
            )
            gx = fx[:, :, None]
            gy = fy[:, :, None]
            top = v00 + gx * (v01 - v00)
            bottom = v10 + gx * (v11 - v10)
            sampled = top + gy * (bottom - top)
            # d sampled / d px and d py; px = x * W - 0.5, so d px / d x = W (and d py / d y = H).
            d_px = (1.0 - gy) * (v01 - v00) + gy * (v11 - v10)
            d_py = bottom - top
            g_sampled = tl.sum(grad * sampled, axis=2)
            g_px = tl.sum(grad * d_px, axis=2)
            g_py = tl.sum(grad * d_py, axis=2)
        sample = row_samples[:, None] + j[None, :]
        index = chunk * stride_gc + sample
        tl.store(gattn_ptr + index, g_sampled, mask=live)
        scale_x = weight * width[None, :].to(tl.float32)
        scale_y = weight * height[None, :].to(tl.float32)
        tl.store(gloc_ptr + 2 * index, scale_x * g_px, mask=live)
        tl.store(gloc_ptr + 2 * index + 1, scale_y * g_py, mask=live)
        if ATOMIC_VALUE:
            if PAIR:
                ptr, down, m_top, m_bottom = pair_pointers(
                    gvalue_rows, chan, chan_ok, x0, y0, in_x0, in_x1, in_y0, in_y1, width, start, stride_gvs
                )
                g = grad[:, :, None, :] * (weight[:, :, None] * wx)[:, :, :, None]
                gb = g * gy
                tl.atomic_add(ptr, g - gb, mask=m_top, sem="relaxed")
                tl.atomic_add(ptr + down, gb, mask=m_bottom, sem="relaxed")
            else:
                ptr, right, down, m00, m01, m10, m11 = corner_pointers(
                    gvalue_rows, chan, chan_ok, x0, y0, in_x0, in_x1, in_y0, in_y1, width, start, stride_gvs
                )
                g = grad * weight[:, :, None]
                gb = g * gy
                gt = g - gb
                tl.atomic_add(ptr, gt - gt * gx, mask=m00, sem="relaxed")
                tl.atomic_add(ptr + right, gt * gx, mask=m01, sem="relaxed")
                tl.atomic_add(ptr + down, gb - gb * gx, mask=m10, sem="relaxed")
                tl.atomic_add(ptr + down + right, gb * gx, mask=m11, sem="relaxed")
        if WRITE_BUCKETS:
            reaches = (in_x0 | in_x1) & (in_y0 | in_y1)
            cell = tl.load(cells_ptr + level, mask=j_ok, other=0)[None, :] + (y0 + 1) * (width[None, :] + 1) + (x0 + 1)
            bucket = tl.where(reaches, (batch * n_heads + head)[:, None] * n_cells + cell, no_bucket)
            # Every channel chunk computes the same bucket; the duplicate stores are identical.
            tl.store(bucket_ptr + sample, bucket, mask=live)


@triton.jit(do_not_specialize=RUNTIME_INTS + ["n_pixels"])
def msda_bwd_value_kernel(
    shapes_ptr, starts_ptr, cells_ptr, loc_ptr, attn_ptr, gout_ptr, offsets_ptr, order_ptr, gvalue_ptr,
    n_rows, n_pixels, n_queries, n_heads, n_levels, n_points, n_cells,
    stride_sl, stride_sc, stride_st,
    stride_ln, stride_lq, stride_lm, stride_ll, stride_lp, stride_lc,
    stride_an, stride_aq, stride_am, stride_al, stride_ap,
    stride_on, stride_oq, stride_oc,
    stride_gvn, stride_gvs, stride_gvm, stride_gvd,
    DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Rows here are value rows (batch, head, pixel), pixel fastest.
    row_ok, batch, pixel, head = query_rows(tl.program_id(0), n_rows, n_pixels, n_heads, BLOCK_R)
    chan = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    chan_ok = chan < DIM
    chan_grad = (chan * stride_oc)[None, :]
    points_per_row = n_levels * n_points

    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    for level in range(n_levels):
        height = tl.load(shapes_ptr + level * stride_sl).to(tl.int64)
        width = tl.load(shapes_ptr + level * stride_sl + stride_sc).to(tl.int64)
        local = pixel - tl.load(starts_ptr + level * stride_st).to(tl.int64)
        inside = row_ok & (local >= 0) & (local < height * width)
        y = tl.where(inside, local, 0) // tl.maximum(width, 1)
        x = tl.where(inside, local, 0) - y * width
        bucket_row = (batch * n_heads + head) * n_cells + tl.load(cells_ptr + level)
        # Fixed order: corner by corner, each bucket in sorted (= original point) order.
        for corner in tl.static_range(4):
            dy = corner // 2
            dx = corner % 2
            bucket = bucket_row + (y - dy + 1) * (width + 1) + (x - dx + 1)
            begin = tl.load(offsets_ptr + bucket, mask=inside, other=0)
            count = tl.load(offsets_ptr + bucket + 1, mask=inside, other=0) - begin
            for k in range(tl.max(count, axis=0)):
                live = k < count
                sample = tl.load(order_ptr + begin + k, mask=live, other=0)
                point = sample % n_points
                query = (sample // points_per_row // n_heads) % n_queries
                loc_x, loc_y, weight = load_sample(
                    loc_ptr + batch * stride_ln + query * stride_lq + head * stride_lm + level * stride_ll
                    + point * stride_lp,
                    attn_ptr + batch * stride_an + query * stride_aq + head * stride_am + level * stride_al
                    + point * stride_ap,
                    live, stride_lc,
                )
                _, _, fx, fy, _, _, _, _ = corner_setup(loc_x, loc_y, height, width, live)
                # The corner this pixel is, seen from the point: right neighbour weighs fx, left one 1 - fx.
                if dx == 1:
                    wx = fx
                else:
                    wx = 1.0 - fx
                if dy == 1:
                    wy = fy
                else:
                    wy = 1.0 - fy
                coef = tl.where(live, weight * wx * wy, 0.0)
                gout = gout_ptr + batch * stride_on + query * stride_oq + (head * DIM) * stride_oc
                grad = tl.load(gout[:, None] + chan_grad, mask=live[:, None] & chan_ok[None, :], other=0.0)
                acc += coef[:, None] * grad.to(tl.float32)

    out = gvalue_ptr + batch * stride_gvn + pixel * stride_gvs + head * stride_gvm
    tl.store(out[:, None] + (chan * stride_gvd)[None, :], acc, mask=row_ok[:, None] & chan_ok[None, :])


def msda_backward(
    grad_out: torch.Tensor,
    value: torch.Tensor,
    shapes: torch.Tensor,
    starts: torch.Tensor,
    loc: torch.Tensor,
    attn: torch.Tensor,
    *,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(grad_value, grad_sampling_locations, grad_attention_weights)``, each in its input's dtype."""
    n, n_pixels, heads, dim = value.shape
    _, n_queries, _, n_levels, n_points, _ = loc.shape
    device = value.device
    n_rows = n * n_queries * heads
    cfg = msda_backward_config(n_rows=n_rows, dim=dim, n_samples=n_levels * n_points, dtype=value.dtype,
                               device=device, n_queries=n_queries, n_pixels=n_pixels)
    n_chunks = cdiv(dim, cfg.block_d) if dim else 1
    n_samples = n_rows * n_levels * n_points
    if n_samples == 0 or dim == 0:
        return torch.zeros_like(value), torch.zeros_like(loc), torch.zeros_like(attn)
    # One channel chunk writes the point gradients in their final dtype; several add fp32 partials afterwards.
    # The kernel writes every point, so no memset; the atomic value gradient needs a zeroed fp32 buffer, the
    # deterministic one writes every value row in the value's dtype.
    gloc = torch.empty((n_chunks, *loc.shape), dtype=loc.dtype if n_chunks == 1 else torch.float32, device=device)
    gattn = torch.empty((n_chunks, *attn.shape), dtype=attn.dtype if n_chunks == 1 else torch.float32, device=device)
    if deterministic:
        gvalue = torch.empty(value.shape, dtype=value.dtype, device=device)
    else:
        # fp32 accumulator; in the transposed layout when the gathers use it (the same corner pairs are
        # contiguous there), copied back to [N, S, M, D] at the end.
        if cfg.transpose:
            gvalue = torch.zeros((n, heads, n_pixels, dim), dtype=torch.float32, device=device).transpose(1, 2)
        else:
            gvalue = torch.zeros(value.shape, dtype=torch.float32, device=device)
    if cfg.transpose:
        value = transposed_value(value)

    if deterministic:
        # Corner cells of every level on a (H + 1) x (W + 1) grid; one host sync for their total.
        sizes = (shapes[:, 0].to(torch.int64) + 1) * (shapes[:, 1].to(torch.int64) + 1)
        cells = torch.cumsum(sizes, 0) - sizes
        n_cells = int(sizes.sum())
        no_bucket = n * heads * n_cells
        buckets = torch.empty(n_samples, dtype=torch.int64, device=device)
    else:
        cells, n_cells, no_bucket, buckets = starts, 0, 0, gvalue

    grid = (cdiv(n_rows, cfg.block_rows), n_chunks)
    msda_bwd_kernel[grid](
        value, shapes, starts, cells, loc, attn, grad_out,
        gvalue, gloc, gattn, buckets,
        n_rows, n_queries, heads, n_levels, n_points, n_cells, no_bucket,
        *value.stride(), *level_strides(shapes, starts), *loc.stride(), *attn.stride(), *grad_out.stride(),
        *gvalue.stride()[:3],
        n_samples,
        DIM=dim,
        BLOCK_R=cfg.block_rows,
        BLOCK_P=cfg.block_points,
        BLOCK_D=cfg.block_d,
        ATOMIC_VALUE=not deterministic,
        WRITE_BUCKETS=deterministic,
        PAIR=cfg.pair,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    gloc = gloc[0] if n_chunks == 1 else gloc.sum(0).to(loc.dtype)
    gattn = gattn[0] if n_chunks == 1 else gattn.sum(0).to(attn.dtype)
    if not deterministic:
        if gvalue.dtype == value.dtype and gvalue.is_contiguous():
            return gvalue, gloc, gattn
        return torch.empty(value.shape, dtype=value.dtype, device=device).copy_(gvalue), gloc, gattn

    sorted_buckets, order = torch.sort(buckets, stable=True)
    offsets = torch.searchsorted(sorted_buckets, torch.arange(no_bucket + 1, device=device))
    n_value_rows = n * n_pixels * heads
    grid = (cdiv(n_value_rows, cfg.gather_rows), cdiv(dim, cfg.block_d))
    msda_bwd_value_kernel[grid](
        shapes, starts, cells, loc, attn, grad_out, offsets, order, gvalue,
        n_value_rows, n_pixels, n_queries, heads, n_levels, n_points, n_cells,
        *level_strides(shapes, starts), *loc.stride(), *attn.stride(), *grad_out.stride(), *gvalue.stride(),
        DIM=dim,
        BLOCK_R=cfg.gather_rows,
        BLOCK_D=cfg.block_d,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return gvalue, gloc, gattn
