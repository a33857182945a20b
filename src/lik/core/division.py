"""Division by a runtime divisor with a multiplier and shift computed on the host.

A kernel that splits its program id (or a row block) by a runtime count pays a 32-bit integer division per
program, ~20 instructions, a visible share of a short program. With the divisor's multiplier and shift made once on
the host (the round-up method of Granlund and Montgomery, as CUTLASS's ``FastDivmod``), the quotient is three
instructions: a shift, a high multiply and a shift.

Example::

    multiplier, shift = divisor_constants(n_chunks)  # host, passed as two int32 kernel arguments
    query = divide(group, multiplier, shift)  # kernel: group // n_chunks
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

__all__ = ["divisor_constants", "divide", "DIVIDEND_LIMIT"]

DIVIDEND_LIMIT = 2**31  # divide is exact for dividends in [0, DIVIDEND_LIMIT)


@functools.lru_cache(maxsize=4096)
def divisor_constants(divisor: int) -> tuple[int, int]:
    """``(multiplier, shift)`` such that ``x // divisor == (x * m) >> (31 + shift)`` for every ``0 <= x < 2**31``,
    ``m`` being ``multiplier`` read as an unsigned 32-bit integer.

    ``shift = ceil(log2(divisor))`` and ``m = ceil(2**(31 + shift) / divisor)``: ``m < 2**32``, and ``m * divisor``
    exceeds ``2**(31 + shift)`` by ``e < divisor <= 2**shift``, so ``x * m / 2**(31 + shift)`` exceeds ``x / divisor``
    by ``x * e / (divisor * 2**(31 + shift)) < 1 / divisor``: too little to reach the next integer. ``m`` is handed
    over as the int32 with the same bits (an int argument of 2**31 or more would be typed int64 and compile another
    variant). Raises ``ValueError`` for a divisor outside ``[1, 2**31)``.
    """
    divisor = int(divisor)
    if not 1 <= divisor < DIVIDEND_LIMIT:
        raise ValueError(f"divisor must be in [1, 2**31), got {divisor}")
    shift = (divisor - 1).bit_length()
    multiplier = -(-(1 << (31 + shift)) // divisor)
    return (multiplier - (1 << 32) if multiplier >= 1 << 31 else multiplier), shift


@triton.jit
def divide(x, multiplier, shift):
    """``x // divisor`` (int32, scalar or block) for ``0 <= x < 2**31``, with ``divisor_constants(divisor)``.

    The high half of ``(2 * x) * m`` is ``(x * m) >> 31``: all in 32 bits, whatever the divisor (1 included)."""
    doubled = x.to(tl.uint32) * 2
    # (Added to unsigned zeros: unsigned operands, a logical shift, also for a caller's specialised constant.)
    high = tl.umulhi(doubled, tl.zeros_like(doubled) + multiplier)
    return (high >> (tl.zeros_like(high) + shift)).to(tl.int32)
