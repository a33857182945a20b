"""Division by a runtime divisor with host-made constants: exact for every dividend in [0, 2**31)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from lik.core.division import DIVIDEND_LIMIT, divide, divisor_constants


def _quotient(x: int, divisor: int) -> int:
    """What ``divide`` computes, in Python integers."""
    multiplier, shift = divisor_constants(divisor)
    return (x * (multiplier % 2**32)) >> (31 + shift)


def _divisors() -> list[int]:
    powers = [2**k + o for k in range(31) for o in (-1, 0, 1)]
    rng = torch.Generator().manual_seed(0)
    random = torch.randint(1, DIVIDEND_LIMIT, (500,), generator=rng).tolist()
    return sorted({d for d in [*range(1, 300), *powers, *random, DIVIDEND_LIMIT - 1] if 1 <= d < DIVIDEND_LIMIT})


def _dividends(divisor: int, rng: torch.Generator) -> list[int]:
    """Random dividends, the largest ones, and both sides of multiples of the divisor (where a wrong multiplier
    would first be off by one)."""
    last_multiple = (DIVIDEND_LIMIT - 1) // divisor * divisor
    near = [k * divisor + o for k in (1, 2, 3, 1000, 2**20) for o in (-1, 0, 1)]
    near += [last_multiple + o for o in (-1, 0, 1)]
    random = torch.randint(0, DIVIDEND_LIMIT, (64,), generator=rng).tolist()
    return [x for x in [0, 1, 2, DIVIDEND_LIMIT - 2, DIVIDEND_LIMIT - 1, *near, *random] if 0 <= x < DIVIDEND_LIMIT]


def test_constants_fit_int32_and_quotients_are_exact():
    rng = torch.Generator().manual_seed(1)
    for divisor in _divisors():
        multiplier, shift = divisor_constants(divisor)
        assert -(2**31) <= multiplier < 2**31 and 0 <= shift <= 31
        for x in _dividends(divisor, rng):
            assert _quotient(x, divisor) == x // divisor, (x, divisor)


def test_every_dividend_for_small_divisors():
    """Exhaustive over a dense range of dividends for the divisors a launch meets most (row blocks, chunks)."""
    x = torch.arange(0, 1 << 20, dtype=torch.int64)
    top = torch.arange(DIVIDEND_LIMIT - (1 << 16), DIVIDEND_LIMIT, dtype=torch.int64)
    for divisor in [*range(1, 130), 1000, 4096, 10_007]:
        multiplier, shift = divisor_constants(divisor)
        m = multiplier % 2**32
        for xs in (x, top):
            # (x * m) overflows int64 for the top dividends: split m into halves.
            product_shifted = ((xs * (m >> 16)) + ((xs * (m & 0xFFFF)) >> 16)) >> (15 + shift)
            assert torch.equal(product_shifted, xs // divisor), divisor


@pytest.mark.parametrize("divisor", [0, -3, DIVIDEND_LIMIT, 2**40])
def test_bad_divisor_raises(divisor):
    with pytest.raises(ValueError, match="divisor must be in"):
        divisor_constants(divisor)


@triton.jit
def _divide_kernel(x_ptr, out_ptr, n, multiplier, shift, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + offs, divide(x, multiplier, shift), mask=offs < n)
    if tl.program_id(0) == 0:  # a scalar dividend takes the same path
        tl.store(out_ptr + n, divide(tl.load(x_ptr + n - 1), multiplier, shift))


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's case")),
    pytest.param("cuda", marks=pytest.mark.gpu),
])
@pytest.mark.parametrize("divisor", [1, 2, 3, 7, 8, 127, 1000, 2**30 + 1, DIVIDEND_LIMIT - 1])
def test_kernel_divide_matches_floor_division(divisor, device):
    rng = torch.Generator().manual_seed(divisor % 1000)
    xs = torch.tensor(_dividends(divisor, rng), dtype=torch.int32)
    out = torch.full((xs.numel() + 1,), -1, dtype=torch.int32, device=device)
    grid = (triton.cdiv(xs.numel(), 64),)
    _divide_kernel[grid](xs.to(device), out, xs.numel(), *divisor_constants(divisor), BLOCK=64)
    expected = xs.long() // divisor
    assert torch.equal(out[:-1].cpu().long(), expected)
    assert out[-1].item() == expected[-1].item()
