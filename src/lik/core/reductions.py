"""Reductions the kernels of several ops fold with: the NaN-propagating maximum (MaxSim's running max, the
quantizer's per-row absolute max)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["nan_max"]


@triton.jit
def nan_max(a, b):
    """Maximum that returns NaN if either side is NaN (the reference's ``torch.max`` behaviour), elementwise or as
    the combine function of ``tl.reduce``.

    Example (inside a kernel): ``row_max = tl.reduce(x, 1, nan_max)``."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
