"""The operators beyond dense MaxSim (packed, index, deformable attention, Chamfer, host time) on the CPU: each
operator's cases run end to end at smoke size, and a peer that is not installed (or breaks at import) is skipped
with a note instead of stopping the run."""

from __future__ import annotations

import json

import pytest
import torch

from lik.bench import main
from lik.bench.cases import Case, CaseMethod, run_case
from lik.bench.measure import Timer
from lik.bench.methods import METHODS, Method
from lik.bench.ops import select_ops
from lik.bench.roofline import Ceilings

CPU = torch.device("cpu")


def _run(case: Case, log=None, noted=None) -> dict:
    return run_case(case, device=CPU, timer=Timer(CPU, warmup_ms=0, rep_ms=1), ceilings=Ceilings(1e10, 1e10),
                    rounds=2, smoke=True, log=log or (lambda line: None), noted=noted)


def _toy_case(name: str, methods: dict) -> Case:
    def inputs(device, smoke):
        return {"x": torch.arange(6.0)}

    return Case("toy", f"toy/{name}", name, inputs, methods,
                floor=lambda s, ceilings: {"floor_ms": 1e-3}, reference=lambda s: s["x"] * 2)


def test_missing_and_broken_peers_are_skipped_with_one_note(tmp_path, monkeypatch):
    # a peer that raises something other than ImportError while importing
    (tmp_path / "lik_broken_peer.py").write_text("raise RuntimeError('built for another CUDA')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    methods = {
        "lik": CaseMethod(lambda s: lambda: s["x"] * 2),
        "absent": CaseMethod(lambda s: lambda: s["x"], module="lik_no_such_peer"),
        "broken": CaseMethod(lambda s: lambda: s["x"], module="lik_broken_peer"),
        "wrong": CaseMethod(lambda s: lambda: s["x"] * 2.1),
        "needs-build": CaseMethod(lambda s: lambda: s["x"] * 2, env="LIK_BENCH_TEST_UNSET"),
    }
    monkeypatch.delenv("LIK_BENCH_TEST_UNSET", raising=False)
    lines, noted = [], set()
    first = _run(_toy_case("a", methods), lines.append, noted)
    second = _run(_toy_case("b", methods), lines.append, noted)
    for entry in (first, second):
        cells = entry["cells"]
        assert cells["absent"]["status"] == cells["broken"]["status"] == cells["needs-build"]["status"] == "unavailable"
        assert "ModuleNotFoundError" in cells["absent"]["error"]
        assert "RuntimeError: built for another CUDA" in cells["broken"]["error"]
        assert cells["needs-build"]["error"] == "LIK_BENCH_TEST_UNSET is not set"
        assert cells["lik"]["status"] == "ok" and len(cells["lik"]["round_ms"]) == 2
        assert cells["wrong"]["status"] == "mismatch" and cells["wrong"]["rel_err"] == pytest.approx(0.05)
        assert cells["lik"]["pct_of_floor"] == pytest.approx(100 * 1e-3 / cells["lik"]["median_ms"])
    notes = [line for line in lines if "skipped" in line]
    assert len(notes) == 3  # one note per method, not per case
    assert any(line.startswith("  absent: skipped (import lik_no_such_peer failed") for line in notes)


def test_a_failing_call_is_recorded_and_the_others_still_run():
    def boom(s):
        def call():
            raise ValueError("peer bug")

        return call

    entry = _run(_toy_case("c", {"lik": CaseMethod(lambda s: lambda: s["x"] * 2), "peer": CaseMethod(boom)}))
    assert entry["cells"]["peer"] == {"status": "error", "error": "ValueError: peer bug"}
    assert entry["cells"]["lik"]["median_ms"] > 0


@pytest.mark.parametrize("op", ["packed", "packed-stream", "index", "reductions", "stored", "contrastive", "fused_head",
                                "msda", "chamfer", "host"])
def test_each_operator_runs_its_first_case_on_the_cpu(op, monkeypatch):
    # lik's CPU path (the reference) stands in for the kernels: this checks the cases' plumbing (inputs, floors,
    # the float64 check), not the kernels, which tests/ops covers.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = select_ops(op)[0].cases()[0]
    entry = _run(case)
    lik = entry["cells"]["lik"]
    assert lik["status"] == "ok", lik
    assert lik["median_ms"] > 0
    peers = [n for n in case.methods if n in select_ops(op)[0].peers]
    assert all(entry["cells"][n]["status"] == "unavailable" for n in peers)  # CUDA-only peers on a CPU
    if op in ("packed", "msda", "chamfer"):
        assert entry["floor"]["floor_ms"] > 0 and lik["pct_of_floor"] > 0
        assert lik["rel_err"] < case.tolerance


def test_the_run_notes_a_peer_whose_wheel_is_absent(tmp_path, capsys, monkeypatch):
    """A GPU machine without the peers' wheels: the peer's columns read n/a, the run says why, nothing stops."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    absent = Method("flash-maxsim", ("forward", "multi", "train", "width"), lambda shape: None,
                    module="lik_no_such_peer")
    monkeypatch.setattr("lik.bench.methods.METHODS",
                        tuple(absent if m.name == "flash-maxsim" else m for m in METHODS))
    argv = ["--smoke", "--ops", "forward", "--methods", "lik,flash-maxsim", "--no-plot", "--out", str(tmp_path)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert ("flash-maxsim: skipped, its column will read n/a (import lik_no_such_peer failed: ModuleNotFoundError"
            in printed)
    results = json.loads((tmp_path / "results.json").read_text())
    assert all(e["cells"]["flash-maxsim"]["status"] == "unavailable" for e in results["shapes"])
    report = (tmp_path / "bench.md").read_text()
    assert "| n/a |" in report and "Not run here: flash-maxsim (import lik_no_such_peer failed" in report


def test_index_cases_cover_queries_placements_dtypes_and_builds(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cases = select_ops("index")[0].cases()
    names = [c.name for c in cases]
    for tag in ("fp16", "int8", "fp8"):
        for placement in ("gpu", "host"):
            assert {f"index/{tag}-{placement}-nq{n}" for n in (1, 32, 256)} <= set(names)
        assert {f"index/build-{tag}-from-gpu", f"index/build-{tag}-from-cpu"} <= set(names)
    assert len(names) == len(set(names)) == 25 and "index/fp16-gpu-ragged32" in names
    assert {c.name for c in cases if c.quick} >= {"index/fp16-gpu-nq1", "index/fp16-gpu-nq32", "index/fp16-gpu-nq256"}
    for name in ("index/build-int8-from-cpu", "index/fp16-host-nq256", "index/fp16-gpu-ragged32"):
        entry = _run(next(c for c in cases if c.name == name))
        assert entry["cells"]["lik"]["status"] == "ok", entry
        assert entry["cells"]["lik"]["median_ms"] > 0
