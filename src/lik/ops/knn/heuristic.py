"""The launch of :func:`lik.knn_points`'s kernel: route, product precision, tiles (``override(knn=...)`` forces one).

Kept beside the op for now; its place is :mod:`lik.config` with the other heuristics (one module per op)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...config.forced import FORCED, register
from ...config.nearest import float32_products

__all__ = ["KnnConfig", "knn_config", "KNN_POINT_MAX_DIM", "product_precision"]

# Point clouds (D up to this) and every norm=1 compare exact coordinate differences; wider feature sets take
# tensor-core products, as lik.nearest_neighbors does.
KNN_POINT_MAX_DIM = 8


@dataclass(frozen=True)
class KnnConfig:
    """Launch of the K-nearest-neighbour kernel.

    ``route``: "direct" (coordinate differences on the CUDA cores: exact distances) or "products"
    (``|x|^2 + |y|^2 - 2 x.y`` from a tensor-core product per tile; only picks the neighbours, whose distances are
    then recomputed exactly). ``precision`` of float32 products: "tf32x3" (each operand split into two TF32 parts:
    about float32's accuracy), "tf32" (one TF32 product, operands rounded to TF32 to nearest: about ``2**-9``
    relative of ``|x - c| |y - c|``), "ieee" (true float32 products), or
    None to follow ``torch.get_float32_matmul_precision()``; half-precision inputs multiply in their own dtype.
    ``block_m`` points of ``p1`` per program against tiles of ``block_n`` points of ``p2``, ``block_k`` feature
    columns per product step."""

    route: str
    precision: str | None = None
    block_m: int = 32
    block_n: int = 64
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 2


def product_precision(dtype: torch.dtype, device: torch.device) -> str:
    """The float32 product precision ``torch.get_float32_matmul_precision()`` asks for, on ``device``: the policy
    of ``lik.nearest_neighbors`` (:func:`lik.config.nearest.float32_products`). Half-precision inputs multiply
    in their own dtype ("ieee" here: no TF32)."""
    return float32_products(device) if dtype == torch.float32 else "ieee"


def knn_config(*, dim: int, k: int, norm: int, dtype: torch.dtype, device: torch.device) -> KnnConfig:
    """The launch for ``dim``-wide points, ``k`` neighbours, ``norm`` (1 or 2), ``dtype`` inputs on ``device``.

    Not yet timed on a GPU (``benchmarks/knn_bench.py`` does): the tiles are the largest whose sm_90 build keeps
    every value in registers for 1 to 32 neighbours (``tests/ops/knn/test_knn_compile.py`` checks it), the
    direct route's 32 x 64 tile in four warps, the products route's 64 x 64 in eight."""
    forced = FORCED.get("knn")
    if forced is not None:
        return forced
    if norm == 1 or dim <= KNN_POINT_MAX_DIM:
        return KnnConfig("direct", block_m=32, block_n=64, num_warps=4)
    block_k = 64 if dtype != torch.float32 else 32
    precision = product_precision(dtype, device)
    # True float32 products (no TF32: before Ampere, or in the interpreter) hold more per thread.
    block_m = 32 if precision == "ieee" and dtype == torch.float32 else 64
    return KnnConfig("products", precision, block_m=block_m, block_n=64, block_k=block_k, num_warps=8,
                     num_stages=2)


register("knn", KnnConfig)
