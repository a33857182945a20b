"""``lik.quantize`` / ``lik.dequantize``: per-row symmetric 8-bit storage of token embeddings."""

from __future__ import annotations

import torch

from ..._device import current_device, interpreting
from ..._replay import NEVER, allowed, file, plan_of, recording, tensor_key
from .kernel import quantize_rows
from .reference import QUANTIZED_DTYPES, dequantize_reference, quantize_reference

__all__ = ["quantize", "dequantize", "check_fp8_supported", "rows_of", "QUANTIZATIONS"]

# replay key -> lik._replay.Plan (buffers: the values and the scales, in the result's shapes) or NEVER
QUANTIZATIONS: dict[tuple, object] = {}

_FLOAT_INPUTS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_fp8_supported(device: torch.device, name: str) -> None:
    """Raise if ``device`` is a GPU without FP8 tensor cores (FP8 needs compute capability 8.9: Ada, Hopper)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(
            f"{name}: float8_e4m3fn needs a GPU with FP8 support (compute capability >= 8.9, e.g. L4, H100); "
            f"{torch.cuda.get_device_name(device)} has none: use torch.int8 instead"
        )


def _uses_kernel(x: torch.Tensor, dtype: torch.dtype) -> bool:
    if x.device.type == "cuda":
        return True
    # The interpreter's float8 conversion differs from PyTorch's (it flushes small values), and it has no bfloat16
    # arithmetic: those run the reference on the CPU; the GPU tests cover the kernel for them.
    return interpreting() and dtype == torch.int8 and x.dtype != torch.bfloat16


def quantize(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row (last dimension) of ``x`` symmetrically to 8 bits.

    Args:
        x: float16, bfloat16, float32 or float64 tensor ``[..., d]`` (any leading shape, any strides).
        dtype: ``torch.int8`` (round to nearest, values in [-127, 127]) or ``torch.float8_e4m3fn``
            (nearest e4m3 value, in [-448, 448]; needs a GPU with FP8 support when ``x`` is on a GPU).

    Returns:
        ``(x_q, scale)``: ``x_q`` of ``dtype`` and shape ``x.shape``, ``scale`` float32 of shape ``x.shape[:-1]``,
        with ``x ≈ x_q.float() * scale[..., None]`` (:func:`dequantize`). A zero row gives zeros and scale 0; a
        row holding NaN or inf gives scale NaN (its dequantized values are NaN). No gradient flows through it.

    Example:
        >>> x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]])
        >>> x_q, scale = lik.quantize(x, torch.int8)
        >>> x_q
        tensor([[  64, -127,   32],
                [   0,    0,    0]], dtype=torch.int8)
        >>> scale
        tensor([0.0157, 0.0000])

    A CUDA call whose shape, strides, dtype and alignment were quantized before replays that launch
    (:mod:`lik._replay`): the same kernel and bits for a fraction of the host time.
    """
    key = _replay_key(x, dtype)
    if key is not None:
        plan = QUANTIZATIONS.get(key)
        if plan is not None and plan is not NEVER:
            buffers = plan.allocate()
            plan((x,), buffers)
            return buffers[0], buffers[1]
        if plan is None:
            with recording() as recorded:
                x_q, scale = _quantize(x, dtype)
            plan = plan_of(recorded, (x,))
            if plan is not None and plan is not NEVER:
                plan.reshape(0, tuple(x_q.shape))
                plan.reshape(1, tuple(scale.shape))
            if plan is not None:
                file(QUANTIZATIONS, key, plan)
            return x_q, scale
    return _quantize(x, dtype)


def _replay_key(x, dtype) -> tuple | None:
    """What fixes a CUDA call's checks and launch besides ``x``'s address (None: no replay now)."""
    if not isinstance(x, torch.Tensor) or not x.is_cuda or not allowed() or torch.compiler.is_compiling():
        return None
    return current_device(), tensor_key(x), dtype


def _quantize(x, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The full path of :func:`quantize`: checks, then the kernel (or the reference)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the embedding width d), got a 0-d tensor")
    if dtype not in QUANTIZED_DTYPES:
        raise ValueError(f"dtype must be torch.int8 or torch.float8_e4m3fn, got {dtype}")
    if dtype == torch.float8_e4m3fn:
        check_fp8_supported(x.device, "quantize")
    if x.numel() == 0 or not _uses_kernel(x, dtype):
        return quantize_reference(x, dtype)
    with torch.no_grad():
        x_q, scale = quantize_rows(rows_of(x), dtype)
    return x_q.view(x.shape), scale.view(x.shape[:-1])


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """The ``[R, d]`` matrix of ``x [..., d]``'s rows that the kernel quantizes: a view of ``x`` where one exists
    (same address), else a copy with unit stride along ``d``."""
    dim = x.shape[-1]
    x2d = x.detach().reshape(-1, dim)
    if dim > 1 and x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    return x2d


def dequantize(x_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``x_q [..., d]`` (int8 / float8_e4m3fn), ``scale [...]`` float32 -> float32.

    Example:
        >>> lik.dequantize(*lik.quantize(torch.tensor([[1.0, -2.0]])))
        tensor([[ 1.0079, -2.0000]])
    """
    if not isinstance(x_q, torch.Tensor):
        raise TypeError(f"x_q must be a torch.Tensor, got {type(x_q).__name__}")
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"scale must be a torch.Tensor, got {type(scale).__name__}")
    if x_q.dtype not in QUANTIZED_DTYPES:
        raise TypeError(f"x_q must be int8 or float8_e4m3fn, got {x_q.dtype}")
    if scale.dtype != torch.float32:
        raise TypeError(f"scale must be float32, got {scale.dtype}")
    if x_q.dim() == 0 or tuple(scale.shape) != tuple(x_q.shape[:-1]):
        raise ValueError(f"scale must have shape x_q.shape[:-1] = {tuple(x_q.shape[:-1])}, got {tuple(scale.shape)}")
    if scale.device != x_q.device:
        raise ValueError(f"scale is on {scale.device}, x_q on {x_q.device}: they must be on one device")
    return dequantize_reference(x_q, scale)
