"""The nearest-neighbour launch (``lik.nearest_neighbors``, ``lik.chamfer_distance``): route, precision, tiles."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _device
from .forced import FORCED, register

__all__ = ["NearestConfig", "nearest_config", "float32_products", "NEAREST_POINT_MAX_DIM"]


@dataclass(frozen=True)
class NearestConfig:
    """Launch of the nearest-neighbour kernels (``lik.nearest_neighbors``, ``lik.chamfer_distance``).

    ``route``: "direct" (coordinate differences on the CUDA cores: exact, one pass per coordinate), "dot" (the
    Chamfer tile loop: tensor-core products, float32 operands centred on the ``x`` cloud, half-precision ones as
    given) or "core" (MaxSim's argmax forward on ``x' = [x, 1]``, ``y' = [2y, -|y|^2]``, with MaxSim's own
    tiles); on "dot" and "core" the winner's distance is recomputed exactly afterwards. ``precision`` of their
    float32 products: "tf32x3" (each operand split into two TF32 parts on the host, three products in one TF32
    product three times as deep: about float32's accuracy), "tf32" (one TF32 product: about ``2**-8`` of
    ``|x - c| |y - c|``) or "ieee" (true float32 products, several times slower); float16 / bfloat16 operands
    multiply in their own dtype whatever it says. ``block_m`` points of ``x`` per program against tiles of
    ``block_n`` points of ``y`` (direct and dot routes). ``one_pass`` (direct and dot routes): a call that needs
    both directions (Chamfer) takes each pair's distance once for both, folding the reverse winners in with one
    atomic min per ``y`` point and tile; otherwise each direction is a pass of its own."""

    route: str
    precision: str = "tf32x3"
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3
    one_pass: bool = True


# Point clouds (D up to this): exact coordinate differences; wider feature sets go through tensor-core products.
NEAREST_POINT_MAX_DIM = 8


def _tensor_cores(device: torch.device) -> bool:
    """TF32 needs Ampere's tensor cores (the interpreter multiplies in float32)."""
    return not _device.interpreting() and _device.arch(device) >= (8, 0)


def float32_products(device: torch.device) -> str:
    """The float32 product precision ``torch.get_float32_matmul_precision()`` asks for on ``device``, as
    ``lik.maxsim`` follows it: "highest" keeps float32's accuracy ("tf32x3"), "high" and "medium" allow one TF32
    product ("tf32"). Without TF32 tensor cores (and in the interpreter) "ieee"."""
    if not _tensor_cores(device):
        return "ieee"
    return "tf32x3" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def nearest_config(*, dim: int, norm: int, device: torch.device, dtype: torch.dtype = torch.float32
                   ) -> NearestConfig:
    """The nearest-neighbour launch for ``dim``-wide ``dtype`` points under ``norm`` (1 or 2) on ``device``.

    H100, forward + backward of both directions (benchmarks/NOTES.md, "Chamfer distance"): point clouds keep the exact
    direct route, both directions in one pass, 32 x 64 tiles of one warp (100 000 points: 6.4 ms; 128 x 64 of
    4 warps 9.7, two passes of 64 x 64 18.7). One warp reduces a tile's rows and columns without shared memory
    or barriers, and small tiles stay clear of register spills. The dot route with TF32-split operands took 12.0
    ms (two passes) but its ``|x|^2 + |y|^2 - 2 x.y`` loses the digits of dense clouds (a million points in the
    unit cube: nearest distances 2.3e-4 relative too far, and 3x the memory), so point clouds never take it.
    Feature sets (D = 128, 100 000 points), float32 at "highest": MaxSim's loop 139 ms, the dot route 133 (two
    passes, within 5%: the one loop is kept), float32 FMA products 462. One TF32 product ("high") and half
    precision take the dot route, both directions in one pass over 128 x 64 tiles with the x block resident
    (not yet timed on a GPU: ``chamfer/1x100000x128`` measures it)."""
    forced = FORCED.get("nearest")
    if forced is not None:
        return forced
    if norm == 1 or dim <= NEAREST_POINT_MAX_DIM:
        return NearestConfig("direct", block_m=32, block_n=64, num_warps=1)
    if dtype in (torch.float16, torch.bfloat16):
        return NearestConfig("dot", "ieee", block_m=128, block_n=64, num_warps=8, num_stages=3)
    precision = float32_products(device)
    if precision == "tf32":
        return NearestConfig("dot", "tf32", block_m=128, block_n=64, num_warps=8, num_stages=3)
    return NearestConfig("core", precision)


register("nearest", NearestConfig)
