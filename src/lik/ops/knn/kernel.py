"""The ``K`` nearest points of ``p2`` to every point of ``p1``, cloud by cloud, on chip.

A program holds ``BLOCK_M`` points of ``p1`` and streams ``p2`` in tiles of ``BLOCK_N`` points. Each tile's
distances become int64 *keys*, ``(float bits << 32) | column``: distances are non-negative, so their bits order as
the values do, and the column breaks ties towards the lower index (NaN is given one bit pattern above +inf, so NaN
neighbours come last). Each row keeps its ``K`` best keys unsorted in registers (``KP``, ``K`` rounded up to a power
of two, slots; the extra slots hold -1 and never move). A tile is folded in by repeated extraction: the tile's
smallest key below the row's worst kept key replaces that worst key, as many times as some row of the block has
such keys (at most ``K``); the tile itself stays int32 distance bits, its columns implied. Most tiles of a large
cloud hold no key below any row's worst, and cost one compare per
pair. At the end each row's keys are sorted by ``KP`` extractions and written as distances and indices.

Two ways to make a tile's distances (:func:`lik.ops.knn.heuristic.knn_config` picks one):

* ``direct``: coordinate differences on the CUDA cores, exact wherever the points lie; both clouds are read
  coordinate-major (``[N, D, P]``) so a tile's loads are contiguous.
* ``products``: ``|x|^2 + |y|^2 - 2 x.y`` with a tensor-core product per tile, on float32 operands centred on
  the ``p1`` cloud (TF32 or TF32-split, as ``torch.get_float32_matmul_precision()`` says) or on the half-precision
  inputs themselves. It only picks the neighbours: their distances are recomputed exactly afterwards (and the list
  re-sorted). A tile that holds a point whose squared norm is not finite (an inf or NaN coordinate, or an overflow)
  takes the exact differences instead, so non-finite points rank as the reference ranks them (a row block
  holding such a point compares its whole row exactly: slow, but only there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._device import cdiv, next_power_of_2
from ..._launch import launch
from ..chamfer.kernel import tf32_parts, tf32_round
from .gather import sort_neighbours, exact_distances
from .heuristic import knn_config, product_precision
from .validation import valid_slots

__all__ = ["knn_kernel", "knn_forward", "coordinate_major", "centred_operands"]

_PAD_BITS = tl.constexpr(0x7FFFFFFF)  # a padded column's distance bits: above every real distance, NaN included
_NAN_BITS = tl.constexpr(0x7FC00000)  # the one NaN every NaN distance becomes (above +inf's 0x7F800000)
_MAX_KEY = tl.constexpr(0x7FFFFFFFFFFFFFFF)
UNROLLED_MAX_DIM = tl.constexpr(16)

# Sizes and the strides that follow them are not specialised on: a new P or K must not compile a new variant. The
# point strides of the products' operands (their width) stay specialised: their alignment lets the loads vectorise.
_RUNTIME_INTS = [
    "P1", "K", "stride_xn", "stride_xd", "stride_yn", "stride_yd", "stride_an", "stride_bn", "stride_sn", "stride_tn",
    "stride_on", "stride_op",
]


@triton.jit
def add_term(dist, diff, NORM: tl.constexpr):
    if NORM == 1:
        return dist + tl.abs(diff)
    return dist + diff * diff


@triton.jit
def exact_tile(x_base, y_base, rows, cols, row_ok, col_ok, stride_xp, stride_xd, stride_yp, stride_yd,
               DIM: tl.constexpr, NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]`` float32 distances from coordinate differences (``NORM`` 2: squares, 1: absolute
    values); masked points read as 0 (the caller masks their keys)."""
    dist = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    x_rows = x_base + rows.to(tl.int64) * stride_xp
    y_cols = y_base + cols.to(tl.int64) * stride_yp
    if DIM <= UNROLLED_MAX_DIM:
        for d in tl.static_range(DIM):
            xd = tl.load(x_rows + d * stride_xd, mask=row_ok, other=0.0).to(tl.float32)
            yd = tl.load(y_cols + d * stride_yd, mask=col_ok, other=0.0).to(tl.float32)
            dist = add_term(dist, xd[:, None] - yd[None, :], NORM)
    else:  # wide points under norm=1, or a product tile's non-finite fallback: a loop, not DIM unrolled steps
        for d in range(0, DIM):
            xd = tl.load(x_rows + d * stride_xd, mask=row_ok, other=0.0).to(tl.float32)
            yd = tl.load(y_cols + d * stride_yd, mask=col_ok, other=0.0).to(tl.float32)
            dist = add_term(dist, xd[:, None] - yd[None, :], NORM)
    return dist


