"""What the launch layer and the heuristics ask of a device: its architecture, SM count and shared memory, whether
kernels run through Triton's interpreter, and the current CUDA device, each answered once and cached.

Heuristics read these through this module's attributes (``_device.arch(device)``, ``_device.interpreting()``), so
a test can pretend to be on another GPU with ``monkeypatch.setattr(lik._device, "arch", lambda device: (9, 0))``
and ``monkeypatch.setattr(lik._device, "interpreting", lambda: False)``.
"""

from __future__ import annotations

import functools
import os

import torch

from .core.budget import shared_memory_limit

__all__ = ["interpreting", "cdiv", "next_power_of_2", "arch", "sm_count", "shared_memory", "current_device"]


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cdiv(a: int, b: int) -> int:
    """Ceiling division for launch grids (``triton.cdiv`` is a Triton constexpr function: ~5 us per host call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two at least ``n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


# The current CUDA device without torch.cuda.current_device()'s lazy-initialisation check and Python wrapper:
# callers hold CUDA tensors, so CUDA is initialised.
current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def arch(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA ``device``; ``(0, 0)`` off CUDA (no GPU architecture)."""
    if device.type != "cuda":
        return (0, 0)
    return _capability(_index(device))


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 1 off CUDA (the interpreter then runs a persistent launch with one
    program per row block, which is what its tests want to exercise)."""
    if device.type != "cuda":
        return 1
    return _sm_count(_index(device))


def shared_memory(device: torch.device) -> int:
    """Shared memory (bytes) one program may use on ``device``: the driver's limit on CUDA, else the table of
    :mod:`lik.core.budget` for :func:`arch` (unlimited without a GPU architecture)."""
    return shared_memory_limit(device, arch(device))
