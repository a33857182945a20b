"""``benchmarks/host_path.py``: its arguments, its dry run on the CPU (every row once, tiny shapes, the interpreter),
the JSON and table it writes, the bars it derives, and its floor scorer's gradients."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.scripts import load_script


@pytest.fixture(scope="module")
def host_path():
    return load_script("benchmarks/host_path.py", "host_path_script")


def test_arguments(host_path, monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    args = host_path.parse([])
    assert args.out == tmp_path / "host_path.json" and not args.dry_run and args.index_tokens == 10_000_000
    args = host_path.parse(["--dry-run", "--out", "x.json", "--rounds", "2", "--index-tokens", "1000"])
    assert args.dry_run and args.out == Path("x.json") and (args.rounds, args.index_tokens) == (2, 1000)
    for bad in (["--rounds", "0"], ["--index-tokens", "-1"], ["--bogus"]):
        with pytest.raises(SystemExit):
            host_path.parse(bad)


def test_without_a_gpu_only_the_dry_run_runs(host_path, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert host_path.main(["--out", str(tmp_path / "r.json")]) == 1
    assert "--dry-run" in capsys.readouterr().err and not (tmp_path / "r.json").exists()


def test_dry_run_writes_every_row_and_the_table_last(host_path, tmp_path, capsys):
    out = tmp_path / "sub" / "host_path.json"
    assert host_path.main(["--dry-run", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    groups = {(r["group"], r["row"]) for r in record["rows"]}
    assert {("ColBERT B=128 step", name) for name in ("lik", "trivial scorer", "einsum")} <= groups
    assert {("other steps", "lik ColBERT B=512"), ("other steps", "lik ColPali B=32"),
            ("small inference call", "lik.maxsim"), ("small inference call", "empty Triton kernel, 45 args"),
            (host_path.INDEX, "lik.Index.search (gpu)"), (host_path.INDEX, "lik.maxsim_packed")} <= groups
    assert all(r["host_us"] > 0 and "device_us" not in r for r in record["rows"])
    assert record["dry_run"] and record["checks"] == [
        {"check": "replays", "replayed": False, "equal": None, "note": "no GPU"}]
    assert set(record["bars"]) == {"colbert_host_above_trivial_us", "small_call_host_over_empty_kernel",
                                   "index_search_over_maxsim_packed"}
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[0] == "| group | row | host us | device us | wall us |" and printed[-1].startswith("| replays |")


def test_bars_compare_the_rows_they_name(host_path):
    rows = [
        {"group": "ColBERT B=128 step", "row": "lik", "host_us": 700.0, "wall_us": 800.0},
        {"group": "ColBERT B=128 step", "row": "trivial scorer", "host_us": 600.0, "wall_us": 650.0},
        {"group": "ColBERT B=128 step", "row": "late-interaction-kernels", "host_us": 900.0, "wall_us": 1000.0},
        {"group": "small inference call", "row": "lik.maxsim", "host_us": 30.0, "wall_us": 31.0},
        {"group": "small inference call", "row": "empty Triton kernel, 45 args", "host_us": 20.0, "wall_us": 21.0},
        {"group": host_path.INDEX, "row": "lik.Index.search (gpu)", "host_us": 1.0, "wall_us": 660.0},
        {"group": host_path.INDEX, "row": "lik.maxsim_packed", "host_us": 1.0, "wall_us": 600.0},
    ]
    assert host_path.summary(rows) == pytest.approx({
        "colbert_host_above_trivial_us": 100.0, "colbert_step_peer_over_lik": 1.25,
        "small_call_host_over_empty_kernel": 1.5, "index_search_over_maxsim_packed": 1.1})
    assert host_path.summary(rows[:1]) == {}


def test_the_floor_scorer_is_differentiable_and_cheap(host_path):
    Q = torch.randn(3, 4, 8, requires_grad=True)
    D = torch.randn(5, 6, 8, dtype=torch.float64, requires_grad=True)
    scores = host_path.TrivialScorer.apply(Q, D)
    assert scores.shape == (3, 5) and scores.dtype == torch.float32
    gq, gd = torch.autograd.grad(scores.sum(), (Q, D))
    assert gq.shape == Q.shape and gd.dtype == torch.float64 and not gq.any() and not gd.any()
