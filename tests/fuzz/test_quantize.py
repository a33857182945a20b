"""Fuzz ``lik.quantize`` / ``lik.dequantize`` against a float64 brute force of the per-row symmetric rule, bit for
bit: any leading shape (sizes from 0), odd and wide widths, float16 / bfloat16 / float32 / float64 inputs, rows
of every magnitude (tiny scales, subnormals, overflow of the float32 cast), zero rows, rows holding NaN or inf,
exact halves, non-contiguous views; int8 on the kernel (interpreter) and the reference, float8 on the reference
(the CPU float8 path: docs/design.md)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lik

from .common import LAYOUTS, PATHS, as_view, fuzz_settings, run_on

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
WIDTHS = [1, 2, 3, 7, 16, 17, 33, 48, 80]
INPUT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# Binary exponent ranges of the row magnitudes each input dtype can hold (float64 also overflows float32).
EXPONENTS = {torch.float32: (-140, 120), torch.float16: (-20, 14), torch.bfloat16: (-120, 120),
             torch.float64: (-160, 135)}


def _e4m3_values() -> torch.Tensor:
    """The non-negative finite float8_e4m3fn values in code order (code 0 .. 126), decoded from the bits."""
    out = []
    for code in range(127):
        exponent, mantissa = code >> 3, code & 7
        out.append(mantissa / 8 * 2.0**-6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return torch.tensor(out, dtype=torch.float64)


E4M3 = _e4m3_values()


def _round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float64 values in [-448, 448] -> the nearest e4m3 value (ties to the even code), sign kept (also of 0)."""
    mag = v.abs()
    hi = torch.searchsorted(E4M3, mag).clamp(max=len(E4M3) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - E4M3[lo], E4M3[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.copysign(torch.where(pick_hi, E4M3[hi], E4M3[lo]), v)


def brute_quantize(x: torch.Tensor, dtype: torch.dtype):
    """The rule in float64, row by row: ``amax`` of the float32 row, ``scale = fp32(amax / qmax)``, values
    ``fp32(x / scale)`` clamped and rounded (int8: half to even; e4m3: nearest); a zero scale gives zeros, a
    non-finite row scale NaN and zeros. Returns ``(values as float64, scale as float64)``."""
    qmax = QMAX[dtype]
    rows = x.detach().float().double().reshape(-1, x.shape[-1])
    q_rows, scales = [], []
    for row in rows:
        if row.numel() == 0:
            q_rows.append(row.clone())
            scales.append(0.0)
            continue
        if not bool(torch.isfinite(row).all()):
            q_rows.append(torch.zeros_like(row))
            scales.append(float("nan"))
            continue
        scale = float(torch.tensor(float(row.abs().max()) / qmax, dtype=torch.float64).float())
        if scale == 0:
            q_rows.append(torch.zeros_like(row))
            scales.append(0.0)
            continue
        quotient = (row / scale).float().double().clamp(-qmax, qmax)
        q_rows.append(torch.round(quotient) if dtype == torch.int8 else _round_e4m3(quotient))
        scales.append(scale)
    values = torch.stack(q_rows).reshape(x.shape) if q_rows else torch.zeros(x.shape, dtype=torch.float64)
    return values, torch.tensor(scales, dtype=torch.float64).reshape(x.shape[:-1])


@dataclass(frozen=True)
class QuantCase:
    lead: tuple[int, ...]
    dim: int
    in_dtype: torch.dtype
    out_dtype: torch.dtype
    specials: bool  # zero rows, negative zeros, NaN / inf rows, exact halves
    layout: str
    seed: int


@st.composite
def quant_cases(draw):
    return QuantCase(
        lead=tuple(draw(st.lists(st.integers(0, 4), max_size=3))),
        dim=draw(st.sampled_from(WIDTHS)),
        in_dtype=draw(st.sampled_from(INPUT_DTYPES)),
        out_dtype=draw(st.sampled_from([torch.int8, torch.float8_e4m3fn])),
        specials=draw(st.booleans()),
        layout=draw(st.sampled_from(LAYOUTS)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _contents(case: QuantCase) -> torch.Tensor:
    gen = torch.Generator().manual_seed(case.seed)
    shape = case.lead + (case.dim,)
    n_rows = 1
    for s in case.lead:
        n_rows *= s
    low, high = EXPONENTS[case.in_dtype]
    exponents = torch.randint(low, high + 1, (n_rows, 1), generator=gen).double()
    x = torch.randn(n_rows, case.dim, generator=gen, dtype=torch.float64) * torch.exp2(exponents)
    if case.specials and n_rows:
        kind = torch.randint(0, 7, (n_rows,), generator=gen)
        x[kind == 1] = 0.0
        x[kind == 2] = -0.0
        col = torch.randint(0, case.dim, (n_rows,), generator=gen)
        for r in (kind == 3).nonzero().flatten().tolist():
            x[r, col[r]] = [float("nan"), float("inf"), -float("inf")][r % 3]
        # Integers against a max of 254 (scale 2): odd values are exact halves, rounded to even.
        halves = torch.randint(-254, 255, (n_rows, case.dim), generator=gen).double()
        halves[:, 0] = 254.0
        x = torch.where((kind == 4)[:, None], halves, x)
        # Signed powers of two: several elements of a row share its max |x|, the others are exact fractions of it.
        powers = torch.exp2(torch.randint(-3, 4, (n_rows, case.dim), generator=gen).double())
        x = torch.where((kind == 5)[:, None], x.sign() * powers, x)
        # float32 subnormals: the scale is rounded coarsely, so max / scale may pass qmax and must be clamped.
        subnormal = torch.randint(-400, 401, (n_rows, case.dim), generator=gen).double() * 2.0**-149
        x = torch.where((kind == 6)[:, None], subnormal, x)
    return x.reshape(shape).to(case.in_dtype)


@pytest.mark.parametrize("path", PATHS)
@fuzz_settings(2.0)
@given(case=quant_cases())
def test_quantize_matches_brute_force_bit_for_bit(path, case):
    x = _contents(case)
    x_arg = as_view(x, case.layout)
    with run_on(path):
        x_q, scale = lik.quantize(x_arg, case.out_dtype)
        back = lik.dequantize(x_q, scale)
    expected_q, expected_scale = brute_quantize(x, case.out_dtype)

    assert x_q.dtype == case.out_dtype and tuple(x_q.shape) == tuple(x.shape)
    assert scale.dtype == torch.float32 and tuple(scale.shape) == tuple(x.shape[:-1])
    assert torch.equal(torch.isnan(scale), torch.isnan(expected_scale)), f"NaN scales: {scale} vs {expected_scale}"
    finite = ~torch.isnan(expected_scale)
    assert torch.equal(scale.double()[finite], expected_scale[finite]), f"scales {scale}, expected {expected_scale}"
    if case.out_dtype == torch.int8:
        assert torch.equal(x_q.double(), expected_q), f"values {x_q}, expected {expected_q}"
    else:  # bit for bit, the sign of zero included
        codes = torch.searchsorted(E4M3, expected_q.abs())  # the brute force's values are e4m3 values
        expected_bits = (codes + 128 * torch.signbit(expected_q).long()).to(torch.uint8)
        assert torch.equal(x_q.view(torch.uint8), expected_bits), f"values {x_q.double()}, expected {expected_q}"
    # dequantize: x_q * scale, one float32 rounding; NaN for a non-finite row.
    assert back.dtype == torch.float32
    expected_back = (expected_q * expected_scale[..., None]).float()
    assert torch.equal(torch.isnan(back), torch.isnan(expected_back))
    assert torch.equal(back[~torch.isnan(back)], expected_back[~torch.isnan(expected_back)])


@pytest.mark.parametrize("path", PATHS)
def test_subnormal_row_is_clamped_to_qmax(path):
    """The scale of a row whose max is -5.73e-43 is 3 * 2**-149 (rounded from 4.51e-45), so max / scale is
    -136.3: the stored value is -127, not a wrapped -136."""
    x = torch.tensor([[-5.731310719088502e-43, 1e-44]])
    with run_on(path):
        x_q, scale = lik.quantize(x, torch.int8)
    expected_q, expected_scale = brute_quantize(x, torch.int8)
    assert expected_q.tolist() == [[-127.0, 2.0]]
    assert torch.equal(scale.double(), expected_scale)
    assert torch.equal(x_q.double(), expected_q), f"values {x_q.tolist()}, expected {expected_q.tolist()}"
