"""flash-maxsim's 8-bit functions on lik (see :mod:`lik.integrations.flash_maxsim` for what differs).

Two formats, as flash-maxsim has them:

* symmetric int8 (``quantize_int8_symmetric`` / ``quantize_query_int8``): lik's own 8-bit format
  (:func:`lik.quantize`), scored by lik's 8-bit kernels; flash-maxsim keeps the scales in float16, so these do
  too, and the scorers read them back as float32;
* affine uint8 (``quantize_int8``: values ``0..255`` with a per-token scale and minimum): not a lik format;
  :func:`flash_maxsim_int8` dequantizes the documents a memory-bounded chunk at a time and scores them with
  :func:`lik.maxsim`.
"""

from __future__ import annotations

import torch

from ...ops.maxsim import maxsim
from ...ops.quantization import quantize
from .scoring import _prefix_mask, _tensor

__all__ = [
    "quantize_int8",
    "dequantize_int8",
    "quantize_int8_symmetric",
    "quantize_query_int8",
    "flash_maxsim_int8",
    "flash_maxsim_int8_symmetric",
    "flash_maxsim_int8x8",
]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Dequantized float32 bytes per chunk of documents in flash_maxsim_int8.
_DEQUANTIZED_CHUNK_BYTES = 256 << 20


def _float_tensor(name: str, x, ndims: tuple[int, ...] | None = None) -> torch.Tensor:
    """``x`` checked to be a float tensor with one of ``ndims`` dimensions (None: at least one)."""
    if ndims is None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0:
            raise ValueError(f"{name} must have at least one dimension (the embedding width d), got a 0-d tensor")
    else:
        _tensor(name, x, ndims)
    if x.dtype not in _FLOATS:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    return x


def _token_values(name: str, values, D: torch.Tensor) -> torch.Tensor:
    """A per-token ``[B, Ld]`` or ``[B, Ld, 1]`` scale / minimum of ``D [B, Ld, d]`` as float32 ``[B, Ld]``."""
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
    if values.dim() == D.dim() and values.shape[-1] == 1:
        values = values[..., 0]
    if tuple(values.shape) != tuple(D.shape[:-1]):
        raise ValueError(f"{name} must have shape {list(D.shape[:-1])} or {list(D.shape[:-1]) + [1]} (one per "
                         f"token), got {list(values.shape)}")
    if not values.dtype.is_floating_point:
        raise TypeError(f"{name} must be a float tensor, got {values.dtype}")
    return values.float()


