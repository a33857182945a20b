"""The benchmark run: ceilings, then every (shape, method) cell, interleaved, written as JSON as it goes.

Per shape:

1. inputs (L2-normalised random, rotated through several sets when one set is small);
2. per method: a first call at the full shape (compilation, autotuning) whose output is checked against
   ``lik.maxsim_reference`` in float64 on a slice; the training step's gradients are checked on a sub-batch,
   and its repeatability (two runs, bitwise) recorded. A method that disagrees is marked ``mismatch``: still
   timed, never silently;
3. ``rounds`` timing rounds, each timing every method once in turn (methods interleaved, so drift in clocks
   or temperature hits all of them alike), in pairs of rounds rotated to start at the next method, the second
   of a pair reversed (:func:`round_order`: no method always runs first, when the board is coolest, or always
   after the same heavy neighbour); the cell's time is the median over rounds of do_bench medians;
4. peak memory per method in a fresh measurement.

Out-of-memory is caught and recorded as ``OOM``; any other failure as ``error`` with its message.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from .measure import (
    InputSets, Timer, free_memory, is_oom, make_inputs, measure_ceilings, measure_storage_ceilings, peak_memory_bytes,
    quantize_throughput,
)
from .methods import QUANTIZED_TOLERANCE, Method, peer_versions, select_methods
from .report import format_table, plot_results
from .roofline import Ceilings, floor, flop_count, min_bytes
from .shapes import SUITES, Shape, select_shapes

__all__ = [
    "main", "run", "run_shape", "round_order", "parse_args", "registry_listing", "environment", "TOLERANCE", "rel_error",
]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

# ||out - ref|| / ||ref|| above which a method is marked "mismatch" (scores and gradients alike).
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 2e-3}

# Slice of the full-shape scores compared with the float64 reference, and the training sub-batch.
CHECK_QUERIES, CHECK_DOCS, CHECK_TRAIN_BATCH = 2, 32, 8

Call = Callable[[torch.Tensor, torch.Tensor], object]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (``inf`` on a shape mismatch, NaN when ``out`` has NaN)."""
    if tuple(out.shape) != tuple(ref.shape):
        return float("inf")
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _forward_call(score: Callable) -> Call:
    def call(*operands):  # (Q, D), or an 8-bit method's prepared operands
        with torch.no_grad():
            return score(*operands)

    return call


def _train_call(score: Callable, labels: torch.Tensor) -> Call:
    """One in-batch contrastive step: scores [B, B], cross-entropy on the diagonal, grads of Q and D."""

    def call(Q, D):
        scores = score(Q, D)
        loss = F.cross_entropy(scores, labels[: scores.shape[0]])
        dq, dd = torch.autograd.grad(loss, (Q, D))
        return scores.detach(), dq, dd

    return call


def _reference_train_step(Q: torch.Tensor, D: torch.Tensor) -> tuple[torch.Tensor, ...]:
    import lik

    q64 = Q.detach().double().requires_grad_()
    d64 = D.detach().double().requires_grad_()
    scores = lik.maxsim_reference(q64, d64)
    loss = F.cross_entropy(scores, torch.arange(scores.shape[0], device=scores.device))
    dq, dd = torch.autograd.grad(loss, (q64, d64))
    return scores.detach(), dq, dd


def _check_scores(shape: Shape, scores: torch.Tensor, Q: torch.Tensor, D: torch.Tensor) -> float:
    """Error of a slice of full-shape scores against the float64 reference."""
    import lik

    nq, nd = min(shape.nq, CHECK_QUERIES), min(shape.b, CHECK_DOCS)
    expected = (shape.b,) if shape.suite == "forward" else (shape.nq, shape.b)
    if tuple(scores.shape) != expected:
        return float("inf")
    q = Q if Q.dim() == 2 else Q[:nq]
    ref = lik.maxsim_reference(q.detach().double(), D[:nd].detach().double())
    got = scores[:nd] if scores.dim() == 1 else scores[:nq, :nd]
    return rel_error(got, ref)


