"""Triton helpers shared by every deformable-attention kernel: row decoding, level lookup, bilinear corners.

One definition of the sampling geometry serves the forward, the backward and the deterministic value-gradient
gather, so the three can never disagree on which corner a sample touches or with what weight. The geometry is
``grid_sample(bilinear, zeros, align_corners=False)``: pixel ``px = x * W - 0.5``, corners ``floor(px)`` and
``floor(px) + 1``, each read as zero outside the map. All of it is fp32, all addressing int64.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["query_rows", "level_geometry", "load_sample", "corner_setup", "corner_pointers", "gather_corners"]


@triton.jit
def query_rows(pid, n_rows, n_queries, n_heads, BLOCK_R: tl.constexpr):
    """A block of (batch, query, head) rows, flattened in that order; out-of-range rows are clamped to row 0
    (and masked by ``row_ok``) so that every address computed from them stays inside the tensors."""
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    rows = tl.where(row_ok, rows, 0)
    head = rows % n_heads
    query = (rows // n_heads) % n_queries
    batch = rows // n_heads // n_queries
    return rows, row_ok, batch, query, head


@triton.jit
def level_geometry(shapes_ptr, starts_ptr, level, stride_sl, stride_sc, stride_st):
    """(H, W, start) of one level as int64 scalars (shape tensors may be int32 or int64)."""
    height = tl.load(shapes_ptr + level * stride_sl).to(tl.int64)
    width = tl.load(shapes_ptr + level * stride_sl + stride_sc).to(tl.int64)
    start = tl.load(starts_ptr + level * stride_st).to(tl.int64)
    return height, width, start


@triton.jit
def load_sample(loc_rows, attn_rows, live, level, point, stride_ll, stride_lp, stride_lc, stride_al, stride_ap):
    """Location (x, y) and attention weight of one sampling point for a block of rows, upcast to fp32."""
    loc = loc_rows + level * stride_ll + point * stride_lp
    loc_x = tl.load(loc, mask=live, other=0.0).to(tl.float32)
    loc_y = tl.load(loc + stride_lc, mask=live, other=0.0).to(tl.float32)
    weight = tl.load(attn_rows + level * stride_al + point * stride_ap, mask=live, other=0.0).to(tl.float32)
    return loc_x, loc_y, weight


@triton.jit
def corner_setup(loc_x, loc_y, height, width):
    """Top-left corner (x0, y0), fractions (fx, fy) and which of the corner columns / rows lie on the map.

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
    in_y0 = (y0f >= 0.0) & (y0f < h)
    in_y1 = (y0f >= -1.0) & (y0f < h - 1.0)
    x0 = tl.where(in_x0 | in_x1, x0f, -1.0).to(tl.int64)
    y0 = tl.where(in_y0 | in_y1, y0f, -1.0).to(tl.int64)
    return x0, y0, fx, fy, in_x0, in_x1, in_y0, in_y1


@triton.jit
def corner_pointers(rows_ptr, chan_off, chan_ok, x0, y0, in_x0, in_x1, in_y0, in_y1, width, start, stride_s):
    """Pointer tile of the top-left corner, the pixel strides to the other three, and the four masks."""
    ptr = rows_ptr[:, None] + ((start + y0 * width + x0) * stride_s)[:, None] + chan_off[None, :]
    ok = chan_ok[None, :]
    m00 = (in_y0 & in_x0)[:, None] & ok
    m01 = (in_y0 & in_x1)[:, None] & ok
    m10 = (in_y1 & in_x0)[:, None] & ok
    m11 = (in_y1 & in_x1)[:, None] & ok
    return ptr, stride_s, width * stride_s, m00, m01, m10, m11


@triton.jit
def gather_corners(rows_ptr, chan_off, chan_ok, x0, y0, in_x0, in_x1, in_y0, in_y1, width, start, stride_s):
    """The four corner tiles ``[rows, channels]`` in fp32, zero where a corner is off the map."""
    ptr, right, down, m00, m01, m10, m11 = corner_pointers(
        rows_ptr, chan_off, chan_ok, x0, y0, in_x0, in_x1, in_y0, in_y1, width, start, stride_s
    )
    v00 = tl.load(ptr, mask=m00, other=0.0).to(tl.float32)
    v01 = tl.load(ptr + right, mask=m01, other=0.0).to(tl.float32)
    v10 = tl.load(ptr + down, mask=m10, other=0.0).to(tl.float32)
    v11 = tl.load(ptr + down + right, mask=m11, other=0.0).to(tl.float32)
    return v00, v01, v10, v11
