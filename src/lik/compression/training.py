"""Training a codec for a corpus the way ColBERTv2's indexer plans it: sample documents, size the centroids from
the sample's average length, train on the sample (see :mod:`lik.compression.sampling` for the formulas).

A streamed build trains on its first documents only; ``num_documents`` then says how many the whole corpus holds, so
that ``K`` is ColBERT's (and fast-plaid's) count for the corpus, not for the prefix (a 1 Mi-token prefix of a 5M-token
corpus would get half their centroids)."""

from __future__ import annotations

import torch

from .codec import ResidualCodec
from .sampling import num_partitions, sample_document_ids

__all__ = ["train_codec"]


def train_codec(
    tokens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    nbits: int,
    *,
    num_centroids: int | None = None,
    num_documents: int | None = None,
    niters: int = 4,
    seed: int = 0,
    matmul_dtype: torch.dtype = torch.float32,
) -> ResidualCodec:
    """Train a :class:`ResidualCodec` for a packed corpus with ColBERTv2's plan.

    Args:
        tokens: float ``[T, d]`` packed document tokens (any device: training runs there).
        cu_seqlens: int ``[N + 1]`` document offsets into ``tokens`` (non-decreasing, from 0 to ``T``).
        nbits: 1, 2 or 4.
        num_centroids: ``K``; by default ColBERT's ``2 ** floor(log2(16 * sqrt(num_documents * avg sampled
            length)))``.
        num_documents: documents in the whole corpus when ``cu_seqlens`` holds only its first ones (``>= N``);
            by default ``N``. Only the default ``K`` uses it: the sample is still drawn from the ``N`` given.
        niters: k-means iterations (ColBERT's default ``kmeans_niters`` is 4).
        seed: document sample, split and k-means start.
        matmul_dtype: the k-means assignment product's dtype.

    Returns:
        The trained codec on ``tokens``' device.

    Example::

        >>> docs = torch.nn.functional.normalize(torch.randn(3000, 64), dim=-1)
        >>> codec = train_codec(docs, torch.arange(0, 3001, 30), nbits=2)
        >>> codec.num_centroids, codec.nbits
        (512, 2)
    """
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D tensor [N + 1] with N >= 1")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise ValueError("tokens must be a 2-D tensor [T, d]")
    offsets = cu_seqlens.detach().to("cpu", torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    if int(offsets[0]) != 0 or int(offsets[-1]) != tokens.shape[0] or bool((lengths < 0).any()):
        raise ValueError(f"cu_seqlens must rise from 0 to tokens.shape[0] ({tokens.shape[0]}) without decreasing")
    num_docs = lengths.numel()
    if num_documents is not None and (
        isinstance(num_documents, bool) or not isinstance(num_documents, int) or num_documents < num_docs
    ):
        raise ValueError(f"num_documents must be an int >= the {num_docs} documents given, got {num_documents!r}")
    sampled = sample_document_ids(num_docs, seed=seed)
    starts, counts = offsets[sampled], lengths[sampled]
    # Every token row of the sampled documents, without a Python loop: row = start + position in the document.
    shift = starts - (counts.cumsum(0) - counts)
    rows = torch.repeat_interleave(shift, counts) + torch.arange(int(counts.sum()))
    if rows.numel() == 0:
        raise ValueError("tokens: the sampled documents hold no token (every document is empty?)")
    sample = tokens[rows.to(tokens.device)]
    if num_centroids is None:
        # ColBERT: num_embeddings_est = the corpus's documents * the sampled documents' average length.
        corpus_docs = num_docs if num_documents is None else num_documents
        num_centroids = num_partitions(corpus_docs * rows.numel() / sampled.numel())
        if num_documents is not None:
            # As fast-plaid: never more centroids than training tokens (a tiny prefix of a huge corpus).
            num_centroids = min(num_centroids, rows.numel())
    return ResidualCodec.train(sample, num_centroids, nbits, niters=niters, seed=seed, matmul_dtype=matmul_dtype)