def _check(shape: Shape, call: Call, inputs: InputSets, operands: InputSets) -> dict:
    """First call at full shape (warm-up) and correctness; for training also gradients and repeatability.
    ``operands`` are what the method is called with (``inputs`` itself, or their 8-bit form); the reference
    always scores the float ``inputs``."""
    Q, D = inputs.sets[0]
    out = call(*operands.sets[0])
    if shape.suite != "train":
        return {"rel_err": _check_scores(shape, out, Q, D)}
    again = call(Q, D)
    repeatable = all(torch.equal(a, b) for a, b in zip(out[1:], again[1:]))
    errors = {"rel_err_scores": _check_scores(shape, out[0], Q, D)}
    del out, again
    n = min(shape.b, CHECK_TRAIN_BATCH)
    q_sub = Q[:n].detach().clone().requires_grad_()
    d_sub = D[:n].detach().clone().requires_grad_()
    got = call(q_sub, d_sub)
    ref = _reference_train_step(q_sub, d_sub)
    errors["rel_err_dq"] = rel_error(got[1], ref[1])
    errors["rel_err_dd"] = rel_error(got[2], ref[2])
    return {"rel_err": max(errors.values()), **errors, "repeatable": repeatable}


def _failure(exc: BaseException) -> dict:
    """The cell record of a failed call (the caller frees memory once the exception, and the frames it
    keeps alive, are gone)."""
    status = "OOM" if is_oom(exc) else "error"
    text = str(exc).strip()
    if status == "error":
        traceback.print_exc()
    return {"status": status, "error": f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:500]}


def _finish_cells(entry: dict, floor_ms: float) -> None:
    """Medians, % of floor (a cell's own ``floor_ms`` where it has one: 8-bit storage), best of each sweep and the
    ratio of every timed method to every other."""
    cells, timed = entry["cells"], {}
    for name, cell in cells.items():
        rounds = cell.get("round_ms")
        if not rounds or "error" in cell:
            continue
        cell["median_ms"] = statistics.median(rounds)
        cell["spread_pct"] = 100.0 * (max(rounds) - min(rounds)) / cell["median_ms"]
        cell["pct_of_floor"] = 100.0 * cell.get("floor_ms", floor_ms) / cell["median_ms"]
        timed[name] = cell["median_ms"]
    sweeps: dict[str, dict] = {}
    for name, cell in cells.items():
        sweep = cell.get("sweep")
        if sweep and name in timed and (sweep not in sweeps or timed[name] < sweeps[sweep]["median_ms"]):
            sweeps[sweep] = {"best": name, "median_ms": timed[name], "pct_of_floor": cells[name]["pct_of_floor"]}
    entry["sweeps"] = sweeps
    timed.update({sweep: best["median_ms"] for sweep, best in sweeps.items()})
    # ratios[a][b] = time(b) / time(a): how many times faster a is than b.
    entry["ratios"] = {a: {b: tb / ta for b, tb in timed.items() if b != a} for a, ta in timed.items()}


