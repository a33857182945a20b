"""``benchmarks/plaid_bench.py --scale`` on the CPU at a tiny size: the streamed build, every stage of the report
(candidates, the scan reference, exact MaxSim, the sweep) written to plaid_scale.json, a truncated build, and
recall against the scan with repeats, ties and padding."""

from __future__ import annotations

import importlib
import importlib.util
import json

import pytest
import torch

from tests.scripts import load_script

TINY = [
    "--scale", "--tokens", "1500", "--centres", "8", "--min-len", "6", "--max-len", "14", "--chunk-tokens", "400",
    "--queries", "6", "--q-len", "4", "--recall-queries", "4", "--n-probe", "4", "--candidates", "16",
    "--num-centroids", "32", "--train-tokens", "600", "--sweep", "2:10",
]  # fmt: skip


def _load(name):
    return load_script(f"benchmarks/{name}.py", name)


@pytest.fixture(scope="module")
def bench():
    return _load("plaid_bench")


def test_recall_vs_scan():
    scale = _load("plaid_scale")
    cand_ids = torch.tensor([[1, 2, 3, 3], [5, 6, 7, -1]])
    cand_scores = torch.tensor([[9.0, 8, 7, 7], [4, 3, 2, float("-inf")]])
    scan_ids = torch.tensor([[1, 2, 4, 3], [5, 9, 10, 11]])
    scan_scores = torch.tensor([[9.0, 8, 7.5, 7], [4, 3.5, 3, 2]])
    # Query 0: 1, 2, 3 held by the scan, the repeated 3 counts once. Query 1: 5 held, 6 and 7 score at least the
    # scan's 4th (2), the padding counts nothing.
    assert scale.recall_vs_scan(cand_ids, cand_scores, scan_ids, scan_scores, k=4) == 0.75
    assert scale.recall_vs_scan(scan_ids, scan_scores, scan_ids, scan_scores, k=4) == 1.0


def test_scale_run_on_cpu(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors run lik's PyTorch references: the plumbing is tested
    pb = bench
    assert pb.main([*TINY, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "plaid_scale.json").read_text())
    stages = report["stages"]
    assert report["done"] and report["meta"]["settings"] == {"n_probe": 4, "candidates": 16}
    build = stages["build"]
    assert not build["truncated"] and build["chunks"] > 1 and 1400 < build["tokens"] < 1600
    assert build["num_centroids"] == 32 and build["bytes"] == build["tokens"] * 36 + 32 * 128 * 4
    assert stages["candidates"]["one_query_ms"] > 0 and stages["candidates"]["batch_ms"] > 0
    assert 0.5 <= stages["scan"]["recall_vs_scan"] <= 1.0
    assert 0.0 < stages["exact"]["scan_recall_at_10"] <= 1.0
    assert 0.0 < stages["exact"]["candidates_recall_at_10"] <= 1.0
    exact = stages["exact"]
    assert exact["candidates_over_scan"] == exact["candidates_recall_at_10"] / exact["scan_recall_at_10"]
    assert [row["n_probe"] for row in stages["sweep"]] == [2] and "recall_vs_scan" in stages["sweep"][0]


def test_truncated_build(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    pb = bench
    argv = [*TINY, "--build-budget-s", "1e-9", "--no-exact", "--sweep", "", "--out", str(tmp_path)]
    assert pb.main(argv) == 0
    report = json.loads((tmp_path / "plaid_scale.json").read_text())
    build = report["stages"]["build"]
    assert build["truncated"] and build["chunks"] == 1  # stopped after the first chunk (the codec trains on it)
    assert "exact" not in report["stages"] and "sweep" not in report["stages"]
    assert any("truncated" in note for note in report["notes"])


def test_fused_assignment_check(monkeypatch):
    from lik.compression import codec as codec_module

    kmeans_module = importlib.import_module("lik.compression.kmeans")  # (the package's kmeans is the function)
    from lik.compression import nearest

    scale = _load("plaid_scale")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(kmeans_module, "FUSED", True)
    original = codec_module.ResidualCodec.compress_into_codes
    monkeypatch.setattr(codec_module.ResidualCodec, "compress_into_codes", original)  # restored after the test
    said = scale.fused_assignment(torch.device("cpu"), tokens=300, centroids=40)
    assert kmeans_module.FUSED and "codes agree 1.00000" in said
    assert ("installed by the bench" in said) == (codec_module.ResidualCodec.compress_into_codes is not original)

    def broken(x, c, **kw):
        codes, scores = nearest.nearest_centroid_reference(x, c, **kw)
        return (codes + 1) % c.shape[0], scores

    monkeypatch.setattr(nearest, "nearest_centroid", broken)
    said = scale.fused_assignment(torch.device("cpu"), tokens=300, centroids=40)
    assert not kmeans_module.FUSED and said.startswith("unfused (the fused kernel failed its check: ValueError")
