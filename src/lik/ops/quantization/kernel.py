"""Fused per-row quantization: one read of ``x``, one write of ``x_q`` and ``scale``.

A program takes ``BLOCK_ROWS`` rows. A row up to ``BLOCK_D`` wide stays in registers between the max and the
scaling; a wider row, or one whose width is not a power of two (:func:`quantize_tiles`), is walked twice in
``BLOCK_D`` chunks (the second read mostly hits L1 / L2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._device import cdiv, next_power_of_2
from ..._launch import launch
from ..._replay import made
from ...core.reductions import nan_max
from .reference import QMAX

__all__ = ["quantize_rows_kernel", "quantize_rows", "quantize_tiles"]

# Elements per program: small programs of two warps, many per SM, keep the most bytes in flight (sweeps at d = 128
# on the H100 and H200: benchmarks/NOTES.md, "8-bit corpora"); a row wider than
# this still takes one program.
_TILE_ELEMENTS = 1024
_MAX_BLOCK_D = 8192


# Below this scale the one-correction quotient's remainder could underflow (it is exact only while it stays a
# normal float32); such rows take the correctly rounded division instead. Real embeddings have scales near 1e-3.
_FAST_MIN_SCALE = tl.constexpr(2.0**-64)
_ROUNDING_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: adding it leaves round-half-even(v) in the low mantissa bits


@triton.jit
def _row_scales(amax, QMAX_VALUE: tl.constexpr):
    """``(scale, finite, fast)`` of rows whose NaN-propagating max |x| is ``amax``: scale 0 for a zero or non-finite
    row; ``fast`` where :func:`_quotients` may multiply by the reciprocal."""
    finite = amax < float("inf")  # (NaN compares False)
    scale = tl.div_rn(tl.where(finite, amax, 0.0), QMAX_VALUE)
    fast = finite & ((scale == 0.0) | (scale >= _FAST_MIN_SCALE))
    return scale, finite, fast


@triton.jit
def _quotients(x, scale, usable, FAST: tl.constexpr, SIGNED_ZERO: tl.constexpr):
    """``x / scale`` per row, correctly rounded as the reference's float32 division (Triton's ``/`` is approximate),
    0 in rows that are not ``usable`` (scale 0, or a non-finite row); ``SIGNED_ZERO`` (float8 stores -0): a -0
    input of a usable row gives -0, as the division does.

    ``FAST`` (every row finite, its scale 0 or at least ``_FAST_MIN_SCALE``): the product with the correctly
    rounded reciprocal and one exact-remainder correction (Markstein's theorem: the correctly rounded quotient),
    three FMA-pipe instructions where ``div_rn`` costs a reciprocal and a checked sequence per element. The sign
    of a zero quotient is then set with bit operations (the compiler may fold a negation across an FMA, which
    changes only the sign of a zero: seen on sm_90)."""
    divisor = tl.where(usable, scale, 1.0)
    if FAST:
        inv = tl.where(usable, tl.div_rn(1.0, divisor), 0.0)[:, None]
        first = x * inv
        values = tl.fma(tl.fma(first, divisor[:, None], -x), -inv, first)
        if SIGNED_ZERO:
            # A nonzero quotient already has x's sign; a zero one takes it in a usable row and is +0 elsewhere.
            sign = tl.where(usable, -2147483648, 0)[:, None]  # the float32 sign bit
            keep = tl.where(usable, -1, 2147483647)[:, None]
            bits = (values.to(tl.int32, bitcast=True) | (x.to(tl.int32, bitcast=True) & sign)) & keep
            values = bits.to(tl.float32, bitcast=True)
        return values
    return tl.where(usable[:, None], tl.div_rn(x, divisor[:, None]), 0.0)


@triton.jit
def _stored_values(x, scale, usable, all_fast, QMAX_VALUE: tl.constexpr, TO_INT8: tl.constexpr,
                   out_dtype: tl.constexpr):
    """The 8-bit values of ``x``'s rows: :func:`_quotients` (its fast form when ``all_fast``, a branch per
    program), then :func:`_to_8bit`."""
    if all_fast:
        values = _quotients(x, scale, usable, True, not TO_INT8)
    else:
        values = _quotients(x, scale, usable, False, not TO_INT8)
    return _to_8bit(values, QMAX_VALUE, TO_INT8, out_dtype)


@triton.jit
def _to_8bit(values, QMAX_VALUE: tl.constexpr, TO_INT8: tl.constexpr, out_dtype: tl.constexpr):
    """Quotients to the stored 8-bit values, clamped to ``[-QMAX, QMAX]``: a subnormal scale is rounded coarsely,
    so a row's largest quotient can pass QMAX (-136 for a row whose largest magnitude is 5.7e-43)."""
    values = tl.minimum(tl.maximum(values, -QMAX_VALUE), QMAX_VALUE)
    if TO_INT8:
        # Round half to even without a float-to-int conversion: the integer sits in the low bits of v + 1.5 * 2**23.
        return (values + _ROUNDING_MAGIC).to(tl.int32, bitcast=True).to(tl.int8)
    return values.to(out_dtype)


