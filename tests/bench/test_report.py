"""The tables ``lik bench`` prints: BENCHMARKS.md's markdown layout, from a synthetic results JSON."""

from __future__ import annotations

import json

from lik.bench import main
from lik.bench.ops import select_ops
from lik.bench.report import format_report, format_section, record_name, time_text


def _section(results, op):
    return format_section(results, select_ops(op)[0]).splitlines()


def test_forward_table_rows_and_header(synthetic_results):
    lines = _section(synthetic_results, "forward")
    assert lines[0] == "## MaxSim forward (inference), canonical shapes"
    header_line = lines[2]
    assert header_line.startswith(
        "NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, late-interaction-kernels 0.4.5, "
        "lik commit `0123456`, float16. Ceilings measured in the run: 4250 GB/s copy"
    )
    assert "Command: `lik bench --quick`. JSON: `benchmarks/results/bench_h200_0123456.json`." in header_line
    # The columns the run has (no chunked sweep, no torch.compile here), lik's % of floor, the peer that is
    # absent as n/a, lik against the faster peer that ran (0.677 / 0.453) and against eager (1.96 / 0.453).
    assert lines[4] == (
        "| cell | floor ms | lik ms (% floor) | flash-maxsim | late-interaction-kernels | eager einsum "
        "| lik vs faster peer | lik vs eager einsum |"
    )
    assert lines[5] == "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    assert lines[6] == "| colpali 1024x1024, B 1 000 | 0.392 | 0.453 (86%) | n/a | 0.677 | 1.96 | 1.49x | 4.33x |"
    reason = synthetic_results["shapes"][0]["cells"]["flash-maxsim"]["error"]
    assert lines[8] == f"Not run here: flash-maxsim ({reason})."
    assert lines[-1] == "![forward](benchmarks/results/plots/forward.png)"


def test_eight_bit_table(synthetic_results):
    lines = _section(synthetic_results, "8bit")
    # x fp16 = 0.453 / 0.30 and 0.453 / 0.2831; fp8 against the 8-bit peer that ran: 0.5309 / 0.2831.
    assert lines[6] == (
        "| colpali 1024x1024, B 1 000 | 0.453 | 0.3 (1.51x, 60%) | 0.283 (1.60x, 70%) | n/a | 0.531 | - | 1.88x |"
    )
    assert "`lik.quantize fp16 [3000000, 128] -> int8`: 0.296 ms, 93% of its copy floor." in lines


def test_training_table_marks_a_mismatch_and_compares_peaks(synthetic_results):
    row = _section(synthetic_results, "train")[6]
    # eager disagreed with the reference: "!"; deterministic / fast = 2.85 / 2.82; peaks 60 MB against the lower
    # peer's 61 MB.
    assert row == (
        "| colbert-train 32x180, B 512 | 0.589 | 2.82 (21%) | 2.85 (21%) | n/a | 4.55 | 14.1! | 1.61x "
        "| 5.00x | 1.01 | 60 / 61 |"
    )


def test_case_tables_show_failures_and_host_microseconds(synthetic_results):
    chamfer = _section(synthetic_results, "chamfer")
    # No row has a cdist cell, so neither its column nor lik's ratio against it is shown.
    assert chamfer[4] == (
        "| cell | floor ms | lik ms (% floor) | flash-maxsim | chamferdist | keops | lik vs faster peer |"
    )
    assert chamfer[6] == "| N 1, P 100 000, D 3 | 0.128 | 6.4 (2%) | 14.7! | 46.7 | error | 2.30x |"
    assert "Skipped (time budget): chamfer/1x1000000x3." in chamfer
    host = _section(synthetic_results, "host")
    assert "Host microseconds per call" in host[2] and "Ceilings" not in host[2]
    assert host[4] == "| call | lik us | late-interaction-kernels | lik vs faster peer |"
    assert host[6] == "| lik.maxsim, 32 x 128 query, 10 x 100 documents | 22.1 | 51.3 | 2.32x |"
    assert host[7] == "| ColBERT training step, B 128 (32 x 180) | 1 234 | 2 469 | 2.00x |"


def test_report_has_a_section_per_operator_with_rows(synthetic_results):
    report = format_report(synthetic_results)
    titles = [line for line in report.splitlines() if line.startswith("## ")]
    assert titles == [
        "## MaxSim forward (inference), canonical shapes",
        "## 8-bit corpora (int8 / fp8)",
        "## MaxSim training step (forward + cross-entropy + backward)",
        "## Chamfer distance (forward + backward, both directions)",
        "## Host time of small calls",
    ]
    assert report.endswith("Wall time of the run: 412 s.")


def test_formatting_helpers(synthetic_results):
    assert [time_text(x) for x in (0.04123, 4.4321, 20.54, 20254.0, None)] == ["0.0412", "4.43", "20.5", "20 254", "-"]
    assert time_text(0.0221, host=True) == "22.1"
    synthetic_results["meta"]["device"] = "NVIDIA H100 80GB HBM3"
    assert record_name(synthetic_results) == "bench_h100_0123456"


def test_from_json_prints_the_tables_without_a_device(synthetic_results, tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(synthetic_results))
    assert main(["--from-json", str(path), "--ops", "chamfer", "--no-plot", "--out", str(tmp_path / "out")]) == 0
    written = (tmp_path / "out" / "bench.md").read_text()
    assert written.startswith("## Chamfer distance") and "## MaxSim" not in written
    assert written.rstrip() in capsys.readouterr().out
