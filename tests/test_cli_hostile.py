"""The ``lik`` command against hostile and malformed input: every subcommand, every file it reads or writes.

Each refusal is checked the same way: the exit status (2: the command line was refused before any work, 1: a
file could not be used), exactly one line on stderr that names the file or flag, and the directory tree around
the command byte for byte as it was (nothing written, nothing deleted). Scoring runs the PyTorch reference here
(``TRITON_INTERPRET=0``): these tests are about the command line; the kernels are tested elsewhere.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import lik
from lik import cli, demo
from lik.index import commands
from lik.index.commands import CommandError, format_rate

from .index.helpers import grid_docs, grid_queries


@pytest.fixture(autouse=True)
def reference_scoring(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("LIK_DEBUG", raising=False)


@pytest.fixture
def work(tmp_path):
    """A folder with documents (``docs.pt``), queries (``queries.pt``) and a saved index of the documents (``ix``)."""
    rng = torch.Generator().manual_seed(60)
    docs = grid_docs(rng)
    torch.save(docs, tmp_path / "docs.pt")
    torch.save(grid_queries(rng), tmp_path / "queries.pt")
    lik.Index.build(docs, dtype=torch.float32, out=tmp_path / "ix", progress=False)
    return tmp_path


def tree(root: Path) -> dict:
    """Every path under ``root``: directories, links (by target) and files (by content digest)."""
    snapshot = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder, name)
            key = str(path.relative_to(root))
            if path.is_symlink():
                snapshot[key] = ("link", os.readlink(path))
            elif path.is_dir():
                snapshot[key] = ("dir",)
            else:
                snapshot[key] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
    return snapshot


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, root: Path, code: int, argv: list, *names) -> str:
    """Run ``argv``; expect exit ``code``, one error line naming each of ``names``, and ``root`` untouched."""
    before = tree(root)
    got, _, err = run(capsys, *argv)
    assert got == code, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    line = err.rstrip("\n")
    assert re.match(r"lik( index)?( \w+)?: error: ", line), line
    for name in names:
        assert str(name) in line, line
    assert tree(root) == before
    return line


def with_pickle(path: Path, payload: bytes) -> Path:
    """A torch.save zip file whose pickle is ``payload``."""
    torch.save(torch.zeros(4, 3), path)
    original = path.read_bytes()
    with zipfile.ZipFile(path.with_suffix(".tmp"), "w") as out, zipfile.ZipFile(path) as source:
        for info in source.infolist():
            out.writestr(info, payload if info.filename.endswith("data.pkl") else source.read(info.filename))
    path.with_suffix(".tmp").replace(path)
    assert path.read_bytes() != original
    return path


def tensor_pickle(tmp_path: Path, *replacements) -> Path:
    """``torch.save(torch.zeros(4, 3))`` with each ``(pattern, replacement function)`` applied to its pickle."""
    torch.save(torch.zeros(4, 3), tmp_path / "plain.pt")
    with zipfile.ZipFile(tmp_path / "plain.pt") as source:
        payload = source.read(next(n for n in source.namelist() if n.endswith("data.pkl")))
    for old, new in replacements:
        assert re.search(old, payload)
        payload = re.sub(old, new, payload, count=1)
    (tmp_path / "plain.pt").unlink()
    return with_pickle(tmp_path / "forged.pt", payload)


class OpensAFile:
    """Unpickling this with plain pickle would create the file: weights_only loading must refuse it."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def raw_safetensors(path: Path, header: bytes, data: bytes = b"", length: int | None = None) -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return path


def _int32(value: int) -> bytes:
    return b"J" + struct.pack("<i", value)


# ---------------------------------------------------------------------------------------------- untrusted files
def test_a_pickle_that_runs_code_is_refused_for_documents_and_queries(work, capsys):
    marker = work / "created-by-the-pickle"
    torch.save([torch.zeros(2, 6), OpensAFile(marker)], work / "evil.pt")
    refused(capsys, work, 1, ["index", "build", work / "evil.pt", "--out", work / "new"], "evil.pt", "weights_only")
    refused(capsys, work, 1, ["search", work / "ix", "--queries", work / "evil.pt"], "evil.pt")
    assert not marker.exists()


