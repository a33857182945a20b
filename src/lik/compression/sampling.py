"""ColBERTv2's training plan for a PLAID codec: how many centroids, which documents to sample, the held-out split,
and the residual buckets, with ColBERT's formulas (``colbert/indexing/collection_indexer.py``, colbert-ai 0.2.22).

- Sampled documents: ``min(1 + int(16 * sqrt(120 * num_docs)), num_docs)`` of them, uniformly without
  replacement (ColBERT takes every token of each sampled passage; 120 is its "typical doclen", kept fixed so the
  sample does not depend on the real lengths).
- Centroids: ``2 ** floor(log2(16 * sqrt(num_embeddings_est)))`` with ``num_embeddings_est = num_docs *
  average sampled length``.
- Held-out split: the shuffled sample's last ``int(min(0.05 * n, 50_000))`` tokens train the buckets, the rest
  the centroids.
- Buckets: the residuals of the held-out tokens (token minus its nearest centroid) pooled over every dimension;
  ``2**nbits - 1`` cutoffs at quantiles ``i / 2**nbits`` and ``2**nbits`` weights at ``(i + 0.5) / 2**nbits``
  (torch's linear-interpolation quantile). The cutoffs and weights are shared by all dimensions, as in ColBERT.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "num_sampled_documents",
    "num_partitions",
    "sample_document_ids",
    "split_heldout",
    "quantile",
    "bucket_cutoffs_and_weights",
]

_TYPICAL_DOCLEN = 120
HELDOUT_FRACTION = 0.05
MAX_HELDOUT = 50_000


def num_sampled_documents(num_docs: int) -> int:
    """How many documents ColBERT samples for training: ``min(1 + int(16 * sqrt(120 * num_docs)), num_docs)``."""
    if isinstance(num_docs, bool) or not isinstance(num_docs, int) or num_docs < 0:
        raise ValueError(f"num_docs must be a non-negative int, got {num_docs!r}")
    return min(1 + int(16 * math.sqrt(_TYPICAL_DOCLEN * num_docs)), num_docs)


def num_partitions(num_embeddings_est: float) -> int:
    """ColBERT's number of centroids: ``2 ** floor(log2(16 * sqrt(num_embeddings_est)))``, e.g. 2**16 for 5M tokens.

    Example::

        >>> num_partitions(5_000_000)
        32768
    """
    if not isinstance(num_embeddings_est, (int, float)) or not num_embeddings_est >= 1:
        raise ValueError(f"num_embeddings_est must be a number >= 1, got {num_embeddings_est!r}")
    return int(2 ** math.floor(math.log2(16 * math.sqrt(num_embeddings_est))))


def sample_document_ids(num_docs: int, seed: int = 0) -> torch.Tensor:
    """int64 ``[num_sampled_documents(num_docs)]``: distinct document ids, sorted, drawn with a seeded CPU generator
    (ColBERT draws with Python's ``random.sample``; the count is what its recipe fixes)."""
    count = num_sampled_documents(num_docs)
    generator = torch.Generator().manual_seed(int(seed))
    return torch.randperm(num_docs, generator=generator)[:count].sort().values


def split_heldout(sample: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Shuffle ``[n, d]`` tokens and split off ColBERT's held-out part: ``(train [n - h, d], heldout [h, d])`` with
    ``h = int(min(0.05 * n, 50_000))`` (0 for fewer than 20 tokens: then the buckets train on ``train``)."""
    generator = torch.Generator().manual_seed(int(seed))
    shuffled = sample[torch.randperm(sample.shape[0], generator=generator).to(sample.device)]
    heldout = int(min(HELDOUT_FRACTION * sample.shape[0], MAX_HELDOUT))
    return shuffled[: sample.shape[0] - heldout], shuffled[sample.shape[0] - heldout :]


def quantile(values: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``torch.quantile(values, q)`` (linear interpolation, over all elements), with no limit on ``values``' size.

    ``torch.quantile`` refuses inputs over 2**24 elements (a 50 000-token held-out set at d = 512 is 25M); this is
    its own arithmetic written out (fp32 ranks ``q * (n - 1)``, ``lerp`` between the neighbours), one sort.
    """
    flat = values.reshape(-1)
    ordered = flat.sort().values
    ranks = q.to(flat.dtype) * (flat.numel() - 1)
    below = ranks.floor().long()
    above = ranks.ceil().long()
    weights = ranks - below.to(ranks.dtype)
    return ordered[below].lerp(ordered[above], weights)


def bucket_cutoffs_and_weights(residuals: torch.Tensor, nbits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ColBERT's buckets from held-out residuals ``[h, d]``: ``(cutoffs fp32 [2**nbits - 1], weights fp32
    [2**nbits])``.

    Example::

        >>> cut, w = bucket_cutoffs_and_weights(torch.arange(9.0).reshape(9, 1), 1)
        >>> cut.tolist(), w.tolist()
        ([4.0], [2.0, 6.0])
    """
    num_options = 2**nbits
    # ColBERT's expression, kept as is so that its float32 quantile levels are the same numbers.
    levels = torch.arange(0, num_options, device=residuals.device) * (1 / num_options)
    cutoff_levels, weight_levels = levels[1:], levels + (0.5 / num_options)
    res = residuals.float()
    return quantile(res, cutoff_levels), quantile(res, weight_levels)
