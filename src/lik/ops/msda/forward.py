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

from ..._device import cdiv, current_device
from ..._launch import launch
from ..._replay import NEVER, allowed, file, layout_key, made, plan_of, recording
from ...config.msda import msda_forward_config
from .sampling import (bilinear, corner_masks, corner_weights, corners_inside, level_points, level_shape, level_spills,
                       load_samples, nearest, query_rows)
from .validation import check_level_table

__all__ = ["msda_fwd_kernel", "nearest_pixel", "msda_forward", "launch_forward", "contiguous_strides", "kernel_value",
           "dense", "check_pixel_count", "check_point_tile", "RUNTIME_INTS", "replay_key", "recorded_plan", "replay",
           "replayed_forward"]

# Batch, query count, heads, levels and points vary per call and never trigger a recompile.
RUNTIME_INTS = ["n_rows", "n_pixels", "n_queries", "n_heads", "n_levels", "n_points"]


@triton.jit
def contiguous_strides(n_pixels, n_queries, n_heads, n_levels, n_points, DIM: tl.constexpr,
                       HEAD_MAJOR: tl.constexpr):
    """Element strides of contiguous ``value [N, S, M, D]`` (or its ``[N, M, S, D]`` copy when ``HEAD_MAJOR``),
    ``sampling_locations [N, Lq, M, L, P, 2]``, ``attention_weights [N, Lq, M, L, P]`` and ``out [N, Lq, M*D]``,
    computed here rather than passed: every argument costs host time per launch (decoder calls are host bound).
    Batch strides are int64 (a tensor may hold 2**31 elements or more)."""
    if HEAD_MAJOR:
        stride_vs = DIM
        stride_vm = n_pixels.to(tl.int64) * DIM
        stride_vn = stride_vm * n_heads
    else:
        stride_vm = DIM
        stride_vs = n_heads * DIM
        stride_vn = n_pixels.to(tl.int64) * stride_vs
    stride_ll = 2 * n_points
    stride_lm = stride_ll * n_levels
    stride_lq = stride_lm * n_heads
    stride_ln = n_queries.to(tl.int64) * stride_lq
    stride_al = n_points
    stride_am = stride_al * n_levels
    stride_aq = stride_am * n_heads
    stride_an = n_queries.to(tl.int64) * stride_aq
    stride_oq = n_heads * DIM
    stride_on = n_queries.to(tl.int64) * stride_oq
    return (stride_vn, stride_vs, stride_vm, stride_ln, stride_lq, stride_lm, stride_ll, stride_an, stride_aq,
            stride_am, stride_al, stride_on, stride_oq)


@triton.jit
def nearest_pixel(chan_ok, loc_x, loc_y, height, width, start, n_pixels, live):
    """RT-DETRv2's discrete sampling of one level: ``[rows, points]`` index along S of each sample's nearest pixel
    and the ``[rows, points, channels]`` read mask; with the pixel's ``(x, y)`` and the per-point read mask for the
    value gradient's buckets."""
    x, y, reads = nearest(loc_x, loc_y, height, width, live)
    mask = reads[:, :, None] & chan_ok
    pixel = start + (y * width + x)
    if level_spills(height, width, start, n_pixels):
        pixel = start + (y.to(tl.int64) * width + x)
        mask, _, _, _ = corners_inside(pixel, width, n_pixels, mask, mask, mask, mask)
    return pixel, mask, x, y, reads


