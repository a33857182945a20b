"""ColBERTv2's residual codec: a token is its nearest centroid's id plus, per dimension, the bucket its residual
falls in, packed ``nbits`` to a dimension exactly as ColBERT packs it (see :mod:`lik.compression.packing`).

The arithmetic is ColBERT's CPU path (``colbert/indexing/codecs/residual.py``, colbert-ai 0.2.22), on any device:

- codes: ``(centroids_fp32 @ tokens_fp32.T).max(dim=0).indices`` (the largest inner product: ColBERT's centroids
  are unit vectors);
- buckets: ``torch.bucketize(token_fp32 - centroid_fp32, cutoffs)`` (index ``i`` with ``cutoffs[i-1] < r <=
  cutoffs[i]``);
- decoding: ``normalize(centroid_fp32 + weights_fp32[bucket], dim=-1)`` (``torch.nn.functional.normalize``).

So lik's codes, bytes and fp32 decode equal ColBERT's CPU ones bit for bit. ColBERT's GPU path differs from its
own CPU path: it subtracts in fp16 (a residual within an fp16 rounding of a cutoff can land in the next bucket) and
decodes in fp16; lik keeps fp32 on every device and casts the normalised result to the requested dtype, except
that on a GPU fp16 tokens choose their centroid by fp16 products with fp32 sums in one fused kernel
(:func:`lik.compression.nearest_centroid`), as ColBERT's GPU path multiplies in fp16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kmeans import kmeans
from .nearest import nearest_centroid
from .packing import check_nbits_and_dim, pack_residual_bits, packed_dim, unpack_residual_bits
from .sampling import bucket_cutoffs_and_weights, split_heldout

__all__ = ["ResidualCodec"]

# Tokens per block in compress / decompress: ColBERT's batch sizes, which bound the temporaries.
_COMPRESS_BLOCK = 1 << 18
_DECOMPRESS_BLOCK = 1 << 15


def _check_float(name: str, t, dims: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    return t


class ResidualCodec:
    """Centroids plus 1/2/4-bit residual buckets, ColBERTv2's ``ResidualCodec`` without its I/O or C++ kernels.

    Args:
        centroids: float ``[K, d]`` (ColBERT: unit rows, fp16 on disk), ``d`` a multiple of 8.
        bucket_cutoffs: float ``[2**nbits - 1]``, non-decreasing.
        bucket_weights: float ``[2**nbits]``.
        nbits: 1, 2 or 4.
        avg_residual: optional float (ColBERT's mean absolute held-out residual; kept for its ``avg_residual.pt``).

    All tensors move to ``centroids``' device. The codec is immutable in use; ``.to(device)`` returns a copy.

    Example::

        >>> codec = ResidualCodec.train(torch.nn.functional.normalize(torch.randn(4096, 64), dim=-1), 64, 2)
        >>> codes, residuals = codec.compress(torch.nn.functional.normalize(torch.randn(10, 64), dim=-1))
        >>> codes.shape, residuals.shape, residuals.dtype
        (torch.Size([10]), torch.Size([10, 16]), torch.uint8)
        >>> codec.decompress(codes, residuals).shape
        torch.Size([10, 64])
    """

    def __init__(self, centroids, bucket_cutoffs, bucket_weights, nbits, avg_residual=None):
        _check_float("centroids", centroids, 2)
        _check_float("bucket_cutoffs", bucket_cutoffs, 1)
        _check_float("bucket_weights", bucket_weights, 1)
        if isinstance(nbits, bool) or not isinstance(nbits, int) or nbits not in (1, 2, 4):
            raise ValueError(f"nbits must be 1, 2 or 4, got {nbits!r}")
        if centroids.shape[0] < 1:
            raise ValueError("centroids must have at least one row")
        check_nbits_and_dim(nbits, int(centroids.shape[1]))
        if bucket_cutoffs.shape[0] != 2**nbits - 1:
            raise ValueError(
                f"bucket_cutoffs must have {2**nbits - 1} values for nbits={nbits}, got {bucket_cutoffs.shape[0]}"
            )
        if bucket_weights.shape[0] != 2**nbits:
            raise ValueError(
                f"bucket_weights must have {2**nbits} values for nbits={nbits}, got {bucket_weights.shape[0]}"
            )
        device = centroids.device
        self.centroids = centroids
        self.bucket_cutoffs = bucket_cutoffs.to(device)
        self.bucket_weights = bucket_weights.to(device)
        if not bool(torch.isfinite(self.bucket_cutoffs).all()) or not bool(torch.isfinite(self.bucket_weights).all()):
            raise ValueError("bucket_cutoffs and bucket_weights must be finite")
        if bool((self.bucket_cutoffs[1:] < self.bucket_cutoffs[:-1]).any()):
            raise ValueError("bucket_cutoffs must be non-decreasing")
        self.nbits = nbits
        self.avg_residual = avg_residual
        # fp32 copies used by every computation (ColBERT's CPU codec holds its centroids and weights in fp32).
        self._centroids32 = centroids.float()
        self._cutoffs32 = self.bucket_cutoffs.float()
        self._weights32 = self.bucket_weights.float()

    @property
    def dim(self) -> int:
        """Embedding width ``d``."""
        return int(self.centroids.shape[1])

    @property
    def num_centroids(self) -> int:
        """Number of centroids ``K``."""
        return int(self.centroids.shape[0])

    @property
    def packed_dim(self) -> int:
        """Bytes of residual per token, ``d * nbits // 8``."""
        return packed_dim(self.dim, self.nbits)

    @property
    def device(self) -> torch.device:
        return self.centroids.device

    def to(self, device) -> ResidualCodec:
        """A copy of the codec on ``device``."""
        return ResidualCodec(
            self.centroids.to(device), self.bucket_cutoffs, self.bucket_weights, self.nbits, self.avg_residual
        )

    def _check_embs(self, embs) -> torch.Tensor:
        _check_float("embs", embs, 2)
        if embs.shape[1] != self.dim:
            raise ValueError(f"embs must have {self.dim} columns (the codec's d), got {embs.shape[1]}")
        return embs.to(self.device)

    def compress_into_codes(self, embs: torch.Tensor) -> torch.Tensor:
        """int32 ``[N]``: the centroid of largest inner product for each row of float ``embs`` ``[N, d]``."""
        embs = self._check_embs(embs)
        if embs.is_cuda:  # fused: no [K, N] fp32 block (it would be 262 TB at 1e9 tokens x 2**16 centroids)
            product = torch.float16 if embs.dtype == torch.float16 else torch.float32
            return nearest_centroid(embs, self.centroids, bias=None, product_dtype=product)[0]
        codes = torch.empty(embs.shape[0], dtype=torch.int32, device=self.device)
        # ColBERT's block (its 2**29 score elements) and orientation, so equal inputs give equal products.
        step = max(1, (1 << 29) // self.num_centroids)
        for start in range(0, embs.shape[0], step):
            scores = self._centroids32 @ embs[start : start + step].float().T
            codes[start : start + step] = scores.max(dim=0).indices.to(torch.int32)
        return codes

    def compress(self, embs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode tokens.

        Args:
            embs: float ``[N, d]`` (any float dtype; ColBERT indexes fp16), finite, any device (moved to the
                codec's).

        Returns:
            ``(codes int32 [N], residuals uint8 [N, d * nbits // 8])``: ColBERT's ``.codes`` and ``.residuals``.
        """
        embs = self._check_embs(embs)
        # A NaN token would get an arbitrary centroid and the last bucket everywhere; refuse it instead.
        if embs.numel() and not bool(torch.isfinite(embs).all()):
            raise ValueError("embs must be finite (no NaN or inf)")
        codes_out, residuals_out = [], []
        for block in embs.split(_COMPRESS_BLOCK):
            codes = self.compress_into_codes(block)
            residual = block.float() - self._centroids32[codes.long()]
            buckets = torch.bucketize(residual.contiguous(), self._cutoffs32)
            codes_out.append(codes)
            residuals_out.append(pack_residual_bits(buckets, self.nbits))
        if not codes_out:
            empty = embs.new_empty((0, self.packed_dim), dtype=torch.uint8)
            return embs.new_empty((0,), dtype=torch.int32), empty
        return torch.cat(codes_out), torch.cat(residuals_out)

    def _check_codes(self, codes, residuals) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(codes, torch.Tensor) or codes.dim() != 1:
            raise ValueError("codes must be a 1-D tensor [N]")
        if codes.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"codes must be int32 or int64, got {codes.dtype}")
        if not isinstance(residuals, torch.Tensor) or residuals.dim() != 2:
            raise ValueError(f"residuals must be a 2-D tensor [N, {self.packed_dim}]")
        if residuals.dtype != torch.uint8:
            raise TypeError(f"residuals must be uint8, got {residuals.dtype}")
        if residuals.shape != (codes.shape[0], self.packed_dim):
            raise ValueError(
                f"residuals must have shape [{codes.shape[0]}, {self.packed_dim}] to match codes and the codec, "
                f"got {list(residuals.shape)}"
            )
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.num_centroids):
            raise ValueError(f"codes must lie in [0, {self.num_centroids}) (the codec's centroids)")
        return codes.to(self.device), residuals.to(self.device)

    def decompress(self, codes, residuals, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decode tokens: ``normalize(centroid + bucket_weights[bucket])`` in fp32, then cast.

        Args:
            codes: int32 / int64 ``[N]``; residuals: uint8 ``[N, d * nbits // 8]``.
            dtype: output dtype (fp32 equals ColBERT's CPU decode bit for bit; ColBERT's GPU decode is fp16).

        Returns:
            ``dtype`` ``[N, d]`` on the codec's device, unit rows.
        """
        codes, residuals = self._check_codes(codes, residuals)
        if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(f"dtype must be a floating dtype, got {dtype}")
        out = torch.empty(codes.shape[0], self.dim, dtype=dtype, device=self.device)
        for start in range(0, codes.shape[0], _DECOMPRESS_BLOCK):
            c = codes[start : start + _DECOMPRESS_BLOCK].long()
            buckets = unpack_residual_bits(residuals[start : start + _DECOMPRESS_BLOCK], self.nbits)
            x = self._centroids32[c] + self._weights32[buckets.long()]
            out[start : start + _DECOMPRESS_BLOCK] = F.normalize(x, p=2, dim=-1)
        return out

    @classmethod
    def train(
        cls,
        sample: torch.Tensor,
        num_centroids: int,
        nbits: int,
        *,
        niters: int = 4,
        seed: int = 0,
        heldout: torch.Tensor | None = None,
        matmul_dtype: torch.dtype = torch.float32,
    ) -> ResidualCodec:
        """Train a codec as ColBERTv2 does, on ``sample``'s device.

        Args:
            sample: float ``[n, d]`` training tokens (ColBERT: every token of the sampled documents, see
                :func:`lik.compression.sampling.sample_document_ids`).
            num_centroids: ``K`` (ColBERT: :func:`lik.compression.sampling.num_partitions`).
            nbits: 1, 2 or 4.
            niters: k-means iterations (ColBERT's default ``kmeans_niters``). seed: shuffling, split and k-means start.
            matmul_dtype: the k-means assignment product's dtype (:func:`lik.compression.kmeans`); the buckets'
                codes are always fp32, as ColBERT's CPU path computes them.
            heldout: tokens for the buckets; by default ColBERT's split of ``sample`` (5%, at most 50 000; the
                whole sample when that is empty).

        Returns:
            A :class:`ResidualCodec` with unit centroids (fp32) and ``avg_residual`` set.
        """
        _check_float("sample", sample, 2)
        check_nbits_and_dim(nbits, int(sample.shape[1]))
        if sample.shape[0] == 0:
            raise ValueError("sample must have at least one row")
        if isinstance(num_centroids, bool) or not isinstance(num_centroids, int) or num_centroids < 1:
            raise ValueError(f"num_centroids must be a positive int, got {num_centroids!r}")
        if heldout is None:
            train_part, heldout = split_heldout(sample, seed=seed)
            if heldout.shape[0] == 0:
                heldout = train_part
        else:
            _check_float("heldout", heldout, 2)
            if heldout.shape[1] != sample.shape[1] or heldout.shape[0] == 0:
                raise ValueError(f"heldout must be a non-empty [h, {sample.shape[1]}] tensor")
            train_part = sample
        centroids = F.normalize(
            kmeans(train_part, num_centroids, niters=niters, seed=seed, matmul_dtype=matmul_dtype), dim=-1
        )
        provisional = cls(centroids, torch.zeros(2**nbits - 1), torch.zeros(2**nbits), nbits)
        codes = provisional.compress_into_codes(heldout)
        residuals = heldout.to(centroids.device).float() - centroids[codes.long()]
        cutoffs, weights = bucket_cutoffs_and_weights(residuals, nbits)
        avg_residual = residuals.abs().mean(dim=0).mean()
        return cls(centroids, cutoffs, weights, nbits, avg_residual=avg_residual)
