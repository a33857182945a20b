"""The PyTorch specification of :func:`lik.maxsim_residual`: decode a bounded run of documents at a time, then
:func:`lik.maxsim_packed_reference` (the CPU path; float64 decodes in float64 for the tests)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lik.compression.packing import unpack_residual_bits
from lik.core.precision import accumulation_dtype
from lik.ops.maxsim.reference_varlen import maxsim_packed_reference

from .validation import ResidualInputs

__all__ = ["decode_tokens", "maxsim_residual_reference"]

# Tokens decoded at once: bounds the reference's temporaries (as ResidualCodec.decompress's blocks do).
_CHUNK_TOKENS = 1 << 15


def decode_tokens(codec, codes: torch.Tensor, residuals: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``normalize(centroid[code] + bucket_weights[bucket])`` for every row, computed in float32 (float64 when
    ``dtype`` is float64) and cast to ``dtype``: ``codec.decompress(codes, residuals, dtype)`` without checks.

    Example::

        >>> sample = torch.nn.functional.normalize(torch.randn(512, 16), dim=-1)
        >>> codec = lik.compression.ResidualCodec.train(sample, 8, 2)
        >>> codes, residuals = codec.compress(torch.nn.functional.normalize(torch.randn(5, 16), dim=-1))
        >>> decode_tokens(codec, codes, residuals, torch.float64).shape
        torch.Size([5, 16])
    """
    work = accumulation_dtype(dtype)
    buckets = unpack_residual_bits(residuals, codec.nbits).long()
    centroids = codec._centroids32 if work == torch.float32 else codec.centroids.to(work)
    weights = codec._weights32 if work == torch.float32 else codec.bucket_weights.to(work)
    x = centroids[codes.long()] + weights[buckets]
    return F.normalize(x, p=2, dim=-1).to(dtype)


def maxsim_residual_reference(inputs: ResidualInputs) -> torch.Tensor:
    """Scores ``[Nq, B]`` (float32; float64 for a float64 ``Q``), differentiable in ``Q``: documents are decoded
    in runs of whole documents of about ``_CHUNK_TOKENS`` tokens (a longer document is one run)."""
    q, cu = inputs.q, inputs.cu.to(torch.int64).cpu()
    n_docs = inputs.n_docs
    parts = []
    first = 0
    while first < n_docs:
        last = first + 1
        while last < n_docs and int(cu[last + 1] - cu[first]) <= _CHUNK_TOKENS:
            last += 1
        lo, hi = int(cu[first]), int(cu[last])
        d = decode_tokens(inputs.codec, inputs.codes[lo:hi], inputs.residuals[lo:hi], q.dtype)
        sub_cu = (cu[first : last + 1] - lo).to(device=q.device, dtype=torch.int32)
        parts.append(maxsim_packed_reference(q, d, sub_cu, inputs.q_mask))
        first = last
    if not parts:
        return torch.zeros(q.shape[0], 0, dtype=accumulation_dtype(q.dtype), device=q.device)
    return torch.cat(parts, dim=1)