@triton.jit
def _nearest_sample(value_rows, chan_off, chan_ok, loc_x, loc_y, weight, height, width, start, n_pixels, live,
                    stride_vs):
    """``[rows, points, channels]`` weight times the nearest pixel (discrete sampling)."""
    pixel, mask, _, _, _ = nearest_pixel(chan_ok, loc_x, loc_y, height, width, start, n_pixels, live)
    ptr = (value_rows[:, None] + pixel * stride_vs)[:, :, None] + chan_off
    return weight[:, :, None] * tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _bilinear_sample(acc, value_rows, chan_off, chan_ok, loc_x, loc_y, weight, height, width, start, n_pixels, live,
                     stride_vs):
    """``acc`` plus the ``[rows, points, channels]`` weight times the bilinear sample (grid_sample's): four
    independent gathers, each added straight into ``acc``."""
    x0, y0, fx, fy, in_x0, in_x1, in_y0, in_y1 = bilinear(loc_x, loc_y, height, width, live)
    w00, w01, w10, w11 = corner_weights(fx, fy, weight)
    m00, m01, m10, m11 = corner_masks(in_x0, in_x1, in_y0, in_y1, chan_ok)
    pixel = start + (y0 * width + x0)
    if level_spills(height, width, start, n_pixels):
        # A table that does not fit value (the host refuses these): mask every corner outside [0, S).
        pixel = start + (y0.to(tl.int64) * width + x0)
        m00, m01, m10, m11 = corners_inside(pixel, width, n_pixels, m00, m01, m10, m11)
    ptr = (value_rows[:, None] + pixel * stride_vs)[:, :, None] + chan_off
    down = width.to(tl.int64) * stride_vs
    acc += w00[:, :, None] * tl.load(ptr, mask=m00, other=0.0).to(tl.float32)
    acc += w01[:, :, None] * tl.load(ptr + stride_vs, mask=m01, other=0.0).to(tl.float32)
    acc += w10[:, :, None] * tl.load(ptr + down, mask=m10, other=0.0).to(tl.float32)
    acc += w11[:, :, None] * tl.load(ptr + down + stride_vs, mask=m11, other=0.0).to(tl.float32)
    return acc


@triton.jit(do_not_specialize=RUNTIME_INTS)
def msda_fwd_kernel(
    value_ptr, shapes_ptr, starts_ptr, points_ptr, loc_ptr, attn_ptr, out_ptr,
    n_rows, n_pixels, n_queries, n_heads, n_levels, n_points,
    DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_MAJOR: tl.constexpr,
    POINT_TABLE: tl.constexpr = False,
    DISCRETE: tl.constexpr = False,
):
    # Every tensor is contiguous (the launcher makes it so); shapes is [L, 2] and starts [L]. With POINT_TABLE the
    # samples are [N, Lq, M, n_points, ...] (every level's points flattened) and points_ptr says which are whose.
    (stride_vn, stride_vs, stride_vm, stride_ln, stride_lq, stride_lm, stride_ll, stride_an, stride_aq, stride_am,
     stride_al, stride_on, stride_oq) = contiguous_strides(n_pixels, n_queries, n_heads,
                                                           1 if POINT_TABLE else n_levels, n_points, DIM,
                                                           HEAD_MAJOR)
    row_ok, batch, query, head = query_rows(tl.program_id(0), n_rows, n_queries, n_heads, BLOCK_R)
    chan = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    if DIM % BLOCK_D == 0:
        # Every channel of every block exists: no channel predicate on the gathers.
        chan_ok = tl.full([1, 1, BLOCK_D], 1, tl.int1)
    else:
        chan_ok = (chan < DIM)[None, None, :]
    value_rows = value_ptr + batch * stride_vn + head * stride_vm
    chan_off = chan.to(tl.int64)[None, None, :]
    loc_rows = loc_ptr + batch * stride_ln + query * stride_lq + head * stride_lm
    attn_rows = attn_ptr + batch * stride_an + query * stride_aq + head * stride_am

    acc = tl.zeros((BLOCK_R, BLOCK_P, BLOCK_D), tl.float32)
    # BLOCK_P covers all points of a level (the launcher checks), so the only loop is over levels: a level's
    # shape is three scalar loads, and no inner loop costs registers (measured: a point loop inside, or one flat
    # loop over (level, point block), made the forward 12-16% slower at encoder scale; benchmarks/NOTES.md).
    point = tl.arange(0, BLOCK_P)
    for level in range(n_levels):
        height, width, start = level_shape(level, shapes_ptr, starts_ptr, 2, 1, 1)
        first, count = level_points(level, points_ptr, n_points, POINT_TABLE)
        live = row_ok[:, None] & (point < count)[None, :]
        loc_x, loc_y, weight = load_samples(loc_rows, attn_rows, first, point, live, 2, 2, 1, 1, 1)
        if DISCRETE:
            acc += _nearest_sample(value_rows, chan_off, chan_ok, loc_x, loc_y, weight, height, width, start,
                                   n_pixels, live, stride_vs)
        else:
            acc = _bilinear_sample(acc, value_rows, chan_off, chan_ok, loc_x, loc_y, weight, height, width, start,
                                   n_pixels, live, stride_vs)

    out = out_ptr + batch * stride_on + query * stride_oq + head * DIM
    tl.store(out[:, None] + chan[None, :], tl.sum(acc, axis=1),
             mask=row_ok[:, None] & (chan < DIM)[None, :])


