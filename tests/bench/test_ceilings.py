"""``lik bench --ceilings``: the one way to measure the ceilings the floors are relative to (CPU plumbing)."""

from __future__ import annotations

import json

from lik.bench import main
from lik.bench.ceilings import format_ceilings


def test_ceilings_smoke_writes_every_ceiling(tmp_path, capsys):
    assert main(["--ceilings", "--smoke", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "ceilings.json").read_text())
    assert results["device"] == "cpu" and results["device_copy"]["GBps"] > 0
    assert list(results["matmul"]) == ["fp16", "bf16", "fp32-tf32", "fp32"]  # no 8-bit matmuls on the CPU
    for name, record in results["matmul"].items():
        assert "error" in record or record["TFLOPps"] > 0, name
    assert "pinned_h2d" not in results  # pinned copies need a GPU
    printed = capsys.readouterr().out
    assert "device_copy" in printed and "matmul fp32-tf32" in printed


def test_format_names_an_unavailable_ceiling():
    results = {
        "device": "gpu",
        "device_copy": {"what": "copy", "median_ms": 0.5, "GBps": 4200.0},
        "pinned_h2d": {"what": "h2d", "median_ms": 20.0, "GBps": 53.1},
        "matmul": {"fp16": {"what": "mm", "median_ms": 1.6, "TFLOPps": 690.0},
                   "fp8": {"error": "RuntimeError: no fp8"}},
    }
    text = format_ceilings(results)
    assert "4200.0 GB/s" in text and "53.1 GB/s" in text and "690.0 TFLOP/s" in text
    assert "matmul fp8       unavailable: RuntimeError: no fp8" in text
