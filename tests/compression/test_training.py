"""train_codec's ``num_documents``: a streamed build's prefix sized for the whole corpus, as ColBERT sizes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lik.compression import ResidualCodec, train_codec
from lik.compression.sampling import num_partitions, sample_document_ids


def _corpus(num_docs, d=16, seed=5, low=3, high=12):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (num_docs,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    tokens = F.normalize(torch.randn(int(cu[-1]), d, generator=g), dim=-1).half()
    return tokens, cu, lengths


def test_num_documents_sizes_k_for_the_whole_corpus():
    tokens, cu, lengths = _corpus(300)
    avg = int(lengths.sum()) / 300  # every document is sampled (16 * sqrt(120 * 300) > 300)
    assert sample_document_ids(300, seed=2).numel() == 300
    alone = train_codec(tokens, cu, 2, seed=2, niters=2)
    assert alone.num_centroids == num_partitions(300 * avg)
    codec = train_codec(tokens, cu, 2, seed=2, niters=2, num_documents=1200)
    assert codec.num_centroids == num_partitions(1200 * avg) == 2 * alone.num_centroids
    # Only K changes: the same sample trained directly with that K gives the same codec, bit for bit.
    direct = ResidualCodec.train(tokens, codec.num_centroids, 2, niters=2, seed=2)
    assert torch.equal(codec.centroids, direct.centroids)
    assert torch.equal(codec.bucket_cutoffs, direct.bucket_cutoffs)
    assert torch.equal(codec.bucket_weights, direct.bucket_weights)
    # num_documents equal to the documents given is the default.
    same = train_codec(tokens, cu, 2, seed=2, niters=2, num_documents=300)
    assert torch.equal(same.centroids, alone.centroids) and torch.equal(same.bucket_weights, alone.bucket_weights)


def test_num_documents_never_gives_more_centroids_than_tokens():
    tokens, cu, _ = _corpus(2, low=5, high=6)  # 10 tokens
    codec = train_codec(tokens, cu, 1, niters=1, num_documents=10**9)
    assert codec.num_centroids == 10
    # An explicit K is kept as given, num_documents or not.
    assert train_codec(tokens, cu, 1, niters=1, num_centroids=4, num_documents=10**9).num_centroids == 4


@pytest.mark.parametrize("bad", [299, 0, -1, 300.0, True, "300"])
def test_num_documents_refused(bad):
    tokens, cu, _ = _corpus(300)
    with pytest.raises(ValueError, match="num_documents"):
        train_codec(tokens, cu, 2, num_documents=bad)
