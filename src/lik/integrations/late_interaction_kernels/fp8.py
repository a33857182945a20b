"""late-interaction-kernels' ``fp8`` module on lik: float8 (e4m3) inference on lik's 8-bit scorers.

::

    Q_fp8, q_scale = quantize_fp8_per_token(Q)          # lik.quantize(Q, torch.float8_e4m3fn)
    D_fp8, d_scale = quantize_fp8_per_token(D)
    scores = maxsim_inference_fp8(Q_fp8, D_fp8, scale_Q=q_scale, scale_D=d_scale)

Per-token scales are lik's own format (:func:`lik.quantize`); a per-tensor scale (0-d) is broadcast to every token,
which gives the same scores. See :mod:`lik.integrations.late_interaction_kernels` for what differs from the peer.
"""

from __future__ import annotations

import warnings

import torch

from ...ops.maxsim import maxsim
from ...ops.quantization import quantize

__all__ = [
    "maxsim_inference_fp8",
    "quantize_fp8_per_tensor",
    "quantize_fp8_per_token",
    "dequantize_fp8_per_tensor",
    "dequantize_fp8_per_token",
]

_E4M3 = torch.float8_e4m3fn
_E4M3_MAX = 448.0
_FALLBACK_WARNED = False


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype != _E4M3:
        raise ValueError(f"dtype must be torch.float8_e4m3fn (lik's float8 format), got {dtype}")


def quantize_fp8_per_token(X: torch.Tensor, dtype: torch.dtype = _E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row float8 of ``X [..., d]`` (late-interaction-kernels' ``quantize_fp8_per_token``):
    :func:`lik.quantize` -> ``(X_fp8, scale float32 X.shape[:-1])``, ``X ≈ X_fp8 * scale[..., None]``."""
    _check_dtype(dtype)
    return quantize(X, _E4M3)


def quantize_fp8_per_tensor(X: torch.Tensor, dtype: torch.dtype = _E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """Float8 of ``X`` with one float32 scale (late-interaction-kernels' ``quantize_fp8_per_tensor``): the
    largest magnitude maps to 448 -> ``(X_fp8 contiguous, scale 0-d float32)``, ``X ≈ X_fp8 * scale``. A zero (or
    empty) tensor gets scale 0, a tensor holding NaN or inf scale NaN, as :func:`lik.quantize` does per row.

    Example:
        >>> X_fp8, scale = quantize_fp8_per_tensor(torch.randn(8, 16))
    """
    _check_dtype(dtype)
    if not isinstance(X, torch.Tensor) or not X.dtype.is_floating_point:
        raise TypeError(f"X must be a float tensor, got {getattr(X, 'dtype', type(X).__name__)}")
    with torch.no_grad():
        values = X.detach().float()
        finite = bool(torch.isfinite(values).all()) if values.numel() else True
        amax = values.abs().amax() if values.numel() and finite else values.new_zeros(())
        scale = amax / _E4M3_MAX
        divisor = scale if scale > 0 else scale.new_ones(())
        X_fp8 = (values / divisor).clamp(-_E4M3_MAX, _E4M3_MAX)
        X_fp8 = torch.where(torch.isfinite(X_fp8), X_fp8, 0.0).to(_E4M3).contiguous()
    return X_fp8, scale if finite else scale.new_full((), float("nan"))


def dequantize_fp8_per_tensor(X_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``X_fp8 * scale`` (0-d scale)."""
    return X_fp8.float() * scale


def dequantize_fp8_per_token(X_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``X_fp8 * scale[..., None]`` (scale of shape ``X_fp8.shape[:-1]``)."""
    return X_fp8.float() * scale[..., None]


def _token_scale(name: str, scale, rows: torch.Tensor) -> torch.Tensor:
    """A 0-d (per-tensor) or ``rows.shape[:-1]`` (per-token) scale as float32 of shape ``rows.shape[:-1]``."""
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (0-d per tensor, or one per token), got "
                        f"{type(scale).__name__}")
    if tuple(scale.shape) == tuple(rows.shape[:-1]):
        return scale.float()
    if scale.numel() != 1:
        raise ValueError(f"{name} must be 0-d (per tensor) or of shape {list(rows.shape[:-1])} (per token), got "
                         f"{list(scale.shape)}")
    return scale.reshape(()).float().expand(rows.shape[:-1]).contiguous()


def _has_fp8(device: torch.device) -> bool:
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def maxsim_inference_fp8(Q: torch.Tensor, D: torch.Tensor, *, scale_Q: torch.Tensor, scale_D: torch.Tensor,
                         q_mask: torch.Tensor | None = None, d_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Inference MaxSim of float8 operands with per-tensor or per-token scales (late-interaction-kernels'
    ``maxsim_inference_fp8``), on :func:`lik.maxsim`'s float8 path.

    Args:
        Q: ``[Nq, Lq, d]`` or ``[Lq, d]`` float8_e4m3fn; D: ``[Nd, Ld, d]`` or ``[Ld, d]``, the same dtype.
        scale_Q, scale_D: float32, 0-d (per tensor) or ``[Nq, Lq]`` / ``[Nd, Ld]`` (``[Lq]`` / ``[Ld]`` for 2-D).
        q_mask, d_mask: optional bool masks, True = real token.

    Returns:
        float32 ``[Nq, Nd]``, squeezed where ``Q`` / ``D`` were 2-D: MaxSim of the dequantized operands (fp32
        products). A GPU without FP8 (compute capability < 8.9) or float8_e5m2 inputs dequantize to float32
        and score that, with a one-time RuntimeWarning, as the peer falls back.

    Example:
        >>> Q, q_scale = quantize_fp8_per_token(torch.randn(2, 32, 128))
        >>> D, d_scale = quantize_fp8_per_token(torch.randn(10, 180, 128))
        >>> maxsim_inference_fp8(Q, D, scale_Q=q_scale, scale_D=d_scale).shape
        torch.Size([2, 10])
    """
    global _FALLBACK_WARNED
    for name, x in (("Q", Q), ("D", D)):
        if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):
            raise ValueError(f"{name} must be a 2-D or 3-D tensor, got {tuple(getattr(x, 'shape', ()))}")
    if Q.shape[-1] != D.shape[-1]:
        raise ValueError(f"Q and D must share the embedding dim; got {Q.shape[-1]} vs {D.shape[-1]}.")
    single_doc = D.dim() == 2
    if single_doc:
        D = D.unsqueeze(0)
        scale_D = scale_D if scale_D.dim() == 0 else scale_D.unsqueeze(0)
        d_mask = None if d_mask is None else d_mask.unsqueeze(0)
    q_scale, d_scale = _token_scale("scale_Q", scale_Q, Q), _token_scale("scale_D", scale_D, D)
    with torch.no_grad():
        if Q.dtype == D.dtype == _E4M3 and _has_fp8(Q.device):
            scores = maxsim(Q, D, q_mask, d_mask, q_scale=q_scale, d_scale=d_scale)
        else:
            if not _FALLBACK_WARNED:
                _FALLBACK_WARNED = True
                warnings.warn("maxsim_inference_fp8: no float8_e4m3fn scoring for these inputs on this device; "
                              "scoring the dequantized float32 operands instead", RuntimeWarning, stacklevel=2)
            scores = maxsim(dequantize_fp8_per_token(Q, q_scale), dequantize_fp8_per_token(D, d_scale), q_mask,
                            d_mask)
    return scores[..., 0] if single_doc else scores
