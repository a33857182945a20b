"""``lik bench``: ceilings, then every operator's cells, interleaved, written as JSON as it goes; then the tables and
the plots.

One run covers the operators of BENCHMARKS.md (``--ops``, default all): the dense MaxSim shapes of
:mod:`lik.bench.shapes` (forward, multi-query, 8-bit, training, widths; :mod:`lik.bench.cells`) and the cases of
the other operators (:mod:`lik.bench.ops`). A time budget (``--time-budget-s``; ``--quick`` sets 420 s) is shared
out between the operators by weight, unused time passing on to the next; a cell that would start past its
operator's share is listed as skipped, and ``--ops`` / ``--shapes`` run it later. Outputs under ``--out``:
``results.json`` (written after every cell), ``bench.md`` (the tables, also printed last) and, under ``--plots``,
one PNG per operator.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .cases import Case, run_case
from .cells import TOLERANCE, run_shape
from .measure import Timer, measure_ceilings, measure_storage_ceilings, quantize_throughput
from .methods import METHODS, Method, peer_versions, select_methods
from .ops import OPS, Op, select_ops
from .plots import plot_all
from .report import format_report, load_results, record_name
from .roofline import flop_count, min_bytes
from .shapes import EIGHT_BIT_CELLS, SUITES, Shape, select_shapes

__all__ = ["main", "run", "parse_args", "registry_listing", "environment", "plan"]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
QUICK_BUDGET_S = 420.0


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
    """Command-line flags of ``lik bench`` / ``python -m lik.bench`` / ``benchmarks/run.py``."""
    p = argparse.ArgumentParser(prog="lik bench", description=__doc__.splitlines()[0])
    p.add_argument("--ops", default="all", help="comma-separated operators (tables): " + ", ".join(o.name for o in OPS)
                   + " (default all)")
    p.add_argument("--suite", default=None, help="comma-separated MaxSim suites to keep: " + ", ".join(SUITES))
    p.add_argument("--shapes", default=None,
                   help="comma-separated substrings; keep only cells whose name contains one (e.g. colpali,chamfer/1x)")
    p.add_argument("--methods", default=None,
                   help="comma-separated method names or sweeps (default: every method of the selected tables)")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out",
                   help="output directory (results.json, bench.md); default $OUT, else bench_out")
    p.add_argument("--plots", default=None, help="directory of the PNG plots (default OUT/plots)")
    p.add_argument("--quick", action="store_true",
                   help=f"the quick subset of cells, 2 rounds of 50 ms, a {QUICK_BUDGET_S:.0f} s budget "
                   "(one device call)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny cells on the CPU with a perf_counter timer: tests the plumbing, not performance")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="MaxSim input dtype (default fp16; fp32 on --smoke)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 3, quick 2, smoke 1)")
    p.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up per timing (ms)")
    p.add_argument("--rep-ms", type=float, default=None,
                   help="do_bench timed time per timing (ms; default 100, quick 50)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="start no cell after this many seconds (shared out between the tables; the rest is listed "
                   "as skipped)")
    p.add_argument("--no-plot", action="store_true", help="draw no plots")
    p.add_argument("--list", action="store_true", help="print the selected cells and methods, and exit")
    p.add_argument("--ceilings", action="store_true",
                   help="no cells: measure the machine's ceilings (device copy, matmul per dtype, pinned host "
                   "copies) into OUT/ceilings.json")
    p.add_argument("--from-json", nargs="+", default=None, metavar="JSON",
                   help="no run: print the tables of one or more results JSON files (merged in order, a later "
                   "file's cell replacing an earlier one's) and redraw their plots")
    args = p.parse_args(argv)
    if args.suite and args.ops == "all":  # --suite names MaxSim suites: the dense MaxSim tables only
        args.ops = ",".join(op.name for op in OPS if op.suites)
    return args


def _maxsim_methods(args: argparse.Namespace, ops: list[Op]) -> list[Method]:
    names = args.methods.split(",") if args.methods else None
    known = {m.name for m in METHODS} | {m.sweep for m in METHODS if m.sweep}
    if names is not None:
        return select_methods([n for n in names if n in known])
    wanted = {c for op in ops if op.suites for c in (*op.lik, *op.peers, *op.others)}
    return [m for m in select_methods(None, quick=args.quick) if m.name in wanted or m.sweep in wanted]


def _selected_shapes(args: argparse.Namespace, ops: list[Op]) -> list[Shape]:
    suites = {s for op in ops for s in op.suites}
    if args.suite:
        requested = args.suite.split(",") if args.suite != "all" else list(SUITES)
        select_shapes(requested)  # names an unknown suite
        suites &= set(requested)
    shapes = select_shapes([s for s in SUITES if s in suites], quick=args.quick, smoke=args.smoke)
    names = {op.name for op in ops}
    if "forward" not in names:  # the 8-bit table alone: its cells only
        shapes = [s for s in shapes if s.suite != "forward" or s.name in EIGHT_BIT_CELLS or s.family == "smoke"]
    return [s for s in shapes if _wanted(args, s.name)]


def _wanted(args: argparse.Namespace, name: str) -> bool:
    return not args.shapes or any(w in name for w in args.shapes.split(",") if w)


def _selected_cases(args: argparse.Namespace, op: Op) -> list[Case]:
    names = set(args.methods.split(",")) if args.methods else None
    cases = []
    for case in op.cases():
        if (args.quick and not case.quick) or not _wanted(args, case.name):
            continue
        if names is not None:
            methods = {k: v for k, v in case.methods.items() if k in names}
            if not methods:
                continue
            case = Case(**{**case.__dict__, "methods": methods})
        cases.append(case)
    return cases


def plan(args: argparse.Namespace) -> list[tuple[str, float, list]]:
    """The run's blocks in order: ``(name, weight, items)`` where items are MaxSim shapes or cases; a block is one
    operator's share of the time budget (the dense MaxSim tables share theirs by suite)."""
    ops = select_ops(args.ops)
    shapes = _selected_shapes(args, ops)
    weights = {op.name: op.weight for op in ops}
    blocks = []
    scoring = [s for s in shapes if s.suite in ("forward", "multi")]
    if scoring:
        blocks.append(("forward", weights.get("forward", 0) + weights.get("8bit", 0), scoring))
    for suite in ("train", "width"):
        chosen = [s for s in shapes if s.suite == suite]
        if chosen:
            blocks.append((suite, weights.get(suite, 1.0), chosen))
    for op in ops:
        if op.cases is not None:
            cases = _selected_cases(args, op)
            if cases:
                blocks.append((op.name, op.weight, cases))
    if not blocks:
        raise SystemExit(f"lik bench: no cell matches --ops {args.ops!r} --shapes {args.shapes!r}")
    return blocks


