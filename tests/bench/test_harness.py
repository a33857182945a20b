"""The benchmark harness on the CPU: registry, floor arithmetic, and the dense MaxSim tables' --smoke run end to end."""

from __future__ import annotations

import json

import pytest
import torch

from lik.bench import CANONICAL_SHAPES, Ceilings, Method, Shape, floor, flop_count, main, min_bytes, select_methods
from lik.bench.measure import Timer
from lik.bench.methods import chunked_einsum_maxsim, einsum_maxsim
from lik.bench.cells import round_order, run_shape
from lik.bench.ops import select_ops
from lik.bench.report import format_report
from lik.bench.shapes import WIDTHS, select_shapes


def test_registry_covers_the_canonical_shapes():
    names = {s.name for s in CANONICAL_SHAPES}
    for family in ("textual", "long-doc", "medium", "visual", "colpali"):
        assert {f"forward/{family}/B1000", f"forward/{family}/B10000"} <= names
    assert {"multi/textual/Nq32xB1024", "multi/long-doc/Nq32xB1024", "multi/colpali/Nq32xB128"} <= names
    for b in (128, 512, 2048):
        assert f"train/colbert-train/B{b}" in names
    for b in (32, 64, 128):
        assert f"train/colpali-train/B{b}" in names
    for d in WIDTHS:
        assert {f"width/colpali/B256/d{d}", f"width/textual/B10000/d{d}"} <= names
    assert len(names) == len(CANONICAL_SHAPES) == 19 + 2 * len(WIDTHS)
    quick = select_shapes(["forward", "multi", "train"], quick=True)
    assert 0 < len(quick) < 19 and all(s.quick for s in quick)
    assert all(s.d == 128 for s in CANONICAL_SHAPES if s.suite != "width")
    with pytest.raises(ValueError, match="unknown suite"):
        select_shapes(["fwd"])


def test_method_selection():
    assert [m.name for m in select_methods(["eager-chunked"])] == [
        "eager-chunked-16", "eager-chunked-64", "eager-chunked-256", "eager-chunked-1024"
    ]
    assert [m.name for m in select_methods(["lik-fast", "eager"])] == ["lik-fast", "eager"]
    with pytest.raises(ValueError, match="unknown method"):
        select_methods(["cublas"])
    # --quick leaves the swept chunk sizes out unless they are asked for
    assert not any(m.sweep for m in select_methods(None, quick=True))
    assert any(m.sweep for m in select_methods(None))


def test_floor_memory_bound_by_hand():
    shape = Shape("forward", "textual", 1, 32, 300, 1000)
    # 2 * 1 * 1000 * 32 * 300 * 128
    assert flop_count(shape) == 2_457_600_000
    # Q 32*128*2 + D 1000*300*128*2 + scores 1000*4
    assert min_bytes(shape, 2) == 8_192 + 76_800_000 + 4_000
    fl = floor(shape, 2, Ceilings(bandwidth_bytes_per_s=3e12, matmul_flops_per_s=800e12))
    assert fl.compute_ms == pytest.approx(0.003072)
    assert fl.memory_ms == pytest.approx(0.025604064)
    assert fl.ms == fl.memory_ms and fl.bound == "memory"


def test_floor_compute_bound_by_hand():
    shape = Shape("forward", "colpali", 1, 1024, 1024, 1000)
    fl = floor(shape, 2, Ceilings(bandwidth_bytes_per_s=4e12, matmul_flops_per_s=1e15))
    assert fl.flops == 268_435_456_000
    assert fl.bytes == 262_144 + 262_144_000 + 4_000
    assert fl.compute_ms == pytest.approx(0.268435456)
    assert fl.memory_ms == pytest.approx(0.065602536)
    assert fl.bound == "compute" and fl.ms == fl.compute_ms


def test_floor_training_step_by_hand():
    shape = Shape("train", "colbert-train", 128, 32, 180, 128)
    # forward 2*128*128*32*180*128, plus the dQ and dD gathers 2 * (2*128*128*32*128)
    assert flop_count(shape) == 24_159_191_040 + 268_435_456
    # read Q and D, write dQ and dD: 2 * (1_048_576 + 5_898_240); scores written and read back: 2 * 65_536
    assert min_bytes(shape, 2) == 13_893_632 + 131_072


def test_chunked_eager_matches_eager():
    gen = torch.Generator().manual_seed(0)
    Q, D = torch.randn(3, 5, 8, generator=gen), torch.randn(11, 7, 8, generator=gen)
    torch.testing.assert_close(chunked_einsum_maxsim(4)(Q, D), einsum_maxsim(Q, D))
    torch.testing.assert_close(chunked_einsum_maxsim(4)(Q[0], D), einsum_maxsim(Q[0], D))


