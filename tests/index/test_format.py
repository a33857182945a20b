"""A saved index that is damaged, incomplete or hostile is refused with an error naming the file (and the field);
an interrupted save never leaves a directory that loads; the version-1 layout still loads."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch

import lik

from .helpers import grid_docs, read_json, record_shard, safetensors_bytes, shard_paths, write_version_1


@pytest.fixture(autouse=True)
def reference_scoring(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # these tests are about files: the reference scores


@pytest.fixture
def saved(tmp_path):
    docs = grid_docs(torch.Generator().manual_seed(7))
    index = lik.Index.build(docs, dtype=torch.float16, shard_tokens=8, progress=False)
    index.save(tmp_path / "ix", progress=False)
    return tmp_path / "ix"


def manifest_of(path):
    return read_json(path / "manifest.json")


def write_manifest(path, manifest):
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_unknown_path_and_missing_manifest(tmp_path, saved):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        lik.Index.load(tmp_path / "nowhere")
    (saved / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        lik.Index.load(saved)


def test_truncated_shard_names_the_file(saved):
    shard = shard_paths(saved)[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ValueError, match=r"shard-00001\.safetensors: shard is truncated"):
        lik.Index.load(saved)


def test_bad_checksum_names_the_file(saved):
    shard = shard_paths(saved)[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"shard-00000\.safetensors: checksum mismatch"):
        lik.Index.load(saved)
    lik.Index.load(saved, verify=False)  # the structure is intact: only the checksum catches a flipped value


def test_missing_shard_names_the_file(saved):
    shard_paths(saved)[2].unlink()
    with pytest.raises(FileNotFoundError, match=r"shard-00002\.safetensors"):
        lik.Index.load(saved)


def one_more_document_in_shard_0(manifest):
    manifest["shards"][0]["num_docs"] += 1
    manifest["num_docs"] += 1


def a_shard_with_minus_one_document(manifest):
    # The totals agree, so only a range check stops shard 1 from being skipped unopened (its documents lost).
    manifest["shards"][1]["num_docs"] = -1
    manifest["num_docs"] = sum(s["num_docs"] for s in manifest["shards"])


def nested(depth):
    return json.loads("[" * depth + "]" * depth)


@pytest.mark.parametrize(
    "edit, message",
    [
        (one_more_document_in_shard_0, r"shard-00000\.safetensors: shard holds"),
        (a_shard_with_minus_one_document, r"manifest\.json: field shards\[1\]\.'num_docs' must be an integer"),
        (lambda m: m.update(d=7), r"shard-00000\.safetensors: shard holds tokens \[\d+, 6\]"),
        (lambda m: m.update(dtype="bfloat16"), r"shard-00000\.safetensors: tensor 'tokens' is F16, expected BF16"),
        (lambda m: m.update(num_docs=3), r"manifest\.json: num_docs"),
        (lambda m: m.update(version=99), r"manifest\.json: format version 99"),
        (lambda m: m.update(version="2"), r"manifest\.json: format version '2'"),
        (lambda m: m.update(version=True), r"manifest\.json: format version True"),
        (lambda m: m.update(format="other"), r"manifest\.json: not a lik\.Index manifest"),
        (lambda m: m.update(dtype="int4"), r"manifest\.json: malformed manifest: field 'dtype'"),
        (lambda m: m.update(dtype=["float16"]), r"manifest\.json: malformed manifest: field 'dtype'"),
        (lambda m: m.update(d="6"), r"manifest\.json: field 'd' must be an integer"),
        (lambda m: m.update(d=6.0), r"manifest\.json: field 'd' must be an integer"),
        (lambda m: m.update(d=True), r"manifest\.json: field 'd' must be an integer"),
        (lambda m: m.update(d=0), r"manifest\.json: field 'd' must be an integer in \[1, "),
        (lambda m: m.pop("d"), r"manifest\.json: field 'd' is missing"),
        (lambda m: m.update(d=10**30), r"manifest\.json: field 'd' must be an integer in \[1, 2\*\*63\)"),
        (lambda m: m.update(num_tokens=None), r"manifest\.json: field 'num_tokens' must be an integer"),
        (lambda m: m.update(shards={}), r"manifest\.json: field 'shards' must be a list"),
        (lambda m: m["shards"].__setitem__(0, []), r"manifest\.json: field 'shards\[0\]' must be an object"),
        (lambda m: m["shards"][2].update(bytes=-1), r"manifest\.json: field shards\[2\]\.'bytes'"),
        (lambda m: m["shards"][0].update(num_tokens=1.5), r"manifest\.json: field shards\[0\]\.'num_tokens'"),
        (lambda m: m["shards"][0].pop("num_tokens"), r"manifest\.json: field shards\[0\]\.'num_tokens' is missing"),
        (lambda m: m["shards"][0].update(sha256=7), r"manifest\.json: field shards\[0\]\.'sha256'"),
        (lambda m: m["shards"][0].update(sha256="ab"), r"manifest\.json: field shards\[0\]\.'sha256'"),
        (lambda m: m["shards"][1].update(file=m["shards"][0]["file"]), r"'shards\[1\]\.file' names .* second time"),
        (lambda m: m.pop("generation"), r"manifest\.json: field 'generation'"),
        (lambda m: m.update(generation="../ix"), r"manifest\.json: field 'generation'"),
        (lambda m: m.update(extra=nested(400)), None),  # unknown fields are ignored, however deep
    ],
)
def test_manifest_fields_are_checked(saved, edit, message):
    manifest = manifest_of(saved)
    edit(manifest)
    write_manifest(saved, manifest)
    if message is None:
        assert len(lik.Index.load(saved)) == 10
        return
    for verify in (True, False):
        with pytest.raises(ValueError, match=message):
            lik.Index.load(saved, verify=verify)


def test_deeply_nested_manifest_is_a_value_error(saved):
    (saved / "manifest.json").write_text('{"format": "lik-index", "x": ' + "[" * 200_000 + "]" * 200_000 + "}")
    with pytest.raises(ValueError, match=r"manifest\.json: not a lik\.Index manifest \(nested too deeply\)"):
        lik.Index.load(saved)


def test_garbage_manifest(saved):
    (saved / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"manifest\.json: not valid JSON"):
        lik.Index.load(saved)
    (saved / "manifest.json").write_bytes(b'{"format": "lik-index\xff"}')
    with pytest.raises(ValueError, match=r"manifest\.json: not valid JSON"):
        lik.Index.load(saved)


@pytest.mark.parametrize("name", [
    "../other/shard-00000.safetensors", "../../other/shard-00000.safetensors", "/ABSOLUTE/shard-00000.safetensors",
    "sub/shard-00000.safetensors", "..", ".", "", "a\\b", "c:shard", " shard-00000.safetensors", 7, None,
])
def test_manifest_names_only_plain_files_inside_the_index(tmp_path, saved, name):
    # Another complete index beside this one, its shard also copied to its top: the manifest entry describes that
    # shard exactly, so only the name rule stands between the load and the other index's documents.
    other = tmp_path / "other"
    lik.Index.build([torch.ones(2, 6)] * 3, shard_tokens=100, progress=False).save(other, progress=False)
    if not (other / "shard-00000.safetensors").exists():
        shutil.copy(shard_paths(other)[0], other / "shard-00000.safetensors")
    manifest = manifest_of(saved)
    if isinstance(name, str):
        name = name.replace("/ABSOLUTE", str(other))
    manifest["shards"][0] = {**manifest_of(other)["shards"][0], "file": name}
    manifest["num_docs"] = sum(s["num_docs"] for s in manifest["shards"])
    manifest["num_tokens"] = sum(s["num_tokens"] for s in manifest["shards"])
    write_manifest(saved, manifest)
    for verify in (True, False):
        with pytest.raises(ValueError, match=r"manifest\.json: field shards\[0\]\.'file' must be a"):
            lik.Index.load(saved, verify=verify)


def test_a_link_out_of_the_index_is_not_followed(tmp_path, saved):
    outside = tmp_path / "outside.safetensors"
    shard = shard_paths(saved)[0]
    shutil.copy(shard, outside)
    shard.unlink()
    shard.symlink_to(outside)  # same bytes, same checksum: only the path rule refuses it
    with pytest.raises(ValueError, match=r"shard-00000\.safetensors: shard file resolves outside"):
        lik.Index.load(saved)
    shard.unlink()
    generation = shard.parent
    moved = tmp_path / "moved-generation"
    generation.rename(moved)
    shutil.copy(outside, moved / shard.name)
    generation.symlink_to(moved)  # the generation directory itself links out
    with pytest.raises(ValueError, match="resolves outside"):
        lik.Index.load(saved, verify=False)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_shard_that_is_not_a_regular_file_is_refused(saved, kind):
    shard = shard_paths(saved)[1]
    shard.unlink()
    if kind == "fifo":
        if not hasattr(os, "mkfifo"):
            pytest.skip("no named pipes on this platform")
        os.mkfifo(shard)  # opening it for reading would wait for a writer forever
    else:
        shard.mkdir()
    with pytest.raises(ValueError, match=r"shard-00001\.safetensors: is not a regular file"):
        lik.Index.load(saved, verify=False)


# ------------------------------------------------------------------ shard headers
TOKENS = torch.arange(12, dtype=torch.float16).reshape(2, 6)  # two documents of one token, d = 6
CU = torch.tensor([0, 1, 2], dtype=torch.int64)


def tensors_area(*tensors):
    return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)


def entries(tokens=(0, 24), cu=(24, 48), tokens_shape=(2, 6), cu_dtype="I64", tokens_dtype="F16", cu_shape=(3,)):
    return {"tokens": {"dtype": tokens_dtype, "shape": list(tokens_shape), "data_offsets": list(tokens)},
            "cu_seqlens": {"dtype": cu_dtype, "shape": list(cu_shape), "data_offsets": list(cu)}}


def with_header_length(length):
    good = safetensors_bytes(entries(), tensors_area(TOKENS, CU))
    return struct.pack("<Q", length) + good[8:]


HEADERS = {
    "negative offset": (safetensors_bytes(entries(tokens=(-24, 0)), tensors_area(TOKENS, CU)),
                        "tensor 'tokens' has malformed data_offsets"),
    "overlapping offsets": (safetensors_bytes(entries(cu=(16, 40)), tensors_area(TOKENS, CU)),
                            "shape \\[3\\] of I64 needs 24 bytes, its data_offsets span 24|overlapping"),
    "overlap with equal spans": (
        safetensors_bytes({**entries(), "extra": {"dtype": "U8", "shape": [8], "data_offsets": [20, 28]}},
                          tensors_area(TOKENS, CU)), "overlapping or with a gap"),
    "gap between tensors": (safetensors_bytes(entries(cu=(32, 56)), tensors_area(TOKENS) + bytes(8) + tensors_area(CU)),
                            "overlapping or with a gap"),
    "byte count differs from the shape": (safetensors_bytes(entries(tokens_shape=(3, 6)), tensors_area(TOKENS, CU)),
                                          "tensor 'tokens': shape \\[3, 6\\] of F16 needs 36 bytes"),
    "offsets past the end": (safetensors_bytes(entries(cu=(24, 4824), cu_shape=(600,)), tensors_area(TOKENS, CU)),
                             "data ends at byte"),
    "data past the tensors": (safetensors_bytes(entries(), tensors_area(TOKENS, CU) + bytes(16)),
                              "data ends at byte"),
    "header longer than the file": (with_header_length(1 << 40), "header length 1099511627776 exceeds the file"),
    "header length just past the file": (with_header_length(10_000), "exceeds the file"),
    "float cu_seqlens": (safetensors_bytes(entries(cu_dtype="F64"), tensors_area(TOKENS, CU.double())),
                         "tensor 'cu_seqlens' is F64, expected an integer tensor"),
    "tokens of another dtype": (safetensors_bytes(entries(tokens_dtype="BF16"), tensors_area(TOKENS, CU)),
                                "tensor 'tokens' is BF16, expected F16"),
    "unknown dtype": (safetensors_bytes(entries(tokens_dtype="Q4"), tensors_area(TOKENS, CU)),
                      "unsupported dtype 'Q4'"),
    "shape of negative size": (safetensors_bytes(entries(tokens_shape=(-2, -6)), tensors_area(TOKENS, CU)),
                               "malformed shape"),
    "no tokens": (safetensors_bytes({"cu_seqlens": entries()["cu_seqlens"] | {"data_offsets": [0, 24]}},
                                    tensors_area(CU)), "shard has no 'tokens' tensor"),
    "header is a list": (safetensors_bytes([], b""), "not a JSON object"),
    "entry with other keys": (safetensors_bytes({"tokens": {"dtype": "F16"}}, b""), "is not {dtype, shape"),
    "header not JSON": (struct.pack("<Q", 8) + b"{{{{{{{{" + bytes(8), "corrupt safetensors header"),
    "eight bytes only": (struct.pack("<Q", 0), "exceeds the file|corrupt"),
    "no header": (b"\x01\x02", "no safetensors header"),
    "cu_seqlens not ending at the tokens": (
        safetensors_bytes(entries(), tensors_area(TOKENS, torch.tensor([0, 1, 1]))), "cu_seqlens must start at 0"),
}


@pytest.mark.parametrize("case", sorted(HEADERS))
def test_shard_headers_are_validated(tmp_path, case):
    """Each shard header is checked before its bytes are used, also with verify=False (the checksum and size in
    the manifest are made to match the hostile file)."""
    lik.Index.build([TOKENS[:1].float(), TOKENS[1:].float()], out=tmp_path / "ix", progress=False)
    data, message = HEADERS[case]
    shard_paths(tmp_path / "ix")[0].write_bytes(data)
    record_shard(tmp_path / "ix", 0)
    for verify in (True, False):
        with pytest.raises(ValueError, match=r"shard-00000\.safetensors: .*(" + message + ")"):
            lik.Index.load(tmp_path / "ix", verify=verify, placement="disk")


def test_a_valid_hand_written_shard_loads(tmp_path):
    """The header rules are the safetensors format's: a file another tool wrote loads (metadata, tensor order)."""
    lik.Index.build([TOKENS[:1].float(), TOKENS[1:].float()], out=tmp_path / "ix", progress=False)
    header = {"__metadata__": {"tool": "other"}, **entries(cu=(0, 24), tokens=(24, 48))}
    shard_paths(tmp_path / "ix")[0].write_bytes(safetensors_bytes(header, tensors_area(CU, TOKENS)))
    record_shard(tmp_path / "ix", 0)
    index = lik.Index.load(tmp_path / "ix", placement="disk")
    assert torch.equal(index.segments[0].tokens, TOKENS)


