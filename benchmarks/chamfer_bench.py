"""Chamfer distance on the GPU: lik against the libraries users pick instead, in one process.

    python benchmarks/chamfer_bench.py --out DIR [--quick]

Methods (each where it runs): lik.chamfer_distance; flash-maxsim's flash_chamfer / flash_chamfer_train (one cloud
per call, so batches loop); chamferdist's ChamferDistance (a CUDA extension built at install); KeOps (pykeops
LazyTensor min-reductions; for training, its argmin followed by a differentiable gather, as a KeOps user writes
it); naive torch.cdist + min where the [N, P1, P2] matrix fits. Forward (no grad) and forward + backward, median
ms and peak memory above the inputs. Accuracy: each method's nearest-neighbour distances for 2 000 sampled
points against float64 brute force on the GPU (max relative error). Ceilings measured in the same run: cuBLAS
float32 matmul rate at "highest" (no TF32) and with TF32, for the D = 128 distance FLOPs (2 D P1 P2 per
direction). Writes DIR/chamfer.json and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import lik  # noqa: E402
from lik.bench.measure import peak_memory_bytes  # noqa: E402


def _time_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = (time.perf_counter() - start) * 1e3
    if once > 40:
        times = []
        for _ in range(3):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end))
        return sorted(times)[1]
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def _peak_mb(fn) -> float:
    return peak_memory_bytes(fn, torch.device("cuda")) / 2**20


def _methods(n, p, d):
    methods = {}

    def lik_loss(x, y):
        return lik.chamfer_distance(x, y)[0]

    methods["lik"] = lik_loss
    try:
        from flash_maxsim import flash_chamfer, flash_chamfer_train

        def flash_loss(x, y):
            fn = flash_chamfer_train if x.requires_grad else flash_chamfer
            return sum(fn(x[i], y[i]) for i in range(x.shape[0])) / x.shape[0]

        methods["flash_chamfer"] = flash_loss
    except Exception as exc:  # recorded, not fatal: the table says which peers ran
        methods["flash_chamfer"] = repr(exc)
    try:
        from chamferdist import ChamferDistance

        cd = ChamferDistance()

        def chamferdist_loss(x, y):
            # Its "mean" point reduction and batch mean equal PyTorch3D's default.
            return cd(x, y, bidirectional=True, point_reduction="mean", batch_reduction="mean")

        methods["chamferdist"] = chamferdist_loss
    except Exception as exc:
        methods["chamferdist"] = repr(exc)
    try:
        from pykeops.torch import LazyTensor

        def keops_loss(x, y):
            xi, yj = LazyTensor(x.detach()[:, :, None, :]), LazyTensor(y.detach()[:, None, :, :])
            dist = ((xi - yj) ** 2).sum(-1)
            ix = dist.argmin(dim=2).long().view(x.shape[0], -1)
            iy = dist.argmin(dim=1).long().view(y.shape[0], -1)
            near_y = torch.gather(y, 1, ix[..., None].expand(-1, -1, d))
            near_x = torch.gather(x, 1, iy[..., None].expand(-1, -1, d))
            return ((x - near_y) ** 2).sum(-1).mean(1).mean() + ((y - near_x) ** 2).sum(-1).mean(1).mean()

        methods["keops"] = keops_loss
    except Exception as exc:
        methods["keops"] = repr(exc)
    if n * p * p * 4 * 3 < 24 * 2**30:
        def naive_loss(x, y):
            dist = torch.cdist(x, y) ** 2
            return dist.min(2).values.mean(1).mean() + dist.min(1).values.mean(1).mean()

        methods["naive_cdist"] = naive_loss
    return methods


def _nn_error(method_name, fn_dist, x, y, sample):
    """Max relative error of the nearest-neighbour distance of ``sample`` points of cloud 0."""
    xs = x[0, sample].double()
    exact = torch.cat([torch.cdist(xs[i:i + 256], y[0].double()).pow(2).min(1).values for i in range(0, len(xs), 256)])
    got = fn_dist(x, y)[0, sample].double()
    return ((got - exact).abs() / exact.clamp(min=1e-30)).max().item()


def _distance_fns():
    fns = {"lik": lambda x, y: lik.nearest_neighbors(x, y)[0]}
    try:
        from flash_maxsim.flash_chamfer import flash_chamfer_one_direction

        fns["flash_chamfer"] = lambda x, y: torch.stack(
            [flash_chamfer_one_direction(x[i], y[i], "l2_sq") for i in range(x.shape[0])]
        )
    except Exception:
        pass
    try:
        from pykeops.torch import LazyTensor

        def keops_dist(x, y):
            xi, yj = LazyTensor(x[:, :, None, :]), LazyTensor(y[:, None, :, :])
            return ((xi - yj) ** 2).sum(-1).min(dim=2).view(x.shape[0], -1)

        fns["keops"] = keops_dist
    except Exception:
        pass
    return fns


def _cublas_rates():
    a = torch.randn(16384, 128, device="cuda")
    b = torch.randn(128, 16384, device="cuda")
    flops = 2 * 16384 * 16384 * 128
    rates = {}
    for name, precision in (("fp32_highest", "highest"), ("tf32", "high")):
        torch.set_float32_matmul_precision(precision)
        ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
        rates[name] = flops / ms / 1e9  # TFLOP/s (ms, not s)
    torch.set_float32_matmul_precision("highest")
    return rates


# Forced launches of lik's nearest-neighbour kernels timed beside the heuristic's (None):
# (route, precision, block_m, block_n, warps, stages[, one_pass]); the direct route takes both directions of a
# Chamfer call in one pass unless one_pass is False.
SWEEP = {
    3: [None, ("direct", "", 128, 64, 4, 1), ("direct", "", 64, 64, 1, 1), ("direct", "", 32, 128, 1, 1),
        ("direct", "", 32, 64, 1, 1), ("direct", "", 32, 32, 1, 1), ("direct", "", 64, 128, 2, 1),
        ("direct", "", 64, 64, 2, 1), ("direct", "", 128, 32, 1, 1), ("direct", "", 128, 32, 4, 1),
        ("direct", "", 64, 64, 4, 1, False)],
    128: [None, ("dot", "tf32x3", 128, 128, 8, 3), ("dot", "tf32x3", 128, 64, 4, 3), ("dot", "tf32x3", 128, 128, 8, 4),
          ("core", "tf32x3", 0, 0, 0, 0)],
}


def sweep(record: dict, shapes, flops_ceiling: float) -> None:
    """Time ``lik.nearest_neighbors`` (forward) and ``lik.chamfer_distance`` (forward + backward) under each
    launch of :data:`SWEEP`, with the nearest-neighbour error against float64, and flash_chamfer beside them."""
    from lik import _config

    record["sweep"] = []
    try:
        from flash_maxsim import flash_chamfer_train
    except Exception:
        flash_chamfer_train = None
    for n, p, d in shapes:
        x = torch.rand(n, p, d, device="cuda")
        y = torch.rand(n, p, d, device="cuda")
        sample = torch.randperm(p, device="cuda")[:2000]
        xg, yg = x.clone().requires_grad_(), y.clone().requires_grad_()

        def step(fn):
            xg.grad = yg.grad = None
            fn(xg, yg).backward()

        if flash_chamfer_train is not None:
            ms = _time_ms(lambda: step(lambda a, b: sum(flash_chamfer_train(a[i], b[i]) for i in range(n)) / n))
            record["sweep"].append({"n": n, "p": p, "d": d, "launch": "flash_chamfer", "fwd_bwd_ms": ms})
            print(f"sweep {n}x{p} D={d} flash_chamfer f+b {ms:.3f} ms", flush=True)
        for launch in SWEEP[d]:
            cell = {"n": n, "p": p, "d": d, "launch": launch}
            cfg = None if launch is None else _config.NearestConfig(
                launch[0], launch[1] or "tf32x3", *(launch[2:6] if launch[0] != "core" else ()),
                one_pass=launch[6] if len(launch) > 6 else True)
            try:
                with _config.override(**({} if cfg is None else {"nearest": cfg})):
                    cell["nn_rel_error"] = _nn_error("lik", lambda a, b: lik.nearest_neighbors(a, b)[0], x, y, sample)
                    # far from the origin: the centring must keep the digits
                    cell["nn_rel_error_at_1000"] = _nn_error(
                        "lik", lambda a, b: lik.nearest_neighbors(a, b)[0], x + 1000, y + 1000, sample)
                    # the reverse direction, as a Chamfer call finds it (one pass on the direct route)
                    cell["reverse_nn_rel_error"] = _nn_error("lik", lambda a, b: lik.chamfer_distance(
                        b, a, batch_reduction=None, point_reduction=None)[0][1], y, x, sample)
                    with torch.no_grad():
                        cell["fwd_ms"] = _time_ms(lambda: lik.nearest_neighbors(x, y))
                    cell["fwd_bwd_ms"] = _time_ms(lambda: step(lambda a, b: lik.chamfer_distance(a, b)[0]))
                # one direction forward; both directions forward + backward
                cell["fwd_bwd_tflops"] = 2 * 2 * d * n * p * p / cell["fwd_bwd_ms"] / 1e9
                cell["pct_of_cublas_fp32"] = 100 * cell["fwd_bwd_tflops"] / flops_ceiling
            except Exception as exc:  # a launch that does not compile: recorded, not fatal
                cell["error"] = repr(exc)[:300]
            record["sweep"].append(cell)
            print("sweep " + json.dumps(cell), flush=True)
        del x, y, xg, yg
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--quick", action="store_true", help="small shapes only (a smoke run)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no new shape after this many seconds")
    parser.add_argument("--methods", default="lik,flash_chamfer,chamferdist,keops,naive_cdist",
                        help="comma-separated; run a peer that may crash its process (KeOps) in a call of its own")
    parser.add_argument("--tag", default="", help="suffix of the JSON file name")
    parser.add_argument("--shapes", default="", help="N:P:D shapes (comma-separated) instead of the default list")
    parser.add_argument("--sweep", default="", help="N:P:D shapes (comma-separated) at which to time lik's launches "
                        "of SWEEP instead of the comparison")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    started = time.perf_counter()
    commit = os.environ.get("LIK_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "commit": commit, "cublas_tflops": _cublas_rates(), "cells": [], "skipped": [],
    }
    if args.sweep:
        sweep(record, [tuple(int(v) for v in s.split(":")) for s in args.sweep.split(",")],
              record["cublas_tflops"]["fp32_highest"])
        with open(os.path.join(args.out, f"chamfer_sweep{args.tag}.json"), "w") as f:
            json.dump(record, f, indent=1)
        return
    shapes = [(1, 1000, 3), (16, 1000, 3), (1, 10_000, 3), (16, 10_000, 3), (1, 100_000, 3), (1, 10_000, 128),
              (1, 100_000, 128), (1, 1_000_000, 3)]
    if args.quick:
        shapes = [(1, 1000, 3), (2, 3000, 128)]
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
    for n, p, d in shapes:
        if time.perf_counter() - started > args.budget_s:
            record["skipped"].append([n, p, d])
            continue
        x = torch.rand(n, p, d, device="cuda")
        y = torch.rand(n, p, d, device="cuda")
        sample = torch.randperm(p, device="cuda")[:2000]
        errors = {}
        wanted = set(args.methods.split(","))
        for name, fn in _distance_fns().items():
            if name not in wanted:
                continue
            if p >= 1_000_000 and name != "lik":
                continue
            try:
                errors[name] = _nn_error(name, fn, x, y, sample)
            except Exception as exc:
                errors[name] = repr(exc)[:200]
        for name, fn in _methods(n, p, d).items():
            if name not in wanted:
                continue
            cell = {"n": n, "p": p, "d": d, "method": name, "nn_rel_error": errors.get(name)}
            if isinstance(fn, str):
                cell["error"] = fn[:300]
                record["cells"].append(cell)
                continue
            if p >= 1_000_000 and name not in ("lik", "flash_chamfer"):
                continue
            if name == "chamferdist" and d > 3 and p >= 100_000:
                continue  # its generic-D kernel takes ~14 s a call here (results/chamfer_h100_5ce3377.json)
            try:
                with torch.no_grad():
                    cell["fwd_ms"] = _time_ms(lambda: fn(x, y))
                    cell["fwd_peak_mb"] = _peak_mb(lambda: fn(x, y))
                xg, yg = x.clone().requires_grad_(), y.clone().requires_grad_()

                def step():
                    xg.grad = yg.grad = None
                    fn(xg, yg).backward()

                cell["fwd_bwd_ms"] = _time_ms(step)
                cell["fwd_bwd_peak_mb"] = _peak_mb(step)
                if d == 128:
                    flops = 2 * 2 * d * n * p * p
                    cell["fwd_tflops"] = flops / cell["fwd_ms"] / 1e9
            except Exception as exc:
                cell["error"] = repr(exc)[:300]
            record["cells"].append(cell)
            print(json.dumps(cell), flush=True)
            torch.cuda.empty_cache()
            # Written after every cell: a peer that kills the process loses nothing measured before it.
            with open(os.path.join(args.out, f"chamfer{args.tag}.json"), "w") as f:
                json.dump(record, f, indent=1)
    print(f"\ncuBLAS fp32 (highest) {record['cublas_tflops']['fp32_highest']:.1f} TFLOP/s, "
          f"TF32 {record['cublas_tflops']['tf32']:.1f} TFLOP/s; {record['device']}, commit {commit}")
    print(f"{'N':>3} {'P':>8} {'D':>4} {'method':>14} {'fwd ms':>9} {'f+b ms':>9} {'f+b MB':>9} {'nn err':>9}")
    for c in record["cells"]:
        err = c.get("nn_rel_error")
        err = f"{err:.1e}" if isinstance(err, float) else "-"
        if "error" in c:
            print(f"{c['n']:>3} {c['p']:>8} {c['d']:>4} {c['method']:>14}   failed: {c['error'][:60]}")
            continue
        print(f"{c['n']:>3} {c['p']:>8} {c['d']:>4} {c['method']:>14} {c['fwd_ms']:>9.3f} {c['fwd_bwd_ms']:>9.3f} "
              f"{c['fwd_bwd_peak_mb']:>9.1f} {err:>9}")


if __name__ == "__main__":
    main()
