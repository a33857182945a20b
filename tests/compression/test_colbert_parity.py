"""Parity with the real colbert-ai (0.2.22) on CPU: its ResidualCodec's bytes and decode, its bucket training, and an
index directory written by its own CollectionIndexer (a stand-in encoder, lik's k-means in place of faiss)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("colbert.indexing.codecs.residual", reason="colbert-ai is in the test extra")

from colbert.indexing.codecs.residual import ResidualCodec as ColbertCodec  # noqa: E402
from colbert.infra.config import ColBERTConfig  # noqa: E402

from lik.compression import ResidualCodec, kmeans, load_colbert_index  # noqa: E402
from lik.compression.packing import decompression_lookup_table, reversed_bit_map  # noqa: E402


@pytest.fixture(autouse=True)
def _colbert_on_cpu(monkeypatch):
    # ColBERT picks its C++/CUDA path from the GPUs it sees at import; its Python path is the reference here.
    monkeypatch.setattr(ColBERTConfig, "total_visible_gpus", 0)


def _unit(n, d, seed):
    return F.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed)), dim=-1)


def _colbert_codec(codec: ResidualCodec, dim: int) -> ColbertCodec:
    config = ColBERTConfig(dim=dim, nbits=codec.nbits)
    assert config.total_visible_gpus == 0  # its Python (CPU) path, no C++ extension
    return ColbertCodec(
        config,
        codec.centroids,
        avg_residual=codec.avg_residual,
        bucket_cutoffs=codec.bucket_cutoffs,
        bucket_weights=codec.bucket_weights,
    )


@pytest.mark.parametrize("nbits, dim", [(1, 24), (2, 48), (4, 32), (2, 128)])
def test_bytes_and_decode_equal_colberts(nbits, dim):
    lik_codec = ResidualCodec.train(_unit(1500, dim, nbits).half(), 32, nbits, niters=4)
    theirs = _colbert_codec(lik_codec, dim)
    assert torch.equal(theirs.reversed_bit_map, reversed_bit_map(nbits))
    assert torch.equal(theirs.decompression_lookup_table, decompression_lookup_table(nbits))
    x = _unit(700, dim, 100 + nbits).half()  # ColBERT indexes fp16 tokens
    expected = theirs.compress(x)
    codes, residuals = lik_codec.compress(x)
    assert torch.equal(codes, expected.codes) and codes.dtype == expected.codes.dtype == torch.int32
    assert torch.equal(residuals, expected.residuals)  # byte for byte
    assert torch.equal(lik_codec.decompress(codes, residuals), theirs.decompress(expected))  # bit for bit
    # A code table of ColBERT's that lik did not write: random bytes, random codes.
    g = torch.Generator().manual_seed(nbits)
    table = ColbertCodec.Embeddings(
        torch.randint(0, 32, (300,), generator=g, dtype=torch.int32),
        torch.randint(0, 256, (300, dim * nbits // 8), generator=g, dtype=torch.uint8),
    )
    assert torch.equal(lik_codec.decompress(table.codes, table.residuals), theirs.decompress(table))


@pytest.mark.parametrize("nbits", [1, 2, 4])
def test_buckets_equal_colberts_training(nbits):
    from colbert.indexing.collection_indexer import CollectionIndexer

    dim = 32
    sample = _unit(2000, dim, 7).half()
    centroids = F.normalize(kmeans(sample[:1900], 16, niters=4), dim=-1)
    heldout = sample[1900:]
    indexer = object.__new__(CollectionIndexer)  # its method alone: no checkpoint, no encoder
    indexer.config, indexer.use_gpu, indexer.verbose = ColBERTConfig(dim=dim, nbits=nbits), False, 0
    cutoffs, weights, avg = indexer._compute_avg_residual(centroids, heldout)
    ours = ResidualCodec.train(sample[:1900], 16, nbits, niters=4, heldout=heldout)
    assert torch.equal(ours.centroids, centroids)
    assert torch.equal(ours.bucket_cutoffs, cutoffs) and torch.equal(ours.bucket_weights, weights)
    assert torch.equal(ours.avg_residual, avg)


class _Encoder:
    """Stands in for ColBERT's CollectionEncoder: passage ``"p<i>"`` -> fixed unit tokens (fp32 on CPU, as its)."""

    def __init__(self, tokens):
        self.tokens = tokens

    def encode_passages(self, passages):
        docs = [self.tokens[int(p[1:])] for p in passages]
        if not docs:
            return torch.empty(0, self.tokens[0].shape[1]), []
        return torch.cat(docs), [d.shape[0] for d in docs]


