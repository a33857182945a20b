"""Launch budgets: how much shared memory a device gives one program, and what fits in it.

A launch configuration must fit the device it runs on: a pipelined loop keeps ``stages`` copies of its operand
tiles in shared memory, so the number of stages (and with it the tile sizes) is derived from the device's
capacity instead of being fixed. The capacity is read from the driver on CUDA (``max_shared_mem``: the opt-in
per-block limit); off CUDA (the interpreter, or compiling for a target on a machine without a GPU) it comes from
a table by compute capability, and the interpreter has no limit at all.

Every function here is a small pure function of its arguments, so a configuration stays deterministic.
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "SHARED_MEMORY_BY_ARCH",
    "UNLIMITED_SHARED_MEMORY",
    "shared_memory_limit",
    "device_shared_memory",
    "pipeline_stages",
    "fits",
    "warps_for_tile",
]

# Opt-in shared memory per block (bytes) by compute capability, as the CUDA programming guide lists it.
SHARED_MEMORY_BY_ARCH: dict[tuple[int, int], int] = {
    (7, 0): 98_304, (7, 5): 65_536,
    (8, 0): 166_912, (8, 6): 101_376, (8, 7): 166_912, (8, 9): 101_376,
    (9, 0): 232_448,
    (10, 0): 232_448, (12, 0): 101_376,
}
UNLIMITED_SHARED_MEMORY = 1 << 30  # the interpreter: no limit to budget against


@functools.cache
def device_shared_memory(index: int) -> int:
    """The driver's opt-in shared-memory limit per block of CUDA device ``index``, in bytes."""
    import triton

    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


def shared_memory_limit(device: torch.device, arch: tuple[int, int]) -> int:
    """Bytes of shared memory one program may use on ``device`` (compute capability ``arch``).

    A CUDA device is asked; otherwise ``arch`` is looked up (the smallest known limit of its major version, or of
    the oldest architecture, when it is not listed), and ``arch == (0, 0)`` (no GPU) means no limit."""
    if device.type == "cuda":
        return device_shared_memory(device.index if device.index is not None else torch.cuda.current_device())
    if arch == (0, 0):
        return UNLIMITED_SHARED_MEMORY
    if arch in SHARED_MEMORY_BY_ARCH:
        return SHARED_MEMORY_BY_ARCH[arch]
    same_major = [v for (major, _), v in SHARED_MEMORY_BY_ARCH.items() if major == arch[0]]
    return min(same_major) if same_major else min(SHARED_MEMORY_BY_ARCH.values())


def pipeline_stages(
    stage_bytes: int, *, limit: int, fixed_bytes: int = 0, programs_per_sm: int = 1, min_stages: int = 2,
    max_stages: int = 4,
) -> int:
    """The most pipeline stages (at most ``max_stages``) whose ``stage_bytes`` each, plus ``fixed_bytes`` that
    live through the loop, fit ``programs_per_sm`` programs into ``limit`` bytes; never below ``min_stages`` (a
    caller whose minimum does not fit must pick smaller tiles: see :func:`fits`)."""
    if stage_bytes <= 0:
        return max_stages
    per_program = limit // max(1, programs_per_sm) - fixed_bytes
    return max(min_stages, min(max_stages, per_program // stage_bytes))


def fits(stage_bytes: int, stages: int, *, limit: int, fixed_bytes: int = 0, programs_per_sm: int = 1) -> bool:
    """Whether ``stages`` copies of ``stage_bytes`` plus ``fixed_bytes`` fit ``programs_per_sm`` programs."""
    return programs_per_sm * (stages * stage_bytes + fixed_bytes) <= limit


def warps_for_tile(rows: int, cols: int, *, registers_per_thread: int = 64, min_warps: int = 4,
                   max_warps: int = 8) -> int:
    """The fewest warps (a power of two in ``[min_warps, max_warps]``) that hold an fp32 ``rows x cols``
    accumulator in at most ``registers_per_thread`` registers per thread (the rest of the 255 are left to the
    loop's operands, addresses and the row-wise reduction)."""
    warps = min_warps
    while warps < max_warps and rows * cols > registers_per_thread * 32 * warps:
        warps *= 2
    return warps
