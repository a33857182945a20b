"""A saved index that is damaged or incomplete is refused with an error naming the file or argument; an
interrupted save never leaves a directory that loads."""

from __future__ import annotations

import json

import pytest
import torch

import lik
from lik.index import format as index_format

from .helpers import grid_docs


@pytest.fixture
def saved(tmp_path):
    docs = grid_docs(torch.Generator().manual_seed(7))
    index = lik.Index.build(docs, dtype=torch.float16, shard_tokens=8, progress=False)
    index.save(tmp_path / "ix", progress=False)
    return tmp_path / "ix"


def manifest_of(path):
    return json.loads((path / "manifest.json").read_text())


def test_unknown_path_and_missing_manifest(tmp_path, saved):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        lik.Index.load(tmp_path / "nowhere")
    (saved / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        lik.Index.load(saved)


def test_truncated_shard_names_the_file(saved):
    shard = saved / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ValueError, match=r"shard-00001\.safetensors: shard is truncated"):
        lik.Index.load(saved)


def test_bad_checksum_names_the_file(saved):
    shard = saved / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"shard-00000\.safetensors: checksum mismatch"):
        lik.Index.load(saved)
    lik.Index.load(saved, verify=False)  # the structure is intact: only the checksum catches a flipped value


def test_missing_shard_names_the_file(saved):
    (saved / "shard-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"shard-00002\.safetensors"):
        lik.Index.load(saved)


def one_more_document_in_shard_0(manifest):
    manifest["shards"][0]["num_docs"] += 1
    manifest["num_docs"] += 1


@pytest.mark.parametrize(
    "edit, message",
    [
        (one_more_document_in_shard_0, r"shard-00000\.safetensors: shard holds"),
        (lambda m: m.update(d=7), r"shard-00000\.safetensors: tokens are"),
        (lambda m: m.update(dtype="bfloat16"), r"shard-00000\.safetensors: tokens are"),
        (lambda m: m.update(num_docs=3), r"manifest\.json: num_docs"),
        (lambda m: m.update(version=99), r"manifest\.json: format version 99"),
        (lambda m: m.update(format="other"), r"manifest\.json: not a lik\.Index manifest"),
        (lambda m: m.update(dtype="int4"), r"manifest\.json: malformed"),
    ],
)
def test_manifest_that_does_not_match_its_shards(saved, edit, message):
    manifest = manifest_of(saved)
    edit(manifest)
    (saved / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=message):
        lik.Index.load(saved)


def test_garbage_manifest(saved):
    (saved / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"manifest\.json: not valid JSON"):
        lik.Index.load(saved)


def test_interrupted_save_leaves_no_index(tmp_path, monkeypatch):
    docs = grid_docs(torch.Generator().manual_seed(3))
    index = lik.Index.build(docs, shard_tokens=4, progress=False)
    real_write = index_format.write_shard
    calls = []

    def failing_write(directory, number, shard):
        calls.append(number)
        if number == 2:
            raise KeyboardInterrupt("simulated interruption mid-save")
        return real_write(directory, number, shard)

    monkeypatch.setattr("lik.index.index.write_shard", failing_write)
    with pytest.raises(KeyboardInterrupt):
        index.save(tmp_path / "ix", progress=False)
    assert calls == [0, 1, 2]
    assert list(tmp_path.iterdir()) == []  # neither the index nor its temporary directory
    with pytest.raises(FileNotFoundError):
        lik.Index.load(tmp_path / "ix")

    # Replacing an existing index: an interrupted overwrite keeps the old one intact and loadable.
    monkeypatch.setattr("lik.index.index.write_shard", real_write)
    old = lik.Index.build(docs[:3], progress=False)
    old.save(tmp_path / "ix", progress=False)
    monkeypatch.setattr("lik.index.index.write_shard", failing_write)
    with pytest.raises(KeyboardInterrupt):
        index.save(tmp_path / "ix", overwrite=True, progress=False)
    assert len(lik.Index.load(tmp_path / "ix")) == 3
    assert [p.name for p in tmp_path.iterdir()] == ["ix"]
    with pytest.raises(FileExistsError, match="already exists"):
        index.save(tmp_path / "ix", progress=False)
    monkeypatch.setattr("lik.index.index.write_shard", real_write)
    index.save(tmp_path / "ix", overwrite=True, progress=False)
    assert len(lik.Index.load(tmp_path / "ix")) == len(docs)


def test_interrupted_streaming_build_leaves_no_index(tmp_path):
    def docs():
        yield torch.randn(3, 4)
        yield torch.randn(2, 4)
        raise RuntimeError("the embedding job died")

    with pytest.raises(RuntimeError, match="embedding job died"):
        lik.Index.build(docs(), out=tmp_path / "ix", shard_tokens=2, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_wrong_d_in_a_streamed_build_names_the_document(tmp_path):
    with pytest.raises(ValueError, match=r"docs\[2\] has d=5"):
        lik.Index.build([torch.randn(2, 4), torch.randn(1, 4), torch.randn(3, 5)], out=tmp_path / "ix",
                        progress=False)
    assert list(tmp_path.iterdir()) == []
