"""Reading colbert-ai index directories: a hand-written one in its exact format, and one-line errors naming the file
for everything missing or malformed."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
import torch.nn.functional as F

from lik.compression import ResidualCodec, is_colbert_index, load_colbert_index

DIM, NBITS = 16, 2


def _write(directory, chunks=((3, 0, 2), (4,)), seed=0):
    """A colbert-ai layout written the way its savers write it (torch.save, ujson-style JSON)."""
    g = torch.Generator().manual_seed(seed)
    codec = ResidualCodec.train(F.normalize(torch.randn(400, DIM, generator=g), dim=-1), 8, NBITS, niters=3)
    directory.mkdir()
    torch.save(codec.centroids.half(), directory / "centroids.pt")
    torch.save((codec.bucket_cutoffs, codec.bucket_weights), directory / "buckets.pt")
    torch.save(torch.tensor([float(codec.avg_residual)]), directory / "avg_residual.pt")
    all_codes, passage_offset, embedding_offset = [], 0, 0
    for i, lengths in enumerate(chunks):
        tokens = F.normalize(torch.randn(sum(lengths), DIM, generator=g), dim=-1).half()
        codes, residuals = codec.compress(tokens)
        torch.save(codes, directory / f"{i}.codes.pt")
        torch.save(residuals, directory / f"{i}.residuals.pt")
        (directory / f"doclens.{i}.json").write_text(json.dumps(list(lengths)))
        meta = {"passage_offset": passage_offset, "num_passages": len(lengths), "num_embeddings": sum(lengths)}
        meta["embedding_offset"] = embedding_offset
        (directory / f"{i}.metadata.json").write_text(json.dumps(meta))
        passage_offset, embedding_offset = passage_offset + len(lengths), embedding_offset + sum(lengths)
        all_codes.append(codes)
    config = {"dim": DIM, "nbits": NBITS, "doc_maxlen": 180}
    meta = {"config": config, "num_chunks": len(chunks), "num_partitions": 8, "num_embeddings": embedding_offset}
    meta["avg_doclen"] = embedding_offset / passage_offset
    (directory / "metadata.json").write_text(json.dumps(meta))
    (directory / "plan.json").write_text(json.dumps({"config": config, "num_chunks": len(chunks)}))
    pid = torch.repeat_interleave(torch.arange(passage_offset), torch.tensor([n for c in chunks for n in c]))
    codes = torch.cat(all_codes)
    lists = [pid[codes == c].unique() for c in range(8)]
    ivf_lengths = torch.tensor([len(x) for x in lists])
    torch.save((torch.cat(lists + [torch.zeros(4, dtype=torch.int64)]), ivf_lengths), directory / "ivf.pid.pt")
    return codec, codes


def test_hand_written_index_loads(tmp_path):
    codec, codes = _write(tmp_path / "ix")
    assert is_colbert_index(tmp_path / "ix") and not is_colbert_index(tmp_path)
    index = load_colbert_index(str(tmp_path / "ix"))
    assert index.doclens.tolist() == [3, 0, 2, 4]
    assert index.cu_seqlens.tolist() == [0, 3, 3, 5, 9]
    assert torch.equal(index.codes, codes) and index.codes.dtype == torch.int32
    assert index.residuals.shape == (9, DIM * NBITS // 8)
    assert index.codec.centroids.dtype == torch.float16 and index.codec.nbits == NBITS
    assert torch.equal(index.codec.bucket_weights, codec.bucket_weights)
    assert index.ivf_lengths.shape == (8,) and int(index.ivf_lengths.sum()) <= index.ivf.shape[0]
    out = index.codec.decompress(index.codes, index.residuals)
    torch.testing.assert_close(out.norm(dim=1), torch.ones(9))
    assert torch.equal(index.decompress(), out.half())
    assert torch.equal(index.decompress(torch.float32, device="cpu"), out)


def test_index_without_ivf_or_avg_residual_loads(tmp_path):
    _write(tmp_path / "ix")
    (tmp_path / "ix" / "ivf.pid.pt").unlink()
    (tmp_path / "ix" / "avg_residual.pt").unlink()
    index = load_colbert_index(tmp_path / "ix")
    assert index.ivf is None and index.ivf_lengths is None and index.codec.avg_residual is None


def test_plan_json_alone_is_enough(tmp_path):
    _write(tmp_path / "ix")
    (tmp_path / "ix" / "metadata.json").unlink()
    assert load_colbert_index(tmp_path / "ix").codes.shape == (9,)


def _corrupt(directory, name, value):
    path = directory / name
    if value is None:
        path.unlink()
    elif isinstance(value, (bytes, str)):
        path.write_bytes(value.encode() if isinstance(value, str) else value)
    else:
        torch.save(value, path)


class _Evil:
    def __reduce__(self):
        return (print, ("pickled code ran",))


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("centroids.pt", None, "missing"),
        ("buckets.pt", None, "missing"),
        ("1.codes.pt", None, "missing"),
        ("0.residuals.pt", None, "missing"),
        ("doclens.1.json", None, "missing"),
        ("metadata.json", "{not json", "not valid JSON"),
        ("metadata.json", '{"num_chunks": 2}', "field 'config' is missing"),
        ("metadata.json", '{"config": {"dim": 12, "nbits": 2}, "num_chunks": 2}', "not a ColBERT residual layout"),
        ("metadata.json", '{"config": {"dim": 16, "nbits": 2}, "num_chunks": 0}', "'num_chunks' must be an integer"),
        (
            "metadata.json",
            '{"config": {"dim": 16, "nbits": 2}, "num_chunks": 2, "num_embeddings": 8}',
            "num_embeddings",
        ),
        ("centroids.pt", b"PK\x03\x04 truncated", "not a readable torch file"),
        ("centroids.pt", torch.zeros(8), "centroids"),
        ("centroids.pt", torch.zeros(8, 32), "expected floating centroids"),
        ("buckets.pt", torch.zeros(3), "expected a pair"),
        ("buckets.pt", (torch.zeros(2), torch.zeros(4)), "bucket_cutoffs must have 3 values"),
        ("0.codes.pt", torch.zeros(5, 1, dtype=torch.int32), r"expected codes \[n\]"),
        ("0.codes.pt", torch.full((5,), 8, dtype=torch.int32), "codes outside"),
        ("0.codes.pt", torch.zeros(5), "expected int32 or int64 codes"),
        ("0.residuals.pt", torch.zeros(5, 3, dtype=torch.uint8), r"expected uint8 \[5, 4\]"),
        ("doclens.0.json", "[3, 0, 3]", "lengths sum to 6"),
        ("doclens.0.json", '[3, "2"]', "list of non-negative integers"),
        ("ivf.pid.pt", (torch.zeros(3, dtype=torch.int64), torch.ones(8, dtype=torch.int64)), "ivf_lengths must have"),
        ("ivf.pid.pt", (torch.full((8,), 9), torch.ones(8, dtype=torch.int64)), "passage ids outside"),
        ("ivf.pid.pt", _Evil(), "not a readable torch file"),
    ],
)
def test_malformed_files_are_named(tmp_path, capsys, name, value, message):
    _write(tmp_path / "ix")
    if isinstance(value, _Evil):
        (tmp_path / "ix" / name).write_bytes(pickle.dumps(value, protocol=2))
    else:
        _corrupt(tmp_path / "ix", name, value)
    error = FileNotFoundError if value is None else ValueError
    with pytest.raises(error, match=message) as raised:
        load_colbert_index(tmp_path / "ix")
    assert str(tmp_path / "ix" / name) in str(raised.value)
    assert "\n" not in str(raised.value)
    assert "pickled code ran" not in capsys.readouterr().out


def test_not_a_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_colbert_index(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="metadata.json: missing"):
        load_colbert_index(tmp_path / "empty")