def test_every_shard_header_is_checked_even_outside_the_loaded_range(saved):
    shard = shard_paths(saved)[-1]
    shard.write_bytes(b"\x00" * 8 + shard.read_bytes()[8:])  # header length 0: not a JSON object
    record_shard(saved, len(shard_paths(saved)) - 1)
    with pytest.raises(ValueError, match=shard.name):
        lik.Index.load(saved, shard=0, num_shards=4, verify=False)


# ------------------------------------------------------------------ layouts and interrupted writes
def test_version_1_layout_loads_and_is_replaced_cleanly(tmp_path):
    docs = grid_docs(torch.Generator().manual_seed(5))
    write_version_1(tmp_path / "ix", docs)
    (tmp_path / "ix" / "notes.txt").write_text("the user's own file")
    index = lik.Index.load(tmp_path / "ix", placement="disk")
    assert len(index) == len(docs)
    assert torch.equal(torch.cat([s.tokens for s in index.segments]), torch.cat(docs))
    lik.Index.build(docs[:4], progress=False).save(tmp_path / "ix", overwrite=True, progress=False)
    assert len(lik.Index.load(tmp_path / "ix")) == 4
    generation = read_json(tmp_path / "ix" / "manifest.json")["generation"]
    assert sorted(os.listdir(tmp_path / "ix")) == [generation, "manifest.json", "notes.txt"]
    # The index loaded before the replace still reads the version-1 files it opened.
    assert torch.equal(torch.cat([s.tokens for s in index.segments]), torch.cat(docs))


