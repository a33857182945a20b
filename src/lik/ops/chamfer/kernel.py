"""Nearest neighbour (k = 1) of every point of ``x`` among the points of ``y``, cloud by cloud, on chip.

Three routes (:func:`lik.config.nearest_config` picks one by width, norm, dtype and
``torch.get_float32_matmul_precision()``; each can be forced for tests and benchmarks):

* ``direct`` (point clouds, ``D <= POINT_MAX_DIM``, and every ``norm=1``): ``sum_k (x_k - y_k)**2`` (or
  ``|x_k - y_k|``) from coordinate differences on the CUDA cores, exact wherever the points lie and however dense
  they are; both clouds read coordinate-major (``[N, D, P]``) so a tile's loads are contiguous.
* ``core`` (``norm=2`` feature sets under float32 matmul precision "highest"): the argmax forward of the
  library's one tile loop (:mod:`lik.core.forward_launch`, as MaxSim runs it). With ``x' = [x, 1]`` and
  ``y' = [2y, -|y|^2]``, ``x'.y' = |x|^2 - |x - y|^2``: each ``x`` point's highest-similarity ``y`` token (lowest
  index on ties) is its nearest neighbour.
* ``dot`` (``norm=2`` feature sets under "high" / "medium", and float16 / bfloat16 inputs): a tensor-core tile
  loop of its own, ``|x|^2 + |y|^2 - 2 x.y`` with the float32 norms added after the product (forced with TF32-split
  or float32 products, up to ``AUGMENTED_MAX_DIM`` it multiplies ``x' = [x, 1, |x|^2]``, ``y' = [-2y, |y|^2, 1]``:
  the product *is* the distance). Up to 128 features the ``x`` block stays resident and each ``y`` tile is one
  product. On point clouds it would cancel the digits of dense clouds (benchmarks/NOTES.md, "Chamfer distance"),
  so they never take it.

float32 operands are centred on the ``x`` cloud (centring keeps the digits of nearby points far from the origin)
and then, at "highest", split on the host into two TF32 parts (:func:`tf32_parts`: float32's accuracy from one
TF32 product three times as deep), or at "high" / "medium" rounded to TF32 to nearest (:func:`tf32_round`; the
tensor cores would truncate). float16 / bfloat16 inputs multiply as they are: their products are exact in the
float32 accumulator (a centred copy rounded back to half precision picked neighbours 0.9% too far at D = 128 on
the H100). The products only choose the winner: the distance the user gets is recomputed from the winner's
coordinates (``function.py``), and rows that touch a non-finite coordinate are settled there as the reference
settles them.

A Chamfer call needs both directions: on the ``direct`` and ``dot`` routes one pass takes each pair's distance
once for both (``BOTH_WAYS``); the reverse winners of a tile reduce over its rows and reach a global int64 key
``(distance bits << 31) | row`` by one atomic min per ``y`` point and tile (exact ties: the lowest row; a min is
the same in any order, so the result is deterministic).

The ``dot`` and ``direct`` loops keep their running minimum as an integer min over *keys*: the distance's float
bits with the low ``log2(BLOCK_N)`` mantissa bits replaced by the column in the tile. One integer min per distance
yields both the minimum and the lowest column attaining it (exact ties go to the lowest index), where a separate
arg-min would cost three more operations per pair. The price: candidates within ``2**-(23 - log2(BLOCK_N))``
relative of each other are ordered by index, not by value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._device import cdiv, next_power_of_2
from ...config.nearest import NEAREST_POINT_MAX_DIM, NearestConfig, nearest_config
from ...core.forward_launch import launch_forward, padded_problem
from .validation import valid_points

__all__ = [
    "nearest_dot_kernel", "nearest_direct_kernel", "nearest_indices", "uses_direct_route", "AUGMENTED_MAX_DIM",
    "POINT_MAX_DIM", "BLOCK_M", "BLOCK_N", "tf32_parts", "tf32_round",
]

POINT_MAX_DIM = NEAREST_POINT_MAX_DIM
# Largest D whose two norm columns still fit the 16-wide tensor-core step without another step.
AUGMENTED_MAX_DIM = 14
# The default tiles (tests size their clouds around them).
BLOCK_M = NearestConfig.block_m
BLOCK_N = NearestConfig.block_n
# Widest operand the dot loop keeps resident (one product per y tile, no feature loop).
RESIDENT_MAX_WIDTH = 128
# The direct kernel unrolls its coordinate loop up to this width.
UNROLLED_MAX_DIM = tl.constexpr(16)
_NO_KEY = tl.constexpr(2147483647)

# Strides that follow the cloud sizes (the coordinate-major copies' coordinate stride is P) are not specialised
# on: a new P must not compile a new variant.
_RUNTIME_INTS = [
    "stride_xn", "stride_xp", "stride_yn", "stride_yp", "stride_sn", "stride_in", "stride_ip", "stride_tn",
    "stride_xk", "stride_yk", "stride_kn",
]
# The dot loop's operand strides (a multiple of the contiguous operands' width) stay specialised: their
# alignment lets a tile's loads vectorise. Only the strides that follow P are not.
_DOT_RUNTIME_INTS = ["stride_sn", "stride_tn", "stride_in", "stride_kn"]


@triton.jit
def distance_keys(dist, index, BITS: tl.constexpr):
    """Winner keys: each distance's float bits with the low ``BITS`` mantissa bits replaced by ``index`` (its
    column or row in the tile, broadcast against ``dist``)."""
    return (dist.to(tl.int32, bitcast=True) & ~((1 << BITS) - 1)) | index


@triton.jit
def fold_key_tile(dist, start, best_key, best_col, BLOCK_N: tl.constexpr, COL_BITS: tl.constexpr):
    """Fold a tile of distances (invalid columns: +inf) into the running (key, column) per row."""
    tile_key = tl.min(distance_keys(dist, tl.arange(0, BLOCK_N)[None, :], COL_BITS), axis=1)
    tile_value = tile_key & ~((1 << COL_BITS) - 1)
    # Strictly smaller keeps the earlier tile on ties.
    take = tile_value < best_key
    best_col = tl.where(take, start + (tile_key & ((1 << COL_BITS) - 1)), best_col)
    best_key = tl.where(take, tile_value, best_key)
    return best_key, best_col


@triton.jit
def store_winners(idx_ptr, cloud, rows, row_ok, best_col, stride_in, stride_ip):
    tl.store(idx_ptr + cloud.to(tl.int64) * stride_in + rows * stride_ip, best_col, mask=row_ok)


@triton.jit(do_not_specialize=_DOT_RUNTIME_INTS)
def nearest_dot_kernel(
    x_ptr, y_ptr, x_sq_ptr, y_sq_ptr, x_len_ptr, y_len_ptr, idx_ptr, y_key_ptr,
    stride_xn, stride_xp, stride_yn, stride_yp, stride_sn, stride_tn, stride_in, stride_ip, stride_kn,
    DIM: tl.constexpr, AUGMENTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, COL_BITS: tl.constexpr, DOT_PRECISION: tl.constexpr, BOTH_WAYS: tl.constexpr,
    ROW_BITS: tl.constexpr,
):
    cloud = tl.program_id(1)
    x_len = tl.load(x_len_ptr + cloud)
    y_len = tl.load(y_len_ptr + cloud)
    row_start = tl.program_id(0).to(tl.int64) * BLOCK_M
    rows = row_start + tl.arange(0, BLOCK_M)
    row_ok = rows < x_len
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + cloud.to(tl.int64) * stride_xn + rows * stride_xp
    y_base = y_ptr + cloud.to(tl.int64) * stride_yn
    best_key = tl.full((BLOCK_M,), _NO_KEY, tl.int32)
    best_col = tl.full((BLOCK_M,), -1, tl.int32)
    if row_start < x_len:
        if not AUGMENTED:
            # A padded row's norm reads +inf: its distances are +inf (never a winner either way) without a select.
            x_sq = tl.load(x_sq_ptr + cloud.to(tl.int64) * stride_sn + rows, mask=row_ok, other=float("inf"))
        if DIM <= BLOCK_K:
            if DIM == BLOCK_K:
                x_tile = tl.load(x_rows[:, None] + offs_k[None, :], mask=row_ok[:, None], other=0.0)
            else:
                x_tile = tl.load(x_rows[:, None] + offs_k[None, :],
                                 mask=row_ok[:, None] & (offs_k[None, :] < DIM), other=0.0)
        for start in range(0, y_len, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < y_len
            y_cols = y_base + cols.to(tl.int64) * stride_yp
            if DIM <= BLOCK_K:
                if DIM == BLOCK_K:
                    y_tile = tl.load(y_cols[:, None] + offs_k[None, :], mask=col_ok[:, None], other=0.0)
                else:
                    y_tile = tl.load(y_cols[:, None] + offs_k[None, :],
                                     mask=col_ok[:, None] & (offs_k[None, :] < DIM), other=0.0)
                prod = tl.dot(x_tile, tl.trans(y_tile), input_precision=DOT_PRECISION)
            else:
                prod = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                for k0 in range(0, DIM, BLOCK_K):
                    kk = k0 + offs_k
                    xk = tl.load(x_rows[:, None] + kk[None, :], mask=row_ok[:, None] & (kk[None, :] < DIM), other=0.0)
                    yk = tl.load(y_cols[:, None] + kk[None, :], mask=col_ok[:, None] & (kk[None, :] < DIM), other=0.0)
                    prod = tl.dot(xk, tl.trans(yk), prod, input_precision=DOT_PRECISION)
            if AUGMENTED:
                dist = tl.where(row_ok[:, None] & col_ok[None, :], prod, float("inf"))
                # An infinite point gives inf - inf = NaN where its true distance to a finite point is +inf.
                dist = tl.where(dist == dist, tl.maximum(dist, 0.0), float("inf"))
            else:
                # Non-finite points come with zero operands and an infinite norm (_finite_rows): no NaN here, so
                # no select. Cancellation can dip below 0, whose float bits would order wrongly as keys.
                y_sq = tl.load(y_sq_ptr + cloud.to(tl.int64) * stride_tn + cols, mask=col_ok, other=float("inf"))
                dist = tl.maximum(x_sq[:, None] + y_sq[None, :] - 2.0 * prod, 0.0)
            best_key, best_col = fold_key_tile(dist, start, best_key, best_col, BLOCK_N, COL_BITS)
            if BOTH_WAYS:
                fold_reverse_tile(dist, row_start, cols, col_ok, y_key_ptr + cloud.to(tl.int64) * stride_kn, ROW_BITS)
    store_winners(idx_ptr, cloud, rows, row_ok, best_col, stride_in, stride_ip)


@triton.jit
def add_coordinate(dist, x_base, y_base, k, rows, cols, row_ok, col_ok, stride_xk, stride_yk, NORM: tl.constexpr):
    """Add coordinate ``k``'s term of every pair: ``(x_k - y_k)**2`` (``NORM`` 2) or ``|x_k - y_k|``. Padded points
    read as +inf, so a pair with one padded point is +inf (never nearer than a real point) without a select."""
    xk = tl.load(x_base + k * stride_xk + rows, mask=row_ok, other=float("inf")).to(tl.float32)
    yk = tl.load(y_base + k * stride_yk + cols, mask=col_ok, other=float("inf")).to(tl.float32)
    diff = xk[:, None] - yk[None, :]
    if NORM == 1:
        return dist + tl.abs(diff)
    return dist + diff * diff


@triton.jit
def fold_reverse_tile(dist, row_start, cols, col_ok, y_key_ptr, ROW_BITS: tl.constexpr):
    """The reverse direction of the same tile: each ``y`` point's nearest row of this ``x`` block, folded into
    its global int64 key ``(distance bits << 31) | row`` with one atomic min (exact ties: the lowest row)."""
    tile_key = tl.min(distance_keys(dist, tl.arange(0, dist.shape[0])[:, None], ROW_BITS), axis=0)
    # Zero-extended: every key is non-negative, whatever the bits (NaN rows are settled by the caller).
    value = (tile_key & ~((1 << ROW_BITS) - 1)).to(tl.uint32, bitcast=True).to(tl.int64)
    key = (value << 31) | (row_start + (tile_key & ((1 << ROW_BITS) - 1)))
    tl.atomic_min(y_key_ptr + cols, key, mask=col_ok, sem="relaxed")


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def nearest_direct_kernel(
    xt_ptr, yt_ptr, x_len_ptr, y_len_ptr, idx_ptr, y_key_ptr,
    stride_xn, stride_xk, stride_yn, stride_yk, stride_in, stride_ip, stride_kn,
    DIM: tl.constexpr, NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COL_BITS: tl.constexpr,
    BOTH_WAYS: tl.constexpr, ROW_BITS: tl.constexpr,
):
    cloud = tl.program_id(1)
    x_len = tl.load(x_len_ptr + cloud)
    y_len = tl.load(y_len_ptr + cloud)
    row_start = tl.program_id(0).to(tl.int64) * BLOCK_M
    rows = row_start + tl.arange(0, BLOCK_M)
    row_ok = rows < x_len
    x_base = xt_ptr + cloud.to(tl.int64) * stride_xn
    y_base = yt_ptr + cloud.to(tl.int64) * stride_yn
    best_key = tl.full((BLOCK_M,), _NO_KEY, tl.int32)
    best_col = tl.full((BLOCK_M,), -1, tl.int32)
    if row_start < x_len:
        for start in range(0, y_len, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < y_len
            dist = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            if DIM <= UNROLLED_MAX_DIM:
                for k in tl.static_range(DIM):
                    dist = add_coordinate(dist, x_base, y_base, k, rows, cols, row_ok, col_ok, stride_xk, stride_yk,
                                          NORM)
            else:  # wide feature sets under norm=1: a runtime loop, not thousands of unrolled steps
                for k in range(0, DIM):
                    dist = add_coordinate(dist, x_base, y_base, k, rows, cols, row_ok, col_ok, stride_xk, stride_yk,
                                          NORM)
            best_key, best_col = fold_key_tile(dist, start, best_key, best_col, BLOCK_N, COL_BITS)
            if BOTH_WAYS:
                fold_reverse_tile(dist, row_start, cols, col_ok, y_key_ptr + cloud.to(tl.int64) * stride_kn, ROW_BITS)
    store_winners(idx_ptr, cloud, rows, row_ok, best_col, stride_in, stride_ip)


def _centred(x: torch.Tensor, y: torch.Tensor, x_lengths: torch.Tensor):
    """float32 ``x`` and ``y`` centred on the finite valid ``x`` points' mean, with their squared norms."""
    p1 = x.shape[1]
    xf, yf = x.float(), y.float()
    valid = valid_points(x_lengths, p1)
    usable = valid & torch.isfinite(xf).all(-1)
    count = usable.sum(1, keepdim=True).clamp(min=1)
    centre = torch.where(usable[..., None], xf, 0.0).sum(1, keepdim=True) / count[..., None]
    xc, yc = xf - centre, yf - centre
    return xc, yc, (xc * xc).sum(-1), (yc * yc).sum(-1)


