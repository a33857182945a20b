"""Triton helpers shared by every deformable-attention kernel: row decoding, one level's geometry, bilinear corners.

One definition of the sampling geometry serves the forward, the backward and the deterministic value-gradient
gather, so the three can never disagree on which corner a sample touches or with what weight. The geometry is
``grid_sample(bilinear, zeros, align_corners=False)``: pixel ``px = x * W - 0.5``, corners ``floor(px)`` and
``floor(px) + 1``, each read as zero outside the map. All of it is fp32; addresses are int64.

The kernels walk the levels in a runtime loop, so a level's (H, W, start) are scalars: the per-point geometry
costs a handful of instructions, which matters because every channel slice of a point repeats it (the kernels
are bound by instruction issue and L1 gathers, benchmarks/NOTES.md, "Tiles [rows, points, channels]").

No address ever leaves ``value``, whatever the level table holds. A level that fits (``0 <= start``,
``start + H * W <= S``, both sides non-negative) keeps every in-map corner inside by construction, so the per-point
path is unchanged; for one that does not, :func:`level_spills` is true and the kernels narrow the corner masks with
:func:`corners_inside` (per point, on that level only), so a corner outside ``[0, S)`` reads zero and receives
nothing. The host refuses such tables before any launch; this is the kernels' own guarantee.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["query_rows", "level_shape", "level_points", "level_spills", "load_samples", "bilinear", "nearest",
           "corner_weights", "corner_masks", "corners_inside"]


@triton.jit
def query_rows(pid, n_rows, n_queries, n_heads, BLOCK_R: tl.constexpr):
    """A block of rows flattened as (batch, head, query), query fastest.

    Consecutive queries of one head sample neighbouring pixels (an encoder's queries are the pixels themselves),
    so a program's corner gathers overlap and hit in L1. Out-of-range rows are clamped to row 0 (and masked by
    ``row_ok``) so that every address computed from them stays inside the tensors.
    """
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    rows = tl.where(row_ok, rows, 0)
    query = rows % n_queries
    head = (rows // n_queries) % n_heads
    batch = rows // n_queries // n_heads
    return row_ok, batch, query, head


@triton.jit
def level_shape(level, shapes_ptr, starts_ptr, stride_sl, stride_sc, stride_st):
    """``(height, width)`` of one level as int32 scalars and its ``start`` along S as int64.

    int32 is enough for a pixel's index inside its level (``y * W + x < H * W <= S``): the launchers reject
    value tensors with 2**31 or more pixels per map."""
    height = tl.load(shapes_ptr + level * stride_sl).to(tl.int32)
    width = tl.load(shapes_ptr + level * stride_sl + stride_sc).to(tl.int32)
    start = tl.load(starts_ptr + level * stride_st).to(tl.int64)
    return height, width, start


@triton.jit
def level_points(level, points_ptr, n_points, POINT_TABLE: tl.constexpr):
    """``(first, count)``: where a level's points start in a row of samples and how many it has.

    Deformable DETR gives every level ``n_points`` (first = level * P). RT-DETRv2 / D-FINE give each level its own
    count (``num_points_list``), the points of all levels flattened per row: then ``points_ptr`` is an int32
    ``[L, 2]`` table of (first, count) and ``n_points`` is the row's total."""
    if POINT_TABLE:
        first = tl.load(points_ptr + 2 * level)
        count = tl.load(points_ptr + 2 * level + 1)
    else:
        first = level * n_points
        count = n_points
    return first, count


@triton.jit
def level_spills(height, width, start, n_pixels):
    """Scalar: whether some pixel ``start + y * W + x`` (``0 <= y < H``, ``0 <= x < W``) of the level may lie outside
    ``[0, n_pixels)``. False for every table the host accepts; then corner indices are in range by construction."""
    return (height < 0) | (width < 0) | (start < 0) | (start + height.to(tl.int64) * width > n_pixels)


@triton.jit
def corners_inside(pixel, width, n_pixels, m00, m01, m10, m11):
    """The four corner masks narrowed to corners whose pixel (``pixel``, ``pixel + 1``, ``pixel + W``,
    ``pixel + W + 1``; ``pixel`` int64 ``[rows, points]``) lies in ``[0, n_pixels)``, for a level that spills."""
    below = pixel + width
    return (
        m00 & ((pixel >= 0) & (pixel < n_pixels))[:, :, None],
        m01 & ((pixel >= -1) & (pixel < n_pixels - 1))[:, :, None],
        m10 & ((below >= 0) & (below < n_pixels))[:, :, None],
        m11 & ((below >= -1) & (below < n_pixels - 1))[:, :, None],
    )