def _run_one(method: Method, shape: Shape) -> dict:
    return run_shape(
        shape, [method], {}, dtype=torch.float32, device=torch.device("cpu"),
        timer=Timer(torch.device("cpu"), warmup_ms=0, rep_ms=1), ceilings=Ceilings(1e10, 1e10),
        rounds=2, rotate_bytes=0, log=lambda line: None,
    )


def test_wrong_method_is_marked_and_still_timed():
    wrong = Method("wrong", ("forward",), lambda shape: lambda Q, D: einsum_maxsim(Q, D) * 1.01)
    cell = _run_one(wrong, Shape("forward", "smoke", 1, 4, 6, 9, d=8))["cells"]["wrong"]
    assert cell["status"] == "mismatch" and cell["rel_err"] == pytest.approx(0.01, rel=1e-3)
    assert len(cell["round_ms"]) == 2 and cell["median_ms"] > 0


def test_eight_bit_method_is_prepared_once_per_input_set_and_checked_against_the_float_inputs():
    prepared = []

    def prepare(shape, Q, D):
        prepared.append(D.data_ptr())
        return Q, D.to(torch.float16), 0.98  # a "quantized" corpus and a wrong scale: 2% off

    method = Method("fake-8bit", ("forward",),
                    lambda shape: lambda Q, D16, scale: einsum_maxsim(Q, D16.float()) * scale,
                    storage="int8", prepare=prepare)
    shape = Shape("forward", "smoke", 1, 4, 6, 9, d=8)
    entry = _run_one(method, shape)
    cell = entry["cells"]["fake-8bit"]
    # 2% off is above int8's 1% allowance: marked, still timed; the quantizer ran once for the one input set.
    assert cell["status"] == "mismatch" and cell["rel_err"] == pytest.approx(0.02, rel=1e-2)
    assert len(prepared) == 1 and len(cell["round_ms"]) == 2
    assert cell["floor_ms"] == pytest.approx(floor(shape, 1, Ceilings(1e10, 1e10)).ms)
    assert cell["pct_of_floor"] == pytest.approx(100 * cell["floor_ms"] / cell["median_ms"])


def test_out_of_memory_is_recorded():
    def build(shape):
        def score(Q, D):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 48.00 GiB")

        return score

    cell = _run_one(Method("hungry", ("train",), build), Shape("train", "smoke", 4, 4, 6, 4, d=8))["cells"]["hungry"]
    assert cell["status"] == "OOM" and "median_ms" not in cell


def test_smoke_run_end_to_end(tmp_path, capsys, monkeypatch):
    # The plumbing, not the kernels: lik takes its CPU reference path here (the interpreted kernels are
    # tested in tests/ops, and would make this run take a minute).
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    argv = ["--smoke", "--ops", "forward,8bit,train,width", "--no-plot", "--out", str(tmp_path)]
    assert main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert {"device", "torch", "triton", "peers", "git_commit", "source_sha256"} <= set(results["meta"])
    assert results["meta"]["command"] == "lik bench " + " ".join(argv)
    assert results["ceilings"]["bandwidth_bytes_per_s"] > 0 and results["ceilings"]["matmul_flops_per_s"] > 0
    assert [e["shape"]["suite"] for e in results["shapes"]] == ["forward", "multi", "train", "width"]
    for entry in results["shapes"]:
        cells = entry["cells"]
        lik_name = "lik-deterministic" if entry["shape"]["suite"] == "train" else "lik"
        assert cells[lik_name]["status"] == "ok", cells[lik_name]
        assert cells[lik_name]["median_ms"] > 0 and cells[lik_name]["pct_of_floor"] > 0
        assert cells["flash-maxsim"]["status"] == "unavailable"
        if entry["shape"]["suite"] != "width":  # the width table times lik against the peers only
            assert cells["eager"]["status"] == "ok"
            assert entry["ratios"][lik_name]["eager"] * entry["ratios"]["eager"][lik_name] == pytest.approx(1.0)
    assert results["shapes"][2]["cells"]["lik-deterministic"]["repeatable"] is True
    assert results["shapes"][3]["shape"]["d"] == 40
    # 8-bit corpora: lik's int8 / fp8 cells pass the quantization-error check against their own 1-byte floor,
    # the peers' 8-bit paths are unavailable here, and lik.quantize is timed for both types.
    forward = results["shapes"][0]
    for name, storage in (("lik-int8", "int8"), ("lik-fp8", "fp8")):
        cell = forward["cells"][name]
        assert cell["status"] == "ok" and cell["storage"] == storage, cell
        assert 0 < cell["floor_ms"] <= forward["floor"]["floor_ms"]  # fewer bytes; on the CPU the same rates
    assert forward["cells"]["late-interaction-kernels-fp8"]["status"] == "unavailable"
    assert "lik-int8" not in results["shapes"][1]["cells"]  # the 8-bit table has no stacked-query rows
    assert [r["what"].rsplit(" ", 1)[1] for r in results["quantize"]] == ["int8", "fp8"]
    assert all(r["median_ms"] > 0 and r["pct_of_floor"] > 0 for r in results["quantize"])
    assert "eager-chunked" in forward["sweeps"]
    report = (tmp_path / "bench.md").read_text()
    for title in ("## MaxSim forward", "## 8-bit corpora", "## MaxSim training step", "## MaxSim at any embedding"):
        assert title in report
    printed = capsys.readouterr().out
    assert "flash-maxsim: skipped, its column will read n/a (needs a CUDA device)" in printed
    assert printed.rstrip().endswith(report.rstrip().splitlines()[-1])
    assert format_report(results, select_ops("forward,8bit,train,width")) == report.rstrip("\n")


