"""Fused per-row quantization: one read of ``x``, one write of ``x_q`` and ``scale``.

A program takes ``BLOCK_ROWS`` rows. A row up to ``BLOCK_D`` wide stays in registers between the max and the
scaling; a wider row, or one whose width is not a power of two (:func:`quantize_tiles`), is walked twice in
``BLOCK_D`` chunks (the second read mostly hits L1 / L2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._config import cdiv, next_power_of_2
from .reference import QMAX

__all__ = ["quantize_rows_kernel", "quantize_rows", "quantize_tiles"]

# Elements per program: small programs of two warps, many per SM, keep the most bytes in flight (sweeps at d = 128
# on the H100 and H200: BENCHMARKS.md, "8-bit corpora on an H200, and lik.quantize's launch"); a row wider than
# this still takes one program.
_TILE_ELEMENTS = 1024
_MAX_BLOCK_D = 8192


@triton.jit
def _scaled(x, inv_ok, scale, QMAX_VALUE: tl.constexpr, TO_INT8: tl.constexpr):
    # Correctly rounded division, as the reference's float32 ``x / scale`` (Triton's ``/`` is approximate).
    values = tl.div_rn(x, tl.where(inv_ok, scale, 1.0)[:, None])
    values = tl.where(inv_ok[:, None], values, 0.0)
    values = tl.minimum(tl.maximum(values, -QMAX_VALUE), QMAX_VALUE)
    if TO_INT8:
        # Round half to even: adding and removing 1.5 * 2**23 leaves the nearest integer (|values| <= 127).
        values = (values + 12582912.0) - 12582912.0
    return values


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
    if SINGLE_CHUNK:
        mask = row_ok[:, None] & (cols[None, :] < dim)
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        # x - x is 0 for finite values and NaN for NaN and inf: one sum flags a non-finite row.
        finite = tl.sum(x - x, axis=1) == 0.0
    else:
        amax = tl.zeros((BLOCK_ROWS,), tl.float32)
        finite = tl.full((BLOCK_ROWS,), 1, tl.int1)
        for start in range(0, dim, BLOCK_D):
            mask = row_ok[:, None] & ((start + cols)[None, :] < dim)
            chunk = tl.load(x_rows + start + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(chunk), axis=1))
            finite = finite & (tl.sum(chunk - chunk, axis=1) == 0.0)
    amax = tl.where(finite, amax, 0.0)
    scale = tl.div_rn(amax, QMAX_VALUE)
    usable = scale > 0.0
    tl.store(scale_ptr + rows, tl.where(finite, scale, float("nan")), mask=row_ok)
    if SINGLE_CHUNK:
        values = _scaled(x, usable, scale, QMAX_VALUE, TO_INT8)
        tl.store(q_rows + cols[None, :], values.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        for start in range(0, dim, BLOCK_D):
            mask = row_ok[:, None] & ((start + cols)[None, :] < dim)
            chunk = tl.load(x_rows + start + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            values = _scaled(chunk, usable, scale, QMAX_VALUE, TO_INT8)
            tl.store(q_rows + start + cols[None, :], values.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows(x2d: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the rows of ``x2d [R, d]`` (unit stride along ``d``) -> ``(x_q [R, d] dtype, scale [R] float32)``."""
    n_rows, dim = x2d.shape
    x_q = torch.empty((n_rows, dim), dtype=dtype, device=x2d.device)
    scale = torch.empty((n_rows,), dtype=torch.float32, device=x2d.device)
    if n_rows == 0:
        return x_q, scale
    block_d, block_rows = quantize_tiles(dim, n_rows)
    tile = block_rows * block_d
    num_warps = 8 if tile >= 8192 else (4 if tile >= 2048 else 2)
    quantize_rows_kernel[(cdiv(n_rows, block_rows),)](
        x2d, x_q, scale, n_rows, dim, x2d.stride(0), x_q.stride(0),
        QMAX_VALUE=QMAX[dtype], TO_INT8=dtype == torch.int8,
        BLOCK_ROWS=block_rows, BLOCK_D=block_d, SINGLE_CHUNK=dim <= block_d, num_warps=num_warps,
    )
    return x_q, scale


def quantize_tiles(dim: int, n_rows: int) -> tuple[int, int]:
    """``(BLOCK_D, BLOCK_ROWS)`` for rows of width ``dim``: one chunk of the row's power-of-two width, or, for a
    width that is not a power of two but a multiple of 16 (96, 80, 384, 768), chunks of its largest power-of-two
    divisor walked twice: a chunk partly past the row is 2.4-2.6x slower (H100, d = 96 and 80,
    BENCHMARKS.md "8-bit corpora on an H200, and lik.quantize's launch")."""
    padded = min(next_power_of_2(max(dim, 16)), _MAX_BLOCK_D)
    divisor = dim & -dim
    if dim == padded or divisor < 16:
        return padded, max(1, min(64, _TILE_ELEMENTS // padded, next_power_of_2(n_rows)))
    block_d = min(divisor, _MAX_BLOCK_D)
    return block_d, max(1, min(64, 2 * _TILE_ELEMENTS // padded, next_power_of_2(n_rows)))
