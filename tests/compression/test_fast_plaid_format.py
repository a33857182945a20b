"""Reading fast-plaid index directories (written here by hand in the layout of its Rust ``create_index``), and
``load_plaid_index`` telling the two formats apart."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lik.compression import (
    ResidualCodec,
    is_fast_plaid_index,
    load_colbert_index,
    load_fast_plaid_index,
    load_plaid_index,
    unpack_residual_bits,
)

from .test_colbert_format import _write as write_colbert

DIM, NBITS, K = 32, 4, 8


def _write(directory, chunks=((2, 5), (0, 3, 1)), seed=0, lengths_size=K):
    g = torch.Generator().manual_seed(seed)
    codec = ResidualCodec.train(F.normalize(torch.randn(500, DIM, generator=g), dim=-1), K, NBITS, niters=3)
    directory.mkdir()
    np.save(directory / "centroids.npy", codec.centroids.numpy())  # fast-plaid's k-means returns fp32
    np.save(directory / "bucket_cutoffs.npy", codec.bucket_cutoffs.numpy())
    np.save(directory / "bucket_weights.npy", codec.bucket_weights.numpy())
    np.save(directory / "avg_residual.npy", np.full(DIM, 0.05, dtype=np.float32))
    np.save(directory / "cluster_threshold.npy", np.float32(0.3))
    (directory / "plan.json").write_text(json.dumps({"nbits": NBITS, "num_chunks": len(chunks)}))
    all_codes, tokens, offset = [], [], 0
    for i, lengths in enumerate(chunks):
        x = F.normalize(torch.randn(sum(lengths), DIM, generator=g), dim=-1).half()
        codes, residuals = codec.compress(x)
        np.save(directory / f"{i}.codes.npy", codes.long().numpy())  # argmax: int64
        np.save(directory / f"{i}.residuals.npy", residuals.numpy())
        (directory / f"doclens.{i}.json").write_text(json.dumps(list(lengths)))
        meta = {"num_documents": len(lengths), "num_embeddings": sum(lengths), "embedding_offset": offset}
        (directory / f"{i}.metadata.json").write_text(json.dumps(meta, indent=2))
        offset += sum(lengths)
        all_codes.append(codes)
        tokens.append(x)
    num_docs = sum(len(c) for c in chunks)
    pid = torch.repeat_interleave(torch.arange(num_docs), torch.tensor([n for c in chunks for n in c]))
    codes = torch.cat(all_codes).long()
    lists = [pid[codes == c].unique() for c in range(lengths_size)]
    np.save(directory / "ivf.npy", torch.cat(lists).numpy().astype(np.int64))
    np.save(directory / "ivf_lengths.npy", np.array([len(x) for x in lists], dtype=np.int32))
    meta = {"num_chunks": len(chunks), "nbits": NBITS, "num_partitions": lengths_size, "num_embeddings": offset}
    meta.update(avg_doclen=offset / num_docs, num_documents=num_docs)
    (directory / "metadata.json").write_text(json.dumps(meta, indent=2))
    return codec, codes, torch.cat(tokens)


def _fast_plaid_decode(index):
    """fast-plaid's decompress_residuals as its loader runs it: fp16 centroids + fp16 weights, then x / |x|."""
    buckets = unpack_residual_bits(index.residuals, index.codec.nbits).long()
    x = index.codec.centroids.half()[index.codes.long()] + index.codec.bucket_weights.half()[buckets]
    return x / x.float().norm(dim=-1, keepdim=True).clamp_min(1e-12).half()