@triton.jit
def load_samples(loc_rows, attn_rows, level, point, live, stride_ll, stride_lp, stride_lc, stride_al, stride_ap):
    """``[rows, points]`` locations (x, y) and attention weights of one level, upcast to fp32 (0 where not
    ``live``)."""
    loc = loc_rows[:, None] + level * stride_ll + point[None, :] * stride_lp
    loc_x = tl.load(loc, mask=live, other=0.0).to(tl.float32)
    loc_y = tl.load(loc + stride_lc, mask=live, other=0.0).to(tl.float32)
    weight = tl.load(attn_rows[:, None] + level * stride_al + point[None, :] * stride_ap, mask=live,
                     other=0.0).to(tl.float32)
    return loc_x, loc_y, weight


@triton.jit
def bilinear(loc_x, loc_y, height, width, live):
    """Top-left corner (x0, y0) as int64, fractions (fx, fy) and which corner columns / rows lie on the map (and
    are ``live``), for a tile of samples on one level of scalar ``height`` x ``width``.

    Bounds are tested on the float coordinates, where NaN compares false and a huge value stays huge, and only
    then is the corner converted to an integer: garbage coordinates can never produce an in-map address. A NaN or
    infinite location leaves fx / fy NaN, so (as with grid_sample) it turns the output NaN without reading memory.
    """
    w = width.to(tl.float32)
    h = height.to(tl.float32)
    px = loc_x * w - 0.5
    py = loc_y * h - 0.5
    x0f = tl.floor(px)
    y0f = tl.floor(py)
    fx = px - x0f
    fy = py - y0f
    in_x0 = (x0f >= 0.0) & (x0f < w)
    in_x1 = (x0f >= -1.0) & (x0f < w - 1.0)
    in_y0 = (y0f >= 0.0) & (y0f < h) & live
    in_y1 = (y0f >= -1.0) & (y0f < h - 1.0) & live
    # fp32 holds every in-map coordinate exactly only below 2**24, so int32 is wide enough here.
    x0 = tl.where(in_x0 | in_x1, x0f, -1.0).to(tl.int32)
    y0 = tl.where(in_y0 | in_y1, y0f, -1.0).to(tl.int32)
    return x0, y0, fx, fy, in_x0, in_x1, in_y0, in_y1


@triton.jit
def nearest(loc_x, loc_y, height, width, live):
    """RT-DETRv2's discrete sampling: the pixel ``(x, y)`` = ``int(loc * size + 0.5)`` clamped to the map (int32
    ``[rows, points]``), and whether it is read (``live`` on a non-empty map).

    Clamping happens on the float coordinate, where NaN compares false: a NaN coordinate lands on 0 and an
    infinite one on the border, as transformers' ``.to(torch.int64)`` followed by ``clamp`` does on a GPU; a
    value below 0.5 pixels truncates to 0 either way."""
    w = width.to(tl.float32)
    h = height.to(tl.float32)
    px = loc_x * w + 0.5
    py = loc_y * h + 0.5
    x = tl.where(px >= w - 1.0, w - 1.0, tl.where(px > 0.0, tl.floor(px), 0.0))
    y = tl.where(py >= h - 1.0, h - 1.0, tl.where(py > 0.0, tl.floor(py), 0.0))
    # On an empty map (W or H = 0) no clamped coordinate satisfies both bounds, so nothing is read there.
    reads = (x >= 0.0) & (x < w) & (y >= 0.0) & (y < h) & live
    return x.to(tl.int32), y.to(tl.int32), reads


@triton.jit
def corner_weights(fx, fy, weight):
    """The four bilinear weights (top-left, top-right, bottom-left, bottom-right) times ``weight``."""
    bottom = weight * fy
    top = weight - bottom
    top_right = top * fx
    bottom_right = bottom * fx
    return top - top_right, top_right, bottom - bottom_right, bottom_right


@triton.jit
def corner_masks(in_x0, in_x1, in_y0, in_y1, chan_ok):
    """``[rows, points, channels]`` load / store masks of the four corners."""
    return (
        (in_y0 & in_x0)[:, :, None] & chan_ok,
        (in_y0 & in_x1)[:, :, None] & chan_ok,
        (in_y1 & in_x0)[:, :, None] & chan_ok,
        (in_y1 & in_x1)[:, :, None] & chan_ok,
    )
