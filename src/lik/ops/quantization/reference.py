"""The specification of :func:`lik.quantize`: per-row (token) symmetric 8-bit quantization in plain PyTorch.

For each row ``x[..., :]`` (one token embedding):

* ``amax = max |x|`` in float32, ``scale = amax / qmax`` (float32) with ``qmax`` 127 for int8, 448 for e4m3;
* ``x_q = round(x / scale)`` clamped to ``[-127, 127]`` for int8 (round half to even), or ``x / scale`` clamped to
  ``[-448, 448]`` and rounded to the nearest e4m3 value for float8;
* a zero row gives ``scale = 0`` and ``x_q = 0`` (no NaN, no inf); a row holding NaN or inf gives ``scale = NaN``
  and ``x_q = 0``, so anything computed from the dequantized row is NaN, never a silently finite number.

The division is IEEE float32 (correctly rounded), which the kernel reproduces, so the two agree bit for bit.
"""

from __future__ import annotations

import torch

__all__ = ["QUANTIZED_DTYPES", "QMAX", "quantize_reference", "dequantize_reference"]

QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)
# Largest magnitude each format stores: int8 is kept symmetric ([-127, 127]), e4m3fn's largest finite value is 448.
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize_reference(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., d]`` float -> ``(x_q [..., d] dtype, scale [...] float32)``; see the module docstring."""
    qmax = QMAX[dtype]
    xf = x.detach().float()
    if xf.shape[-1] == 0:
        return torch.zeros(x.shape, dtype=dtype, device=x.device), torch.zeros(x.shape[:-1], device=x.device)
    finite = torch.isfinite(xf).all(dim=-1)
    amax = torch.where(finite, xf.abs().amax(dim=-1), 0.0)
    scale = amax / qmax
    usable = scale > 0
    values = xf / torch.where(usable, scale, 1.0)[..., None]
    values = torch.where(usable[..., None], values, 0.0).clamp(-qmax, qmax)
    if dtype == torch.int8:
        values = torch.round(values)
    x_q = values.to(dtype)
    return x_q, torch.where(finite, scale, float("nan"))


def dequantize_reference(x_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x_q [..., d]`` (int8 / float8) and ``scale [...]`` float32 -> float32 ``x_q * scale[..., None]``."""
    return x_q.float() * scale[..., None]
