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