def test_hand_written_index_loads(tmp_path):
    codec, codes, tokens = _write(tmp_path / "fp")
    assert is_fast_plaid_index(tmp_path / "fp")
    for index in (load_fast_plaid_index(tmp_path / "fp"), load_plaid_index(str(tmp_path / "fp"))):
        assert index.source == "fast-plaid"
        assert index.doclens.tolist() == [2, 5, 0, 3, 1] and index.cu_seqlens[-1] == 11
        assert torch.equal(index.codes, codes.int()) and index.codes.dtype == torch.int32
        assert index.codec.centroids.dtype == torch.float16 and index.codec.bucket_weights.dtype == torch.float16
        assert index.codec.avg_residual.shape == (DIM,)
        assert index.ivf_lengths.dtype == torch.int64 and int(index.ivf_lengths.sum()) == index.ivf.shape[0]
    out = index.codec.decompress(index.codes, index.residuals)
    torch.testing.assert_close(out, _fast_plaid_decode(index).float(), atol=2e-3, rtol=0)
    assert (out - tokens.float()).norm(dim=1).max() < 0.5  # a 4-bit decode is near the token


def test_ivf_lengths_longer_or_shorter_than_the_centroids(tmp_path):
    _write(tmp_path / "long", lengths_size=K + 3)  # fast-plaid's estimate above the centroids trained
    assert load_fast_plaid_index(tmp_path / "long").ivf_lengths.shape == (K,)
    _write(tmp_path / "short", seed=1)
    lengths = np.load(tmp_path / "short" / "ivf_lengths.npy")
    np.save(tmp_path / "short" / "ivf_lengths.npy", lengths[: int(np.nonzero(lengths)[0].max()) + 1])
    index = load_fast_plaid_index(tmp_path / "short")
    assert index.ivf_lengths.shape == (K,) and index.ivf_lengths.tolist() == lengths.tolist()


def test_compress_only_index_has_no_ivf(tmp_path):
    _write(tmp_path / "fp")
    (tmp_path / "fp" / "ivf.npy").unlink()
    (tmp_path / "fp" / "ivf_lengths.npy").unlink()
    assert load_fast_plaid_index(tmp_path / "fp").ivf is None


def test_load_plaid_index_dispatches(tmp_path):
    write_colbert(tmp_path / "cb")
    assert load_plaid_index(tmp_path / "cb").source == "colbert"
    assert load_plaid_index(tmp_path / "cb").codes.shape == load_colbert_index(tmp_path / "cb").codes.shape
    (tmp_path / "neither").mkdir()
    with pytest.raises(ValueError, match="neither a colbert-ai index"):
        load_plaid_index(tmp_path / "neither")


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("centroids.npy", None, "missing"),
        ("1.residuals.npy", None, "missing"),
        ("doclens.0.json", None, "missing"),
        ("metadata.json", '{"nbits": 3, "num_chunks": 2}', "'nbits' must be 1, 2 or 4"),
        ("metadata.json", '{"nbits": 4}', "'num_chunks' must be an integer"),
        ("centroids.npy", np.zeros((8, 12), np.float32), "d a multiple of 8"),
        ("centroids.npy", np.array(["a", "b"], dtype=object), "not a readable .npy array"),
        ("centroids.npy", b"\x93NUMPY garbage", "not a readable .npy array"),
        ("bucket_weights.npy", np.zeros(4, np.float32), "expected 16 floats"),
        ("0.codes.npy", np.full(7, K, np.int64), "codes outside"),
        ("0.codes.npy", np.zeros(7, np.float32), "expected int32 or int64 codes"),
        ("0.residuals.npy", np.zeros((7, 3), np.uint8), r"expected uint8 \[7, 16\]"),
        ("doclens.1.json", "[1, 1]", "lengths sum to 2"),
        ("ivf_lengths.npy", np.zeros(K, np.int32), "sum to"),
        ("ivf.npy", None, "missing"),
        ("ivf.npy", "IVF", "not a readable .npy array"),
    ],
)
def test_malformed_files_are_named(tmp_path, name, value, message):
    _write(tmp_path / "fp")
    path = tmp_path / "fp" / name
    if value is None:
        path.unlink()
    elif isinstance(value, (str, bytes)):
        path.write_bytes(value.encode() if isinstance(value, str) else value)
    else:
        np.save(path, value, allow_pickle=True)
    with pytest.raises(FileNotFoundError if value is None else ValueError, match=message) as raised:
        load_fast_plaid_index(tmp_path / "fp")
    assert str(path) in str(raised.value) and "\n" not in str(raised.value)