@pytest.mark.parametrize("name, make", [
    ("legacy", lambda d: torch.save([torch.zeros(2, 6)], d / "f.pt", _use_new_zipfile_serialization=False)),
    ("random bytes", lambda d: (d / "f.pt").write_bytes(os.urandom(300))),
    ("empty", lambda d: (d / "f.pt").write_bytes(b"")),
    ("truncated zip", lambda d: (torch.save([torch.zeros(2, 6)], d / "f.pt"),
                                 (d / "f.pt").write_bytes((d / "f.pt").read_bytes()[:-40]))),
    ("text", lambda d: (d / "f.pt").write_text("not a tensor file")),
])
def test_files_that_are_not_torch_save_zips_are_refused(work, capsys, name, make):
    make(work)
    refused(capsys, work, 1, ["index", "build", work / "f.pt", "--out", work / "new"], "f.pt")


@pytest.mark.parametrize("storage", [False, True], ids=["shape", "shape and storage"])
def test_huge_declared_shapes_are_refused_without_allocating(work, capsys, storage):
    # A [2^20, 2^20] float32 tensor (4 TiB) over the file's 12 values, its storage declared 2^40 bytes or not:
    # sizes come from the file, so the reader fails on the shape rather than trying to allocate it.
    shape = (rb"K\x04K\x03\x86", lambda match: _int32(1 << 20) + _int32(1 << 20) + b"\x86")
    numel = (rb"(cpuq.)K\x0c", lambda match: match.group(1) + b"\x8a\x08" + struct.pack("<q", 1 << 40))
    forged = tensor_pickle(work, shape, *([numel] if storage else []))
    for argv in (["index", "build", forged, "--out", work / "new"], ["search", work / "ix", "--queries", forged]):
        assert "allocate" not in refused(capsys, work, 1, argv, "forged.pt")


def test_deeply_nested_pickles_are_refused(work, capsys):
    depth = 100_000  # lists inside lists, built without recursion by the pickle's opcodes
    with_pickle(work / "nested.pt", b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b".")
    refused(capsys, work, 1, ["index", "build", work / "nested.pt", "--out", work / "new"], "nested.pt", "list")


@pytest.mark.parametrize("header, data, length", [
    (b'{"t": {"dtype": "F32", "shape": [1099511627776, 128], "data_offsets": [0, 16]}}', b"\0" * 16, None),
    (b"{}", b"", 1 << 62),
    (b'{"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}', b"\0" * 7, None),
    (b"not json", b"", None),
    (b"", b"", 0),
    (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
     b'"b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', b"\0" * 8, None),
], ids=["huge shape", "huge header", "truncated", "not json", "empty header", "overlapping"])
def test_malformed_safetensors_are_refused(work, capsys, header, data, length):
    path = raw_safetensors(work / "bad.safetensors", header, data, length)
    refused(capsys, work, 1, ["index", "build", path, "--out", work / "new"], "bad.safetensors")
    refused(capsys, work, 1, ["search", work / "ix", "--queries", path], "bad.safetensors")


