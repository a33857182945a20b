"""``lik index build | info`` and ``lik search``: a round trip through files equals the Python API."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import lik
from lik import cli

from .helpers import grid_docs, grid_queries


@pytest.fixture
def files(tmp_path):
    rng = torch.Generator().manual_seed(21)
    docs = grid_docs(rng)
    # Half the corpus as a .pt list, half as a safetensors file with one tensor per document (numeric keys).
    torch.save(docs[:4], tmp_path / "a.pt")
    save_file({str(i): doc.contiguous() for i, doc in enumerate(docs[4:])}, str(tmp_path / "b.safetensors"))
    Q = grid_queries(rng)
    torch.save(list(Q), tmp_path / "queries.pt")
    return tmp_path, docs, Q


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_build_info_search_round_trip(files, capsys, dtype):
    tmp_path, docs, Q = files
    out = tmp_path / "ix"
    assert cli.main(["index", "build", str(tmp_path / "a.pt"), str(tmp_path / "b.safetensors"), "--out", str(out),
                     "--dtype", dtype, "--shard-tokens", "7"]) == 0
    assert f"{len(docs)} documents" in capsys.readouterr().out

    assert cli.main(["index", "info", str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["documents"] == len(docs) and info["d"] == 6 and info["dtype"] == dtype and info["shards"] > 1

    assert cli.main(["search", str(out), "--queries", str(tmp_path / "queries.pt"), "--k", "3",
                     "--placement", "disk", "--batch-size", "2", "--output", str(tmp_path / "hits.pt")]) == 0
    printed = capsys.readouterr().out
    assert "queries/s" in printed and "p50" in printed and "p99" in printed and "(2 calls)" in printed
    hits = torch.load(tmp_path / "hits.pt")
    want = lik.Index.build(docs, dtype=getattr(torch, dtype), progress=False).search(Q, 3)
    assert torch.equal(hits["ids"], want[1])
    torch.testing.assert_close(hits["scores"], want[0], rtol=1e-6, atol=1e-6)

    assert cli.main(["search", str(out), "--queries", str(tmp_path / "queries.pt"), "--k", "2"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"query 0: {int(want[1][0, 0])} (")


def test_errors_name_the_file_or_argument(files, capsys):
    tmp_path, _, _ = files
    assert cli.main(["index", "info", str(tmp_path / "missing")]) == 2
    assert "missing: no such index directory" in capsys.readouterr().err
    assert cli.main(["index", "build", str(tmp_path / "nope.pt"), "--out", str(tmp_path / "ix")]) == 2
    assert "nope.pt: no such file" in capsys.readouterr().err
    assert cli.main(["index", "build", str(tmp_path / "a.pt"), "--out", str(tmp_path / "ix")]) == 0
    capsys.readouterr()
    assert cli.main(["index", "build", str(tmp_path / "a.pt"), "--out", str(tmp_path / "ix")]) == 2
    err = capsys.readouterr().err
    assert "already exists (pass --overwrite" in err and "overwrite=True" not in err
    assert cli.main(["search", str(tmp_path / "ix"), "--queries", str(tmp_path / "queries.pt"), "--k", "99"]) == 2
    assert "--k 99 is larger than the index" in capsys.readouterr().err
    torch.save([torch.randn(2, 5)], tmp_path / "wide.pt")
    assert cli.main(["search", str(tmp_path / "ix"), "--queries", str(tmp_path / "wide.pt")]) == 1
    assert "wide.pt: queries have d=5" in capsys.readouterr().err


def test_percentile_interpolates_between_ranks():
    from lik.index.commands import percentile

    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile(list(range(101)), 99) == 99.0
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)


def _with_codec_flags(parser):
    """``lik index build`` with --codec / --nbits, as src/lik/cli.py declares them (added here if it does not)."""
    index = next(a for a in parser._subparsers._group_actions if "index" in a.choices).choices["index"]
    build = next(a for a in index._subparsers._group_actions if "build" in a.choices).choices["build"]
    if not any("--codec" in a.option_strings for a in build._actions):
        build.add_argument("--codec", choices=("exact", "plaid"), default="exact")
        build.add_argument("--nbits", type=int, default=None)
    return parser


@pytest.fixture
def plaid_files(tmp_path, monkeypatch):
    real = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda: _with_codec_flags(real()))
    rng = torch.Generator().manual_seed(5)
    docs = [torch.nn.functional.normalize(torch.randn(n, 16, generator=rng), dim=-1) for n in (9, 0, 4, 12, 7, 3)]
    torch.save(docs, tmp_path / "docs.pt")
    Q = torch.randn(2, 4, 16, generator=rng)
    torch.save(list(Q), tmp_path / "queries.pt")
    return tmp_path, docs, Q


def test_plaid_build_info_search(plaid_files, capsys):
    tmp_path, docs, Q = plaid_files
    out = tmp_path / "ix"
    assert cli.main(["index", "build", str(tmp_path / "docs.pt"), "--out", str(out), "--codec", "plaid",
                     "--nbits", "4", "--dtype", "float32"]) == 0
    assert "6 documents, 35 tokens, d=16, plaid 4-bit" in capsys.readouterr().out
    assert cli.main(["index", "info", str(out), "--verify"]) == 0
    info = json.loads(capsys.readouterr().out)
    index = lik.Index.load(out)
    assert info["codec"] == "plaid" and info["nbits"] == 4 and info["centroids"] == index.codec.num_centroids
    assert info["bytes_per_token"] == 4 + 16 * 4 // 8 and info["dtype"] == "float32"
    assert info["total_bytes"] == 35 * info["bytes_per_token"] + info["codec_bytes"]
    assert cli.main(["search", str(out), "--queries", str(tmp_path / "queries.pt"), "--k", "3",
                     "--output", str(tmp_path / "hits.pt")]) == 0
    capsys.readouterr()
    hits = torch.load(tmp_path / "hits.pt")
    assert torch.equal(hits["ids"], index.search(Q, 3)[1])
    assert cli.main(["index", "build", str(tmp_path / "docs.pt"), "--out", str(tmp_path / "exact")]) == 0
    capsys.readouterr()
    assert cli.main(["index", "info", str(tmp_path / "exact")]) == 0
    assert json.loads(capsys.readouterr().out)["codec"] == "exact"


@pytest.mark.parametrize("flags, message", [
    (["--codec", "plaid", "--nbits", "3"], "--nbits must be 1, 2 or 4, got 3"),
    (["--codec", "plaid", "--dtype", "int8"], "--dtype int8: --codec plaid stores residual codes"),
    (["--nbits", "2"], "--nbits 2: only with --codec plaid"),
])
def test_plaid_flag_errors_are_one_line(plaid_files, capsys, flags, message):
    tmp_path, _, _ = plaid_files
    assert cli.main(["index", "build", str(tmp_path / "docs.pt"), "--out", str(tmp_path / "ix"), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "ix").exists()
