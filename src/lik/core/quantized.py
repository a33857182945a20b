"""The 8-bit loader of the tile loop: int8 / float8 operands with per-row fp32 scales applied to the product.

Quantized rows enter the tensor cores as they are stored (no dequantized copy anywhere). The similarity of query
row ``i`` and document row ``t`` is ``float32(dot(q_q[i], d_q[t])) * d_scale[t]``, and a query row's maximum over
the tokens is multiplied by ``q_scale[i]`` once, after the max, all in fp32; the PyTorch reference repeats it.
Scaling after the max is exact: multiplying by one non-negative fp32 number is monotone, so it picks the same token
and gives the same bits as scaling every similarity (whenever the similarities are finite), and it takes one
multiply per similarity out of the loop. Scales are non-negative (``lik.quantize`` makes them so); a negative query
scale, which would turn the max into a min, makes its row's contribution NaN instead of a wrong number. int8
products accumulate exactly in int32 (``|dot| <= 127^2 * 8192 < 2^31``) and are converted once per tile; float8
products accumulate in fp32. The flag ``LOADER`` chooses, and is ``FLOAT`` (0) for fp16 / bf16 / fp32 operands,
whose code is then exactly the float loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = [
    "FLOAT", "INT8", "FP8", "MIN_8BIT_BLOCK_K", "loader_of", "loader_chunks", "zero_similarity", "scale_similarity",
    "scale_columns", "row_scales", "scale_rows", "reset_similarity",
]

FLOAT = tl.constexpr(0)  # fp16 / bf16 / fp32 rows, no scales
INT8 = tl.constexpr(1)  # int8 rows, int32 accumulation, per-row fp32 scales
FP8 = tl.constexpr(2)  # float8_e4m3fn rows, fp32 accumulation, per-row fp32 scales

_LOADERS = {torch.int8: 1, torch.float8_e4m3fn: 2}


def loader_of(dtype: torch.dtype) -> int:
    """The ``LOADER`` flag of embeddings stored as ``dtype``."""
    return _LOADERS.get(dtype, 0)


# 8-bit tensor-core products take k in steps of 32 (16-bit ones in steps of 16).
MIN_8BIT_BLOCK_K = 32


def loader_chunks(block_k: int, num_k: int, loader: int) -> tuple[int, int]:
    """``(BLOCK_K, NUM_K)`` of a launch whose rows use ``loader``: a resident 8-bit block is at least 32 wide
    (the padding is masked to 0)."""
    if loader and num_k == 1:
        return max(block_k, MIN_8BIT_BLOCK_K), 1
    return block_k, num_k


@triton.jit
def zero_similarity(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOADER: tl.constexpr):
    """An empty accumulator of a streamed tile: int32 for int8 rows (exact), fp32 otherwise."""
    # (if / else, not an early return: the compiler types every return statement it reaches)
    if LOADER == INT8:
        sim = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
    else:
        sim = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    return sim


@triton.jit
def reset_similarity(sim, reset, LOADER: tl.constexpr):
    """``sim`` zeroed where ``reset`` (the streamed-k loop starting its next tile), in its own dtype."""
    if LOADER == INT8:
        sim = tl.where(reset, 0, sim)
    else:
        sim = tl.where(reset, 0.0, sim)
    return sim


@triton.jit
def row_scales(scale_ptrs, valid, LOADER: tl.constexpr):
    """The fp32 scales of a block of rows or of a tile's columns (0 where not ``valid``, so garbage there stays out
    of the product).

    Unused (and never loaded) for float rows."""
    if LOADER == FLOAT:
        scales = tl.zeros(valid.shape, tl.float32)
    else:
        scales = tl.load(scale_ptrs, mask=valid, other=0.0)
    return scales


@triton.jit
def scale_similarity(sim, col_scale_ptrs, col_valid, LOADER: tl.constexpr):
    """The 8-bit loader's step after the product: ``float32(sim) * d_scale[t]`` (the query row's scale comes after
    the max: :func:`scale_rows`). A column that is not ``col_valid`` gets scale 0 (a masked column's products are
    0 already). Float tiles pass through. (:func:`row_scales` then :func:`scale_columns`; a tile loop that can load
    the scales before its product calls the two itself, so that their latency overlaps the product's.)"""
    return scale_columns(sim, row_scales(col_scale_ptrs, col_valid, LOADER), LOADER)


@triton.jit
def scale_columns(sim, col_scale, LOADER: tl.constexpr):
    """``float32(sim) * col_scale[t]`` for 8-bit tiles, with ``col_scale`` from :func:`row_scales`; float tiles
    pass through (their placeholder scales are never read)."""
    if LOADER != FLOAT:
        sim = sim.to(tl.float32) * col_scale[None, :]
    return sim


@triton.jit
def scale_rows(best, q_scale, LOADER: tl.constexpr):
    """A block's row maxima of 8-bit similarities times the query rows' scales; NaN where a scale is negative
    (the max would have to be a min). Float rows pass through."""
    if LOADER != FLOAT:
        best = best * tl.where(q_scale < 0, float("nan"), q_scale)
    return best
