"""Sweep MaxSim forward tilings on the GPU: the evidence behind the heuristic in ``lik._config``.

For each canonical shape (docs/design.md, fp16, d = 128) it times the heuristic's choice, a grid of forced
configurations and fp16 eager einsum, reports each as % of the floor (measured ceilings of this machine) and
writes everything as JSON. Usage on the device::

    PYTHONPATH=src python3 benchmarks/tune_maxsim.py --out $OUT
    # persistent launches around the shipped tiles only (document tiles, stages, programs per SM):
    PYTHONPATH=src python3 benchmarks/tune_maxsim.py --near-heuristic --programs-per-sm 0,1,2,4 --out $OUT
    # the heuristic alone (an A/B of two source trees), or a few forced tiles (with fp32: also cuBLAS's TF32 rate):
    PYTHONPATH=src python3 benchmarks/tune_maxsim.py --tiles none --out $OUT
    PYTHONPATH=src python3 benchmarks/tune_maxsim.py --dtype fp32 --tiles "256,1,64,8,3;128,1,128,8,2" --out $OUT
    # 8-bit corpora (Q and D quantized per token once, outside the timing; the floor counts 1-byte rows):
    PYTHONPATH=src python3 benchmarks/tune_maxsim.py --dtype int8 --shapes colpali,textual-10k --tiles "..." --out $OUT
    # an A/B of a few tiles on device time (CUDA graph replays beside the heuristic's), five interleaved rounds:
    PYTHONPATH=src python3 benchmarks/tune_maxsim.py --dtype int8 --tiles "..." --graph --rounds 5 --out $OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os

import torch
import triton

import lik
from ab_trees import graph_replay
from lik import _config

SHAPES = {  # name: (Nq, Lq, B, Ld)
    "textual": (1, 32, 1000, 300),
    "long-doc": (1, 32, 1000, 1024),
    "medium": (1, 128, 1000, 1024),
    "visual": (1, 512, 1000, 1024),
    "colpali": (1, 1024, 1000, 1024),
    "multi-textual": (32, 32, 1024, 300),
    "multi-long-doc": (32, 32, 1024, 1024),
    "multi-colpali": (32, 1024, 128, 1024),
    "colpali-10k": (1, 1024, 10000, 1024),
    "textual-10k": (1, 32, 10000, 300),
    "long-doc-10k": (1, 32, 10000, 1024),
}
DIM = 128


def ceilings() -> tuple[float, float]:
    """(bytes/s of a large device copy counting read + write, fp16 cuBLAS FLOP/s)."""
    src = torch.empty(2 * 1024**3 // 2, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    bandwidth = 2 * src.numel() * 2 / (ms * 1e-3)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    # The same rate over a 4x longer matmul (~6 ms, as long as a ColPali B = 10 000 call): sustained clocks.
    wide = torch.randn(8192, 4 * 8192, device="cuda", dtype=torch.float16)
    long_ms = triton.testing.do_bench(lambda: a @ wide, warmup=10, rep=300, return_mode="median")
    print(f"cuBLAS fp16: 8192^3 {2 * 8192**3 / ms / 1e9:.0f} TFLOP/s ({ms:.2f} ms), "
          f"8192 x 8192 x 32768 {8 * 8192**3 / long_ms / 1e9:.0f} TFLOP/s ({long_ms:.2f} ms)", flush=True)
    return bandwidth, 2 * 8192**3 / (ms * 1e-3)


DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "int8": torch.int8,
          "fp8": torch.float8_e4m3fn}
EIGHT_BIT = (torch.int8, torch.float8_e4m3fn)


def floor_ms(shape, bandwidth, flops, element_bytes=2) -> float:
    n_q, l_q, n_docs, l_d = shape
    work = 2.0 * n_q * l_q * n_docs * l_d * DIM
    moved = element_bytes * (n_q * l_q * DIM + n_docs * l_d * DIM) + 4.0 * n_q * n_docs
    return max(work / flops, moved / bandwidth) * 1e3


def candidates(l_q: int, n_q: int, wide: bool = False):
    """The two largest row groups the query fills, stacked to 128 / 256 rows when there are many queries; 4 or 8
    warps (16 never placed in the top three on the H200), tiles up to 256 x 128. ``wide`` (fp32): the three
    largest row groups, 32- and 64-token tiles, 2 or 3 stages (fp32 tiles take twice the shared memory)."""
    bucket = max(16, triton.next_power_of_2(l_q))
    rows = [r for r in (16, 32, 64, 128, 256) if r <= bucket][-3 if wide else -2:]
    block_ns, stage_counts = ((32, 64), (2, 3)) if wide else ((64, 128), (3, 4))
    for group_rows, total, block_n, warps, stages in itertools.product(
        rows, (0, 128, 256), block_ns, (4, 8), stage_counts
    ):
        total = total or group_rows
        if total < group_rows or (total > group_rows and n_q == 1):
            continue
        if total * block_n > 256 * 128 or (total >= 128 and warps == 4):
            continue
        yield _config.MaxSimForwardConfig(group_rows, total // group_rows, block_n, DIM, warps, stages)


def near(cfg: _config.MaxSimForwardConfig):
    """The shipped tiles with other document tiles and stage counts."""
    for block_n, stages in itertools.product((64, 128), (cfg.num_stages, cfg.num_stages + 1)):
        if cfg.block_m * block_n <= 256 * 128:
            yield dataclasses.replace(cfg, block_n=block_n, num_stages=stages)


def parse_tiles(spec: str) -> list[_config.MaxSimForwardConfig]:
    """``--tiles``: 'none' (no forced tiles), or ';'-separated
    'group_rows,groups,block_n,warps,stages[,programs_per_sm[,max_registers]]'."""
    if spec == "none":
        return []
    tiles = []
    for item in spec.split(";"):
        group_rows, groups, block_n, warps, stages, *rest = (int(v) for v in item.split(","))
        tiles.append(_config.MaxSimForwardConfig(group_rows, groups, block_n, DIM, warps, stages, *rest))
    return tiles


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16", help="fp32 runs with TF32 products")
    parser.add_argument("--near-heuristic", action="store_true", help="sweep only around the shipped tiles")
    parser.add_argument("--programs-per-sm", default="0", help="persistent launches to try (0: one per document)")
    parser.add_argument("--tiles", default=None,
                        help="time only these forced tiles instead of a sweep: 'none' (the heuristic alone), or "
                             "';'-separated 'group_rows,groups,block_n,warps,stages[,programs_per_sm[,max_registers]]'")
    parser.add_argument("--graph", action="store_true",
                        help="time forced tiles by replaying a CUDA graph of the call (device time, no host path)")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds over the forced tiles (median)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dtype = DTYPES[args.dtype]
    if dtype == torch.float32:
        torch.set_float32_matmul_precision("high")  # TF32: lik's fp32 is benchmarked with it
    bandwidth, flops = ceilings()
    print(f"ceilings: {bandwidth / 1e12:.2f} TB/s copy, {flops / 1e12:.0f} TFLOP/s fp16 cuBLAS", flush=True)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "dtype": args.dtype,
               "bandwidth": bandwidth, "flops": flops, "shapes": {}}
    if dtype == torch.float32:
        # The TF32 tensor-core rate of cuBLAS on this machine: what "fp32 within 2x of fp16" is up against.
        a = torch.randn(8192, 8192, device="cuda")
        ms = triton.testing.do_bench(lambda: a @ a, warmup=50, rep=300, return_mode="median")
        results["flops_tf32"] = 2 * 8192**3 / (ms * 1e-3)
        print(f"cuBLAS TF32: 8192^3 {results['flops_tf32'] / 1e12:.0f} TFLOP/s "
              f"({flops / results['flops_tf32']:.2f}x the fp16 time)", flush=True)
        del a
    summary = []
    for name in args.shapes.split(","):
        n_q, l_q, n_docs, l_d = shape = SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        Q = torch.nn.functional.normalize(torch.randn(n_q, l_q, DIM, device="cuda", generator=gen), dim=-1)
        D = torch.nn.functional.normalize(torch.randn(n_docs, l_d, DIM, device="cuda", generator=gen), dim=-1)
        if dtype in EIGHT_BIT:
            (Q, q_scale), (D, d_scale) = lik.quantize(Q, dtype), lik.quantize(D, dtype)
            scales = {"q_scale": q_scale, "d_scale": d_scale}
            # (the floor counts the 1-byte rows, not their fp32 scales: 3% more bytes at d = 128)
            floor = floor_ms(shape, bandwidth, float("inf"), 1)  # the memory floor only (no fp16 rate)
        else:
            Q, D, scales = Q.to(dtype), D.to(dtype), {}
            floor = floor_ms(shape, bandwidth, flops, torch.finfo(dtype).bits // 8)
        ref = lik.maxsim(Q, D, **scales)

        def bench(fn):
            return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")

        heuristic = bench(lambda: lik.maxsim(Q, D, **scales))
        # Device time alone (host launch overhead removed): replay of a captured graph of the same call.
        heuristic_graph = bench(graph_replay(lambda: lik.maxsim(Q, D, **scales)))
        try:
            if dtype in EIGHT_BIT:
                raise RuntimeError("no 8-bit einsum")
            einsum = bench(lambda: torch.einsum("nsh,bth->nbst", Q, D).amax(-1).float().sum(-1))
        except (torch.OutOfMemoryError, RuntimeError):  # (no 8-bit einsum)
            einsum = float("nan")
        rows = []
        shipped = _config.maxsim_forward_config(q_len=l_q, n_queries=n_q, dim=DIM, dtype=dtype, per_query=False,
                                                device=Q.device, doc_len=l_d)
        if args.tiles is not None:
            tiles = parse_tiles(args.tiles)
        elif args.near_heuristic:
            tiles = near(shipped)
        else:
            tiles = candidates(l_q, n_q, wide=dtype == torch.float32)
        programs = [int(p) for p in args.programs_per_sm.split(",")]
        runnable = []
        for cfg in (dataclasses.replace(t, programs_per_sm=p) if p else t for t in tiles for p in programs):
            with _config.override(maxsim_forward=cfg):
                try:
                    out = lik.maxsim(Q, D, **scales)
                    ok = torch.allclose(out, ref, rtol=1e-3, atol=1e-2)
                    call = lambda: lik.maxsim(Q, D, **scales)  # noqa: E731
                    if args.graph:  # the launch alone: a forced tile's host path is not the shipped one's replay
                        call = graph_replay(call)
                    call()
                    torch.cuda.synchronize()
                except Exception as exc:  # out of shared memory / registers: record and go on
                    rows.append({"config": cfg.__dict__, "error": type(exc).__name__})
                    continue
            runnable.append((cfg, call, ok, []))
        for _ in range(args.rounds):  # interleaved, so that a slow stretch touches every tile alike
            for cfg, call, _ok, times in runnable:
                with _config.override(maxsim_forward=cfg):
                    times.append(bench(call))
        for cfg, _call, ok, times in runnable:
            ms = sorted(times)[len(times) // 2]
            rows.append({"config": cfg.__dict__, "ms": ms, "rounds_ms": times, "pct_floor": 100 * floor / ms,
                         "correct": ok})
        timed = sorted((r for r in rows if "ms" in r and r["correct"]), key=lambda r: r["ms"])
        results["shapes"][name] = {"shape": shape, "floor_ms": floor, "heuristic_ms": heuristic,
                                   "heuristic_graph_ms": heuristic_graph,
                                   "einsum_ms": einsum, "configs": rows}
        best = timed[0] if timed else None
        summary.append((name, floor, heuristic, einsum, best))
        print(f"{name}: floor {floor:.3f} ms, heuristic {heuristic:.3f} ({100 * floor / heuristic:.0f}%), "
              f"graph {heuristic_graph:.3f} ({100 * floor / heuristic_graph:.0f}%), "
              f"einsum {einsum:.3f}", flush=True)
        for r in timed[: args.top]:
            print(f"    {r['ms']:.3f} ms {r['pct_floor']:.0f}%  {r['config']}", flush=True)
        bad = [r for r in rows if "correct" in r and not r["correct"]]
        if bad:
            print(f"    WRONG RESULTS from {len(bad)} configs, e.g. {bad[0]['config']}", flush=True)
        Q = D = None  # the calls above close over them: drop the tensors before the next shape
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, f"tune_maxsim_{args.dtype}.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n{'shape':16s} {'floor':>8s} {'lik':>8s} {'%floor':>7s} {'best':>8s} {'%floor':>7s} {'einsum':>8s}")
    for name, floor, heuristic, einsum, best in summary:
        b = best["ms"] if best else float("nan")
        print(f"{name:16s} {floor:8.3f} {heuristic:8.3f} {100 * floor / heuristic:6.0f}% {b:8.3f} "
              f"{100 * floor / b:6.0f}% {einsum:8.3f}")


if __name__ == "__main__":
    main()