# ---------------------------------------------------------------------------------------------- layouts
E, M = torch.randn(3, 4, 6), torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0], [0, 0, 0, 1]])
T = torch.randn(5, 6)
BAD_LAYOUTS = {
    "single [L, d] tensor": (torch.randn(4, 6), "[N, L, d]"),
    "integer tokens": ([torch.ones(2, 6, dtype=torch.int64)], "int64"),
    "complex tokens": ([torch.randn(2, 6, dtype=torch.complex64)], "complex64"),
    "list of 3-D": ([torch.randn(1, 2, 6)], "item 0"),
    "list holding a number": ([torch.randn(2, 6), 3], "item 1"),
    "d = 0": ([torch.randn(2, 0)], "d must be >= 1"),
    "widths differ": ([torch.randn(2, 6), torch.randn(2, 5)], "d=6 and d=5"),
    "sparse": ([torch.randn(2, 6).to_sparse()], "dense"),
    "no positions": (torch.randn(3, 0, 6), "L = 0"),
    "a string": ("embeddings", "str"),
    "non-string keys": ({1: torch.randn(2, 6)}, "keys must be strings"),
    "float mask": ({"embeddings": E, "mask": M.float()}, "'mask'"),
    "mask of 2s": ({"embeddings": E, "mask": M * 2}, "'mask' holds 2"),
    "mask of -1s": ({"embeddings": E, "mask": -M}, "'mask' holds -1"),
    "mask shape": ({"embeddings": E, "mask": M[:, :3]}, "'mask' has shape [3, 3]"),
    "mask alone": ({"mask": M}, "'embeddings'"),
    "extra key": ({"embeddings": E, "ids": torch.arange(3)}, "'ids'"),
    "cu_seqlens decreasing": ({"tokens": T, "cu_seqlens": torch.tensor([0, 3, 2, 5])}, "decreases at position 2"),
    "cu_seqlens past the end": ({"tokens": T, "cu_seqlens": torch.tensor([0, 3, 9])}, "ends at 9"),
    "cu_seqlens short": ({"tokens": T, "cu_seqlens": torch.tensor([0, 3, 4])}, "ends at 4"),
    "cu_seqlens not from 0": ({"tokens": T, "cu_seqlens": torch.tensor([1, 3, 5])}, "starts at 1"),
    "cu_seqlens float": ({"tokens": T, "cu_seqlens": torch.tensor([0.0, 3.0, 5.0])}, "float32"),
    "cu_seqlens bool": ({"tokens": T, "cu_seqlens": torch.tensor([False, True])}, "bool"),
    "cu_seqlens 2-D": ({"tokens": T, "cu_seqlens": torch.tensor([[0, 5]])}, "[N + 1]"),
    "cu_seqlens empty": ({"tokens": T, "cu_seqlens": torch.zeros(0, dtype=torch.int64)}, "empty"),
    "tokens without cu_seqlens": ({"tokens": T}, "'cu_seqlens'"),
}


@pytest.mark.parametrize("name", BAD_LAYOUTS)
def test_bad_layouts_are_refused_by_name(work, capsys, name):
    data, expected = BAD_LAYOUTS[name]
    torch.save(data, work / "bad.pt")
    line = refused(capsys, work, 1, ["index", "build", work / "bad.pt", "--out", work / "new"], "bad.pt", expected)
    if "cu_seqlens" in name:
        assert "cu_seqlens" in line


@pytest.mark.parametrize("name", [n for n in BAD_LAYOUTS if isinstance(BAD_LAYOUTS[n][0], dict)
                                  and all(isinstance(k, str) for k in BAD_LAYOUTS[n][0])])
def test_bad_layouts_are_refused_the_same_way_from_safetensors(work, capsys, name):
    data, expected = BAD_LAYOUTS[name]
    save_file({k: v.contiguous() for k, v in data.items()}, str(work / "bad.safetensors"))
    refused(capsys, work, 1, ["index", "build", work / "bad.safetensors", "--out", work / "new"], "bad.safetensors",
            expected)


def test_files_of_different_widths_are_refused_naming_both(work, capsys):
    torch.save([torch.randn(2, 5)], work / "narrow.pt")
    refused(capsys, work, 1, ["index", "build", work / "docs.pt", work / "narrow.pt", "--out", work / "new"],
            "narrow.pt", "docs.pt")


def test_files_without_documents_are_refused(work, capsys):
    torch.save([], work / "empty.pt")
    refused(capsys, work, 1, ["index", "build", work / "empty.pt", "--out", work / "new"], "empty.pt", "no documents")
    refused(capsys, work, 1, ["search", work / "ix", "--queries", work / "empty.pt"], "empty.pt", "no queries")