def _build_with_colbert(directory, docs, dim, nbits, chunksize, monkeypatch):
    import colbert.indexing.collection_indexer as indexer_module
    from colbert.data.collection import Collection
    from colbert.indexing.index_saver import IndexSaver
    from colbert.infra.config import RunConfig
    from colbert.infra.run import Run

    def faiss_free_kmeans(dim, num_partitions, kmeans_niters, shared_lists, return_value_queue=None):
        return kmeans(shared_lists[0][0].float(), num_partitions, niters=kmeans_niters, seed=123)

    monkeypatch.setattr(indexer_module, "compute_faiss_kmeans", faiss_free_kmeans)
    directory.mkdir()
    config = ColBERTConfig(dim=dim, nbits=nbits, index_path=str(directory), kmeans_niters=4)
    random.seed(0)  # ColBERT samples passages with Python's random
    torch.manual_seed(0)  # and shuffles the sample with torch's
    with Run().context(RunConfig(nranks=1, rank=0)):
        indexer = object.__new__(indexer_module.CollectionIndexer)
        indexer.verbose, indexer.config, indexer.rank, indexer.nranks, indexer.use_gpu = 0, config, 0, 1, False
        indexer.collection = Collection.cast([f"p{i}" for i in range(len(docs))])
        indexer.collection.get_chunksize = lambda: chunksize
        indexer.encoder, indexer.saver = _Encoder(docs), IndexSaver(config)
        indexer.run(shared_lists=[[None]])
    return ColbertCodec.load(str(directory))


@pytest.mark.parametrize("nbits", [2, 4])
def test_index_written_by_colbert_loads_in_lik(tmp_path, monkeypatch, capsys, nbits):
    dim = 32
    g = torch.Generator().manual_seed(nbits)
    lengths = torch.randint(1, 12, (120,), generator=g).tolist()
    lengths[5] = 0  # an empty passage
    docs = [F.normalize(torch.randn(n, dim, generator=g), dim=-1) for n in lengths]
    theirs = _build_with_colbert(tmp_path / "index", docs, dim, nbits, chunksize=50, monkeypatch=monkeypatch)
    capsys.readouterr()

    index = load_colbert_index(tmp_path / "index")
    assert index.metadata["num_chunks"] == 3
    assert index.doclens.tolist() == lengths
    assert index.codes.shape == (sum(lengths),) and index.residuals.shape == (sum(lengths), dim * nbits // 8)
    assert index.codec.nbits == nbits and index.codec.dim == dim
    assert torch.equal(index.codec.centroids, theirs.centroids.half())  # centroids.pt is fp16
    # ColBERT's own decode of the stored table equals lik's, bit for bit.
    expected = theirs.decompress(ColbertCodec.Embeddings(index.codes, index.residuals))
    assert torch.equal(index.codec.decompress(index.codes, index.residuals), expected)
    # And lik re-encoding the fp16 tokens with the loaded codec gives the stored bytes.
    codes, residuals = index.codec.compress(torch.cat(docs).half())
    assert torch.equal(codes, index.codes) and torch.equal(residuals, index.residuals)
    # The IVF maps each centroid to the passages holding one of its tokens.
    pid = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), index.ivf_lengths.cumsum(0)])
    for c in range(index.codec.num_centroids):
        listed = index.ivf[offsets[c] : offsets[c + 1]].long()
        assert torch.equal(listed, pid[index.codes == c].unique())