@triton.jit
def product_tile(a_base, b_base, xs, ys, rows, cols, row_ok, col_ok, stride_ap, stride_bp,
                 WIDTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """``|x|^2 + |y|^2 - 2 a.b`` (``a.b = x.y``; ``[.., WIDTH]``, feature-contiguous), clamped at 0."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    a_rows = a_base + rows.to(tl.int64) * stride_ap
    b_cols = b_base + cols.to(tl.int64) * stride_bp
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, WIDTH, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(a_rows[:, None] + kk[None, :], mask=row_ok[:, None] & (kk[None, :] < WIDTH), other=0.0)
        b = tl.load(b_cols[:, None] + kk[None, :], mask=col_ok[:, None] & (kk[None, :] < WIDTH), other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
    dist = xs[:, None] + ys[None, :] - 2.0 * acc
    # Cancellation can dip below 0, whose bits would order wrongly (NaN fails the test and stays NaN).
    return tl.where(dist < 0.0, 0.0, dist)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def knn_kernel(
    x_ptr, y_ptr, a_ptr, b_ptr, xs_ptr, ys_ptr, len1_ptr, len2_ptr, dist_ptr, idx_ptr, P1, K,
    stride_xn, stride_xp, stride_xd, stride_yn, stride_yp, stride_yd,
    stride_an, stride_ap, stride_bn, stride_bp, stride_sn, stride_tn, stride_on, stride_op,
    DIM: tl.constexpr, NORM: tl.constexpr, KP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRODUCTS: tl.constexpr, WIDTH: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    cloud = tl.program_id(1).to(tl.int64)
    len1 = tl.load(len1_ptr + cloud).to(tl.int32)  # int32 rows and columns: int64 would double every index op
    len2 = tl.load(len2_ptr + cloud).to(tl.int32)
    row_start = tl.program_id(0) * BLOCK_M
    rows = row_start + tl.arange(0, BLOCK_M)
    row_ok = rows < len1
    slots = tl.arange(0, KP)
    # Unfilled slots hold distinct keys above every real one; slots past K hold -1, never the worst, never replaced.
    unfilled = (tl.full((KP,), _PAD_BITS, tl.int64) << 32) | slots.to(tl.int64)
    best = tl.where(slots[None, :] < K, unfilled[None, :], -1) + tl.zeros((BLOCK_M, KP), tl.int64)
    x_base = x_ptr + cloud * stride_xn
    y_base = y_ptr + cloud * stride_yn
    if row_start < len1:
        if PRODUCTS:
            xs = tl.load(xs_ptr + cloud * stride_sn + rows, mask=row_ok, other=0.0)
            a_base = a_ptr + cloud * stride_an
            b_base = b_ptr + cloud * stride_bn
            # Masked rows and columns read a norm of 0: finite.
            rows_nonfinite = tl.sum((xs < float("inf")).to(tl.int32) ^ 1, 0)
        for start in range(0, len2, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < len2
            if PRODUCTS:
                ys = tl.load(ys_ptr + cloud * stride_tn + cols, mask=col_ok, other=0.0)
                nonfinite = rows_nonfinite + tl.sum((ys < float("inf")).to(tl.int32) ^ 1, 0)
                if nonfinite > 0:
                    dist = exact_tile(x_base, y_base, rows, cols, row_ok, col_ok, stride_xp, stride_xd, stride_yp,
                                      stride_yd, DIM, NORM, BLOCK_M, BLOCK_N)
                else:
                    dist = product_tile(a_base, b_base, xs, ys, rows, cols, row_ok, col_ok, stride_ap, stride_bp,
                                        WIDTH, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
            else:
                dist = exact_tile(x_base, y_base, rows, cols, row_ok, col_ok, stride_xp, stride_xd, stride_yp,
                                  stride_yd, DIM, NORM, BLOCK_M, BLOCK_N)
            bits = tl.where(dist == dist, dist.to(tl.int32, bitcast=True), _NAN_BITS)
            worst = tl.max(best, 1)
            # A distance of this tile equal in bits to a row's worst has a higher column: it is never better.
            hit = (bits < (worst >> 32).to(tl.int32)[:, None]) & col_ok[None, :]
            steps = tl.minimum(tl.max(tl.sum(hit.to(tl.int32), 1), 0), K)
            # The candidates as int32 bits, their columns implied (keys are formed per row, not per pair).
            bits = tl.where(hit, bits, _PAD_BITS)
            for _ in range(0, steps):
                low_bits = tl.min(bits, 1)
                low_col = tl.min(tl.where(bits == low_bits[:, None], cols[None, :], _PAD_BITS), 1)
                low = (low_bits.to(tl.int64) << 32) | low_col.to(tl.int64)
                take = (low_bits < _PAD_BITS) & (low < worst)
                best = tl.where(take[:, None] & (best == worst[:, None]), low[:, None], best)
                bits = tl.where(cols[None, :] == low_col[:, None], _PAD_BITS, bits)
                worst = tl.max(best, 1)
    # Sort each row's keys ascending; the extra slots go last.
    best = tl.where(slots[None, :] < K, best, _MAX_KEY)
    ordered = tl.zeros((BLOCK_M, KP), tl.int64)
    for j in tl.static_range(KP):
        low = tl.min(best, 1)
        ordered = tl.where(slots[None, :] == j, low[:, None], ordered)
        best = tl.where(best == low[:, None], _MAX_KEY, best)
    high = (ordered >> 32).to(tl.int32)
    filled = (high < _PAD_BITS) & row_ok[:, None]
    dist = tl.where(filled, high.to(tl.float32, bitcast=True), 0.0)
    col = tl.where(filled, ordered - (high.to(tl.int64) << 32), 0)
    out = cloud * stride_on + rows.to(tl.int64)[:, None] * stride_op + slots[None, :]
    store_ok = (rows < P1)[:, None] & (slots[None, :] < K)
    tl.store(dist_ptr + out, dist, mask=store_ok)
    tl.store(idx_ptr + out, col, mask=store_ok)


def coordinate_major(points: torch.Tensor) -> torch.Tensor:
    """``[N, P, D]`` -> ``[N, D, P]`` with contiguous points (the direct route's layout), in the input dtype."""
    return points.transpose(1, 2).contiguous().transpose(1, 2)


def centred_operands(p1: torch.Tensor, p2: torch.Tensor, lengths1: torch.Tensor, precision: str):
    """The products route's operands ``a [N, P1, W]``, ``b [N, P2, W]`` (``a.b = x.y``) and float32 squared
    norms ``[N, P]``. Half-precision inputs multiply as they are; float32 is centred on the finite valid ``p1``
    points' mean (centring keeps the digits of nearby points far from the origin) and, for "tf32x3", split into
    TF32 parts, for "tf32" rounded to TF32 to nearest."""
    if p1.dtype != torch.float32:
        return p1.contiguous(), p2.contiguous(), p1.float().square().sum(-1), p2.float().square().sum(-1)
    rows = torch.arange(p1.shape[1], device=p1.device)[None, :] < lengths1[:, None]
    usable = rows & torch.isfinite(p1).all(-1)
    count = usable.sum(1, keepdim=True).clamp(min=1)
    centre = torch.where(usable[..., None], p1, 0.0).sum(1, keepdim=True) / count[..., None]
    x, y = p1 - centre, p2 - centre
    a, b = x, y
    if precision == "tf32x3":
        a, b = tf32_parts(a, b)
    elif precision == "tf32":
        a, b = tf32_round(a), tf32_round(b)  # the tensor cores would truncate: half the error, no bias
    return a.contiguous(), b.contiguous(), x.square().sum(-1), y.square().sum(-1)


def knn_forward(p1: torch.Tensor, p2: torch.Tensor, lengths1: torch.Tensor, lengths2: torch.Tensor, K: int,
                norm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``dists [N, P1, K]`` (sorted ascending, exact) and int64 ``idx [N, P1, K]``; rows past
    ``lengths1`` and slots past ``lengths2`` hold 0 and 0. ``p1 [N, P1, D]``, ``p2 [N, P2, D]`` float16 /
    bfloat16 / float32 on one device (CUDA, or CPU under the interpreter), any strides; int64 lengths."""
    n, p1_size, dim = p1.shape
    p2_size = p2.shape[1]
    dists = torch.empty((n, p1_size, K), dtype=torch.float32, device=p1.device)
    idx = torch.empty((n, p1_size, K), dtype=torch.int64, device=p1.device)
    if n == 0 or p1_size == 0:
        return dists, idx
    cfg = knn_config(dim=dim, k=K, norm=norm, dtype=p1.dtype, device=p1.device)
    products = cfg.route == "products" and norm == 2 and dim > 0 and p2_size > 0
    if products:
        precision = cfg.precision or product_precision(p1.dtype, p1.device)
        a, b, xs, ys = centred_operands(p1, p2, lengths1, precision)
        dot_precision = "tf32" if precision in ("tf32", "tf32x3") else "ieee"
        x, y = p1, p2  # read only for tiles holding a non-finite point
    else:
        x, y = coordinate_major(p1), coordinate_major(p2)
        a, b, xs, ys = x, y, dists, dists  # unused pointers (PRODUCTS is off)
        dot_precision = "ieee"
    width = a.shape[2] if products else 1
    block_k = min(cfg.block_k, max(16, next_power_of_2(width)))
    grid = (cdiv(p1_size, cfg.block_m), n)
    launch(
        knn_kernel, grid, x, y, a, b, xs, ys, lengths1, lengths2, dists, idx, p1_size, K,
        x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), xs.stride(0), ys.stride(0), dists.stride(0),
        dists.stride(1),
        DIM=dim, NORM=norm, KP=next_power_of_2(K), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PRODUCTS=products,
        WIDTH=width, BLOCK_K=block_k, DOT_PRECISION=dot_precision, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if products:
        valid = valid_slots(lengths1, lengths2, p1_size, K)
        dists = exact_distances(p1, p2, idx, valid, norm)
        dists, idx = sort_neighbours(dists, idx, valid)
    return dists, idx
