"""MaxSim at any embedding width: lik beside flash-maxsim and late-interaction-kernels, per ``d``.

Runs the harness's cells (``lik.bench``: checks against an fp32 reference, interleaved rounds, peak memory,
the floor from the ceilings measured in this process) for

* compute-bound: one 2-D query, Lq = Ld = 1024, B = 256 (the ColPali geometry);
* memory-bound: one 2-D query, Lq = 32, Ld = 300, B = 10 000 (textual);
* training at d = 768: ColBERT (B 128, Lq 32, Ld 180) and ColPali (B 32, 1024 x 1024);

at each ``--dims`` width, and writes one JSON and a short table::

    python benchmarks/width_bench.py --out $OUT --dims 128,256,384,768,1024,2048,4096
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from lik.bench.measure import Timer, measure_ceilings
from lik.bench.methods import peer_versions, select_methods
from lik.bench.runner import environment, run_shape
from lik.bench.shapes import Shape

METHODS = ["lik", "lik-fast", "lik-deterministic", "flash-maxsim", "late-interaction-kernels"]


def shapes(dims: list[int], train_dims: list[int]) -> list[Shape]:
    out = []
    for d in dims:
        out.append(Shape("forward", "colpali", 1, 1024, 1024, 256, d))
        out.append(Shape("forward", "textual", 1, 32, 300, 10_000, d))
    for d in train_dims:
        out.append(Shape("train", "colbert-train", 128, 32, 180, 128, d))
        out.append(Shape("train", "colpali-train", 32, 1024, 1024, 32, d))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--dims", default="128,256,384,768,1024,2048,4096")
    parser.add_argument("--train-dims", default="768")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rep-ms", type=float, default=60.0)
    parser.add_argument("--sweep", default="", help="widths at which to time forced tiles beside the heuristic")
    parser.add_argument("--same-product", default="", help="widths at which to time cuBLAS on the compute-bound "
                        "cell's own product beside lik")
    args = parser.parse_args()
    device = torch.device("cuda")
    timer = Timer(device, warmup_ms=20.0, rep_ms=args.rep_ms)
    ceilings, how = measure_ceilings(timer, copy_bytes=2**30, matmul_n=8192)
    rotate_bytes = 4 * torch.cuda.get_device_properties(device).L2_cache_size
    methods = select_methods(METHODS)
    unavailable = {m.name: r for m in methods if (r := m.unavailable_reason(device))}
    results = {
        "environment": environment(device), "peers": peer_versions(), "ceilings": ceilings.as_dict(),
        "ceiling_measurement": how, "shapes": [],
    }
    print(f"{ceilings.bandwidth_bytes_per_s / 1e9:.0f} GB/s copy, {ceilings.matmul_flops_per_s / 1e12:.0f} TFLOP/s")
    dims = [int(x) for x in args.dims.split(",") if x]
    train_dims = [int(x) for x in args.train_dims.split(",") if x]
    if args.sweep:  # first: a crash in a peer below would leave the CUDA context unusable
        results["sweep"] = sweep([int(x) for x in args.sweep.split(",")], timer)
    if args.same_product:
        results["same_product"] = same_product([int(x) for x in args.same_product.split(",")], timer)
    for shape in shapes(dims, train_dims):
        start = time.perf_counter()
        print(f"{shape.name} d={shape.d}", flush=True)
        skipped = dict(unavailable)
        if shape.family == "textual" and shape.d >= 768:
            # late-interaction-kernels 0.4.5 hit an illegal memory access here (H100, textual d = 768), which
            # leaves the process's CUDA context unusable: not run.
            skipped["late-interaction-kernels"] = "illegal memory access at textual d >= 768 (H100 run)"
        entry = run_shape(shape, methods, skipped, dtype=torch.float16, device=device, timer=timer,
                          ceilings=ceilings, rounds=args.rounds, rotate_bytes=rotate_bytes, log=print)
        entry["wall_s"] = time.perf_counter() - start
        results["shapes"].append(entry)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "width_bench.json").write_text(json.dumps(results, indent=1))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "width_bench.json").write_text(json.dumps(results, indent=1))
    print(table(results))


# Forced forward tiles timed beside the heuristic's: (group_rows, block_n, block_k, warps, stages, flat_k).
SWEEP = {
    "colpali": [(128, 256, 64, 8, 3, False), (256, 128, 64, 8, 3, False), (128, 256, 64, 8, 4, False),
                (128, 256, 128, 8, 2, False), (256, 128, 128, 8, 2, False), (128, 128, 256, 8, 2, True),
                (128, 64, 256, 8, 3, True), (128, 128, 64, 8, 4, True), (64, 64, 256, 4, 2, True),
                (128, 64, 256, 8, 2, True), (64, 128, 256, 4, 2, True), (128, 64, 256, 4, 3, True)],
}


def sweep(dims: list[int], timer: Timer) -> list[dict]:
    """Median ms of ``lik.maxsim`` with each forced tile of :data:`SWEEP` (and the heuristic's, ``None``)."""
    import lik
    from lik import _config

    rows = []
    for d in dims:
        for family, (lq, ld, b) in {"colpali": (1024, 1024, 256)}.items():
            gen = torch.Generator(device="cuda").manual_seed(0)
            Q = torch.nn.functional.normalize(torch.randn(lq, d, device="cuda", generator=gen), dim=-1).half()
            D = torch.nn.functional.normalize(torch.randn(b, ld, d, device="cuda", generator=gen), dim=-1).half()
            for tiles in [None, *SWEEP[family]]:
                if tiles is None:
                    ms = timer.median_ms(lambda: lik.maxsim(Q, D))
                else:
                    group_rows, block_n, block_k, warps, stages, flat_k = tiles
                    cfg = _config.MaxSimForwardConfig(group_rows, 1, block_n, block_k, warps, stages, flat_k=flat_k)
                    try:
                        with _config.override(maxsim_forward=cfg):
                            ms = timer.median_ms(lambda: lik.maxsim(Q, D))
                    except Exception as exc:  # a tile that does not fit: recorded, not fatal
                        ms = f"{type(exc).__name__}"
                rows.append({"family": family, "d": d, "tiles": tiles, "ms": ms})
                print(f"sweep {family} d={d} {tiles}: {ms}", flush=True)
            del Q, D
            torch.cuda.empty_cache()
    return rows


def same_product(dims: list[int], timer: Timer) -> list[dict]:
    """cuBLAS on the compute-bound cell's own product (``[Lq, d] @ [d, B * Ld]``, fp16 out) beside lik: the rate
    cuBLAS reaches at this depth, where writing its output competes with the FLOPs."""
    import lik

    lq, ld, b = 1024, 1024, 256
    rows = []
    for d in dims:
        gen = torch.Generator(device="cuda").manual_seed(0)
        Q = torch.nn.functional.normalize(torch.randn(lq, d, device="cuda", generator=gen), dim=-1).half()
        D = torch.nn.functional.normalize(torch.randn(b, ld, d, device="cuda", generator=gen), dim=-1).half()
        flat = D.view(-1, d)
        flops = 2 * lq * ld * b * d
        row = {"d": d, "flops": flops}
        for _ in range(2):  # interleaved rounds
            for name, fn in (("cublas_same_product", lambda: torch.matmul(Q, flat.T)), ("lik", lambda: lik.maxsim(Q, D))):
                row.setdefault(name + "_ms", []).append(timer.median_ms(fn))
        for name in ("cublas_same_product", "lik"):
            row[name + "_ms"] = min(row[name + "_ms"])
            row[name + "_tflops"] = flops / row[name + "_ms"] / 1e9
        row["lik_pct_of_cublas_same_product"] = 100 * row["cublas_same_product_ms"] / row["lik_ms"]
        rows.append(row)
        print(f"same product d={d}: cuBLAS {row['cublas_same_product_ms']:.4f} ms "
              f"({row['cublas_same_product_tflops']:.0f} TFLOP/s), lik {row['lik_ms']:.4f} ms "
              f"({row['lik_pct_of_cublas_same_product']:.0f}%)", flush=True)
        del Q, D, flat
        torch.cuda.empty_cache()
    return rows


def table(results: dict) -> str:
    lines = ["| shape | d | lik ms | % floor | flash-maxsim ms | LIK ms | lik vs flash | lik MB | flash MB | LIK MB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for entry in results["shapes"]:
        cells = entry["cells"]

        def get(name, key):
            value = cells.get(name, {}).get(key)
            return "fail" if value is None else f"{value:.3f}" if key == "median_ms" else f"{value:.0f}"

        ratio = "-"
        lik = "lik" if "lik" in cells else "lik-fast"  # training cells: the fast backward
        lik_ms, flash_ms = cells.get(lik, {}).get("median_ms"), cells.get("flash-maxsim", {}).get("median_ms")
        if lik_ms and flash_ms:
            ratio = f"{flash_ms / lik_ms:.2f}x"
        pct = cells.get(lik, {}).get("pct_of_floor")
        lines.append(
            f"| {entry['name']} | {entry['shape']['d']} | {get(lik, 'median_ms')} | "
            f"{'-' if pct is None else f'{pct:.0f}%'} | {get('flash-maxsim', 'median_ms')} | "
            f"{get('late-interaction-kernels', 'median_ms')} | {ratio} | {get(lik, 'peak_MB')} | "
            f"{get('flash-maxsim', 'peak_MB')} | {get('late-interaction-kernels', 'peak_MB')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