# n_rows stays unspecialized (no recompile per corpus size); dim and the row strides keep Triton's 16-divisibility
# specialization, without which the row loads are not vectorized.
@triton.jit(do_not_specialize=["n_rows"])
def quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, n_rows, dim, stride_xr, stride_qr,
    QMAX_VALUE: tl.constexpr, TO_INT8: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, SINGLE_CHUNK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < n_rows
    cols = tl.arange(0, BLOCK_D)
    x_rows = x_ptr + rows[:, None] * stride_xr
    q_rows = q_ptr + rows[:, None] * stride_qr
    out_dtype: tl.constexpr = q_ptr.dtype.element_ty
    if SINGLE_CHUNK:
        mask = row_ok[:, None] & (cols[None, :] < dim)
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.reduce(tl.abs(x), 1, nan_max)
    else:
        amax = tl.zeros((BLOCK_ROWS,), tl.float32)
        for start in range(0, dim, BLOCK_D):
            mask = row_ok[:, None] & ((start + cols)[None, :] < dim)
            chunk = tl.load(x_rows + start + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = nan_max(amax, tl.reduce(tl.abs(chunk), 1, nan_max))
    scale, finite, fast = _row_scales(amax, QMAX_VALUE)
    usable = scale > 0.0
    tl.store(scale_ptr + rows, tl.where(finite, scale, float("nan")), mask=row_ok)
    # One branch per program: a block with a non-finite row or a tiny scale takes the division.
    all_fast = tl.min(fast.to(tl.int32), axis=0) == 1
    if SINGLE_CHUNK:
        tl.store(q_rows + cols[None, :], _stored_values(x, scale, usable, all_fast, QMAX_VALUE, TO_INT8, out_dtype),
                 mask=mask)
    else:
        for start in range(0, dim, BLOCK_D):
            mask = row_ok[:, None] & ((start + cols)[None, :] < dim)
            chunk = tl.load(x_rows + start + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            values = _stored_values(chunk, scale, usable, all_fast, QMAX_VALUE, TO_INT8, out_dtype)
            tl.store(q_rows + start + cols[None, :], values, mask=mask)


def quantize_rows(x2d: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the rows of ``x2d [R, d]`` (unit stride along ``d``) -> ``(x_q [R, d] dtype, scale [R] float32)``."""
    n_rows, dim = x2d.shape
    x_q = made(torch.empty((n_rows, dim), dtype=dtype, device=x2d.device))
    scale = made(torch.empty((n_rows,), dtype=torch.float32, device=x2d.device))
    if n_rows == 0:
        return x_q, scale
    block_d, block_rows = quantize_tiles(dim, n_rows)
    tile = block_rows * block_d
    launch(
        quantize_rows_kernel, (cdiv(n_rows, block_rows),), x2d, x_q, scale, n_rows, dim, x2d.stride(0), x_q.stride(0),
        QMAX_VALUE=QMAX[dtype], TO_INT8=dtype == torch.int8, BLOCK_ROWS=block_rows, BLOCK_D=block_d,
        SINGLE_CHUNK=dim <= block_d, num_warps=8 if tile >= 8192 else (4 if tile >= 2048 else 2),
    )
    return x_q, scale


def quantize_tiles(dim: int, n_rows: int) -> tuple[int, int]:
    """``(BLOCK_D, BLOCK_ROWS)`` for rows of width ``dim``: one chunk of the row's power-of-two width, or, for a
    width that is not a power of two but a multiple of 16 (96, 80, 384, 768), chunks of its largest power-of-two
    divisor walked twice: a chunk partly past the row is 2.4-2.6x slower (H100, d = 96 and 80,
    benchmarks/NOTES.md "8-bit corpora")."""
    padded = min(next_power_of_2(max(dim, 16)), _MAX_BLOCK_D)
    divisor = dim & -dim
    if dim == padded or divisor < 16:
        return padded, max(1, min(64, _TILE_ELEMENTS // padded, next_power_of_2(n_rows)))
    block_d = min(divisor, _MAX_BLOCK_D)
    return block_d, max(1, min(64, 2 * _TILE_ELEMENTS // padded, next_power_of_2(n_rows)))
