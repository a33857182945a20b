"""Nearest centroid of every token as one Triton kernel: the assignment step of k-means and of compression.

Assigning ``N`` tokens to ``K`` centroids in PyTorch is a GEMM that writes the ``[N, K]`` score matrix and an
argmax that reads it back: at a billion tokens and ``2**16`` centroids that is 262 TB of fp32 traffic, hours on an
H200. Here a program owns a tile of tokens, walks every tile of centroids, multiplies on the tensor cores (fp16 /
bf16 operands, fp32 accumulation) and keeps each token's running best score and index in registers: DRAM sees
the tokens once, the centroids from L2, and one int32 plus one float per token.

Score: ``<x, c> + bias[c]`` with ``bias = -|c|^2 / 2`` (nearest in L2, k-means) or no bias (largest inner
product, ColBERT's assignment with unit centroids). Ties go to the lowest centroid index; a NaN score never wins
(a token whose every score is NaN gets centroid 0 and score -inf), the same rule as
:func:`nearest_centroid_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _device
from .._launch import launch

__all__ = ["nearest_centroid", "nearest_centroid_reference"]

_HALF_BLOCK = 128  # tokens per program and centroids per step with fp16 / bf16 operands (64 KB of operands)
_WIDE_BLOCK = 64  # the same for fp32 / fp64 operands, whose tiles take four times the shared memory
# Centroid tiles in flight (the loop's software pipeline: cp.async copies ahead of the product); 1 turns it off.
STAGES = 3
# The reference's [rows, K] score block stays under about 256 MB.
_REFERENCE_BYTES = 1 << 28
_PRODUCT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@triton.jit(do_not_specialize=["N", "K", "D", "stride_x", "stride_c"])
def _nearest_kernel(
    x_ptr,
    c_ptr,
    bias_ptr,
    code_ptr,
    score_ptr,
    N,
    K,
    D,
    stride_x,
    stride_c,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    ONE_STEP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    STAGES: tl.constexpr,
):
    # The centroids come in the product dtype and the scores in the accumulation dtype (fp32, or fp64).
    PRODUCT = c_ptr.dtype.element_ty
    ACC = score_ptr.dtype.element_ty
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    dims = tl.arange(0, BLOCK_D)
    best = tl.full((BLOCK_M,), float("-inf"), ACC)
    best_idx = tl.zeros((BLOCK_M,), tl.int32)
    if ONE_STEP:  # d fits one product: the token tile is read once and kept for every centroid tile
        x_tile = tl.load(
            x_ptr + rows[:, None] * stride_x + dims[None, :], mask=row_ok[:, None] & (dims < D)[None, :], other=0
        ).to(PRODUCT)
    for n0 in tl.range(0, K, BLOCK_N, num_stages=STAGES):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < K
        c_rows = c_ptr + cols[:, None].to(tl.int64) * stride_c
        if ONE_STEP:
            ct = tl.load(c_rows + dims[None, :], mask=col_ok[:, None] & (dims < D)[None, :], other=0)
            # Operands in the product dtype (tensor cores for fp16 / bf16), accumulation in ACC (fp32, fp64).
            acc = tl.dot(x_tile, tl.trans(ct), input_precision=PRECISION, out_dtype=ACC)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
            for d0 in range(0, D, BLOCK_D):
                d_ok = (d0 + dims) < D
                xt = tl.load(
                    x_ptr + rows[:, None] * stride_x + (d0 + dims)[None, :],
                    mask=row_ok[:, None] & d_ok[None, :],
                    other=0,
                )
                ct = tl.load(c_rows + (d0 + dims)[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0)
                acc = tl.dot(xt.to(PRODUCT), tl.trans(ct), acc, input_precision=PRECISION, out_dtype=ACC)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0).to(ACC)[None, :]
        # NaN never wins and padded centroids never count: both read as -inf.
        acc = tl.where(col_ok[None, :] & (acc == acc), acc, float("-inf"))
        tile_best = tl.max(acc, axis=1)
        # The lowest column among the tile's equal maxima (an all -inf tile replaces nothing below).
        tile_idx = tl.min(tl.where(acc == tile_best[:, None], cols[None, :], 2147483647), axis=1)
        # Strictly greater: an earlier tile, a lower index, keeps a tie.
        better = tile_best > best
        best = tl.where(better, tile_best, best)
        best_idx = tl.where(better, tile_idx, best_idx)
    tl.store(code_ptr + rows, best_idx, mask=row_ok)
    tl.store(score_ptr + rows, best, mask=row_ok)


def _check(x, centroids, bias, product_dtype):
    for name, t in (("x", x), ("centroids", centroids)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating torch.Tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if centroids.shape[1] != x.shape[1]:
        raise ValueError(f"centroids must be [K, {x.shape[1]}] (x's d), got shape {tuple(centroids.shape)}")
    if centroids.device != x.device:
        raise ValueError(f"centroids must be on x's device {x.device}, got {centroids.device}")
    if bias not in ("l2", None):
        raise ValueError(f"bias must be 'l2' or None, got {bias!r}")
    if product_dtype is not None and product_dtype not in _PRODUCT_DTYPES:
        raise TypeError(f"product_dtype must be float16, bfloat16, float32 or float64, got {product_dtype}")
    product = torch.promote_types(x.dtype, centroids.dtype) if product_dtype is None else product_dtype
    return product, torch.float64 if product == torch.float64 else torch.float32


def _half_norm_bias(centroids: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    c = centroids.to(acc)
    return -0.5 * (c * c).sum(-1)


def nearest_centroid_reference(
    x: torch.Tensor, centroids: torch.Tensor, *, bias: str | None = "l2", product_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`nearest_centroid` in PyTorch ops (chunked GEMM + argmax): the CPU path and the tests' reference.

    Same arguments and results. The operands are rounded to ``product_dtype`` and multiplied in the accumulation
    dtype (fp32, fp64 for fp64): the kernel's arithmetic up to the order of the sums.
    """
    product, acc = _check(x, centroids, bias, product_dtype)
    n, k = x.shape[0], centroids.shape[0]
    codes = torch.zeros(n, dtype=torch.int32, device=x.device)
    best = torch.full((n,), float("-inf"), dtype=acc, device=x.device)
    if n == 0 or k == 0:
        return codes, best
    c = centroids.to(product).to(acc)
    b = _half_norm_bias(centroids, acc) if bias == "l2" else None
    step = max(1, _REFERENCE_BYTES // (8 * k))
    for s in range(0, n, step):
        scores = x[s : s + step].to(product).to(acc) @ c.T
        if b is not None:
            scores += b
        scores = scores.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
        value, idx = scores.max(dim=1)  # the first of equal maxima
        codes[s : s + step] = idx.to(torch.int32)
        best[s : s + step] = value
    return codes, best


def nearest_centroid(
    x: torch.Tensor, centroids: torch.Tensor, *, bias: str | None = "l2", product_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest centroid of every row of ``x``, fused: no ``[N, K]`` score matrix is ever written.

    Args:
        x: float ``[N, d]`` (fp16 / bf16 / fp32 / fp64; rows may be strided). centroids: float ``[K, d]`` on the
            same device.
        bias: ``"l2"`` scores ``<x, c> - |c|^2 / 2`` (argmax = nearest in L2; ``|c|^2`` in the accumulation
            dtype from the centroids as given); ``None`` scores ``<x, c>`` (largest inner product: the nearest
            for unit centroids, ColBERT's assignment).
        product_dtype: the dtype both operands are rounded to for the product (default: ``x`` and ``centroids``
            promoted). fp16 / bf16 run on tensor cores with fp32 accumulation; fp32 follows
            ``torch.get_float32_matmul_precision()`` ("highest": full fp32, else TF32); fp64 accumulates in fp64.

    Returns:
        ``(codes int32 [N], scores [N])``: the winning centroid and its score, fp32 (fp64 for an fp64 product).
        Ties go to the lowest index and NaN scores never win; a row with no non-NaN score (or ``K == 0``) gets
        code 0 and score -inf.

    On a CPU outside the Triton interpreter (and for a bf16 product under it) this runs
    :func:`nearest_centroid_reference`.

    Example::

        >>> nearest_centroid(torch.tensor([[0.0, 1.0], [2.0, 0.1]]), torch.eye(2))[0].tolist()
        [1, 0]
    """
    product, acc = _check(x, centroids, bias, product_dtype)
    # Triton's interpreter has no bfloat16 arithmetic: a CPU bf16 product runs the reference (as lik._dispatch).
    if not (x.is_cuda or (_device.interpreting() and product != torch.bfloat16)):
        return nearest_centroid_reference(x, centroids, bias=bias, product_dtype=product_dtype)
    n, k, d = x.shape[0], centroids.shape[0], x.shape[1]
    codes = torch.zeros(n, dtype=torch.int32, device=x.device)
    scores = torch.full((n,), float("-inf"), dtype=acc, device=x.device)
    if n == 0 or k == 0:
        return codes, scores
    if x.stride(1) != 1:
        x = x.contiguous()
    c = centroids.to(product).contiguous()
    bias_t = _half_norm_bias(centroids, acc).contiguous() if bias == "l2" else scores  # any pointer without a bias
    half = product in (torch.float16, torch.bfloat16)
    block = _HALF_BLOCK if half else _WIDE_BLOCK
    block_d = min(_device.next_power_of_2(max(d, 16)), block)
    precision = "ieee"
    if product == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        precision = "tf32"
    launch(
        _nearest_kernel,
        (_device.cdiv(n, block),),
        x,
        c,
        bias_t,
        codes,
        scores,
        n,
        k,
        d,
        x.stride(0),
        c.stride(0),
        HAS_BIAS=bias == "l2",
        PRECISION=precision,
        ONE_STEP=d <= block_d,
        BLOCK_M=block,
        BLOCK_N=block,
        BLOCK_D=block_d,
        STAGES=STAGES if half else 2,
        num_warps=8 if half else 4,
    )
    return codes, scores
