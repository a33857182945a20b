"""Zero-filled buffers for atomic accumulation, with less host time than ``torch.zeros`` on CUDA.

The backward kernels that scatter a gradient with fp32 atomics (deformable attention's value gradient, MaxSim's
"fast" document gradient) need a zeroed buffer before they launch. ``torch.zeros`` on a CUDA device allocates,
builds a TensorIterator and launches PyTorch's fill kernel: 10-13 us of host time on the lent H100 hosts, a large
part of a decoder-sized backward whose kernels take less time than their host path (``benchmarks/MSDA.md``).
:func:`zeros` allocates with ``torch.empty`` and clears the bytes with one ``cuMemsetD32Async`` (or
``cuMemsetD8Async`` for a size not divisible by 4) on the current stream, called through ``ctypes``: the CUDA
driver is loaded already by PyTorch and Triton, and every floating-point and integer dtype's zero is the all-zero
bit pattern.

It falls back to ``torch.Tensor.zero_`` whenever the driver path is not certain to be right: a tensor not on CUDA,
a ROCm build, no loadable ``libcuda.so.1``, a tensor on a device other than the current one (the stream and the
driver context would belong to another device), or any non-zero return code from the driver (for example no
current context on a new thread). The memset is stream-ordered like the fill kernel it replaces, and is recorded
as a memset node under CUDA graph capture.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["zeros", "driver_memset_available"]

# (cuMemsetD32Async, cuMemsetD8Async) once loaded; False when the driver cannot be used; None before the first try.
_MEMSET: tuple | bool | None = None

_get_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None)


def _load_memset() -> tuple | bool:
    global _MEMSET
    if torch.version.hip is not None or _get_stream is None or _current_device is None:
        _MEMSET = False
        return _MEMSET
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        words, bytes_ = driver.cuMemsetD32Async, driver.cuMemsetD8Async
    except (OSError, AttributeError):
        _MEMSET = False
        return _MEMSET
    # CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned int value, size_t count, CUstream stream), and D8 alike.
    words.argtypes = (ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p)
    bytes_.argtypes = (ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t, ctypes.c_void_p)
    words.restype = bytes_.restype = ctypes.c_int
    _MEMSET = (words, bytes_)
    return _MEMSET


def driver_memset_available() -> bool:
    """True when :func:`zeros` can clear CUDA buffers through the driver (loads the driver on first call)."""
    return bool(_MEMSET if _MEMSET is not None else _load_memset())


def zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous tensor of zeros, like ``torch.zeros(shape, dtype=dtype, device=device)``.

    Args:
        shape: any shape (a zero-size one allocates nothing to clear).
        dtype: any dtype whose zero is the all-zero bit pattern (every float, int and bool dtype).
        device: a CUDA device (cleared by the driver's memset on the current stream when it is the current
            device), or any other device (``zero_``).

    Example:
        >>> grad = zeros((4, 22223, 8, 32), torch.float32, torch.device("cuda"))   # then scattered by atomics
    """
    out = torch.empty(shape, dtype=dtype, device=device)
    index = out.get_device()  # -1 off CUDA; cheaper than out.device.index
    if index < 0:
        return out.zero_()
    memset = _MEMSET if _MEMSET is not None else _load_memset()
    if memset and index == _current_device():
        size = out.numel() * out.element_size()
        if size == 0:
            return out
        stream = _get_stream(index)
        if size % 4 == 0:
            failed = memset[0](out.data_ptr(), 0, size >> 2, stream)
        else:
            failed = memset[1](out.data_ptr(), 0, size, stream)
        if not failed:
            return out
    return out.zero_()