def kernel_value(value: torch.Tensor, head_major: bool) -> tuple[torch.Tensor, bool]:
    """``value`` as the kernels read it: contiguous ``[N, S, M, D]``, or a contiguous ``[N, M, S, D]`` (returned
    transposed, with True) when ``head_major`` is asked for or is how ``value`` is already stored. Copies only
    when neither layout is dense. The head-major layout makes each head's map one block, its pixels ``D`` apart
    (measured slower on the encoder, benchmarks/NOTES.md, "Multi-scale deformable attention"; kept as a forced
    option)."""
    if not head_major and value.is_contiguous():
        return value, False
    heads_first = value.transpose(1, 2)
    if heads_first.is_contiguous():
        return heads_first, True
    if head_major:
        return heads_first.contiguous(), True
    return value.contiguous(), False


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when contiguous, else a contiguous copy (the kernels compute strides from the shapes)."""
    return t if t.is_contiguous() else t.contiguous()


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


# Replays of recorded launches (lik._replay). A decoder layer repeats its shapes every step and is host bound: the
# tile choice and the launch key of such a call are fixed by its tensors' shapes, layouts, dtypes and alignment, so
# a call with a recorded key makes its output and relaunches (docs/design.md, "The host path").
_FORWARD_REPLAYS: dict[tuple, object] = {}


def replay_key(value, shapes, starts, loc, attn, *more) -> tuple | None:
    """What fixes a launch besides the addresses: the current device (where Triton launches) and per tensor
    :func:`lik._replay.layout_key`, with ``more``; None when no launch may be replayed now (a tensor off CUDA,
    replays off: :func:`lik._replay.allowed`). Every tensor is asked (not only ``value``) because
    :func:`lik.ms_deform_attn` skips its device checks for a key it has seen pass them."""
    if not (value.is_cuda and shapes.is_cuda and starts.is_cuda and loc.is_cuda and attn.is_cuda) or not allowed():
        return None
    return (current_device(), layout_key(value), layout_key(shapes), layout_key(starts), layout_key(loc),
            layout_key(attn), *more)


def recorded_plan(key: tuple):
    """The recorded forward of calls with ``key`` (:func:`replay_key`), or None when there is none to replay."""
    plan = _FORWARD_REPLAYS.get(key)
    return None if plan is NEVER else plan


def replay(plan, *sources: torch.Tensor) -> torch.Tensor:
    """The forward of a call whose key recorded ``plan``, relaunched for ``sources`` (those of the recording, in its
    order): the output is made and the recorded kernel launched with their addresses (the full path's bits; the
    level table is the caller's to check).

    Example:
        >>> out = replay(recorded_plan(replay_key(value, shapes, starts, loc, attn)), value, shapes, starts, loc, attn)
    """
    (out,) = buffers = plan.allocate()
    plan(sources, buffers)
    return out


def replayed_forward(table: dict, key: tuple, sources: tuple, full) -> torch.Tensor:
    """A forward through its recorded launch: replayed from ``table[key]`` when it holds one, else ``full()`` (the
    full path, which returns the output), recorded and filed under ``key`` on the first call (or marked never
    replayable: :func:`lik._replay.plan_of`). ``sources`` are the tensors the launches read that the caller owns."""
    plan = table.get(key)
    if plan is not None and plan is not NEVER:
        return replay(plan, *sources)
    if plan is NEVER:
        return full()
    with recording() as recorded:
        out = full()
    plan = plan_of(recorded, sources)
    if plan is not None:
        file(table, key, plan)
    return out


def msda_forward(
    value: torch.Tensor,
    shapes: torch.Tensor,
    starts: torch.Tensor,
    loc: torch.Tensor,
    attn: torch.Tensor,
) -> torch.Tensor:
    """Launch the forward on inputs ``check_inputs`` accepted (any strides: non-contiguous ones are copied once);
    returns ``[N, Lq, M*D]`` in ``value``'s dtype. A call whose shapes were launched before replays that launch.

    The level table's values are checked here, before the replay, so every kernel path checks them once: eager
    inference, the autograd Function and the ``torch.compile`` custom operator all reach the forward through this
    function (the backward runs on the table its forward checked)."""
    check_level_table(shapes, starts, value.shape[1])
    key = replay_key(value, shapes, starts, loc, attn)
    if key is None:
        return _forward(value, shapes, starts, loc, attn)
    return replayed_forward(_FORWARD_REPLAYS, key, (value, shapes, starts, loc, attn),
                            lambda: _forward(value, shapes, starts, loc, attn))


def _forward(value, shapes, starts, loc, attn) -> torch.Tensor:
    """The full path of :func:`msda_forward` past the level table's check."""
    return launch_forward(value, shapes, starts, loc, attn)


def launch_forward(value, shapes, starts, loc, attn, points=None, max_points=0, discrete=False) -> torch.Tensor:
    """Launch the forward on checked inputs (the level table included). Deformable DETR's layout by default; with
    ``points`` (int32 ``[L, 2]`` rows of (first, count), on value's device) RT-DETRv2's: ``loc [N, Lq, M, T, 2]``,
    ``attn [N, Lq, M, T]``, every level's points flattened, ``max_points`` the largest count. ``discrete``:
    nearest-pixel sampling instead of bilinear."""
    check_pixel_count(value)
    n, n_pixels, heads, dim = value.shape
    n_levels = shapes.shape[0]
    n_queries, n_points = loc.shape[1], loc.shape[-2]
    tile_points = n_points if points is None else max_points
    out = made(torch.empty((n, n_queries, heads * dim), dtype=value.dtype, device=value.device))
    n_rows = n * n_queries * heads
    if n_rows == 0 or dim == 0:
        return out.zero_()
    cfg = msda_forward_config(n_rows=n_rows, dim=dim, n_points=tile_points, device=value.device)
    check_point_tile(cfg.block_points, tile_points)
    value, head_major = kernel_value(value, cfg.transpose)
    grid = (cdiv(n_rows, cfg.block_rows), cdiv(dim, cfg.block_d))
    starts = dense(starts)
    flags = {} if points is None and not discrete else dict(POINT_TABLE=points is not None, DISCRETE=discrete)
    launch(msda_fwd_kernel, grid, value, dense(shapes), starts, starts if points is None else points, dense(loc),
           dense(attn), out, n_rows, n_pixels, n_queries, heads, n_levels, n_points,
           DIM=dim, BLOCK_R=cfg.block_rows, BLOCK_P=cfg.block_points, BLOCK_D=cfg.block_d, HEAD_MAJOR=head_major,
           num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags)
    return out
