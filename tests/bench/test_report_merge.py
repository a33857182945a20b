"""Several results JSON files merged into one set of tables (``python -m lik.bench --from-json A.json B.json``):
a later file's cell replaces an earlier one's, every commit is listed, rows from older runs name their commit, and a
file the reader does not know is refused in one line naming it."""

from __future__ import annotations

import copy
import json

import pytest

from lik.bench.__main__ import main as bench_main
from lik.bench.ops import select_ops
from lik.bench.report import format_report, format_section, load_results, merge_results, section_rows


def _newer(synthetic_results):
    """A second run at commit 'fedcba9': colbert-train B 512 and the host small call re-timed, the ColPali forward
    cell and the ColBERT training-step host case skipped for time, and only the Chamfer cell the older run skipped."""
    newer = copy.deepcopy(synthetic_results)
    newer["meta"].update(git_commit="fedcba9876", command="lik bench --quick --time-budget-s 400")
    newer["ceilings"] = {"bandwidth_GBps": 4224.0, "matmul_TFLOPps": 678.0}
    newer["shapes"] = [newer["shapes"][1]]
    newer["shapes"][0]["cells"]["lik-fast"]["median_ms"] = 2.62
    chamfer, small, _ = newer["cases"]
    small["cells"]["lik"]["median_ms"] = 0.0176
    big = copy.deepcopy(chamfer)
    big.update(name="chamfer/1x1000000x3", label="N 1, P 1 000 000, D 3")
    newer["cases"] = [big, small]  # the older run's Chamfer cell not selected, the one it skipped run
    newer["skipped"] = ["forward/colpali/B1000", "host/colbert-train-step"]
    newer["quantize"] = []
    newer["wall_s"] = 300.0
    return newer


def _write(tmp_path, name, results):
    path = tmp_path / name
    path.write_text(json.dumps(results))
    return path


def test_a_later_file_replaces_the_cell_and_older_rows_name_their_commit(synthetic_results, tmp_path):
    older, newer = synthetic_results, _newer(synthetic_results)
    merged = load_results([_write(tmp_path, "old.json", older), _write(tmp_path, "new.json", newer)])
    train = format_section(merged, select_ops("train")[0]).splitlines()
    # Only the newer run's B 512 row (2.62 ms, not 2.82), unmarked: the table's newest run is 'fedcba9'.
    assert [line.split(" | ")[:3] for line in train if line.startswith("| colbert")] == [
        ["| colbert-train 32x180, B 512", "0.589", "2.62 (21%)"]
    ]
    assert "lik commit `fedcba9`" in train[2] and "0123456" not in train[2]
    host = format_section(merged, select_ops("host")[0]).splitlines()
    assert host[6] == "| lik.maxsim, 32 x 128 query, 10 x 100 documents | 17.6 | 51.3 | 2.91x |"
    # The step the newer run skipped keeps the older run's time, labelled with its commit; no longer "skipped".
    assert host[7] == "| ColBERT training step, B 128 (32 x 180) (0123456) | 1 234 | 2 469 | 2.00x |"
    assert (
        "lik commits `fedcba9`, `0123456`" in host[2] and "Rows measured before `fedcba9` name their commit" in host[2]
    )
    assert not any(line.startswith("Skipped") for line in host)


def test_the_header_lists_every_commit_ceiling_command_and_json(synthetic_results):
    merged = merge_results([synthetic_results, _newer(synthetic_results)])
    header = format_section(merged, select_ops("chamfer")[0]).splitlines()[2]
    assert "lik commits `fedcba9`, `0123456`. Rows measured before `fedcba9` name their commit." in header
    assert (
        "4224 GB/s copy (read + write), 678 TFLOP/s matmul at `fedcba9`; 4250 GB/s, 680 TFLOP/s at `0123456`" in header
    )
    assert "Commands: `lik bench --quick --time-budget-s 400` (`fedcba9`); `lik bench --quick` (`0123456`)" in header
    assert header.endswith(
        "JSON: `benchmarks/results/bench_h200_fedcba9.json`, `benchmarks/results/bench_h200_0123456.json`."
    )
    # The forward table's one row comes from the older run alone: its own commit, ceilings and JSON, no marks.
    forward = format_section(merged, select_ops("forward")[0]).splitlines()
    assert "lik commit `0123456`, float16. Ceilings measured in the run: 4250 GB/s copy" in forward[2]
    assert forward[6].startswith("| colpali 1024x1024, B 1 000 | 0.392 | 0.453 (86%) |")
    report = format_report(merged)
    assert report.endswith("Wall time of the runs: 412 s at `0123456`, 300 s at `fedcba9`.")


def test_rows_keep_the_harness_order_and_skips_only_of_cells_no_run_has(synthetic_results):
    newer = _newer(synthetic_results)
    merged = merge_results([synthetic_results, newer])
    # 1M points: the older run skipped it (listed after its measured 100K cell), the newer one measured it. Within
    # an operator the runs' order holds; each entry says which run it came from.
    names = [(e["name"], e["run"]) for e in merged["cases"]]
    assert [n for n in names if n[0].startswith("chamfer/")] == [("chamfer/1x100000x3", 0), ("chamfer/1x1000000x3", 1)]
    assert [n for n in names if n[0].startswith("host/")] == [("host/maxsim-small", 1), ("host/colbert-train-step", 0)]
    assert merged["skipped"] == []
    chamfer = format_section(merged, select_ops("chamfer")[0]).splitlines()
    assert [line.split(" | ")[0] for line in chamfer if line.startswith("| N")] == [
        "| N 1, P 100 000, D 3 (0123456)",
        "| N 1, P 1 000 000, D 3",
    ]
    # lik.quantize came from the older run only: its lines name that commit.
    eight_bit = format_section(merged, select_ops("8bit")[0]).splitlines()
    assert "`lik.quantize fp16 [3000000, 128] -> int8`: 0.296 ms, 93% of its copy floor." in eight_bit
    merged = merge_results([synthetic_results, newer, {**newer, "shapes": [], "quantize": []}])
    assert merged["runs"][2]["meta"]["git_commit"].startswith("fedcba9")
    eight_bit = format_section(merged, select_ops("8bit")[0]).splitlines()
    assert "`lik.quantize fp16 [3000000, 128] -> int8`: 0.296 ms, 93% of its copy floor." in eight_bit


