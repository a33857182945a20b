"""One plot per operator, drawn from a synthetic results JSON; and the note when matplotlib is missing."""

from __future__ import annotations

import sys

import pytest

from lik.bench.ops import OPS, select_ops
from lik.bench.plots import plot_all, plot_op

PNG = b"\x89PNG\r\n\x1a\n"


def test_one_png_per_operator_with_rows(synthetic_results, tmp_path):
    pytest.importorskip("matplotlib")
    note = plot_all(synthetic_results, tmp_path / "plots")
    drawn = sorted(p.name for p in (tmp_path / "plots").iterdir())
    # the synthetic run has rows for these five tables only; the others draw nothing
    assert drawn == sorted(["forward.png", "8bit.png", "train.png", "chamfer.png", "host.png"])
    assert note == f"plots: forward, 8bit, train, chamfer, host in {tmp_path / 'plots'}"
    for path in (tmp_path / "plots").iterdir():
        assert path.read_bytes().startswith(PNG) and path.stat().st_size > 5_000


def test_a_table_without_a_timed_cell_draws_nothing(synthetic_results, tmp_path):
    pytest.importorskip("matplotlib")
    for cell in synthetic_results["cases"][0]["cells"].values():
        cell.pop("median_ms", None)
    assert plot_op(synthetic_results, select_ops("chamfer")[0], tmp_path / "chamfer.png") is False
    assert not (tmp_path / "chamfer.png").exists()
    assert [op.name for op in OPS] == [
        "forward",
        "8bit",
        "train",
        "width",
        "packed",
        "packed-stream",
        "index",
        "reductions",
        "stored",
        "contrastive",
        "fused_head",
        "msda",
        "chamfer",
        "host",
    ]


def test_without_matplotlib_nothing_is_drawn_and_the_note_says_how_to_redraw(synthetic_results, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    note = plot_all(synthetic_results, tmp_path / "plots")
    assert note.startswith("plots skipped: matplotlib is not installed")
    assert "lik bench --from-json results.json --plots DIR" in note
    assert not (tmp_path / "plots").exists()