def round_order(calls: dict, round_index: int) -> list:
    """The ``(name, call)`` pairs of timing round ``round_index``: rounds come in pairs, the methods in their order
    rotated to start at the ``round_index // 2``-th, then that order reversed. On a power-capped GPU a method's time
    depends on what ran just before it (the first timing of a phase is the fast one, BENCHMARKS.md): a fixed order
    would favour the first method every round, and a rotation alone keeps every method behind the same neighbour
    (a heavy one slows it in every round); the reversed rounds put it behind its other neighbour.

    Example: methods ``a, b, c`` run ``a b c``, ``c b a``, ``b c a``, ``a c b``, ``c a b``, ``b a c``."""
    items = list(calls.items())
    start = (round_index // 2) % max(1, len(items))
    order = items[start:] + items[:start]
    return order[::-1] if round_index % 2 else order


def run_shape(
    shape: Shape,
    methods: list[Method],
    unavailable: dict[str, str],
    *,
    dtype: torch.dtype,
    device: torch.device,
    timer: Timer,
    ceilings: Ceilings,
    rounds: int,
    rotate_bytes: int,
    log: Callable[[str], None],
    storage_ceilings: dict[str, Ceilings] | None = None,
) -> dict:
    """Benchmark every applicable method at one shape; returns the shape's JSON entry.

    ``storage_ceilings``: the ceilings of 8-bit methods' floors by storage (matmul rate of that type)."""
    fl = floor(shape, torch.finfo(dtype).bits // 8, ceilings)
    entry = {"name": shape.name, "shape": asdict(shape), "floor": fl.as_dict(), "cells": {}}
    train = shape.suite == "train"
    try:
        inputs = make_inputs(shape, dtype, device, rotate_bytes=rotate_bytes, requires_grad=train)
    except Exception as exc:
        entry["error"] = _failure(exc)
    if "error" in entry:
        free_memory(device)
        return entry
    entry["input_sets"] = len(inputs)
    labels = torch.arange(shape.b, device=device)
    calls: dict[str, Call] = {}
    operands: dict[str, InputSets] = {}
    for method in methods:
        if shape.suite not in method.suites or not method.applies(shape):
            continue
        cell = entry["cells"][method.name] = {"sweep": method.sweep} if method.sweep else {}
        if method.name in unavailable:
            cell.update(status="unavailable", error=unavailable[method.name])
            continue
        start = time.perf_counter()
        try:
            score = method.build(shape)
            call = _train_call(score, labels) if train else _forward_call(score)
            operands[method.name] = inputs
            if method.prepare is not None:  # quantized once per input set, outside the timing
                with torch.no_grad():
                    operands[method.name] = InputSets([method.prepare(shape, Q, D) for Q, D in inputs.sets])
            cell.update(_check(shape, call, inputs, operands[method.name]))
        except Exception as exc:
            cell.update(_failure(exc))
        free_memory(device)
        if "error" in cell:
            operands.pop(method.name, None)
            log(f"  {method.name:26s} {cell['status']}: {cell['error'][:120]}")
            continue
        tolerance = QUANTIZED_TOLERANCE[method.storage] if method.storage else TOLERANCE[dtype]
        cell["status"] = "ok" if cell["rel_err"] <= tolerance else "mismatch"
        cell["check_s"] = time.perf_counter() - start
        if method.storage:
            cell["storage"] = method.storage
            own = (storage_ceilings or {}).get(method.storage, ceilings)
            cell["floor_ms"] = floor(shape, 1, own).ms
        calls[method.name] = call
        log(f"  {method.name:26s} {cell['status']} rel_err {cell['rel_err']:.1e}, first call and check "
            f"{cell['check_s']:.1f} s" + ("" if cell.get("repeatable", True) else ", not bitwise repeatable"))

    for round_index in range(rounds):
        for name, call in round_order(calls, round_index):
            cell = entry["cells"][name]
            if "error" in cell:
                continue
            try:
                cell.setdefault("round_ms", []).append(timer.median_ms(lambda: call(*operands[name].next())))
            except Exception as exc:
                cell.update(_failure(exc))
            if "error" in cell:
                free_memory(device)

    for name, call in calls.items():
        cell = entry["cells"][name]
        if "error" in cell:
            continue
        try:
            peak = peak_memory_bytes(lambda: call(*operands[name].sets[0]), device)
            cell["peak_MB"] = None if peak is None else peak / 2**20
        except Exception as exc:
            cell.update(_failure(exc))
        if "error" in cell:
            free_memory(device)
    _finish_cells(entry, fl.ms)
    for name, cell in entry["cells"].items():
        if "median_ms" in cell:
            flag = "" if cell["status"] == "ok" else f"  MISMATCH rel_err={cell['rel_err']:.2e}"
            log(f"  {name:26s} {cell['median_ms']:10.4f} ms {cell['pct_of_floor']:6.1f}% of floor{flag}")
    del inputs, calls, operands
    free_memory(device)
    return entry


def _git(*args: str) -> str | None:
    root = Path(__file__).resolve().parents[3]
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _source_digest() -> str:
    """sha256 over the package's Python sources: identifies the code even where there is no git checkout."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _gpu_state() -> str | None:
    """Clocks, power and temperature as nvidia-smi reports them (read-only query), for the record."""
    fields = "name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu,utilization.gpu"
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def environment(device: torch.device) -> dict:
    """Device, versions and code identity of this run."""
    import lik

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    status = _git("status", "--porcelain", "--untracked-files=no")
    info = {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "lik": lik.__version__,
        "peers": peer_versions(),
        "git_commit": os.environ.get("LIK_COMMIT") or _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "source_sha256": _source_digest(),
        "device": platform.processor() or platform.machine(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            device=props.name,
            capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            memory_GB=props.total_memory / 1e9,
            l2_MB=getattr(props, "L2_cache_size", 0) / 2**20,
            gpu_state_before=_gpu_state(),
        )
    return info


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags of ``lik bench`` / ``benchmarks/run.py``."""
    p = argparse.ArgumentParser(prog="lik bench", description=__doc__.splitlines()[0])
    p.add_argument("--suite", default="all",
                   help="comma-separated suites: forward, multi, train, or all (default all)")
    p.add_argument("--shapes", default=None,
                   help="comma-separated substrings; keep only shapes whose name contains one (e.g. colpali-train)")
    p.add_argument("--methods", default=None,
                   help="comma-separated method names or sweeps (default: all), e.g. lik,flash-maxsim,eager-chunked")
    p.add_argument("--out", default="bench_out", help="output directory (JSON, table, plot); default bench_out")
    p.add_argument("--quick", action="store_true", help="the quick subset of shapes, fewer rounds, shorter reps")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on the CPU with a perf_counter timer: tests the plumbing, not performance")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="input dtype (default fp16; fp32 on --smoke)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 3, quick 2, smoke 1)")
    p.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up per timing (ms)")
    p.add_argument("--rep-ms", type=float, default=None, help="do_bench timed time per timing (ms; default 100, quick 50)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="start no new shape after this many seconds (the rest is recorded as skipped)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    p.add_argument("--list", action="store_true", help="print the selected shapes and methods with their floors' "
                   "FLOPs and bytes, and exit")
    p.add_argument("--ceilings", action="store_true",
                   help="no shapes: measure the machine's ceilings (device copy, matmul per dtype, pinned host "
                   "copies) into OUT/ceilings.json")
    p.add_argument("--from-json", default=None,
                   help="no run: re-print the table and redraw the plot of an existing results JSON")
    return p.parse_args(argv)


def _write_json(path: Path, results: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(path)


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict:
    """Run the benchmark described by ``args``; writes ``results.json`` under ``args.out`` and returns it."""
    started = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("lik bench: no CUDA device; use --smoke for the CPU plumbing check")
    dtype = DTYPES[args.dtype or ("fp32" if args.smoke else "fp16")]
    if dtype == torch.float32 and device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32: lik's fp32 numbers are measured with it
    shapes = _selected_shapes(args)
    methods = select_methods(args.methods.split(",") if args.methods else None)
    rounds = args.rounds or (1 if args.smoke else 2 if args.quick else 3)
    rep_ms = args.rep_ms or (20.0 if args.smoke else 50.0 if args.quick else 100.0)
    timer = Timer(device, warmup_ms=args.warmup_ms, rep_ms=rep_ms)
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20) if device.type == "cuda" else 0
    rotate_bytes = 4 * l2

    unavailable = {m.name: r for m in methods if (r := m.unavailable_reason(device)) is not None}
    if args.smoke:
        ceilings, how = measure_ceilings(timer, copy_bytes=2**24, matmul_n=256)
    else:
        ceilings, how = measure_ceilings(timer, copy_bytes=2**30, matmul_n=8192)
    log(f"lik bench on {device}: {ceilings.bandwidth_bytes_per_s / 1e9:.0f} GB/s copy, "
        f"{ceilings.matmul_flops_per_s / 1e12:.4g} TFLOP/s matmul; {len(shapes)} shapes")
    for name, reason in unavailable.items():
        log(f"  unavailable: {name}: {reason}")
    # 8-bit methods: their floors' matmul rates, and the throughput of lik.quantize that stores their corpora.
    suites = {shape.suite for shape in shapes}
    eight_bit = [m for m in methods if m.storage and suites & set(m.suites) and m.name not in unavailable]
    storage_ceilings, quantize = {}, []
    if eight_bit:
        storage_ceilings, how["storage_matmul"] = measure_storage_ceilings(
            timer, ceilings, {m.storage for m in eight_bit}, matmul_n=256 if args.smoke else 8192)
        if any(m.name.startswith("lik-") for m in eight_bit):
            quantize = quantize_throughput(timer, ceilings, rows=4096 if args.smoke else 3_000_000)
        for record in quantize:
            log(f"  {record['what']}: {record['median_ms']:.3f} ms, {record['pct_of_floor']:.0f}% of its copy floor")

    results = {
        "schema": 1,
        "meta": {
            **environment(device),
            "argv": sys.argv,
            "settings": {
                "dtype": str(dtype).removeprefix("torch."), "rounds": rounds, "warmup_ms": args.warmup_ms,
                "rep_ms": rep_ms, "rotate_bytes": rotate_bytes, "quick": args.quick, "smoke": args.smoke,
                "timer": "triton.testing.do_bench median" if device.type == "cuda" else "perf_counter median",
                "tolerance": TOLERANCE[dtype],
            },
        },
        "ceilings": ceilings.as_dict(),
        "storage_ceilings": {k: c.as_dict() for k, c in storage_ceilings.items()},
        "ceiling_measurement": how,
        "quantize": quantize,
        "methods": {
            m.name: {"suites": list(m.suites), "sweep": m.sweep, "unavailable": unavailable.get(m.name)}
            for m in methods
        },
        "shapes": [],
        "skipped_shapes": [],
    }
    json_path = out_dir / "results.json"
    for shape in shapes:
        elapsed = time.perf_counter() - started
        if args.time_budget_s is not None and elapsed > args.time_budget_s:
            results["skipped_shapes"].append(shape.name)
            log(f"{shape.name}: skipped (time budget {args.time_budget_s:.0f} s spent)")
            continue
        log(f"{shape.name}  [{elapsed:6.1f} s]")
        results["shapes"].append(run_shape(
            shape, methods, unavailable, dtype=dtype, device=device, timer=timer, ceilings=ceilings,
            rounds=rounds, rotate_bytes=rotate_bytes, log=log, storage_ceilings=storage_ceilings,
        ))
        results["wall_s"] = time.perf_counter() - started
        _write_json(json_path, results)
    if device.type == "cuda":
        results["meta"]["gpu_state_after"] = _gpu_state()
    results["wall_s"] = time.perf_counter() - started
    _write_json(json_path, results)
    return results


def _selected_shapes(args: argparse.Namespace) -> list[Shape]:
    suites = list(SUITES) if args.suite == "all" else args.suite.split(",")
    shapes = select_shapes(suites, quick=args.quick, smoke=args.smoke)
    if args.shapes:
        wanted = [w for w in args.shapes.split(",") if w]
        shapes = [s for s in shapes if any(w in s.name for w in wanted)]
        if not shapes:
            raise SystemExit(f"lik bench: no shape matches --shapes {args.shapes!r}")
    return shapes


def registry_listing(args: argparse.Namespace) -> str:
    """The shapes and methods a run with ``args`` would cover (no device work)."""
    itemsize = torch.finfo(DTYPES[args.dtype or ("fp32" if args.smoke else "fp16")]).bits // 8
    methods = select_methods(args.methods.split(",") if args.methods else None)
    lines = [f"{'shape':30s} {'GFLOP':>10s} {'MB':>10s}  methods"]
    for shape in _selected_shapes(args):
        names = [m.name for m in methods if shape.suite in m.suites and m.applies(shape)]
        lines.append(f"{shape.name:30s} {flop_count(shape) / 1e9:10.1f} {min_bytes(shape, itemsize) / 1e6:10.1f}  "
                     + ", ".join(names))
    return "\n".join(lines)


def _report(results: dict, out_dir: Path, plot: bool, log: Callable[[str], None]) -> None:
    table = format_table(results)
    (out_dir / "table.txt").write_text(table + "\n")
    if plot:
        log(plot_results(results, out_dir / "bench.png"))
    log(table)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``lik bench`` and ``benchmarks/run.py``; returns the process exit code."""
    args = parse_args(argv)
    if args.list:
        print(registry_listing(args))
        return 0
    if args.ceilings:
        from .ceilings import main as measure_ceilings_only

        measure_ceilings_only(args.out, smoke=args.smoke, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms or 100.0)
        return 0
    out_dir = Path(args.out)
    if args.from_json:
        out_dir.mkdir(parents=True, exist_ok=True)
        results = json.loads(Path(args.from_json).read_text())
    else:
        results = run(args)
    _report(results, out_dir, not args.no_plot, print)
    return 0
