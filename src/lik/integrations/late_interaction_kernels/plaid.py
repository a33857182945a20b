"""late-interaction-kernels' ``plaid`` module on lik: MaxSim against PLAID / ColBERTv2 residual-compressed documents
(:func:`maxsim_residual`, padded; :func:`maxsim_residual_varlen`, ragged), the IVF pruning step
(:func:`plaid_approx_score`) and PyTorch references with the peer's semantics (see
:mod:`lik.integrations.late_interaction_kernels` for what differs).

The peer packs a token's ``d`` bucket indices ``8 // nbits`` to a byte, the first dimension in the low bits; ColBERT
(and :func:`lik.maxsim_residual`) puts it in the high bits with each index's bits reversed. Both hold the same
dimensions in the same byte, so one 256-entry table turns a peer byte into ColBERT's and the corpus is scored on
chip by :func:`lik.maxsim_residual` (``nbits`` 2 or 4, ``normalize=True``, ``d`` a multiple of 8, finite bucket
weights). The other cases (``nbits=8``, ``normalize=False``, which lik's codec has no format for) decode the
documents' tokens once in fp32 and score them with :func:`lik.maxsim_packed`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ...compression.codec import ResidualCodec
from ...compression.packing import pack_residual_bits
from ...ops.maxsim import maxsim_packed
from ...ops.residual import maxsim_residual as _lik_maxsim_residual

__all__ = [
    "plaid_approx_score",
    "plaid_approx_score_reference",
    "maxsim_residual",
    "maxsim_residual_reference",
    "maxsim_residual_varlen",
]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Elements of the [docs, tokens, Lq] gather plaid_approx_score holds at once.
_APPROX_ELEMENTS = 1 << 24


@functools.cache
def _colbert_byte_table(nbits: int) -> torch.Tensor:
    """uint8 ``[256]``: a peer byte (dimension ``k`` of the byte in bits ``k*nbits ..``) as ColBERT packs it."""
    per_byte = 8 // nbits
    groups = (torch.arange(256)[:, None] >> (torch.arange(per_byte) * nbits)) & ((1 << nbits) - 1)
    # pack_residual_bits packs whole groups of 8 dimensions: repeat the byte's dimensions, keep the first byte.
    return pack_residual_bits(groups.repeat(1, 8 // per_byte), nbits)[:, 0].contiguous()


def _unpack(residuals: torch.Tensor, nbits: int, dim: int) -> torch.Tensor:
    """int64 bucket indices ``[..., dim]`` of the peer's packed bytes."""
    feature = torch.arange(dim, device=residuals.device)
    per_byte = 8 // nbits
    byte = residuals.to(torch.int64)[..., feature // per_byte]
    return (byte >> ((feature % per_byte) * nbits)) & ((1 << nbits) - 1)


def _check_common(Q, centroids, bucket_weights, nbits, residuals, packed_name) -> int:
    if nbits not in (2, 4, 8) or isinstance(nbits, bool):
        raise ValueError(f"nbits must be 2, 4, or 8; got {nbits}")
    for name, x in (("Q", Q), ("centroids", centroids), ("bucket_weights", bucket_weights), (packed_name, residuals)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if Q.dtype not in _FLOATS:
        raise TypeError(f"Q must be float16, bfloat16, float32 or float64, got {Q.dtype}")
    if Q.dim() not in (2, 3):
        raise ValueError(f"Q must be [Lq, d] or [Nq, Lq, d], got shape {tuple(Q.shape)}")
    dim = int(Q.shape[-1])
    if centroids.dim() != 2 or centroids.shape[1] != dim or not centroids.dtype.is_floating_point:
        raise ValueError(
            f"centroids must be float [n_centroids, {dim}] (Q's d), got {centroids.dtype} {tuple(centroids.shape)}"
        )
    if bucket_weights.dim() != 1 or bucket_weights.shape[0] != 2**nbits or not bucket_weights.dtype.is_floating_point:
        raise ValueError(
            f"bucket_weights must be float [{2**nbits}] (2**nbits), got {bucket_weights.dtype} "
            f"{tuple(bucket_weights.shape)}"
        )
    if residuals.dtype != torch.uint8:
        raise TypeError(f"{packed_name} must be uint8, got {residuals.dtype}")
    expected = (dim * nbits + 7) // 8
    if residuals.shape[-1] != expected:
        raise ValueError(
            f"{packed_name} last dim {residuals.shape[-1]} != expected {expected} for d={dim}, nbits={nbits}"
        )
    return dim


def _decode(codes, residuals, centroids, bucket_weights, nbits, dim, normalize, dtype) -> torch.Tensor:
    """``centroid[code] + bucket_weights[bucket]`` per token (L2-normalised when ``normalize``), in fp32 (fp64 for a
    float64 ``dtype``), cast to ``dtype``."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    emb = centroids.to(work)[codes.long()] + bucket_weights.to(work)[_unpack(residuals, nbits, dim)]
    return (F.normalize(emb, p=2, dim=-1, eps=1e-12) if normalize else emb).to(dtype)


def _score_packed(Q, codes, residuals, cu, centroids, bucket_weights, nbits, normalize, dim) -> torch.Tensor:
    """Scores ``[Nq, Nd]`` (``[Nd]`` for 2-D ``Q``) of ragged compressed documents, checked inputs."""
    device = Q.device
    for name, x in (("centroids", centroids), ("bucket_weights", bucket_weights)):
        if x.device != device:
            raise ValueError(f"{name} must be on Q's device {device}, got {x.device}")
    codes = codes.to(device) if codes.dtype in (torch.int32, torch.int64) else codes.to(device, torch.int64)
    residuals = residuals.to(device)
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= centroids.shape[0]):
        raise ValueError(f"codes must lie in [0, {centroids.shape[0]}) (the centroids' rows)")
    # The peer normalises Q in fp32 inside its kernel; here a copy, rounded once to Q's dtype, with its gradient.
    q = (
        F.normalize(Q.to(torch.float64 if Q.dtype == torch.float64 else torch.float32), p=2, dim=-1, eps=1e-12).to(
            Q.dtype
        )
        if normalize
        else Q
    )
    weights_finite = bool(torch.isfinite(bucket_weights).all())
    if normalize and nbits in (2, 4) and dim % 8 == 0 and weights_finite:
        cutoffs = torch.zeros(2**nbits - 1, device=device)  # only the compression side reads them
        codec = ResidualCodec(centroids, cutoffs, bucket_weights, nbits)
        colbert = _colbert_byte_table(nbits).to(device)[residuals.long()]
        return _lik_maxsim_residual(q, codes, colbert, codec, cu)
    return maxsim_packed(q, _decode(codes, residuals, centroids, bucket_weights, nbits, dim, normalize, Q.dtype), cu)


def _padded_to_packed(codes, residuals, doc_lengths):
    """The valid prefix of each padded document, packed: ``(codes [T], residuals [T, p], cu_seqlens [Nd + 1])``; a
    length past the padding counts as the padding, a negative one as 0 (the peer's kernel masks so)."""
    n_docs, width = codes.shape
    lengths = doc_lengths.to(device=codes.device, dtype=torch.int64).clamp(0, width)
    valid = torch.arange(width, device=codes.device)[None, :] < lengths[:, None]
    cu = torch.zeros(n_docs + 1, dtype=torch.int32, device=codes.device)
    cu[1:] = lengths.cumsum(0)
    return codes[valid], residuals[valid], cu


def maxsim_residual(
    Q: torch.Tensor,
    codes: torch.Tensor,
    residuals: torch.Tensor,
    doc_lengths: torch.Tensor,
    centroids: torch.Tensor,
    bucket_weights: torch.Tensor,
    nbits: int,
    *,
    normalize: bool = True,
) -> torch.Tensor:
    """MaxSim against padded PLAID-compressed documents (late-interaction-kernels' ``plaid.maxsim_residual``).

    A document token is ``centroids[code] + bucket_weights[bucket]`` (one bucket per dimension), L2-normalised with
    ``Q`` when ``normalize``. Only the first ``doc_lengths[n]`` tokens of document ``n`` take part; an empty document
    scores 0 (with zero gradient).

    Args:
        Q: ``[Lq, d]`` or ``[Nq, Lq, d]``; float16, bfloat16, float32 (float64 decodes and scores in float64).
        codes: integer ``[Nd, max_Ld]`` centroid ids (padding positions are never read).
        residuals: uint8 ``[Nd, max_Ld, ceil(d * nbits / 8)]``, the peer's packing (``8 // nbits`` bucket indices a
            byte, first dimension in the low bits).
        doc_lengths: integer ``[Nd]`` valid lengths.
        centroids: float ``[n_centroids, d]``; bucket_weights: float ``[2**nbits]``; both on ``Q``'s device.
        nbits: 2, 4 or 8.
        normalize: normalise ``Q`` and every decoded token (PLAID's convention).

    Returns:
        float32 ``[Nq, Nd]`` (``[Nd]`` for 2-D ``Q``; float64 for float64 ``Q``), differentiable in ``Q``.

    Example:
        >>> codes = torch.randint(0, 64, (10, 40)); residuals = torch.randint(0, 256, (10, 40, 32), dtype=torch.uint8)
        >>> maxsim_residual(torch.randn(2, 32, 128), codes, residuals, torch.full((10,), 40), torch.randn(64, 128),
        ...                 torch.linspace(-0.1, 0.1, 4), nbits=2).shape
        torch.Size([2, 10])
    """
    dim = _check_common(Q, centroids, bucket_weights, nbits, residuals, "residuals")
    for name, x, dims in (("codes", codes, 2), ("doc_lengths", doc_lengths, 1)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype.is_floating_point or x.dtype == torch.bool or x.dim() != dims:
            raise ValueError(
                f"{name} must be an integer tensor with {dims} dimension(s), got {x.dtype} {tuple(x.shape)}"
            )
    if residuals.dim() != 3 or tuple(residuals.shape[:2]) != tuple(codes.shape):
        raise ValueError(
            f"residuals must be [Nd, max_Ld, packed_dim] with codes' [Nd, max_Ld] = "
            f"{tuple(codes.shape)}, got {tuple(residuals.shape)}"
        )
    if doc_lengths.shape[0] != codes.shape[0]:
        raise ValueError(f"doc_lengths must be [{codes.shape[0]}] (codes' Nd), got {tuple(doc_lengths.shape)}")
    flat_codes, flat_residuals, cu = _padded_to_packed(codes, residuals, doc_lengths)
    return _score_packed(
        Q, flat_codes, flat_residuals, cu.to(Q.device), centroids, bucket_weights, nbits, normalize, dim
    )


def maxsim_residual_varlen(
    Q: torch.Tensor,
    codes_flat: torch.Tensor,
    residuals_flat: torch.Tensor,
    cu_seqlens_d: torch.Tensor,
    centroids: torch.Tensor,
    bucket_weights: torch.Tensor,
    nbits: int,
    *,
    max_seqlen_d: int | None = None,
    normalize: bool = True,
) -> torch.Tensor:
    """:func:`maxsim_residual` on ragged documents (late-interaction-kernels' ``plaid.maxsim_residual_varlen``):
    ``codes_flat [T]``, ``residuals_flat [T, ceil(d * nbits / 8)]`` and int32 ``cu_seqlens_d [Nd + 1]`` offsets
    (0 first, ``T`` last, non-decreasing). ``max_seqlen_d`` is accepted as a hint (lik reads the offsets once).
    Differentiable in ``Q`` (the peer's is inference only).

    Example:
        >>> cu = torch.tensor([0, 30, 30, 100], dtype=torch.int32)
        >>> codes = torch.randint(0, 64, (100,)); residuals = torch.randint(0, 256, (100, 64), dtype=torch.uint8)
        >>> maxsim_residual_varlen(torch.randn(32, 128), codes, residuals, cu, torch.randn(64, 128),
        ...                        torch.linspace(-0.1, 0.1, 16), nbits=4).shape
        torch.Size([3])
    """
    dim = _check_common(Q, centroids, bucket_weights, nbits, residuals_flat, "residuals_flat")
    if not isinstance(codes_flat, torch.Tensor) or codes_flat.dim() != 1 or codes_flat.dtype.is_floating_point:
        raise ValueError("codes_flat must be a 1-D integer tensor [total_d_tokens]")
    if residuals_flat.dim() != 2 or residuals_flat.shape[0] != codes_flat.shape[0]:
        raise ValueError(
            f"residuals_flat must be 2-D [total_d_tokens, packed_dim] with codes_flat's "
            f"{codes_flat.shape[0]} rows, got {tuple(residuals_flat.shape)}"
        )
    if (
        not isinstance(cu_seqlens_d, torch.Tensor)
        or cu_seqlens_d.dim() != 1
        or cu_seqlens_d.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError("cu_seqlens_d must be a 1-D int32 (or int64) tensor [Nd + 1]")
    return _score_packed(
        Q, codes_flat, residuals_flat, cu_seqlens_d.to(Q.device), centroids, bucket_weights, nbits, normalize, dim
    )


def plaid_approx_score(
    query_centroid_scores: torch.Tensor, codes: torch.Tensor, doc_lengths: torch.Tensor
) -> torch.Tensor:
    """PLAID's pruning score (late-interaction-kernels' ``plaid.plaid_approx_score``):
    ``sum_s max_{t < doc_lengths[b]} query_centroid_scores[codes[b, t], s]``, an empty document 0.

    Args:
        query_centroid_scores: ``[n_centroids, Lq]`` (``centroids @ Q.T``), computed in float32.
        codes: integer ``[B, max_Ld]``; a code outside ``[0, n_centroids)`` reads centroid 0 (as the peer's kernel).
        doc_lengths: integer ``[B]``.

    Returns:
        float32 ``[B]``. A gather and a masked max in PyTorch, a bounded block of documents at a time.

    Example:
        >>> plaid_approx_score(torch.randn(256, 32), torch.randint(0, 256, (20, 64)), torch.full((20,), 50)).shape
        torch.Size([20])
    """
    for name, x, dims in (
        ("query_centroid_scores", query_centroid_scores, 2),
        ("codes", codes, 2),
        ("doc_lengths", doc_lengths, 1),
    ):
        if not isinstance(x, torch.Tensor) or x.dim() != dims:
            raise ValueError(f"{name} must be a tensor with {dims} dimension(s)")
    if doc_lengths.shape[0] != codes.shape[0]:
        raise ValueError("doc_lengths must be [B] with B matching codes")
    qcs = query_centroid_scores.to(torch.float32)
    n_centroids, n_query = qcs.shape
    n_docs, width = codes.shape
    codes = codes.to(qcs.device).long()
    codes = torch.where((codes >= 0) & (codes < n_centroids), codes, 0)
    valid = torch.arange(width, device=qcs.device)[None, :] < doc_lengths.to(qcs.device)[:, None]
    out = torch.zeros(n_docs, dtype=torch.float32, device=qcs.device)
    step = max(1, _APPROX_ELEMENTS // max(1, width * n_query))
    for lo in range(0, n_docs, step):
        gathered = qcs[codes[lo : lo + step]].masked_fill(~valid[lo : lo + step, :, None], float("-inf"))
        best = gathered.amax(dim=1) if width else gathered.new_full((gathered.shape[0], n_query), float("-inf"))
        out[lo : lo + step] = torch.where(best == float("-inf"), 0.0, best).sum(dim=-1)
    return out


def plaid_approx_score_reference(
    query_centroid_scores: torch.Tensor, codes: torch.Tensor, doc_lengths: torch.Tensor
) -> torch.Tensor:
    """The peer's dense PyTorch reference of :func:`plaid_approx_score` (one gather of every document; a
    non-finite maximum counts 0). float32 ``[B]``."""
    qcs = query_centroid_scores.float()
    n_docs, width = codes.shape
    flat = qcs[codes.long().reshape(-1)].reshape(n_docs, width, -1)
    valid = torch.arange(width, device=codes.device)[None, :] < doc_lengths.to(codes.device)[:, None]
    best = flat.masked_fill(~valid[..., None], float("-inf")).max(dim=1).values
    return torch.where(torch.isfinite(best), best, torch.zeros_like(best)).sum(dim=-1)


def maxsim_residual_reference(
    Q: torch.Tensor,
    codes: torch.Tensor,
    residuals: torch.Tensor,
    doc_lengths: torch.Tensor,
    centroids: torch.Tensor,
    bucket_weights: torch.Tensor,
    nbits: int,
    *,
    normalize: bool = True,
) -> torch.Tensor:
    """The peer's dense PyTorch reference of :func:`maxsim_residual`: every padded token decoded in fp32 (fp64 for
    float64 ``Q``), one einsum, padding masked, a non-finite maximum counted 0. ``[Nq, Nd]`` (``[1, Nd]`` for 2-D
    ``Q``, as the peer's)."""
    q = Q.unsqueeze(0) if Q.dim() == 2 else Q
    work = torch.float64 if Q.dtype == torch.float64 else torch.float32
    dim = q.shape[-1]
    buckets = _unpack(residuals, nbits, dim).clamp(0, bucket_weights.numel() - 1)
    emb = centroids.to(work)[codes.long()] + bucket_weights.to(work)[buckets]
    q = q.to(work)
    if normalize:
        emb = F.normalize(emb, p=2, dim=-1, eps=1e-12)
        q = F.normalize(q, p=2, dim=-1, eps=1e-12)
    valid = torch.arange(codes.shape[1], device=codes.device)[None, :] < doc_lengths.to(codes.device)[:, None]
    sim = torch.einsum("ild,jtd->ijlt", q, emb).masked_fill(~valid[None, :, None, :], float("-inf"))
    best = sim.max(dim=-1).values
    return torch.where(torch.isfinite(best), best, torch.zeros_like(best)).sum(dim=-1)
