"""Deformable attention's launch heuristics: the forward tile and the backward tiles; and the opt-in switch of the
value gradient's accumulation for fp16 / bf16 values."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from .. import _device
from .._device import next_power_of_2
from .forced import FORCED, register

__all__ = ["MsdaForwardConfig", "MsdaBackwardConfig", "msda_forward_config", "msda_backward_config",
           "VALUE_GRAD_ACCUMULATIONS", "value_grad_accumulation", "set_value_grad_accumulation",
           "accumulate_value_grad_in"]


@dataclass(frozen=True)
class MsdaForwardConfig:
    """Tile of the deformable-attention forward: ``block_rows`` queries of one head, ``block_points`` >= P
    sampling points (all points of one level at a time; the levels are walked in a loop), ``block_d`` channels."""

    block_rows: int
    block_points: int
    block_d: int
    num_warps: int = 1
    num_stages: int = 1
    transpose: bool = False  # gather from a [N, M, S, D] copy of value (measured slower; never chosen)


@dataclass(frozen=True)
class MsdaBackwardConfig:
    """Tiles of the deformable-attention backward: the sample-side kernel (as the forward) and the
    deterministic value-gradient gather (``gather_rows`` value rows)."""

    block_rows: int
    block_points: int
    block_d: int
    gather_rows: int
    num_warps: int = 1
    num_stages: int = 1
    transpose: bool = False


# Elements of one [rows, points, channels] corner tile per warp: 16 per thread (four 16-byte fp32 loads).
_MSDA_TILE_PER_WARP = 512


@functools.lru_cache(maxsize=1024)  # a pure function, called on every launch (host time matters at decoder scale)
def _msda_tile(n_rows: int, dim: int, n_points: int, device: torch.device) -> tuple[int, int, int, int]:
    # Every channel of a head up to 128 (wider heads split over a grid axis) and every point of a level in one
    # tile (the kernels have no point loop); one warp per 512 elements of a corner tile, rows to fill it, then fewer
    # rows until there are a few programs per SM (the decoder has only N * 300 * M rows). Measured on an H200 at
    # encoder scale, D = 32, P = 4 (benchmarks/NOTES.md): 4 rows x 1 warp and 16 rows x 4 warps
    # are equal in fp32 (0.76 ms), 1 warp is faster in bf16 (0.56 against 0.78 ms).
    full_d = next_power_of_2(max(dim, 1))
    block_d = min(full_d, 128)
    block_p = next_power_of_2(max(n_points, 1))
    num_warps = min(8, max(1, block_p * block_d // _MSDA_TILE_PER_WARP))
    block_rows = max(1, num_warps * _MSDA_TILE_PER_WARP // (block_d * block_p))
    if device.type == "cuda":
        sms = _device.sm_count(device)
        while block_rows > 1 and -(-n_rows // block_rows) * (full_d // block_d) < 4 * sms:
            block_rows //= 2
    return block_rows, block_p, block_d, num_warps



def msda_forward_config(*, n_rows: int, dim: int, n_points: int, device: torch.device) -> MsdaForwardConfig:
    """Forward tile for ``n_rows`` = N * M * Lq rows of ``dim`` channels and ``n_points`` points per level."""
    forced = FORCED.get("msda_forward")
    if forced is not None:
        return forced
    return _msda_configs(n_rows, dim, n_points, device)[0]


def msda_backward_config(*, n_rows: int, dim: int, n_points: int, device: torch.device) -> MsdaBackwardConfig:
    """Backward tiles: the forward's tile at half its rows (the atomics of a shorter tile overlap better: 10% less
    device time at decoder scale, 2.5% at encoder scale on the H200) and 32 value rows per program for the
    deterministic gather."""
    forced = FORCED.get("msda_backward")
    if forced is not None:
        return forced
    return _msda_configs(n_rows, dim, n_points, device)[1]


@functools.lru_cache(maxsize=1024)  # building a frozen dataclass per call costs host time too
def _msda_configs(n_rows: int, dim: int, n_points: int, device: torch.device
                  ) -> tuple[MsdaForwardConfig, MsdaBackwardConfig]:
    block_rows, block_p, block_d, num_warps = _msda_tile(n_rows, dim, n_points, device)
    return (MsdaForwardConfig(block_rows, block_p, block_d, num_warps=num_warps),
            MsdaBackwardConfig(max(1, block_rows // 2), block_p, block_d, gather_rows=32, num_warps=num_warps))



register("msda_forward", MsdaForwardConfig)
register("msda_backward", MsdaBackwardConfig)


# How the atomic backward accumulates the value gradient of an fp16 / bf16 value. "float32" (the default): into an
# fp32 buffer, cast once at the end (the rounding of an fp32 sum, then one rounding to the value's dtype).
# "input": atomics straight into a gradient of the value's dtype, which rounds after every add (relative error
# about sqrt(k) * 2**-9 for bf16 and sqrt(k) * 2**-12 for fp16 on a pixel that k samples reach), and saves the fp32
# buffer's memset and the cast pass (3x the value gradient's bytes). fp32 values and the deterministic backward
# are unaffected.
VALUE_GRAD_ACCUMULATIONS = ("float32", "input")
_VALUE_GRAD = {"mode": "float32"}


def value_grad_accumulation() -> str:
    """The current mode: ``"float32"`` (default) or ``"input"`` (see :func:`set_value_grad_accumulation`)."""
    return _VALUE_GRAD["mode"]


def set_value_grad_accumulation(mode: str) -> None:
    """Choose how the atomic deformable-attention backward accumulates the gradient of an fp16 / bf16 ``value``:
    ``"float32"`` (default: an fp32 buffer cast once) or ``"input"`` (atomics in the value's own dtype: faster,
    rounds at every add). Process-wide; fp32 values and the deterministic backward ignore it.

    Example:
        >>> lik.config.msda.set_value_grad_accumulation("input")   # bf16 training, rounding at every add accepted
    """
    if mode not in VALUE_GRAD_ACCUMULATIONS:
        raise ValueError(f"mode must be one of {VALUE_GRAD_ACCUMULATIONS}, got {mode!r}")
    _VALUE_GRAD["mode"] = mode


@contextlib.contextmanager
def accumulate_value_grad_in(mode: str):
    """:func:`set_value_grad_accumulation` for a ``with`` block, then back to the mode before it.

    Example:
        >>> with lik.config.msda.accumulate_value_grad_in("input"):
        ...     loss.backward()
    """
    saved = value_grad_accumulation()
    set_value_grad_accumulation(mode)
    try:
        yield
    finally:
        _VALUE_GRAD["mode"] = saved
