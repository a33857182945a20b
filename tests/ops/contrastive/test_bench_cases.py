"""The contrastive-step benchmark cases (src/lik/bench/contrastive_cases.py) run end to end at smoke size on the CPU:
their plumbing (inputs, floors, the check against lik.maxsim + F.cross_entropy), not the kernels."""

from __future__ import annotations

import pytest
import torch

from lik.bench.cases import run_case
from lik.bench.contrastive_cases import contrastive_cases, contrastive_host_cases
from lik.bench.measure import Timer
from lik.bench.roofline import Ceilings

CPU = torch.device("cpu")


@pytest.mark.parametrize("index", range(4))
def test_each_case_runs_on_the_cpu(index, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the reference path stands in for the kernels
    case = (contrastive_cases() + contrastive_host_cases())[index]
    entry = run_case(
        case,
        device=CPU,
        timer=Timer(CPU, warmup_ms=0, rep_ms=1),
        ceilings=Ceilings(1e10, 1e10),
        rounds=1,
        smoke=True,
        log=lambda line: None,
    )
    cells = entry["cells"]
    assert cells["lik"]["status"] == "ok" and cells["lik"]["median_ms"] > 0
    assert cells["lik-maxsim-ce"]["status"] == "ok"
    assert cells["flash-maxsim"]["status"] == cells["late-interaction-kernels"]["status"] == "unavailable"
    if case.host_time:
        assert cells["trivial-scorer"]["status"] == "ok"
    else:
        assert entry["floor"]["floor_ms"] > 0 and cells["lik"]["rel_err"] < case.tolerance