def _write_json(path: Path, results: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(path)


def _command(argv: list[str]) -> str:
    return " ".join(["lik bench", *argv]).strip()


def run(args: argparse.Namespace, log: Callable[[str], None] = print, argv: list[str] | None = None) -> dict:
    """Run the benchmark described by ``args``; writes ``results.json`` under ``args.out`` and returns it."""
    # Everything imported so far lives as long as the process: keep it out of the collections that free_memory
    # runs between methods (a full collection of torch's and triton's objects took ~0.4 s each).
    gc.freeze()
    try:
        return _run(args, log, argv)
    finally:
        gc.unfreeze()  # handed back, so that the interpreter's own shutdown frees them


def _run(args: argparse.Namespace, log: Callable[[str], None], argv: list[str] | None) -> dict:
    started = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("lik bench: no CUDA device; use --smoke for the CPU plumbing check")
    dtype = DTYPES[args.dtype or ("fp32" if args.smoke else "fp16")]
    if dtype == torch.float32 and device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32: lik's fp32 numbers are measured with it
    ops = select_ops(args.ops)
    blocks = plan(args)
    methods = _maxsim_methods(args, ops)
    rounds = args.rounds or (1 if args.smoke else 2 if args.quick else 3)
    rep_ms = args.rep_ms or (20.0 if args.smoke else 50.0 if args.quick else 100.0)
    budget = args.time_budget_s if args.time_budget_s is not None else (QUICK_BUDGET_S if args.quick else None)
    timer = Timer(device, warmup_ms=args.warmup_ms, rep_ms=rep_ms)
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20) if device.type == "cuda" else 0

    unavailable = {m.name: r for m in methods if (r := m.unavailable_reason(device)) is not None}
    size = dict(copy_bytes=2**24, matmul_n=256) if args.smoke else dict(copy_bytes=2**30, matmul_n=8192)
    ceilings, how = measure_ceilings(timer, **size)
    log(f"lik bench on {device}: {ceilings.bandwidth_bytes_per_s / 1e9:.0f} GB/s copy, "
        f"{ceilings.matmul_flops_per_s / 1e12:.4g} TFLOP/s matmul; "
        + ", ".join(f"{name} ({len(items)})" for name, _, items in blocks))
    for name, reason in unavailable.items():
        log(f"  {name}: skipped, its column will read n/a ({reason})")
    suites = {item.suite for _, _, items in blocks for item in items if isinstance(item, Shape)}
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
        "schema": 2,
        "meta": {
            **environment(device),
            "argv": sys.argv,
            "command": _command(argv if argv is not None else sys.argv[1:]),
            "ops": [op.name for op in ops],
            "settings": {
                "dtype": str(dtype).removeprefix("torch."), "rounds": rounds, "warmup_ms": args.warmup_ms,
                "rep_ms": rep_ms, "rotate_bytes": 4 * l2, "quick": args.quick, "smoke": args.smoke,
                "time_budget_s": budget,
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
        "cases": [],
        "skipped": [],
    }
    json_path = out_dir / "results.json"
    noted: set[str] = set()
    for index, (block, weight, items) in enumerate(blocks):
        deadline = None
        if budget is not None:
            left = budget - (time.perf_counter() - started)
            deadline = time.perf_counter() + left * weight / max(sum(w for _, w, _ in blocks[index:]), 1e-9)
        log(f"[{block}]")
        for position, item in enumerate(items):
            # Every block runs its first item whatever the clock says, so every table and plot has a row.
            if position > 0 and deadline is not None and time.perf_counter() > deadline:
                results["skipped"].append(item.name)
                log(f"{item.name}: skipped (time budget)")
                continue
            log(f"{item.name}  [{time.perf_counter() - started:6.1f} s]")
            if isinstance(item, Shape):
                results["shapes"].append(run_shape(
                    item, methods, unavailable, dtype=dtype, device=device, timer=timer, ceilings=ceilings,
                    rounds=rounds, rotate_bytes=4 * l2, log=log, storage_ceilings=storage_ceilings,
                ))
            else:
                results["cases"].append(run_case(item, device=device, timer=timer, ceilings=ceilings, rounds=rounds,
                                                 smoke=args.smoke, log=log, noted=noted))
            results["wall_s"] = time.perf_counter() - started
            _write_json(json_path, results)
    if device.type == "cuda":
        results["meta"]["gpu_state_after"] = _gpu_state()
    results["wall_s"] = time.perf_counter() - started
    _write_json(json_path, results)
    return results


def registry_listing(args: argparse.Namespace) -> str:
    """The cells and methods a run with ``args`` would cover (no device work)."""
    itemsize = torch.finfo(DTYPES[args.dtype or ("fp32" if args.smoke else "fp16")]).bits // 8
    methods = _maxsim_methods(args, select_ops(args.ops))
    lines = [f"{'cell':34s} {'GFLOP':>10s} {'MB':>10s}  methods"]
    for _, _, items in plan(args):
        for item in items:
            if isinstance(item, Shape):
                names = [m.name for m in methods if item.suite in m.suites and m.applies(item)]
                lines.append(f"{item.name:34s} {flop_count(item) / 1e9:10.1f} {min_bytes(item, itemsize) / 1e6:10.1f}  "
                             + ", ".join(names))
            else:
                lines.append(f"{item.name:34s} {'':10s} {'':10s}  " + ", ".join(item.methods))
    return "\n".join(lines)


def _check_method_names(args: argparse.Namespace) -> None:
    """A ``--methods`` name that no selected table has is a typo: say so before any device work."""
    if not args.methods:
        return
    known = {m.name for m in METHODS} | {m.sweep for m in METHODS if m.sweep}
    for op in select_ops(args.ops):
        if op.cases is not None:
            known |= {name for case in op.cases() for name in case.methods}
    unknown = [n for n in args.methods.split(",") if n and n not in known]
    if unknown:
        raise SystemExit(f"lik bench: unknown method(s) {unknown}; choose from {sorted(known)}")


def _report(results: dict, args: argparse.Namespace, log: Callable[[str], None]) -> None:
    ops = select_ops(args.ops)
    text = format_report(results, ops)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.md").write_text(text + "\n")
    if not args.no_plot:
        log(plot_all(results, Path(args.plots) if args.plots else out_dir / "plots", ops))
    log(f"record: copy {out_dir / 'results.json'} to benchmarks/results/{record_name(results)}.json")
    log(text)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``lik bench`` and ``benchmarks/run.py``; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    try:
        select_ops(args.ops)
    except ValueError as exc:
        raise SystemExit(f"lik bench: {exc}") from None
    _check_method_names(args)
    if args.list:
        print(registry_listing(args))
        return 0
    if args.ceilings:
        from .ceilings import main as measure_ceilings_only

        measure_ceilings_only(args.out, smoke=args.smoke, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms or 100.0)
        return 0
    if args.from_json:
        try:
            results = load_results(args.from_json)
        except ValueError as exc:
            raise SystemExit(f"lik bench: {exc}") from None
    else:
        results = run(args, argv=argv)
    _report(results, args, print)
    return 0