def tf32_round(t: torch.Tensor) -> torch.Tensor:
    """float32 ``t`` rounded to TF32's 10 mantissa bits, to nearest even (inf and NaN as they are). The tensor
    cores truncate float32 operands: rounding first halves the error and removes truncation's bias towards 0."""
    bits = t.contiguous().view(torch.int32)
    rounded = ((bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF).view(torch.float32)
    return torch.where(torch.isfinite(t), rounded, t)


def tf32_parts(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``a [..., K]``, ``b [..., K]`` -> ``[a_hi, a_lo, a_hi]``, ``[b_hi, b_hi, b_lo]`` (``[..., 3K]``)
    whose TF32 product is ``a_hi.b_hi + a_lo.b_hi + a_hi.b_lo``: float32's accuracy from TF32 tensor cores
    (the ``a_lo.b_lo`` term left out is ``2**-22`` relative). ``hi`` keeps TF32's 10 mantissa bits exactly."""

    def split(t):
        hi = (t.contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)
        return hi, t - hi

    a_hi, a_lo = split(a)
    b_hi, b_lo = split(b)
    return torch.cat([a_hi, a_lo, a_hi], dim=-1), torch.cat([b_hi, b_hi, b_lo], dim=-1)


def _dot_operands(x, y, x_lengths, augmented: bool, split: bool, tf32: bool):
    """Operands of the dot route. float32: centred on the ``x`` cloud, ``x' = [x, 1, |x|^2]``,
    ``y' = [-2y, |y|^2, 1]`` when ``augmented`` (the product is the distance), else ``x`` and ``y`` with the
    norms added in the kernel; TF32 parts when ``split``, else rounded to TF32 when ``tf32``. float16 /
    bfloat16: the inputs themselves (exact products on the tensor cores; a centred copy would round), with
    float32 norms."""
    if x.dtype != torch.float32:
        x_sq, y_sq = x.float().square().sum(-1), y.float().square().sum(-1)
        (xa, x_sq), (ya, y_sq) = _finite_rows(x, x_sq), _finite_rows(y, y_sq)
        return xa.contiguous(), ya.contiguous(), x_sq.contiguous(), y_sq.contiguous()
    xc, yc, x_sq, y_sq = _centred(x, y, x_lengths)
    if augmented:
        ones_x, ones_y = torch.ones_like(x_sq)[..., None], torch.ones_like(y_sq)[..., None]
        xa = torch.cat([xc, ones_x, x_sq[..., None]], dim=-1)
        ya = torch.cat([-2.0 * yc, y_sq[..., None], ones_y], dim=-1)
    else:
        xa, ya = xc, yc
    if split:
        xa, ya = tf32_parts(xa, ya)
    elif tf32:
        xa, ya = tf32_round(xa), tf32_round(ya)
    if not augmented:
        (xa, x_sq), (ya, y_sq) = _finite_rows(xa, x_sq), _finite_rows(ya, y_sq)
    return xa.contiguous(), ya.contiguous(), x_sq.contiguous(), y_sq.contiguous()


def _finite_rows(a: torch.Tensor, sq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Operands ``a [N, P, W]`` and float32 squared norms ``sq [N, P]`` with every point whose norm is not finite
    (an inf or NaN coordinate, or an overflow) given zero operands and an infinite norm: its distance to every
    point is then +inf, never NaN, and the caller settles such rows as the reference does."""
    bad = ~torch.isfinite(sq)
    return torch.where(bad[..., None], 0, a), torch.where(bad, float("inf"), sq)


def _core_nearest(x, y, x_lengths, y_lengths, split: bool) -> torch.Tensor:
    """Nearest neighbours through MaxSim's argmax forward: with ``x' = [x, 1]`` and ``y' = [2y, -|y|^2]``,
    ``x'.y' = |x|^2 - |x - y|^2``, so each ``x`` point's winning ``y`` token (highest similarity, lowest index
    on ties) is its nearest neighbour. Each cloud is one query against its own one-document corpus."""
    p1, p2 = x.shape[1], y.shape[1]
    x_valid = valid_points(x_lengths, p1)
    xc, yc, _, y_sq = _centred(x, y, x_lengths)
    xa = torch.cat([xc, torch.ones_like(xc[..., :1])], dim=-1)
    ya = torch.cat([2.0 * yc, -y_sq[..., None]], dim=-1)
    # A y point with an infinite coordinate is infinitely far from every finite x (x'.y' would be NaN): it is
    # excluded, and only wins where nothing else is left (the reference's tie at +inf: the lowest index).
    y_ok = valid_points(y_lengths, p2) & ~(torch.isinf(yc).any(-1) & ~torch.isnan(yc).any(-1))
    if split:
        xa, ya = tf32_parts(xa, ya)
    problem = padded_problem(xa.contiguous(), ya.contiguous()[:, None], x_valid, y_ok[:, None], exclude=True,
                             per_query=True, precision="tf32" if split else "ieee")
    _, argmax = launch_forward(problem, store_argmax=True)
    idx = argmax[:, 0].to(torch.int32)
    stranded = (idx < 0) & x_valid & (y_lengths > 0)[:, None]
    return torch.where(stranded, 0, idx)


def coordinate_major(points: torch.Tensor) -> torch.Tensor:
    """``[N, P, D]`` -> contiguous ``[N, D, P]`` (the direct kernel's layout), in the input dtype."""
    return points.transpose(1, 2).contiguous()


def uses_direct_route(dim: int, norm: int, device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
    """Whether :func:`nearest_indices` reads the clouds coordinate-major (the caller may prepare those copies)."""
    return nearest_config(dim=dim, norm=norm, device=device, dtype=dtype).route == "direct"


def _decode_reverse(keys: torch.Tensor) -> torch.Tensor:
    """int64 keys of the reverse direction -> int32 rows, -1 where no row was folded in."""
    empty = keys == torch.iinfo(torch.int64).max
    return torch.where(empty, -1, keys & 0x7FFFFFFF).to(torch.int32)


def nearest_indices(
    x: torch.Tensor, y: torch.Tensor, x_lengths: torch.Tensor, y_lengths: torch.Tensor, norm: int,
    xt: torch.Tensor | None = None, yt: torch.Tensor | None = None, both_ways: bool = False,
):
    """Winner of each valid ``x`` point: int32 ``[N, P1]``, -1 for padded points and empty ``y`` clouds; with
    ``both_ways``, also each valid ``y`` point's winner in ``x`` (``[N, P2]``), as a pair.

    ``x [N, P1, D]`` and ``y [N, P2, D]`` on one device; ``xt`` / ``yt`` may pass their
    :func:`coordinate_major` copies (a Chamfer call makes them once for both directions). Padded points are
    never read. Among non-finite distances the winner is unspecified (the caller settles NaN rows). The direct
    route finds both directions in one pass over the pairs (:attr:`NearestConfig.one_pass`)."""
    n, p1, dim = x.shape
    p2 = y.shape[1]
    cfg = nearest_config(dim=dim, norm=norm, device=x.device, dtype=x.dtype)
    if cfg.route != "direct" and norm != 2:
        raise ValueError(f"the {cfg.route} route computes squared L2 distances only, not norm={norm}")
    if both_ways and not (cfg.route in ("direct", "dot") and cfg.one_pass):
        return (nearest_indices(x, y, x_lengths, y_lengths, norm, xt, yt),
                nearest_indices(y, x, y_lengths, x_lengths, norm, yt, xt))
    if both_ways and p2 > p1:
        # The grid runs over x blocks: the larger cloud there keeps more programs busy.
        idx_yx, idx_xy = nearest_indices(y, x, y_lengths, x_lengths, norm, yt, xt, both_ways=True)
        return idx_xy, idx_yx
    idx = torch.full((n, p1), -1, dtype=torch.int32, device=x.device)
    if n == 0 or p1 == 0 or p2 == 0 or dim == 0:
        return (idx, torch.full((n, p2), -1, dtype=torch.int32, device=x.device)) if both_ways else idx
    x_len32 = x_lengths.to(torch.int32)
    y_len32 = y_lengths.to(torch.int32)
    grid = (cdiv(p1, cfg.block_m), n)
    col_bits = cfg.block_n.bit_length() - 1
    if cfg.route == "direct":
        xt = coordinate_major(x) if xt is None else xt
        yt = coordinate_major(y) if yt is None else yt
        # One direction never touches the reverse keys: ``idx`` stands in for the pointer (no allocation).
        y_keys = torch.full((n, p2), torch.iinfo(torch.int64).max, dtype=torch.int64, device=x.device) \
            if both_ways else idx
        nearest_direct_kernel[grid](
            xt, yt, x_len32, y_len32, idx, y_keys,
            xt.stride(0), xt.stride(1), yt.stride(0), yt.stride(1), idx.stride(0), idx.stride(1), y_keys.stride(0),
            DIM=dim, NORM=norm, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, COL_BITS=col_bits,
            BOTH_WAYS=both_ways, ROW_BITS=cfg.block_m.bit_length() - 1, num_warps=cfg.num_warps,
        )
        return (idx, _decode_reverse(y_keys)) if both_ways else idx
    split = cfg.precision == "tf32x3" and x.dtype == torch.float32
    if cfg.route == "core":
        return _core_nearest(x, y, x_lengths, y_lengths, split)
    # The norms' columns would be rounded to TF32 with the coordinates (or to half precision): outside the
    # product they stay float32.
    augmented = dim <= AUGMENTED_MAX_DIM and x.dtype == torch.float32 and cfg.precision != "tf32"
    tf32 = x.dtype == torch.float32 and cfg.precision in ("tf32", "tf32x3")
    xa, ya, x_sq, y_sq = _dot_operands(x, y, x_lengths, augmented, split, tf32)
    width = xa.shape[-1]
    # Up to 128 features the x block stays resident and each y tile is one product.
    block_k = max(16, next_power_of_2(width)) if width <= RESIDENT_MAX_WIDTH else 32
    y_keys = torch.full((n, p2), torch.iinfo(torch.int64).max, dtype=torch.int64, device=x.device) \
        if both_ways else idx
    nearest_dot_kernel[grid](
        xa, ya, x_sq, y_sq, x_len32, y_len32, idx, y_keys,
        xa.stride(0), xa.stride(1), ya.stride(0), ya.stride(1), x_sq.stride(0), y_sq.stride(0),
        idx.stride(0), idx.stride(1), y_keys.stride(0),
        DIM=width, AUGMENTED=augmented, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        COL_BITS=col_bits, DOT_PRECISION="tf32" if tf32 else "ieee", BOTH_WAYS=both_ways,
        ROW_BITS=cfg.block_m.bit_length() - 1, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return (idx, _decode_reverse(y_keys)) if both_ways else idx
