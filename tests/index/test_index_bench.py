"""benchmarks/index_bench.py on the CPU: the smoke grid (every dtype x placement x query count, one build each, the
JSON and the table), the time budget (nothing started past it, the JSON still written), document lengths and argument
errors. On the CPU ``gpu`` is skipped and the other placements run lik's PyTorch reference."""

from __future__ import annotations

import json

import pytest
import torch

from tests.scripts import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("benchmarks/index_bench.py", "index_bench")


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors then run the PyTorch reference: the plumbing is tested


def test_smoke_grid(script, tmp_path, capsys):
    work = tmp_path / "work"
    argv = ["--smoke", "--nq", "1,2", "--dtypes", "float16,int8,float8_e4m3fn", "--placements", "gpu,host,disk"]
    assert script.main([*argv, "--out", str(tmp_path), "--work-dir", str(work), "--tag=-t"]) == 0
    result = json.loads((tmp_path / "index_bench-t.json").read_text())
    assert not result["stopped_early"] and result["docs"] == 48 and 48 <= result["tokens"] <= 48 * 39
    assert [b["dtype"] for b in result["builds"]] == ["float16", "int8", "float8_e4m3fn"]
    assert all(b["docs"] == 48 and b["build_s"] > 0 for b in result["builds"])
    fp16, int8, fp8 = (b["corpus_bytes"] for b in result["builds"])
    assert fp16 > 256 * result["tokens"] and int8 > 128 * result["tokens"] and fp8 == int8  # the shard files found
    assert all("load_host_s" in b and "load_disk_s" in b for b in result["builds"])
    cells = {(c["dtype"], c["placement"], c["nq"]): c for c in result["cells"]}
    expected = {(d, p, n) for d in ("float16", "int8", "float8_e4m3fn") for p in ("host", "disk") for n in (1, 2)}
    assert set(cells) == expected  # no gpu (nor kernel floor) on the CPU
    for (_, _, nq), cell in cells.items():
        assert cell["runs"] >= 3 and cell["ms"] > 0 and cell["same_ids"]
        assert cell["queries_per_s"] == pytest.approx(nq / cell["ms"] * 1e3)
        assert ("p50_ms" in cell) == (nq == 1) and ("p99_ms" in cell) == (nq == 1)
        if nq == 1:
            assert cell["p50_ms"] <= cell["p99_ms"]
    assert not list(work.glob("ix-*"))  # each dtype's directory is deleted after use
    out = capsys.readouterr().out
    assert "fp8 disk Nq2" in out and "int8 host Nq1" in out and "build int8 from cpu" in out
    assert "IDS DIFFER" not in out


def test_every_placement_finds_the_exact_top_k(script, tmp_path):
    # same_ids compares each placement with the first: check the first against brute force once.
    args = script.parse_args(["--smoke", "--nq", "2"])
    lengths = script.draw_lengths(args, torch.Generator().manual_seed(0))
    corpus = script.draw_corpus(lengths, torch.device("cpu"), 0)
    docs = list(corpus.split(lengths))
    index = __import__("lik").Index.build(docs, dtype=torch.float16, progress=False, device="cpu")
    Q = torch.nn.functional.normalize(torch.randn(2, 32, 128, generator=torch.Generator().manual_seed(1)), dim=-1)
    _, ids = index.search(Q.half(), script.K)
    exact = torch.stack([torch.stack([(q.float() @ d.float().T).amax(1).sum() for d in docs]) for q in Q.half()])
    assert torch.equal(ids, exact.topk(script.K, dim=1).indices)


def test_budget_stops_before_any_cell(script, tmp_path, capsys):
    assert script.main(["--smoke", "--time-budget-s", "0", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "index_bench.json").read_text())
    assert result["stopped_early"] and result["cells"] == [] and result["builds"] == []
    assert "stopped at the time budget" in capsys.readouterr().out


def test_lengths(script):
    rng = torch.Generator().manual_seed(0)
    ranged = script.draw_lengths(script.parse_args(["--docs", "2000", "--min-len", "60", "--max-len", "140"]), rng)
    assert min(ranged) == 60 and max(ranged) == 140 and len(ranged) == 2000
    fixed = script.draw_lengths(script.parse_args(["--docs", "5", "--doc-len", "1030", "--fixed-len"]), rng)
    assert fixed == [1030] * 5
    default = script.draw_lengths(script.parse_args(["--docs", "500", "--doc-len", "10"]), rng)
    assert min(default) >= 1 and max(default) <= 19
    with pytest.raises(SystemExit, match="--min-len"):
        script.draw_lengths(script.parse_args(["--min-len", "9", "--max-len", "3"]), rng)


@pytest.mark.parametrize(
    "argv",
    [["--dtypes", "float32"], ["--dtypes", ""], ["--placements", "tape"], ["--nq", "0"], ["--nq", "1,x"]],
)
def test_argument_errors(script, argv):
    with pytest.raises(SystemExit):
        script.parse_args(argv)


def test_lists_parsed(script):
    args = script.parse_args(["--nq", "1,32,256", "--dtype", "int8", "--placements", "host"])
    assert args.nq == [1, 32, 256] and args.dtypes == ["int8"] and args.placements == ["host"]
