"""Nearest neighbour (k = 1) of every point of ``x`` among the points of ``y``, cloud by cloud, on chip.

The hard-selection loop of MaxSim with a min-of-distance reduction: a block of ``x`` points is held by a program,
``y`` is streamed in tiles, each tile gives a ``[BLOCK_M, BLOCK_N]`` block of distances that is folded into a
running minimum and the lowest winning index; only the index (and the running minimum) leave the chip. Two ways
to form the distance tile:

* ``direct``: from the coordinate differences, ``sum_k (x_k - y_k)**2`` (or ``|x_k - y_k|``), exact wherever the
  points lie; used for small ``D`` (point clouds) and for ``norm=1``;
* ``dot``: ``|y|**2 - 2 x.y`` on tensor cores, on coordinates centred on the cloud (so distances between nearby
  points far from the origin keep their digits), for wide feature sets.

Either way the distance returned to the user is recomputed from the winner's coordinates (see ``function.py``);
the kernel's own value only decides the winner and flags rows whose minimum is NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._config import cdiv

__all__ = ["nearest_direct_kernel", "nearest_dot_kernel", "nearest_indices", "DIRECT_MAX_DIM", "NO_INDEX"]

NO_INDEX = tl.constexpr(2147483647)
# Widths up to this use the difference form: a few FMAs per pair beat padding a tensor-core product to 16.
DIRECT_MAX_DIM = 8

_RUNTIME_INTS = [
    "x_points", "stride_xn", "stride_xp", "stride_yn", "stride_yp", "stride_in", "stride_ip", "stride_sn",
]


@triton.jit
def nan_min(a, b):
    """Minimum that returns NaN if either side is NaN (``torch.min``'s behaviour)."""
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def fold_min_tile(dist, cols, best, arg):
    """Fold a tile of distances (invalid columns already +inf) into the running minimum and lowest winner.

    Strictly smaller keeps the earlier tile on ties; a row whose minimum becomes NaN keeps a meaningless index,
    settled on the host (the first NaN wins, as in the reference)."""
    tile_best = tl.reduce(dist, 1, nan_min)
    tile_arg = tl.min(tl.where(dist == tile_best[:, None], cols[None, :], NO_INDEX), axis=1)
    take = (tile_best < best) | (arg == NO_INDEX)
    arg = tl.where(take & (tile_arg != NO_INDEX), tile_arg, arg)
    return nan_min(best, tile_best), arg


@triton.jit
def store_nearest(idx_ptr, best_ptr, cloud, rows, row_ok, best, arg, stride_in, stride_ip):
    offsets = cloud.to(tl.int64) * stride_in + rows * stride_ip
    tl.store(idx_ptr + offsets, tl.where(arg == NO_INDEX, -1, arg), mask=row_ok)
    tl.store(best_ptr + offsets, best, mask=row_ok)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def nearest_direct_kernel(
    x_ptr, y_ptr, x_len_ptr, y_len_ptr, idx_ptr, best_ptr,
    x_points, stride_xn, stride_xp, stride_yn, stride_yp, stride_in, stride_ip,
    DIM: tl.constexpr, NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    cloud = tl.program_id(1)
    x_len = tl.load(x_len_ptr + cloud)
    y_len = tl.load(y_len_ptr + cloud)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < x_len
    x_rows = x_ptr + cloud.to(tl.int64) * stride_xn + rows * stride_xp
    y_base = y_ptr + cloud.to(tl.int64) * stride_yn
    best = tl.full((BLOCK_M,), float("inf"), tl.float32)
    arg = tl.full((BLOCK_M,), NO_INDEX, tl.int32)
    if tl.program_id(0) * BLOCK_M < x_len:
        for start in range(0, y_len, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < y_len
            y_cols = y_base + cols.to(tl.int64) * stride_yp
            dist = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for k in tl.static_range(DIM):
                xk = tl.load(x_rows + k, mask=row_ok, other=0.0).to(tl.float32)
                yk = tl.load(y_cols + k, mask=col_ok, other=0.0).to(tl.float32)
                diff = xk[:, None] - yk[None, :]
                if NORM == 1:
                    dist += tl.abs(diff)
                else:
                    dist += diff * diff
            dist = tl.where(col_ok[None, :], dist, float("inf"))
            best, arg = fold_min_tile(dist, cols, best, arg)
    store_nearest(idx_ptr, best_ptr, cloud, rows, row_ok, best, arg, stride_in, stride_ip)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def nearest_dot_kernel(
    x_ptr, y_ptr, y_sq_ptr, x_len_ptr, y_len_ptr, idx_ptr, best_ptr,
    x_points, stride_xn, stride_xp, stride_yn, stride_yp, stride_sn, stride_in, stride_ip,
    DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    cloud = tl.program_id(1)
    x_len = tl.load(x_len_ptr + cloud)
    y_len = tl.load(y_len_ptr + cloud)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < x_len
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + cloud.to(tl.int64) * stride_xn + rows * stride_xp
    y_base = y_ptr + cloud.to(tl.int64) * stride_yn
    best = tl.full((BLOCK_M,), float("inf"), tl.float32)
    arg = tl.full((BLOCK_M,), NO_INDEX, tl.int32)
    if tl.program_id(0) * BLOCK_M < x_len:
        for start in range(0, y_len, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < y_len
            y_cols = y_base + cols.to(tl.int64) * stride_yp
            product = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for k0 in range(0, DIM, BLOCK_K):
                kk = k0 + offs_k
                x_tile = tl.load(x_rows[:, None] + kk[None, :], mask=row_ok[:, None] & (kk[None, :] < DIM), other=0.0)
                y_tile = tl.load(y_cols[:, None] + kk[None, :], mask=col_ok[:, None] & (kk[None, :] < DIM), other=0.0)
                product = tl.dot(x_tile, tl.trans(y_tile), product, input_precision=DOT_PRECISION)
            y_sq = tl.load(y_sq_ptr + cloud.to(tl.int64) * stride_sn + cols, mask=col_ok, other=float("inf"))
            # |x|^2 is the same for a whole row: it cannot change the winner and is left out.
            dist = tl.where(col_ok[None, :], y_sq[None, :] - 2.0 * product, float("inf"))
            best, arg = fold_min_tile(dist, cols, best, arg)
    store_nearest(idx_ptr, best_ptr, cloud, rows, row_ok, best, arg, stride_in, stride_ip)


def _dot_precision(dtype: torch.dtype) -> str:
    # Near-fp32 products (three TF32 passes) unless the user allowed TF32 for float32 matmuls.
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "tf32x3"


def nearest_indices(
    x: torch.Tensor, y: torch.Tensor, x_lengths: torch.Tensor, y_lengths: torch.Tensor, norm: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Winner of each ``x`` point: ``(idx int32 [N, P1] (-1: none), best fp32 [N, P1])``.

    ``x [N, P1, D]`` and ``y [N, P2, D]`` must have unit stride along ``D``; padded points are never read.
    ``best`` is the kernel's own minimum (for ``dot``, without the row's ``|x|^2``): NaN marks rows to settle."""
    n, p1, dim = x.shape
    idx = torch.full((n, p1), -1, dtype=torch.int32, device=x.device)
    best = torch.zeros((n, p1), dtype=torch.float32, device=x.device)
    if n == 0 or p1 == 0 or y.shape[1] == 0 or dim == 0:
        return idx, best
    x_len32 = x_lengths.to(torch.int32)
    y_len32 = y_lengths.to(torch.int32)
    if dim <= DIRECT_MAX_DIM or norm == 1:
        block_m, block_n = 64, 64
        nearest_direct_kernel[(cdiv(p1, block_m), n)](
            x, y, x_len32, y_len32, idx, best,
            p1, x.stride(0), x.stride(1), y.stride(0), y.stride(1), idx.stride(0), idx.stride(1),
            DIM=dim, NORM=norm, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
        )
        return idx, best
    # Centre each pair of clouds on the valid x points' mean (finite points only: one NaN must not spoil the
    # others); distances do not change, the digits cancelled by |y|^2 - 2 x.y do.
    xf, yf = x.float(), y.float()
    valid_x = torch.arange(p1, device=x.device)[None, :] < x_lengths[:, None]
    usable = valid_x & torch.isfinite(xf).all(-1)
    count = usable.sum(1, keepdim=True).clamp(min=1)
    centre = torch.where(usable[..., None], xf, 0.0).sum(1, keepdim=True) / count[..., None]
    xc = (xf - centre).contiguous()
    yc = (yf - centre).contiguous()
    y_sq = (yc * yc).sum(-1).contiguous()
    block_m, block_n = 64, 64
    block_k = 32 if dim >= 32 else 16
    nearest_dot_kernel[(cdiv(p1, block_m), n)](
        xc, yc, y_sq, x_len32, y_len32, idx, best,
        p1, xc.stride(0), xc.stride(1), yc.stride(0), yc.stride(1), y_sq.stride(0), idx.stride(0), idx.stride(1),
        DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=_dot_precision(torch.float32),
        num_warps=4, num_stages=2,
    )
    return idx, best
