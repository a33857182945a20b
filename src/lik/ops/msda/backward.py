"""Deformable-attention backward: sample-side gradients without atomics, value gradient two ways.

``msda_bwd_kernel`` walks the same row blocks (consecutive queries of one head) and levels as the forward. Per
point it re-gathers the four corners and reduces each against the output gradient over channels
(``s_c = sum_d grad_d * corner_c,d``); the location and attention-weight gradients are bilinear combinations of
those four sums and are written directly (each point belongs to exactly one program per channel block: no
atomics; heads wider than one channel block add fp32 partials afterwards). For ``grad_value`` it either

* scatters ``grad_out * corner weight`` into an fp32 buffer with relaxed-ordering atomics (fast path: fp32
  because bf16 / fp16 atomics round at every add and, before Hopper, fall into a compare-and-swap loop), or
* writes each point's *bucket* (batch, head, level, top-left corner cell) for the deterministic path: the points
  are stably sorted by bucket and ``msda_bwd_value_kernel`` lets every value row gather, in a fixed order, from
  the (at most) four buckets whose points can reach it. No atomics, bitwise repeatable.

A corner cell is indexed on a (H + 1) x (W + 1) grid per level, since a top-left corner can be -1 in x or y.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..._device import cdiv, current_device, sm_count
from ..._launch import launch
from ..._replay import NEVER, allowed, file, layout_key, made, note, plan_of, recording
from ...config.msda import msda_backward_config, value_grad_accumulation
from .forward import (RUNTIME_INTS, check_pixel_count, check_point_tile, contiguous_strides, dense, kernel_value,
                      nearest_pixel, replay_key)
from .sampling import (bilinear, corner_masks, corner_weights, corners_inside, level_points, level_shape, level_spills,
                       load_samples, query_rows)
from .validation import checked_cell_count

__all__ = ["msda_bwd_kernel", "msda_bwd_value_kernel", "msda_backward", "launch_backward"]


@triton.jit(do_not_specialize=RUNTIME_INTS + ["n_cells", "no_bucket", "stride_gc"])
def msda_bwd_kernel(
    value_ptr, shapes_ptr, starts_ptr, points_ptr, cells_ptr, loc_ptr, attn_ptr, gout_ptr,
    gvalue_ptr, gloc_ptr, gattn_ptr, bucket_ptr,
    n_rows, n_pixels, n_queries, n_heads, n_levels, n_points, n_cells, no_bucket, stride_gc,
    DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_MAJOR: tl.constexpr,
    ATOMIC_VALUE: tl.constexpr,
    WRITE_BUCKETS: tl.constexpr,
    POINT_TABLE: tl.constexpr = False,
    DISCRETE: tl.constexpr = False,
    SPLIT_LEVELS: tl.constexpr = False,
):
    # Every tensor is contiguous (the launcher makes it so); value and the fp32 value gradient share one layout.
    # POINT_TABLE and DISCRETE as in the forward. SPLIT_LEVELS: one level per program (grid axis 0 is row blocks
    # times levels, level fastest); a level's points are nobody else's, so nothing but the parallelism changes.
    (stride_vn, stride_vs, stride_vm, stride_ln, stride_lq, stride_lm, stride_ll, stride_an, stride_aq, stride_am,
     stride_al, stride_on, stride_oq) = contiguous_strides(n_pixels, n_queries, n_heads,
                                                           1 if POINT_TABLE else n_levels, n_points, DIM,
                                                           HEAD_MAJOR)
    if SPLIT_LEVELS:
        block = tl.program_id(0) // n_levels
        first_level = tl.program_id(0) % n_levels
        end_level = first_level + 1
    else:
        block = tl.program_id(0)
        first_level = 0
        end_level = n_levels
    row_ok, batch, query, head = query_rows(block, n_rows, n_queries, n_heads, BLOCK_R)
    chunk = tl.program_id(1)
    chan = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    if DIM % BLOCK_D == 0:
        chan_ok = tl.full([1, 1, BLOCK_D], 1, tl.int1)
    else:
        chan_ok = (chan < DIM)[None, None, :]
    value_rows = value_ptr + batch * stride_vn + head * stride_vm
    chan_off = chan.to(tl.int64)[None, None, :]
    loc_rows = loc_ptr + batch * stride_ln + query * stride_lq + head * stride_lm
    attn_rows = attn_ptr + batch * stride_an + query * stride_aq + head * stride_am
    gout = gout_ptr + batch * stride_on + query * stride_oq + head * DIM
    grad = tl.load(
        gout[:, None] + chan[None, :], mask=row_ok[:, None] & (chan < DIM)[None, :], other=0.0
    ).to(tl.float32)[:, None, :]
    gvalue_rows = gvalue_ptr + batch * stride_vn + head * stride_vm
    # Point gradients are written contiguously as [chunk, N, Lq, M, L * P] (times 2 for locations).
    row_samples = ((batch * n_queries + query) * n_heads + head) * (n_points if POINT_TABLE else n_levels * n_points)

    # As in the forward: one loop over levels, all points of a level in one [rows, BLOCK_P] tile.
    point = tl.arange(0, BLOCK_P)
    for level in range(first_level, end_level):
        height, width, start = level_shape(level, shapes_ptr, starts_ptr, 2, 1, 1)
        first, count = level_points(level, points_ptr, n_points, POINT_TABLE)
        live = row_ok[:, None] & (point < count)[None, :]
        loc_x, loc_y, weight = load_samples(loc_rows, attn_rows, first, point, live, 2, 2, 1, 1, 1)
        sample = row_samples[:, None] + first + point[None, :]
        index = chunk * stride_gc + sample
        if DISCRETE:
            _nearest_backward(value_rows, gvalue_rows, chan_off, chan_ok, grad, loc_x, loc_y, weight, height, width,
                              start, n_pixels, live, stride_vs, cells_ptr, level, batch * n_heads + head, n_cells,
                              no_bucket, gloc_ptr, gattn_ptr, bucket_ptr, sample, index, ATOMIC_VALUE, WRITE_BUCKETS)
        else:
            _bilinear_backward(value_rows, gvalue_rows, chan_off, chan_ok, grad, loc_x, loc_y, weight, height,
                               width, start, n_pixels, live, stride_vs, cells_ptr, level, batch * n_heads + head,
                               n_cells, no_bucket, gloc_ptr, gattn_ptr, bucket_ptr, sample, index, ATOMIC_VALUE,
                               WRITE_BUCKETS)


@triton.jit
def _bilinear_backward(value_rows, gvalue_rows, chan_off, chan_ok, grad, loc_x, loc_y, weight, height, width, start,
                       n_pixels, live, stride_vs, cells_ptr, level, map_index, n_cells, no_bucket, gloc_ptr,
                       gattn_ptr, bucket_ptr, sample, index, ATOMIC_VALUE: tl.constexpr,
                       WRITE_BUCKETS: tl.constexpr):
    """One level of bilinear samples: their location and weight gradients, and the value gradient's atomics or
    buckets (``map_index`` = batch * M + head, per row)."""
    down = width.to(tl.int64) * stride_vs
    x0, y0, fx, fy, in_x0, in_x1, in_y0, in_y1 = bilinear(loc_x, loc_y, height, width, live)
    m00, m01, m10, m11 = corner_masks(in_x0, in_x1, in_y0, in_y1, chan_ok)
    pixel = start + (y0 * width + x0)
    if level_spills(height, width, start, n_pixels):
        # As in the forward: a table that does not fit value reads and scatters nothing outside [0, S).
        pixel = start + (y0.to(tl.int64) * width + x0)
        m00, m01, m10, m11 = corners_inside(pixel, width, n_pixels, m00, m01, m10, m11)
    ptr = (value_rows[:, None] + pixel * stride_vs)[:, :, None] + chan_off
    s00 = tl.sum(grad * tl.load(ptr, mask=m00, other=0.0).to(tl.float32), axis=2)
    s01 = tl.sum(grad * tl.load(ptr + stride_vs, mask=m01, other=0.0).to(tl.float32), axis=2)
    s10 = tl.sum(grad * tl.load(ptr + down, mask=m10, other=0.0).to(tl.float32), axis=2)
    s11 = tl.sum(grad * tl.load(ptr + down + stride_vs, mask=m11, other=0.0).to(tl.float32), axis=2)
    top = s00 + fx * (s01 - s00)
    bottom = s10 + fx * (s11 - s10)
    # d out / d px = lerp_y of the horizontal differences; px = x * W - 0.5, so d px / d x = W.
    d_px = (s01 - s00) + fy * ((s11 - s10) - (s01 - s00))
    tl.store(gattn_ptr + index, top + fy * (bottom - top), mask=live)
    tl.store(gloc_ptr + 2 * index, weight * width.to(tl.float32) * d_px, mask=live)
    tl.store(gloc_ptr + 2 * index + 1, weight * height.to(tl.float32) * (bottom - top), mask=live)
    if ATOMIC_VALUE:
        w00, w01, w10, w11 = corner_weights(fx, fy, weight)
        gptr = (gvalue_rows[:, None] + pixel * stride_vs)[:, :, None] + chan_off
        # The buffer is fp32 unless the opt-in "input" accumulation gave it the value's dtype (a no-op cast then).
        kind = gvalue_rows.dtype.element_ty
        tl.atomic_add(gptr, (grad * w00[:, :, None]).to(kind), mask=m00, sem="relaxed")
        tl.atomic_add(gptr + stride_vs, (grad * w01[:, :, None]).to(kind), mask=m01, sem="relaxed")
        tl.atomic_add(gptr + down, (grad * w10[:, :, None]).to(kind), mask=m10, sem="relaxed")
        tl.atomic_add(gptr + down + stride_vs, (grad * w11[:, :, None]).to(kind), mask=m11, sem="relaxed")
    if WRITE_BUCKETS:
        reaches = (in_x0 | in_x1) & (in_y0 | in_y1)
        cell = tl.load(cells_ptr + level) + (y0 + 1).to(tl.int64) * (width + 1) + (x0 + 1)
        bucket = tl.where(reaches, map_index[:, None] * n_cells + cell, no_bucket)
        # Every channel chunk computes the same bucket; the duplicate stores are identical.
        tl.store(bucket_ptr + sample, bucket, mask=live)


@triton.jit
def _nearest_backward(value_rows, gvalue_rows, chan_off, chan_ok, grad, loc_x, loc_y, weight, height, width, start,
                      n_pixels, live, stride_vs, cells_ptr, level, map_index, n_cells, no_bucket, gloc_ptr,
                      gattn_ptr, bucket_ptr, sample, index, ATOMIC_VALUE: tl.constexpr,
                      WRITE_BUCKETS: tl.constexpr):
    """One level of discrete samples: the weight gradient is the pixel's dot product with the output gradient, the
    location gradient is 0 (the nearest pixel is piecewise constant), and the value gradient goes to the one
    pixel each sample read (its bucket is that pixel's cell, read as corner 0 by the gather)."""
    pixel, mask, x, y, reads = nearest_pixel(chan_ok, loc_x, loc_y, height, width, start, n_pixels, live)
    ptr = (value_rows[:, None] + pixel * stride_vs)[:, :, None] + chan_off
    found = tl.sum(grad * tl.load(ptr, mask=mask, other=0.0).to(tl.float32), axis=2)
    tl.store(gattn_ptr + index, found, mask=live)
    tl.store(gloc_ptr + 2 * index, tl.zeros_like(found), mask=live)
    tl.store(gloc_ptr + 2 * index + 1, tl.zeros_like(found), mask=live)
    if ATOMIC_VALUE:
        gptr = (gvalue_rows[:, None] + pixel * stride_vs)[:, :, None] + chan_off
        tl.atomic_add(gptr, (grad * weight[:, :, None]).to(gvalue_rows.dtype.element_ty), mask=mask, sem="relaxed")
    if WRITE_BUCKETS:
        cell = tl.load(cells_ptr + level) + (y + 1).to(tl.int64) * (width + 1) + (x + 1)
        bucket = tl.where(reads, map_index[:, None] * n_cells + cell, no_bucket)
        tl.store(bucket_ptr + sample, bucket, mask=live)


@triton.jit(do_not_specialize=RUNTIME_INTS + ["n_pixels"])
def msda_bwd_value_kernel(
    shapes_ptr, starts_ptr, cells_ptr, loc_ptr, attn_ptr, gout_ptr, offsets_ptr, order_ptr, gvalue_ptr,
    n_rows, n_pixels, n_queries, n_heads, n_levels, n_points, n_cells,
    stride_sl, stride_sc, stride_st,
    stride_ln, stride_lq, stride_lm, stride_lp, stride_lc,
    stride_an, stride_aq, stride_am, stride_ap,
    stride_on, stride_oq, stride_oc,
    stride_gvn, stride_gvs, stride_gvm, stride_gvd,
    DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DISCRETE: tl.constexpr = False,
):
    # Rows here are value rows (batch, head, pixel), pixel fastest. The samples are read as [N, Lq, M, n_points]
    # with n_points every point of a row (L * P, or the sum of num_points_list): a sample's index in its row says
    # where it is, whichever level it belongs to. DISCRETE: each sample reached one pixel, its bucket's corner 0.
    row_ok, batch, pixel, head = query_rows(tl.program_id(0), n_rows, n_pixels, n_heads, BLOCK_R)
    chan = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    chan_ok = chan < DIM
    chan_grad = (chan * stride_oc)[None, :]

    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    for level in range(n_levels):
        height, width, start = level_shape(level, shapes_ptr, starts_ptr, stride_sl, stride_sc, stride_st)
        local = pixel - start
        # No pixel in a level with a negative side (two negative sides have a positive product).
        n_level_pixels = tl.where((height > 0) & (width > 0), height.to(tl.int64) * width, 0)
        inside = row_ok & (local >= 0) & (local < n_level_pixels)
        y = tl.where(inside, local, 0) // tl.maximum(width, 1)
        x = tl.where(inside, local, 0) - y * width
        level_cells = tl.load(cells_ptr + level)
        bucket_row = (batch * n_heads + head) * n_cells
        # Fixed order: corner by corner, each bucket in sorted (= original point) order.
        for corner in tl.static_range(1 if DISCRETE else 4):
            dy = corner // 2
            dx = corner % 2
            cell = level_cells + (y - dy + 1) * (width + 1) + (x - dx + 1)
            # Inside the level's cells by construction when the table matches the cells the host counted; the
            # test keeps the bucket offsets in bounds even when it does not.
            reached = inside & (cell >= 0) & (cell < n_cells)
            bucket = bucket_row + cell
            begin = tl.load(offsets_ptr + bucket, mask=reached, other=0)
            count = tl.load(offsets_ptr + bucket + 1, mask=reached, other=0) - begin
            for k in range(tl.max(count, axis=0)):
                live = k < count
                sample = tl.load(order_ptr + begin + k, mask=live, other=0)
                point = sample % n_points
                query = (sample // n_points // n_heads) % n_queries
                weight = tl.load(attn_ptr + batch * stride_an + query * stride_aq + head * stride_am
                                 + point * stride_ap, mask=live, other=0.0).to(tl.float32)
                loc = loc_ptr + batch * stride_ln + query * stride_lq + head * stride_lm + point * stride_lp
                if not DISCRETE:
                    loc_x = tl.load(loc, mask=live, other=0.0).to(tl.float32)
                    loc_y = tl.load(loc + stride_lc, mask=live, other=0.0).to(tl.float32)
                    _, _, fx, fy, _, _, _, _ = bilinear(loc_x, loc_y, height, width, live)
                    # The corner this pixel is, seen from the point (dx = 1: it is the point's right neighbour).
                    w00, w01, w10, w11 = corner_weights(fx, fy, weight)
                if DISCRETE:
                    coef = weight  # the sample's whole weight went to its nearest pixel
                elif corner == 0:
                    coef = w00
                elif corner == 1:
                    coef = w01
                elif corner == 2:
                    coef = w10
                else:
                    coef = w11
                coef = tl.where(live, coef, 0.0)
                gout = gout_ptr + batch * stride_on + query * stride_oq + (head * DIM) * stride_oc
                grad = tl.load(gout[:, None] + chan_grad, mask=live[:, None] & chan_ok[None, :], other=0.0)
                acc += coef[:, None] * grad.to(tl.float32)

    out = gvalue_ptr + batch * stride_gvn + pixel * stride_gvs + head * stride_gvm
    tl.store(out[:, None] + (chan * stride_gvd)[None, :], acc, mask=row_ok[:, None] & chan_ok[None, :])


# Replays of the atomic backward (lik._replay), keyed as the forward's with the gradient's: those of one channel
# block in value's own layout, whose buffers a replay makes as the full path does (zeroed fp32 value gradient, the
# point gradients in their dtype).
_REPLAYS: dict[tuple, object] = {}

# Launch variants of the atomic backward, for timing on a GPU (not public; the default is ""), "+"-joined parts:
# "split" gives each program one level (4x the programs of a decoder's 9 600 rows, whose 1-warp programs otherwise
# walk their levels one after the other), "auto" splits only grids of fewer than 64 row blocks per SM (decoders; an
# encoder's 260 000 blocks keep their loop), "r2" / "r4" divide the rows of a tile by 2 / 4, "s2" / "s3" ask Triton
# to pipeline the level loop. Measured on an H200 (fp32, device time): split 5% faster at decoder scale and 10%
# slower at encoder scale, r2 10% / 2.5% faster, s2 and s3 unchanged. Chosen by LIK_MSDA_BWD_VARIANT at import or by
# setting _VARIANT; part of the replay key.
VARIANTS = ("", "split", "r2", "r4", "auto+r2", "s3")
_VARIANT = os.environ.get("LIK_MSDA_BWD_VARIANT", "")


def _replay_atomic(plan, sources: tuple, value: torch.Tensor):
    """The atomic backward replayed from ``plan`` with ``sources = (value, shapes, starts, loc, attn, grad_out)``."""
    (gvalue_shape, gvalue_dtype), (gloc_shape, gloc_dtype), (gattn_shape, gattn_dtype) = plan.buffers
    device = plan.device
    buffers = (torch.zeros(gvalue_shape, dtype=gvalue_dtype, device=device),
               torch.empty(gloc_shape, dtype=gloc_dtype, device=device),
               torch.empty(gattn_shape, dtype=gattn_dtype, device=device))
    plan(sources, buffers)
    return _in_value_dtype(buffers[0], value), buffers[1], buffers[2]


def _atomic_dtype(dtype: torch.dtype) -> torch.dtype:
    """The atomic value gradient's buffer dtype: fp32, or fp16 / bf16 itself under the opt-in "input"
    accumulation (:func:`lik.config.msda.set_value_grad_accumulation`)."""
    if dtype in (torch.float16, torch.bfloat16) and value_grad_accumulation() == "input":
        return dtype
    return torch.float32


def _in_value_dtype(gvalue: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The fp32 value gradient in ``value``'s dtype (one cast, only when they differ)."""
    if gvalue.dtype == value.dtype:
        return gvalue
    return gvalue.to(value.dtype)


def _backward_key(forward_key: tuple, grad_out: torch.Tensor, value_dtype: torch.dtype) -> tuple:
    """The atomic backward's replay key: the forward's (:func:`lik.ops.msda.forward.replay_key` of the same five
    tensors) with the output gradient's layout and the value gradient's buffer dtype (the opt-in accumulation
    changes the recorded launch)."""
    return (*forward_key, layout_key(grad_out), _atomic_dtype(value_dtype), _VARIANT)


def msda_backward(
    grad_out: torch.Tensor,
    value: torch.Tensor,
    shapes: torch.Tensor,
    starts: torch.Tensor,
    loc: torch.Tensor,
    attn: torch.Tensor,
    *,
    deterministic: bool,
    forward_key: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(grad_value, grad_sampling_locations, grad_attention_weights)``, each in its input's dtype (any
    strides: non-contiguous inputs are copied once). An atomic backward whose shapes were launched before replays
    that launch.

    ``forward_key``: the replay key under which these five tensors' forward replayed (the autograd Function saved
    them, so their layouts are still the key's); it spares the backward from keying them again (26 of the 63 Python
    calls a replayed backward made). It is used only while it names the current device and replays are allowed."""
    if deterministic:
        return _backward(grad_out, value, shapes, starts, loc, attn, deterministic)
    if forward_key is not None and allowed() and forward_key[0] == current_device():
        key = _backward_key(forward_key, grad_out, value.dtype)
    else:
        key = replay_key(value, shapes, starts, loc, attn, layout_key(grad_out), _atomic_dtype(value.dtype), _VARIANT)
    plan = None if key is None else _REPLAYS.get(key)
    sources = (value, shapes, starts, loc, attn, grad_out)
    if plan is not None and plan is not NEVER:
        return _replay_atomic(plan, sources, value)
    if key is None or plan is NEVER:
        return _backward(grad_out, value, shapes, starts, loc, attn, deterministic)
    with recording() as recorded:
        grads = _backward(grad_out, value, shapes, starts, loc, attn, deterministic)
    plan = plan_of(recorded, sources)
    if plan is not None:  # several channel blocks or a head-major value: buffers a replay does not make
        file(_REPLAYS, key, plan if recorded.notes.get("simple") else NEVER)
    return grads


def _backward(grad_out, value, shapes, starts, loc, attn, deterministic: bool):
    """The full path of :func:`msda_backward`."""
    return launch_backward(grad_out, value, shapes, starts, loc, attn, deterministic)


def launch_backward(grad_out, value, shapes, starts, loc, attn, deterministic: bool, points=None, max_points=0,
                    discrete=False):
    """The backward's launches on checked inputs, in Deformable DETR's layout or, with ``points``, RT-DETRv2's
    (``points``, ``max_points`` and ``discrete`` as for :func:`lik.ops.msda.forward.launch_forward`)."""
    check_pixel_count(value)
    n, n_pixels, heads, dim = value.shape
    n_levels, n_queries = shapes.shape[0], loc.shape[1]
    n_points = loc.shape[-2]  # P per level, or every point of a row with a point table
    tile_points = n_points if points is None else max_points
    device = value.device
    n_rows = n * n_queries * heads
    cfg = msda_backward_config(n_rows=n_rows, dim=dim, n_points=tile_points, device=device)
    check_point_tile(cfg.block_points, tile_points)
    n_chunks = -(-dim // cfg.block_d) if dim else 1
    per_row = n_points if points is not None else n_levels * n_points
    n_samples = n_rows * per_row
    if n_samples == 0 or dim == 0:
        return tuple(torch.zeros(t.shape, dtype=t.dtype, device=device) for t in (value, loc, attn))
    # Known without a read when the forward's check cached the table (before dense: the cache knows the caller's).
    known_cells = checked_cell_count(shapes, starts, n_pixels) if deterministic else None
    value, head_major = kernel_value(value, cfg.transpose)
    shapes, starts, loc, attn, grad_out = dense(shapes), dense(starts), dense(loc), dense(attn), dense(grad_out)
    # One channel chunk writes the point gradients in their final dtype, straight into the returned tensors;
    # several add fp32 partials afterwards. The kernel writes every point, so no memset; the atomic value gradient
    # needs a zeroed fp32 buffer (in value's layout), the deterministic one writes every value row.
    if n_chunks == 1:
        gloc, gattn = torch.empty_like(loc), torch.empty_like(attn)
    else:
        gloc = loc.new_empty((n_chunks, *loc.shape), dtype=torch.float32)
        gattn = attn.new_empty((n_chunks, *attn.shape), dtype=torch.float32)
    if deterministic:
        gvalue = torch.empty((n, n_pixels, heads, dim), dtype=value.dtype, device=device)
        # Corner cells of every level on a (H + 1) x (W + 1) grid (none for an empty level, which no sample
        # reaches); their total is the checked table's, else one host sync.
        heights, widths = shapes[:, 0].to(torch.int64), shapes[:, 1].to(torch.int64)
        sizes = torch.where((heights > 0) & (widths > 0), (heights + 1) * (widths + 1), 0)
        cells = torch.cumsum(sizes, 0) - sizes
        n_cells = int(sizes.sum()) if known_cells is None else known_cells
        no_bucket = n * heads * n_cells
        buckets = torch.empty(n_samples, dtype=torch.int64, device=device)
    else:
        gvalue = made(torch.zeros(value.shape, dtype=_atomic_dtype(value.dtype), device=device))
        made(gloc), made(gattn)
        cells, n_cells, no_bucket, buckets = starts, 0, 0, gvalue

    block_rows, split, stages = cfg.block_rows, False, cfg.num_stages
    if _VARIANT and not deterministic:
        parts = _VARIANT.split("+")
        block_rows = max(1, block_rows // (4 if "r4" in parts else 2 if "r2" in parts else 1))
        blocks = -(-n_rows // block_rows) * n_chunks
        split = "split" in parts or ("auto" in parts and blocks < 64 * sm_count(device))
        stages = 3 if "s3" in parts else 2 if "s2" in parts else stages
    grid = (-(-n_rows // block_rows) * (n_levels if split else 1), n_chunks)
    tensors = (value, shapes, starts, starts if points is None else points, cells, loc, attn, grad_out, gvalue, gloc,
               gattn, buckets)
    ints = (n_rows, n_pixels, n_queries, heads, n_levels, n_points, n_cells, no_bucket, n_samples)
    options = dict(DIM=dim, BLOCK_R=block_rows, BLOCK_P=cfg.block_points, BLOCK_D=cfg.block_d,
                   HEAD_MAJOR=head_major, ATOMIC_VALUE=not deterministic, WRITE_BUCKETS=deterministic,
                   num_warps=cfg.num_warps, num_stages=stages)
    if points is not None or discrete:
        options.update(POINT_TABLE=points is not None, DISCRETE=discrete)
    if split:
        options.update(SPLIT_LEVELS=True)
    launch(msda_bwd_kernel, grid, *tensors, *ints, **options)
    if n_chunks > 1:
        gloc = gloc.sum(0).to(loc.dtype)
        gattn = gattn.sum(0).to(attn.dtype)
    if not deterministic:
        # A replay makes these buffers again and returns them as they are: one channel block, value's own layout.
        note("simple", n_chunks == 1 and not head_major)
        if head_major:
            gvalue = gvalue.transpose(1, 2)  # back to [N, S, M, D] (head-major storage)
        return _in_value_dtype(gvalue, value), gloc, gattn

    sorted_buckets, order = torch.sort(buckets, stable=True)
    offsets = torch.searchsorted(sorted_buckets, torch.arange(no_bucket + 1, device=device))
    n_value_rows = n * n_pixels * heads
    grid = (cdiv(n_value_rows, cfg.gather_rows), cdiv(dim, cfg.block_d))
    # The samples seen as [N, Lq, M, points of a row] (views: both are contiguous).
    flat_loc, flat_attn = loc.view(n, n_queries, heads, per_row, 2), attn.view(n, n_queries, heads, per_row)
    launch(
        msda_bwd_value_kernel, grid,
        shapes, starts, cells, loc, attn, grad_out, offsets, order, gvalue,
        n_value_rows, n_pixels, n_queries, heads, n_levels, per_row, n_cells,
        shapes.stride(0), shapes.stride(1), starts.stride(0), *flat_loc.stride(), *flat_attn.stride(),
        *grad_out.stride(), *gvalue.stride(),
        DIM=dim,
        BLOCK_R=cfg.gather_rows,
        BLOCK_D=cfg.block_d,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **({"DISCRETE": True} if discrete else {}),
    )
    return gvalue, gloc, gattn
