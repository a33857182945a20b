"""Triton helpers shared by every deformable-attention kernel: row decoding, level lookup, bilinear corners.

One definition of the sampling geometry serves the forward, the backward and the deterministic value-gradient
gather, so the three can never disagree on which corner a sample touches or with what weight. The geometry is
``grid_sample(bilinear, zeros, align_corners=False)``: pixel ``px = x * W - 0.5``, corners ``floor(px)`` and
``floor(px) + 1``, each read as zero outside the map. All of it is fp32, all addressing int64.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "query_rows", "point_block", "load_sample", "corner_setup", "corner_pointers", "gather_corners", "pair_pointers",
    "gather_pairs", "x_weights",
]


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
def point_block(first, n_points, n_samples, shapes_ptr, starts_ptr, stride_sl, stride_sc, stride_st,
                BLOCK_P: tl.constexpr):
    """``BLOCK_P`` sampling points (level-major, as in ``[L, P]``) from index ``first`` on, with the (H, W,
    start) of each one's level as int64 vectors; points past ``n_samples`` = L * P are masked and read a 0x0 map."""
    j = first + tl.arange(0, BLOCK_P)
    j_ok = j < n_samples
    level = j // n_points
    point = j - level * n_points
    height = tl.load(shapes_ptr + level * stride_sl, mask=j_ok, other=0).to(tl.int64)
    width = tl.load(shapes_ptr + level * stride_sl + stride_sc, mask=j_ok, other=0).to(tl.int64)
    start = tl.load(starts_ptr + level * stride_st, mask=j_ok, other=0).to(tl.int64)
    return j, j_ok, level, point, height, width, start


@triton.jit
def load_sample(loc_ptrs, attn_ptrs, live, stride_lc):
    """Locations (x, y) and attention weights at the given pointers, upcast to fp32 (0 where not ``live``)."""
    loc_x = tl.load(loc_ptrs, mask=live, other=0.0).to(tl.float32)
    loc_y = tl.load(loc_ptrs + stride_lc, mask=live, other=0.0).to(tl.float32)
    weight = tl.load(attn_ptrs, mask=live, other=0.0).to(tl.float32)
    return loc_x, loc_y, weight


@triton.jit
def corner_setup(loc_x, loc_y, height, width, live):
    """Top-left corner (x0, y0), fractions (fx, fy) and which corner columns / rows lie on the map (and are
    ``live``); any shape, broadcasting.

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
    x0 = tl.where(in_x0 | in_x1, x0f, -1.0).to(tl.int64)
    y0 = tl.where(in_y0 | in_y1, y0f, -1.0).to(tl.int64)
    return x0, y0, fx, fy, in_x0, in_x1, in_y0, in_y1


@triton.jit
def corner_pointers(rows_ptr, chan_off, chan_ok, x0, y0, in_x0, in_x1, in_y0, in_y1, width, start, stride_s):
    """For ``[rows, points]`` corners: the ``[rows, points, channels]`` pointer tile of the top-left corners, the
    steps to the right and lower neighbours, and the four masks."""
    pixel = start[None, :] + y0 * width[None, :] + x0
    ptr = rows_ptr[:, None, None] + (pixel * stride_s)[:, :, None] + chan_off[None, None, :]
    ok = chan_ok[None, None, :]
    m00 = (in_y0 & in_x0)[:, :, None] & ok
    m01 = (in_y0 & in_x1)[:, :, None] & ok
    m10 = (in_y1 & in_x0)[:, :, None] & ok
    m11 = (in_y1 & in_x1)[:, :, None] & ok
    return ptr, stride_s, (width * stride_s)[None, :, None], m00, m01, m10, m11


@triton.jit
def gather_corners(rows_ptr, chan_off, chan_ok, x0, y0, in_x0, in_x1, in_y0, in_y1, width, start, stride_s):
    """The four corner tiles ``[rows, points, channels]`` in fp32, zero where a corner is off the map; all
    4 * points loads are independent, so they are in flight together."""
    ptr, right, down, m00, m01, m10, m11 = corner_pointers(
        rows_ptr, chan_off, chan_ok, x0, y0, in_x0, in_x1, in_y0, in_y1, width, start, stride_s
    )
    v00 = tl.load(ptr, mask=m00, other=0.0).to(tl.float32)
    v01 = tl.load(ptr + right, mask=m01, other=0.0).to(tl.float32)
    v10 = tl.load(ptr + down, mask=m10, other=0.0).to(tl.float32)
    v11 = tl.load(ptr + down + right, mask=m11, other=0.0).to(tl.float32)
    return v00, v01, v10, v11


@triton.jit
def pair_pointers(rows_ptr, chan_off, chan_ok, x0, y0, in_x0, in_x1, in_y0, in_y1, width, start, stride_s):
    """The two x-neighbours of a corner row as one ``[rows, points, 2, channels]`` tile (the middle axis is
    x0 / x0 + 1): the pointer tile of the top row, the step to the bottom row and the top / bottom masks.

    In the transposed ``[N, M, S, D]`` value layout the two halves are one contiguous ``2 * D`` span, so a pair
    costs one wide request instead of two; in any layout it halves the address arithmetic and mask work.
    """
    pixel = start[None, :] + y0 * width[None, :] + x0
    half = tl.arange(0, 2).to(tl.int64)
    ptr = (rows_ptr[:, None, None, None] + ((pixel[:, :, None] + half[None, None, :]) * stride_s)[:, :, :, None]
           + chan_off[None, None, None, :])
    in_x = tl.where(half[None, None, :] == 0, in_x0[:, :, None], in_x1[:, :, None])
    ok = chan_ok[None, None, None, :]
    m_top = (in_y0[:, :, None] & in_x)[:, :, :, None] & ok
    m_bottom = (in_y1[:, :, None] & in_x)[:, :, :, None] & ok
    return ptr, (width * stride_s)[None, :, None, None], m_top, m_bottom


@triton.jit
def gather_pairs(rows_ptr, chan_off, chan_ok, x0, y0, in_x0, in_x1, in_y0, in_y1, width, start, stride_s):
    """Top and bottom corner pairs ``[rows, points, 2, channels]`` in fp32 (zero off the map)."""
    ptr, down, m_top, m_bottom = pair_pointers(
        rows_ptr, chan_off, chan_ok, x0, y0, in_x0, in_x1, in_y0, in_y1, width, start, stride_s
    )
    top = tl.load(ptr, mask=m_top, other=0.0).to(tl.float32)
    bottom = tl.load(ptr + down, mask=m_bottom, other=0.0).to(tl.float32)
    return top, bottom


@triton.jit
def x_weights(fx):
    """``[rows, points, 2]`` bilinear x weights (1 - fx, fx) of a corner pair."""
    half = tl.arange(0, 2)
    return tl.where(half[None, None, :] == 0, 1.0 - fx[:, :, None], fx[:, :, None])
