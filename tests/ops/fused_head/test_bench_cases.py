"""The fused-head benchmark cases' plumbing on the CPU at smoke size (inputs, floors, the check against the
unfused float32 path): lik's CPU path stands in for the kernel, which the other tests of this folder cover."""

from __future__ import annotations

import pytest
import torch

from lik.bench.cases import run_case
from lik.bench.fused_head_cases import fused_head_cases
from lik.bench.measure import Timer
from lik.bench.roofline import Ceilings

CPU = torch.device("cpu")
CASES = fused_head_cases()


def test_the_table_has_the_issue_rows():
    names = [c.name for c in CASES]
    assert names == ["fused_head/rerank/1x32/1000", "fused_head/rerank/16x32/1000", "fused_head/rerank/1x32/10000",
                     "fused_head/rerank/16x32/10000", "fused_head/train/ColBERT/128", "fused_head/train/ColPali/32"]
    assert all("late-interaction-kernels" in c.methods and "lik unfused" in c.methods for c in CASES)


@pytest.mark.parametrize("case", [CASES[1], CASES[4]], ids=["rerank", "train"])
def test_a_case_runs_on_the_cpu(case, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    entry = run_case(case, device=CPU, timer=Timer(CPU, warmup_ms=0, rep_ms=1), ceilings=Ceilings(1e10, 1e10),
                     rounds=1, smoke=True, log=lambda line: None)
    assert entry["floor"]["floor_ms"] > 0
    for name in ("lik", "lik unfused") + (("lik packed",) if "lik packed" in case.methods else ()):
        cell = entry["cells"][name]
        assert cell["status"] == "ok" and cell["rel_err"] < case.tolerance, (name, cell)
    assert entry["cells"]["late-interaction-kernels"]["status"] == "unavailable"  # CUDA-only