def test_the_order_of_the_files_decides(synthetic_results):
    older, newer = synthetic_results, _newer(synthetic_results)
    swapped = merge_results([newer, older])
    rows = format_section(swapped, select_ops("train")[0]).splitlines()
    assert rows[6].startswith("| colbert-train 32x180, B 512 | 0.589 | 2.82 (21%) |")
    assert merge_results([older]) is older  # one run: returned as it is, its tables unchanged


def test_an_unknown_schema_or_a_broken_file_is_one_line_naming_it(synthetic_results, tmp_path):
    good = _write(tmp_path, "good.json", synthetic_results)
    old_layout = _write(tmp_path, "width_h100.json", {"environment": {}, "shapes": []})
    with pytest.raises(ValueError, match=r"^--from-json .*width_h100\.json: unknown results schema None") as info:
        load_results([good, old_layout])
    assert "\n" not in str(info.value)
    future = _write(tmp_path, "future.json", {**synthetic_results, "schema": 3})
    with pytest.raises(ValueError, match=r"future\.json: unknown results schema 3 \(lik bench reads 1, 2\)"):
        load_results([future])
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ValueError, match=r"^--from-json .*broken\.json: Expecting"):
        load_results([good, broken])
    with pytest.raises(ValueError, match=r"^--from-json .*missing\.json: "):
        load_results([good, tmp_path / "missing.json"])
    with pytest.raises(ValueError, match="non-empty list"):
        load_results([])
    with pytest.raises(SystemExit, match=r"^lik bench: --from-json .*width_h100\.json: unknown results schema None"):
        bench_main(["--from-json", str(good), str(old_layout), "--no-plot", "--out", str(tmp_path / "out")])


def test_the_command_merges_files_into_tables_and_plots(synthetic_results, tmp_path, capsys, monkeypatch):
    old = _write(tmp_path, "old.json", synthetic_results)
    new = _write(tmp_path, "new.json", _newer(synthetic_results))
    out = tmp_path / "out"
    assert bench_main(["--from-json", str(old), str(new), "--ops", "train,host", "--no-plot", "--out", str(out)]) == 0
    written = (out / "bench.md").read_text()
    assert "| ColBERT training step, B 128 (32 x 180) (0123456) |" in written and "2.62 (21%)" in written
    assert "## Chamfer" not in written and written.rstrip() in capsys.readouterr().out
    # A single file goes through the same reader (and its schema check).
    assert bench_main(["--from-json", str(old), "--ops", "chamfer", "--no-plot", "--out", str(out)]) == 0
    assert (out / "bench.md").read_text().startswith("## Chamfer distance")

    plt = pytest.importorskip("matplotlib.pyplot")
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep each figure to read its title and bar labels
    plots = tmp_path / "plots"
    assert (
        bench_main(["--from-json", str(old), str(new), "--ops", "host", "--out", str(out), "--plots", str(plots)]) == 0
    )
    assert sorted(p.name for p in plots.iterdir()) == ["host.png"]
    (axes,) = figures[0].axes
    assert axes.get_title().endswith("NVIDIA H200, lik fedcba9, 0123456")
    assert [t.get_text() for t in axes.get_xticklabels()] == [
        "lik.maxsim, 32 x 128 query, 10 x 100 documents",
        "ColBERT training step, B 128 (32 x 180) (0123456)",
    ]
    heights = sorted(round(bar.get_height(), 1) for bar in axes.patches)
    assert heights[0] == 17.6  # the newer run's small call, in microseconds


def test_section_rows_of_a_single_run_are_its_own(synthetic_results):
    rows, runs = section_rows(synthetic_results, select_ops("host")[0])
    assert runs == [synthetic_results] and [r["name"] for r in rows] == ["host/maxsim-small", "host/colbert-train-step"]


def _chamfer_run(commit, measured, skipped=()):
    case = {"op": "chamfer", "floor": {"floor_ms": 1.0}, "cells": {"lik": {"status": "ok", "median_ms": 2.0}}}
    return {
        "schema": 2,
        "meta": {"device": "NVIDIA H200", "git_commit": commit},
        "ceilings": {"bandwidth_GBps": 4000.0, "matmul_TFLOPps": 600.0},
        "cases": [{**case, "name": f"chamfer/{n}", "label": n} for n in measured],
        "skipped": [f"chamfer/{n}" for n in skipped],
    }


def test_a_cell_new_to_a_later_run_takes_its_place_and_the_newer_order_wins_a_conflict():
    older = _chamfer_run("aaaaaaa", ["a", "c", "d"])
    newer = _chamfer_run("bbbbbbb", ["a", "b"], skipped=["c", "d"])  # b comes between a and c in the harness
    assert [e["label"] for e in merge_results([older, newer])["cases"]] == ["a", "b", "c", "d"]
    assert merge_results([older, newer])["skipped"] == []
    reordered = _chamfer_run("ccccccc", ["d", "a"])  # a harness that changed its order: the newer order holds
    assert [e["label"] for e in merge_results([older, reordered])["cases"]] == ["d", "a", "c"]