def quantize_int8(D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token affine 8-bit quantization (flash-maxsim's ``quantize_int8``).

    Args:
        D: float ``[B, Ld, d]`` (any leading shape).

    Returns:
        ``(D_uint8 [B, Ld, d] uint8, scales [B, Ld, 1] float16, mins [B, Ld, 1] float16)`` with
        ``D ≈ D_uint8 * scales + mins`` (:func:`dequantize_int8`).

    Example:
        >>> D_u8, scales, mins = quantize_int8(torch.randn(10, 300, 128))
    """
    _float_tensor("D", D, None)
    with torch.no_grad():
        values = D.float()
        low, high = torch.aminmax(values, dim=-1, keepdim=True)
        step = ((high - low) / 255.0).clamp_min(1e-8)
        codes = ((values - low) / step).round().clamp(0, 255).to(torch.uint8)
    return codes, step.half(), low.half()


def dequantize_int8(D_uint8: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """float32 ``D_uint8 * scales + mins`` (flash-maxsim's ``dequantize_int8``), scales and minimums
    ``[B, Ld, 1]``."""
    return D_uint8.float() * scales.float() + mins.float()


def quantize_int8_symmetric(D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8 (flash-maxsim's ``quantize_int8_symmetric``) through :func:`lik.quantize`.

    Args:
        D: float ``[B, Ld, d]`` (any leading shape).

    Returns:
        ``(D_int8 [B, Ld, d] int8 in [-127, 127], scales [B, Ld, 1] float16)``.

    Example:
        >>> D_int8, d_scales = quantize_int8_symmetric(torch.randn(10, 300, 128))
    """
    _float_tensor("D", D, None)
    D_int8, scale = quantize(D, torch.int8)
    return D_int8, scale.half().unsqueeze(-1)


def quantize_query_int8(Q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8 of a query (flash-maxsim's ``quantize_query_int8``): ``Q [Lq, d]`` ->
    ``(Q_int8 [Lq, d] int8, q_scales [Lq] float16)``, through :func:`lik.quantize`."""
    _float_tensor("Q", Q, None)
    Q_int8, scale = quantize(Q, torch.int8)
    return Q_int8, scale.half()


def flash_maxsim_int8x8(Q: torch.Tensor | None, D_int8: torch.Tensor, d_scales: torch.Tensor,
                        Q_int8: torch.Tensor | None = None, q_scales: torch.Tensor | None = None,
                        doc_lengths=None, query_chunk_size: int = 128) -> torch.Tensor:
    """int8 query against an int8 corpus (flash-maxsim's ``flash_maxsim_int8x8``), on lik's 8-bit kernels.

    Args:
        Q: float ``[Lq, d]``, quantized with :func:`quantize_query_int8` unless ``Q_int8`` and ``q_scales`` are
            given.
        D_int8: ``[B, Ld, d]`` int8 from :func:`quantize_int8_symmetric`; d_scales: ``[B, Ld]`` or ``[B, Ld, 1]``.
        Q_int8, q_scales: an already quantized query, ``[Lq, d]`` int8 and ``[Lq]``.
        doc_lengths: optional ``[B]`` valid lengths. query_chunk_size: accepted, no effect.

    Returns:
        float32 ``[B]``: MaxSim of the dequantized operands (the int8 products summed exactly).

    Example:
        >>> D_int8, d_scales = quantize_int8_symmetric(torch.randn(10, 300, 128))
        >>> flash_maxsim_int8x8(torch.randn(32, 128), D_int8, d_scales).shape
        torch.Size([10])
    """
    if Q_int8 is None or q_scales is None:
        Q_int8, q_scales = quantize_query_int8(Q)
    _tensor("Q_int8", Q_int8, (2,))
    _tensor("D_int8", D_int8, (3,))
    if not isinstance(q_scales, torch.Tensor) or tuple(q_scales.shape) != tuple(Q_int8.shape[:1]):
        raise ValueError(f"q_scales must be a [{Q_int8.shape[0]}] tensor (one per query token)")
    d_scale = _token_values("d_scales", d_scales, D_int8)
    d_mask = _prefix_mask("doc_lengths", doc_lengths, D_int8.shape[0], D_int8.shape[1], D_int8.device)
    with torch.no_grad():
        return maxsim(Q_int8, D_int8, None, d_mask, q_scale=q_scales.float(), d_scale=d_scale)


def flash_maxsim_int8_symmetric(Q: torch.Tensor, D_int8: torch.Tensor, scales: torch.Tensor, doc_lengths=None,
                                query_chunk_size: int = 128) -> torch.Tensor:
    """A float query against a symmetric int8 corpus (flash-maxsim's ``flash_maxsim_int8_symmetric``) ->
    float32 ``[B]``. As everywhere in lik, the query is quantized per token to int8 first, so this equals
    :func:`flash_maxsim_int8x8` (flash-maxsim multiplies the float16 query with the int8 values)."""
    return flash_maxsim_int8x8(Q, D_int8, scales, doc_lengths=doc_lengths)


def flash_maxsim_int8(Q: torch.Tensor, D_uint8: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                      doc_lengths=None, query_chunk_size: int = 128) -> torch.Tensor:
    """A float query against an affine uint8 corpus (flash-maxsim's ``flash_maxsim_int8``).

    The affine format is not lik's: the documents are dequantized (``D_uint8 * scales + mins``) to ``Q``'s dtype a
    chunk of at most 256 MB at a time and scored with :func:`lik.maxsim`, so the scores are MaxSim of the
    dequantized corpus; use :func:`quantize_int8_symmetric` and :func:`flash_maxsim_int8x8` for lik's fused 8-bit
    kernels.

    Args:
        Q: float ``[Lq, d]``. D_uint8: ``[B, Ld, d]`` uint8 from :func:`quantize_int8`; scales, mins:
            ``[B, Ld, 1]`` or ``[B, Ld]``. doc_lengths: optional ``[B]``. query_chunk_size: accepted, no effect.

    Returns:
        float32 ``[B]``.

    Example:
        >>> D_u8, scales, mins = quantize_int8(torch.randn(10, 300, 128))
        >>> flash_maxsim_int8(torch.randn(32, 128), D_u8, scales, mins).shape
        torch.Size([10])
    """
    _float_tensor("Q", Q, (2,))
    _tensor("D_uint8", D_uint8, (3,))
    if D_uint8.dtype != torch.uint8:
        raise TypeError(f"D_uint8 must be uint8 (from quantize_int8), got {D_uint8.dtype}")
    if Q.shape[1] != D_uint8.shape[2]:
        raise ValueError(f"Q and D_uint8 must share the embedding width: Q has {Q.shape[1]}, D_uint8 "
                         f"{D_uint8.shape[2]}")
    step = _token_values("scales", scales, D_uint8)
    low = _token_values("mins", mins, D_uint8)
    n_docs, doc_len, dim = D_uint8.shape
    d_mask = _prefix_mask("doc_lengths", doc_lengths, n_docs, doc_len, D_uint8.device)
    chunk = max(1, _DEQUANTIZED_CHUNK_BYTES // max(1, doc_len * dim * 4))
    scores = []
    with torch.no_grad():
        for start in range(0, n_docs, chunk):
            part = slice(start, start + chunk)
            docs = (D_uint8[part].float() * step[part, :, None] + low[part, :, None]).to(Q.dtype)
            scores.append(maxsim(Q, docs, None, None if d_mask is None else d_mask[part]))
    return torch.cat(scores) if scores else Q.new_zeros(0, dtype=torch.float32)