@pytest.mark.parametrize("mask_dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_integer_masks_select_tokens(work, capsys, mask_dtype, suffix):
    # A Hugging Face attention_mask: 1 keeps a position, 0 drops it; it is never an index of rows.
    embeddings = torch.arange(3 * 4 * 6, dtype=torch.float32).reshape(3, 4, 6) / 50
    mask = M.to(mask_dtype)
    path = work / f"hf{suffix}"
    if suffix == ".pt":
        torch.save({"embeddings": embeddings, "mask": mask}, path)
    else:
        save_file({"embeddings": embeddings, "mask": mask}, str(path))
    assert run(capsys, "index", "build", path, "--out", work / "new", "--dtype", "float32")[0] == 0
    expected = [embeddings[0, [0, 2, 3]], embeddings[1, [0, 1]], embeddings[2, [3]]]
    Q = torch.randn(2, 3, 6)
    got = lik.Index.load(work / "new").search(Q, 3)
    want = lik.Index.build(expected, dtype=torch.float32, progress=False).search(Q, 3)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_queries_as_one_tensor_from_safetensors_and_pt_alike(work, capsys):
    Q = torch.load(work / "queries.pt")
    save_file({"queries": Q}, str(work / "queries.safetensors"))
    code, from_pt, _ = run(capsys, "search", work / "ix", "--queries", work / "queries.pt", "--k", "3")
    assert code == 0
    code, from_safetensors, _ = run(capsys, "search", work / "ix", "--queries", work / "queries.safetensors",
                                    "--k", "3")
    assert code == 0
    hits = [line for line in from_pt.splitlines() if line.startswith("query ")]
    assert len(hits) == Q.shape[0] and hits == [ln for ln in from_safetensors.splitlines() if ln.startswith("query ")]


def test_throughput_units_fit_small_runs(work, capsys):
    code, out, _ = run(capsys, "search", work / "ix", "--queries", work / "queries.pt", "--k", "2")
    assert code == 0 and "document tokens/s" in out and not re.search(r" 0\.0+ [kMG]?\w", out.splitlines()[-1])
    assert format_rate(453, 1.0, "tokens") == "453 tokens/s"
    assert format_rate(12_345, 1.0, "tokens") == "12.3 k tokens/s"
    assert format_rate(4_560_000, 1.0, "tokens") == "4.56 M tokens/s"
    assert format_rate(3e9, 2.0, "tokens") == "1.50 G tokens/s"
    assert format_rate(0, 1.0, "queries") == "0.00 queries/s"


# ---------------------------------------------------------------------------------------------- lik index build --out
def test_overwrite_never_replaces_a_directory_that_is_not_an_index(tmp_path, capsys):
    project = tmp_path / "project"
    project.mkdir()
    torch.save(grid_docs(torch.Generator().manual_seed(1)), project / "embeddings.pt")
    (project / "notes.txt").write_text("the user's own file")
    refused(capsys, tmp_path, 2, ["index", "build", project / "embeddings.pt", "--out", project, "--overwrite"],
            "--out", "not a lik index")


def test_overwrite_never_deletes_an_input_inside_the_index(work, capsys):
    (work / "ix" / "docs.pt").write_bytes((work / "docs.pt").read_bytes())
    refused(capsys, work, 2, ["index", "build", work / "ix" / "docs.pt", "--out", work / "ix", "--overwrite"],
            "--out", "docs.pt")
    (work / "ix" / "docs.pt").unlink()
    (work / "ix" / "docs.pt").write_bytes((work / "docs.pt").read_bytes())
    os.symlink(work / "ix" / "docs.pt", work / "link.pt")
    refused(capsys, work, 2, ["index", "build", work / "link.pt", "--out", work / "ix", "--overwrite"], "link.pt")


@pytest.mark.parametrize("kind", ["index without --overwrite", "file", "symlink", "under a file"])
def test_out_paths_that_must_not_be_written_are_refused_up_front(work, capsys, kind):
    out = {"index without --overwrite": work / "ix", "file": work / "docs.pt", "symlink": work / "alias",
           "under a file": work / "queries.pt" / "ix"}[kind]
    if kind == "symlink":
        os.symlink(work / "ix", out)
    extra = ["--overwrite"] if kind != "index without --overwrite" else []
    line = refused(capsys, work, 2, ["index", "build", work / "docs.pt", "--out", out, *extra], f"--out {out}")
    if kind == "index without --overwrite":
        assert "pass --overwrite" in line and "overwrite=True" not in line


def test_overwrite_replaces_an_index_and_touches_nothing_else(work, capsys):
    before = tree(work)
    torch.save([torch.ones(3, 6)], work / "one.pt")
    code, out, _ = run(capsys, "index", "build", work / "one.pt", "--out", work / "ix", "--overwrite")
    assert code == 0 and "1 documents" in out
    assert len(lik.Index.load(work / "ix")) == 1
    after = tree(work)

    def outside(snapshot):
        return {k: v for k, v in snapshot.items() if k.split(os.sep)[0] not in ("ix", "one.pt")}

    assert outside(after) == outside(before)


def test_an_out_directory_that_appears_during_the_build_is_kept(work, capsys, monkeypatch):
    read = commands.read_embeddings

    def read_while_someone_writes(path):
        yield from read(path)
        (work / "new").mkdir()
        (work / "new" / "notes.txt").write_text("the user's own file")

    monkeypatch.setattr(commands, "read_embeddings", read_while_someone_writes)
    before = tree(work)
    code, _, err = run(capsys, "index", "build", work / "docs.pt", "--out", work / "new")
    assert code == 1 and len(err.splitlines()) == 1 and "--out" in err and "--overwrite" in err, err
    after = tree(work)
    assert set(after) - set(before) == {"new", os.path.join("new", "notes.txt")}
    assert {k: after[k] for k in before} == before


def test_a_failing_build_leaves_nothing_behind(work, capsys):
    torch.save({"tokens": T, "cu_seqlens": torch.tensor([0, 9])}, work / "bad.pt")
    refused(capsys, work, 1, ["index", "build", work / "docs.pt", work / "bad.pt", "--out", work / "new"], "bad.pt")
    refused(capsys, work, 1, ["index", "build", work / "docs.pt", work / "bad.pt", "--out", work / "ix",
                              "--overwrite"], "bad.pt")


def test_build_flags_are_checked(work, capsys):
    refused(capsys, work, 2, ["index", "build", work / "docs.pt", "--out", work / "n", "--shard-tokens", "0"],
            "--shard-tokens")
    refused(capsys, work, 2, ["index", "build", work / "docs.txt", "--out", work / "n"], "docs.txt")
    refused(capsys, work, 2, ["index", "build", work / "docs.pt"], "--out")
    refused(capsys, work, 2, ["index", "build", work, "--out", work / "n"], "not a readable file")
    (work / "docs.npy").write_bytes(b"")
    refused(capsys, work, 2, ["index", "build", work / "docs.npy", "--out", work / "n"], "docs.npy", ".safetensors")


# ---------------------------------------------------------------------------------------------- lik search --output
def _no_index_load(monkeypatch):
    """Make loading the index fail the test: a refusal must come before any work."""
    monkeypatch.setattr(lik.Index, "load", classmethod(lambda cls, *a, **k: pytest.fail("the index was loaded")))


@pytest.mark.parametrize("kind", ["existing", "manifest", "inside the index", "queries", "directory", "symlink",
                                  "missing parent", "dangling symlink"])
def test_output_paths_are_refused_before_searching(work, capsys, monkeypatch, kind):
    (work / "results.pt").write_text("the user's earlier results")
    output = {"existing": work / "results.pt", "manifest": work / "ix" / "manifest.json",
              "inside the index": work / "ix" / "hits.pt", "queries": work / "queries.pt", "directory": work,
              "symlink": work / "alias.pt", "missing parent": work / "nowhere" / "hits.pt",
              "dangling symlink": work / "dangling.pt"}[kind]
    if kind == "symlink":
        os.symlink(work / "results.pt", output)
    if kind == "dangling symlink":
        os.symlink(work / "nothing-here.pt", output)
    _no_index_load(monkeypatch)
    extra = [] if kind == "existing" else ["--overwrite"]
    line = refused(capsys, work, 2, ["search", work / "ix", "--queries", work / "queries.pt", "--output", output,
                                     *extra], "--output")
    if kind == "existing":
        assert "--overwrite" in line


def test_output_in_a_read_only_directory_is_refused(work, capsys, monkeypatch):
    locked = work / "locked"
    locked.mkdir(mode=0o500)
    access = os.access
    # What os.access answers an unprivileged user (root may write anywhere, and tests may run as root).
    monkeypatch.setattr(os, "access", lambda path, mode: access(path, mode) and not (
        Path(path) == locked and mode & os.W_OK))
    _no_index_load(monkeypatch)
    refused(capsys, work, 2, ["search", work / "ix", "--queries", work / "queries.pt", "--output",
                              locked / "hits.pt"], "--output", "writable")
    refused(capsys, work, 2, ["index", "build", work / "docs.pt", "--out", locked / "ix"], "--out", "writable")


def test_an_empty_directory_is_replaced_only_with_overwrite(work, capsys):
    (work / "empty").mkdir()
    refused(capsys, work, 2, ["index", "build", work / "docs.pt", "--out", work / "empty"], "--overwrite")
    assert run(capsys, "index", "build", work / "docs.pt", "--out", work / "empty", "--overwrite")[0] == 0
    assert len(lik.Index.load(work / "empty")) == 10


def test_output_is_written_whole_and_replaced_only_with_overwrite(work, capsys):
    before = tree(work)
    code, _, _ = run(capsys, "search", work / "ix", "--queries", work / "queries.pt", "--k", "2",
                     "--output", work / "hits.pt")
    assert code == 0 and set(tree(work)) - set(before) == {"hits.pt"}
    first = torch.load(work / "hits.pt")
    assert first["ids"].shape == (3, 2)
    code, _, _ = run(capsys, "search", work / "ix", "--queries", work / "queries.pt", "--k", "3",
                     "--output", work / "hits.pt", "--overwrite")
    assert code == 0 and torch.load(work / "hits.pt")["ids"].shape == (3, 3)
    assert set(tree(work)) - set(before) == {"hits.pt"}


def test_a_failed_write_leaves_no_partial_output(work, capsys, monkeypatch):
    def disk_full(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    refused(capsys, work, 1, ["search", work / "ix", "--queries", work / "queries.pt", "--output", work / "hits.pt"],
            "--output", "No space left")


def test_an_output_that_appears_during_the_search_is_not_replaced(work, capsys, monkeypatch):
    search = lik.Index.search

    def search_while_someone_writes(self, *args, **kwargs):
        (work / "hits.pt").write_text("written by someone else meanwhile")
        return search(self, *args, **kwargs)

    monkeypatch.setattr(lik.Index, "search", search_while_someone_writes)
    code, _, err = run(capsys, "search", work / "ix", "--queries", work / "queries.pt", "--output", work / "hits.pt")
    assert code == 1 and len(err.splitlines()) == 1 and "--output" in err
    assert (work / "hits.pt").read_text() == "written by someone else meanwhile"
    assert not [p for p in os.listdir(work) if ".tmp-" in p]


def test_search_flags_are_checked_before_any_work(work, capsys, monkeypatch):
    _no_index_load(monkeypatch)
    q = work / "queries.pt"
    for flags, name in [(["--k", "-1"], "--k"), (["--k", "x"], "--k"), (["--batch-size", "0"], "--batch-size"),
                        (["--device", "nonsense"], "--device"), (["--placement", "moon"], "--placement")]:
        refused(capsys, work, 2, ["search", work / "ix", "--queries", q, *flags], name)
    refused(capsys, work, 2, ["search", work / "nowhere", "--queries", q], "nowhere")
    refused(capsys, work, 2, ["search", work / "ix", "--queries", work / "missing.pt"], "--queries", "missing.pt")
    refused(capsys, work, 2, ["search", work / "ix"], "--queries")


def test_search_refusals_after_loading_name_the_flag_or_file(work, capsys):
    refused(capsys, work, 2, ["search", work / "ix", "--queries", work / "queries.pt", "--k", "99"], "--k 99")
    torch.save([torch.randn(2, 5)], work / "wide.pt")
    refused(capsys, work, 1, ["search", work / "ix", "--queries", work / "wide.pt"], "wide.pt", "d=5")


# ---------------------------------------------------------------------------------------------- damaged indexes
def _shard(index: Path) -> Path:
    return sorted(index.rglob("*.safetensors"))[0]


def _flip_a_token_byte(shard: Path) -> None:
    data = bytearray(shard.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    begin, end = json.loads(data[8 : 8 + length])["tokens"]["data_offsets"]
    data[8 + length + (begin + end) // 2] ^= 1  # the lowest bit of a float32 mantissa: the value stays finite
    shard.write_bytes(bytes(data))


def test_info_checks_sizes_always_and_checksums_with_verify(work, capsys):
    code, out, _ = run(capsys, "index", "info", work / "ix")
    assert code == 0 and json.loads(out)["documents"] == 10 and "--verify" in json.loads(out)["checked"]
    _flip_a_token_byte(_shard(work / "ix"))
    assert run(capsys, "index", "info", work / "ix")[0] == 0  # a flipped bit needs the checksums to show
    refused(capsys, work, 1, ["index", "info", work / "ix", "--verify"], work / "ix")
    shard = _shard(work / "ix")
    shard.write_bytes(shard.read_bytes()[:-8])
    refused(capsys, work, 1, ["index", "info", work / "ix"], work / "ix")
    refused(capsys, work, 1, ["search", work / "ix", "--queries", work / "queries.pt"], work / "ix")


@pytest.mark.parametrize("manifest", ["not json", "[" * 100_000 + "]" * 100_000, '{"format": "lik-index"}', "{}"])
def test_damaged_manifests_are_one_line(work, capsys, manifest):
    (work / "ix" / "manifest.json").write_text(manifest)
    refused(capsys, work, 1, ["index", "info", work / "ix"], work / "ix")
    refused(capsys, work, 1, ["search", work / "ix", "--queries", work / "queries.pt"], work / "ix")


def test_info_of_a_missing_or_foreign_directory(work, capsys):
    refused(capsys, work, 2, ["index", "info", work / "nowhere"], "nowhere")
    (work / "plain").mkdir()
    refused(capsys, work, 1, ["index", "info", work / "plain"], "plain")


# ---------------------------------------------------------------------------------------------- lik demo
@pytest.mark.parametrize("synthetic", [True, False])
def test_demo_corpus_errors_are_one_line(tmp_path, capsys, monkeypatch, synthetic):
    monkeypatch.setattr(demo, "load_encoder", lambda: pytest.fail("the encoder was loaded for a bad corpus"))
    flags = ["--synthetic"] if synthetic else []
    (tmp_path / "blank.txt").write_text("\n   \n# only a comment\n\n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    refused(capsys, tmp_path, 2, ["demo", *flags, "--corpus", tmp_path / "missing.txt"], "--corpus", "missing.txt")
    refused(capsys, tmp_path, 2, ["demo", *flags, "--corpus", tmp_path], "--corpus")
    refused(capsys, tmp_path, 1, ["demo", *flags, "--corpus", tmp_path / "blank.txt"], "blank.txt", "no passages")
    refused(capsys, tmp_path, 1, ["demo", *flags, "--corpus", tmp_path / "latin1.txt"], "latin1.txt", "UTF-8")


# ---------------------------------------------------------------------------------------------- the command itself
def test_argument_errors_are_one_line_without_usage(tmp_path, capsys):
    for argv, name in [(["bogus"], "bogus"), (["index"], "lik index"), (["index", "build"], "--out"),
                       (["search"], "--queries"), (["demo", "--top-k", "many"], "--top-k")]:
        refused(capsys, tmp_path, 2, argv, name)


def test_help_lists_the_file_layouts_and_exit_codes(capsys):
    for argv in (["index", "build", "--help"], ["search", "--help"]):
        code, out, _ = run(capsys, *argv)
        assert code == 0
        for text in ("cu_seqlens", "'embeddings' [N, L, d]", "attention_mask", "weights_only=True", "key order"):
            assert text in out
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "LIK_DEBUG" in out and "Exit status" in out


def test_an_internal_error_is_one_line_unless_debugging(work, capsys, monkeypatch):
    def broken(self, *args, **kwargs):
        raise AttributeError("'NoneType' object has no attribute 'shape'")

    monkeypatch.setattr(lik.Index, "search", broken)
    line = refused(capsys, work, 1, ["search", work / "ix", "--queries", work / "queries.pt"], "internal error")
    assert "AttributeError" in line and "LIK_DEBUG=1" in line
    monkeypatch.setenv("LIK_DEBUG", "1")
    with pytest.raises(AttributeError):
        cli.main(["search", str(work / "ix"), "--queries", str(work / "queries.pt")])
    (work / "blank.txt").write_text("\n")
    with pytest.raises(ValueError, match="no passages"):
        cli.main(["demo", "--synthetic", "--corpus", str(work / "blank.txt")])
    with pytest.raises(CommandError, match="'mask' holds 2"):
        torch.save({"embeddings": E, "mask": M * 2}, work / "bad.pt")
        cli.main(["index", "build", str(work / "bad.pt"), "--out", str(work / "new")])


def test_a_hostile_file_in_a_fresh_process(work):
    marker = work / "created-by-the-pickle"
    torch.save([OpensAFile(marker)], work / "evil.pt")
    before = tree(work)
    result = subprocess.run([sys.executable, "-m", "lik.cli", "index", "build", "evil.pt", "--out", "new"],
                            capture_output=True, text=True, timeout=300, cwd=work, check=False)
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("lik index build: error: evil.pt: refused by torch.load(weights_only=True)")
    assert tree(work) == before and not marker.exists()