def test_shape_filter():
    from lik.bench.runner import _selected_shapes, parse_args

    args = parse_args(["--ops", "train", "--shapes", "colpali-train,B2048"])
    names = [s.name for s in _selected_shapes(args, select_ops(args.ops))]
    assert names == [
        "train/colbert-train/B2048", "train/colpali-train/B32", "train/colpali-train/B64", "train/colpali-train/B128"
    ]
    args = parse_args(["--ops", "8bit", "--quick"])  # the 8-bit table alone: its seven forward cells
    assert len(_selected_shapes(args, select_ops(args.ops))) == 7
    from lik.bench.runner import plan

    assert [block for block, _, _ in plan(parse_args(["--suite", "train"]))] == ["train"]  # no other operator
    with pytest.raises(SystemExit, match="no cell matches"):
        plan(parse_args(["--ops", "train", "--shapes", "visual"]))
    with pytest.raises(SystemExit, match="unknown op"):
        main(["--ops", "fwd", "--list"])
    with pytest.raises(SystemExit, match="unknown method"):
        main(["--ops", "chamfer", "--methods", "likk", "--list"])


def test_rounds_rotate_in_pairs_and_reverse():
    """Rounds come in pairs: the methods rotated to start at the next one, then that order reversed, so no method
    is always first (the coolest board) or always behind the same neighbour (rotation alone keeps every method
    behind the same one); every method is still timed once a round."""
    called, timed = [], []

    class RecordingTimer:
        def median_ms(self, fn):
            before = len(called)
            fn()
            timed.append(called[before])
            return 1.0

    methods = [Method(name, ("forward",),
                      lambda shape, name=name: lambda Q, D: called.append(name) or einsum_maxsim(Q, D))
               for name in ("a", "b", "c")]
    entry = run_shape(
        Shape("forward", "smoke", 1, 4, 6, 9, d=8), methods, {}, dtype=torch.float32, device=torch.device("cpu"),
        timer=RecordingTimer(), ceilings=Ceilings(1e10, 1e10), rounds=4, rotate_bytes=0, log=lambda line: None,
    )
    assert timed == ["a", "b", "c", "c", "b", "a", "b", "c", "a", "a", "c", "b"]
    assert all(entry["cells"][name]["round_ms"] == [1.0] * 4 for name in "abc")
    orders = ["".join(name for name, _ in round_order({"a": 1, "b": 2, "c": 3}, r)) for r in range(8)]
    assert orders == ["abc", "cba", "bca", "acb", "cab", "bac", "abc", "cba"]
    # over six rounds every method runs in every place twice and behind each other method twice
    for name in "abc":
        assert sorted(order.index(name) for order in orders[:6]) == [0, 0, 1, 1, 2, 2]
        behind = [order[order.index(name) - 1] for order in orders[:6] if order.index(name) > 0]
        assert sorted(behind) == sorted(2 * [other for other in "abc" if other != name])
    assert round_order({}, 3) == []


def test_an_exhausted_budget_still_runs_each_blocks_first_item(tmp_path, monkeypatch):
    # A budget spent before the first cell: each operator still gets its first row (a table and a plot), and
    # only the rest of each block is skipped.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    argv = ["--smoke", "--ops", "forward,train", "--no-plot", "--time-budget-s", "0", "--out", str(tmp_path)]
    assert main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [e["shape"]["suite"] for e in results["shapes"]] == ["forward", "train"]
    assert "multi" in " ".join(results["skipped"])
