"""Reductions the kernels of several ops fold with: the NaN-propagating maximum (MaxSim's running max, the
quantizer's per-row absolute max), and the values of the ``REDUCTION`` flag that names a kernel's reduction over a
query token's document tokens (MaxSim's max in the tile loop; the soft ones in :mod:`lik.core.soft`)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["nan_max", "REDUCE_SMOOTH", "REDUCE_TOPK", "REDUCTIONS"]

# (REDUCE_MAX = 0 is lik.core.tile's.) The smooth maximum tau * logsumexp(s / tau) and the mean of the top_k largest.
REDUCE_SMOOTH = tl.constexpr(1)
REDUCE_TOPK = tl.constexpr(2)
# The public names of the reductions, in flag order.
REDUCTIONS = ("max", "smooth", "topk")


@triton.jit
def nan_max(a, b):
    """Maximum that returns NaN if either side is NaN (the reference's ``torch.max`` behaviour), elementwise or as
    the combine function of ``tl.reduce``.

    Example (inside a kernel): ``row_max = tl.reduce(x, 1, nan_max)``."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
