"""benchmarks/pylate_retrieval.py runs end to end at smoke size: lik's rows retrieve the exact top-10 (recall 1),
a missing peer is a skipped row with its reason, and the JSON holds the table it printed."""

from __future__ import annotations

import json

import pytest
import torch

from tests.scripts import load_script as load_repo_script



def load_script():
    return load_repo_script("benchmarks/pylate_retrieval.py", "pylate_retrieval")


def test_recall_counts_ties_at_the_kth_score():
    script = load_script()
    exact = torch.tensor([[5.0, 4.0, 4.0] + [1.0] * 8 + [3.0] * 9])
    names = [f"d{n}" for n in range(exact.shape[1])]
    tenth = [0, 1, 2] + list(range(11, 18))  # the top 10, with the tie at 3.0 broken one way
    other = [0, 1, 2] + list(range(12, 19))  # ... and the other way: just as exact
    worse = [0, 1, 2] + list(range(11, 17)) + [3]
    assert script.recall_at_k([[{"id": names[i]} for i in tenth]], exact, names) == 1.0
    assert script.recall_at_k([[{"id": names[i]} for i in other]], exact, names) == 1.0
    assert script.recall_at_k([[{"id": names[i]} for i in worse]], exact, names) == 0.9


def test_smoke_run(tmp_path, monkeypatch):
    pytest.importorskip("pylate.indexes")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the plumbing is under test, not the kernels
    script = load_script()
    assert script.main(["--smoke", "--skip", "voyager,plaid", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "pylate_retrieval.json").read_text())
    rows = {row["method"]: row for row in report["rows"]}
    for name in ("lik fp16 (PyLate wrapper)", "lik.Index.search fp16"):
        assert rows[name]["recall_at_10"] == 1.0 and rows[name]["qps"] > 0 and rows[name]["bytes"] > 0
    assert rows["lik int8 (PyLate wrapper)"]["recall_at_10"] >= 0.9
    assert rows["PyLate Voyager"]["note"] == "--skip"
    assert report["markdown"].count("\n| ") == len(rows) + 2  # the header, its rule, a line per method