def test_interrupted_save_leaves_no_index(tmp_path, monkeypatch):
    docs = grid_docs(torch.Generator().manual_seed(3))
    index = lik.Index.build(docs, shard_tokens=4, progress=False)
    real_write = lik.index.storage.write_shard
    calls = []

    def failing_write(path, shard):
        calls.append(path.name)
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated interruption mid-save")
        return real_write(path, shard)

    monkeypatch.setattr("lik.index.storage.write_shard", failing_write)
    with pytest.raises(KeyboardInterrupt):
        index.save(tmp_path / "ix", progress=False)
    assert calls == ["shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"]
    assert list(tmp_path.iterdir()) == []  # neither the index nor its staging directory
    with pytest.raises(FileNotFoundError):
        lik.Index.load(tmp_path / "ix")

    # Replacing an existing index: an interrupted overwrite keeps the old one intact and loadable.
    monkeypatch.setattr("lik.index.storage.write_shard", real_write)
    old = lik.Index.build(docs[:3], progress=False)
    old.save(tmp_path / "ix", progress=False)
    monkeypatch.setattr("lik.index.storage.write_shard", failing_write)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        index.save(tmp_path / "ix", overwrite=True, progress=False)
    assert len(lik.Index.load(tmp_path / "ix")) == 3
    assert [p.name for p in tmp_path.iterdir()] == ["ix"]
    with pytest.raises(FileExistsError, match="already exists"):
        index.save(tmp_path / "ix", progress=False)
    monkeypatch.setattr("lik.index.storage.write_shard", real_write)
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
