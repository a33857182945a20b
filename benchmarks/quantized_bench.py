"""8-bit corpora on the GPU: lik fp16 / int8 / fp8 beside flash-maxsim's int8x8 and late-interaction-kernels' fp8,
plus ``lik.quantize`` throughput against a device copy of the same bytes. One process, ``do_bench`` medians.

    python3 benchmarks/quantized_bench.py --out $OUT      (peers imported where installed)

Each method scores the same L2-normalised fp16 data; 8-bit operands are quantized once, outside the timing (a
served corpus is stored quantized). ``err`` is the largest |score - fp16 lik score|. ``extra MiB`` is the peak
device memory of one lik call above what was allocated before it (no dequantized copy of D: it must stay far
below D's size). Writes ``quantized_bench.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton

import lik

SHAPES = [  # name, Nq (1: a 2-D query), Lq, Ld, B
    ("colpali B1000", 1, 1024, 1024, 1000),
    ("visual B1000", 1, 512, 1024, 1000),
    ("textual B1000", 1, 32, 300, 1000),
    ("textual B10000", 1, 32, 300, 10_000),
    ("long-doc B10000", 1, 32, 1024, 10_000),
    ("multi textual Nq32xB1024", 32, 32, 300, 1024),
    ("multi colpali Nq32xB128", 32, 1024, 1024, 128),
]
EIGHT_BIT = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def median_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def extra_peak_mib(fn) -> float:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def unit(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x.float(), dim=-1).half()


def peer_methods(Q, D, nq):
    """The peers' 8-bit paths on this data, each ``(name, fn)``; absent peers and unsupported shapes are skipped."""
    methods = []
    try:
        import flash_maxsim as fm

        if nq == 1:  # flash-maxsim's int8x8 takes one 2-D query
            D_i, d_sc = fm.quantize_int8_symmetric(D)
            Q_i, q_sc = fm.quantize_query_int8(Q)
            methods.append(("flash-maxsim int8x8", lambda: fm.flash_maxsim_int8x8(Q, D_i, d_sc, Q_i, q_sc)))
    except ImportError:
        pass
    try:
        from late_interaction_kernels import fp8 as lk8

        Q_f, q_sc8 = lk8.quantize_fp8_per_token(Q)
        D_f, d_sc8 = lk8.quantize_fp8_per_token(D)
        methods.append(("late-interaction-kernels fp8",
                        lambda: lk8.maxsim_inference_fp8(Q_f, D_f, scale_Q=q_sc8, scale_D=d_sc8)))
    except ImportError:
        pass
    return methods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--quantize-only", action="store_true", help="time lik.quantize alone")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []

    x = unit(torch.randn(3_000_000, 128, device="cuda", generator=gen))
    copy_ms = median_ms(lambda: x.clone())
    for tag, dtype in EIGHT_BIT.items():
        ms = median_ms(lambda: lik.quantize(x, dtype))
        moved = x.numel() * 2 + x.numel() + x.shape[0] * 4  # read fp16, write 8-bit rows and fp32 scales
        floor = moved / (2 * x.numel() * 2 / copy_ms)
        rows.append({"what": f"lik.quantize fp16 -> {tag}", "rows": x.shape[0], "ms": ms, "floor_ms": floor,
                     "pct_of_floor": 100 * floor / ms})
        print(json.dumps(rows[-1]), flush=True)
    del x

    for name, nq, lq, ld, b in [] if args.quantize_only else SHAPES:
        Q = unit(torch.randn((lq, 128) if nq == 1 else (nq, lq, 128), device="cuda", generator=gen))
        D = unit(torch.randn(b, ld, 128, device="cuda", generator=gen))
        reference = lik.maxsim(Q, D)
        methods = [("lik fp16", lambda: lik.maxsim(Q, D))]
        quantized = {}
        for tag, dtype in EIGHT_BIT.items():
            D_q, d_scale = lik.quantize(D, dtype)
            Q_q, q_scale = lik.quantize(Q, dtype)
            quantized[tag] = (Q_q, D_q, q_scale, d_scale)
            methods.append((f"lik {tag}", lambda t=tag: lik.maxsim(
                quantized[t][0], quantized[t][1], q_scale=quantized[t][2], d_scale=quantized[t][3])))
        methods += peer_methods(Q, D, nq)
        for method, fn in methods:
            row = {"shape": name, "method": method, "d_bytes": D.numel() * (1 if "int8" in method or "fp8" in method else 2)}
            try:
                row["err"] = (fn() - reference).abs().max().item()
                row["ms"] = median_ms(fn)
                if method.startswith("lik "):
                    row["extra_peak_MiB"] = extra_peak_mib(fn)
            except Exception as exc:  # a peer failing at a shape is recorded, not fatal
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
        del D, quantized, methods
        torch.cuda.empty_cache()

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    with open(os.path.join(args.out, "quantized_bench.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    fp16 = {r["shape"]: r["ms"] for r in rows if r.get("method") == "lik fp16" and "ms" in r}
    print(f"{'shape':26} {'method':30} {'ms':>8} {'vs lik fp16':>11} {'max err':>8}")
    for r in rows:
        if "shape" in r and "ms" in r:
            print(f"{r['shape']:26} {r['method']:30} {r['ms']:8.3f} {fp16[r['shape']] / r['ms']:10.2f}x {r['err']:8.4f}")
    for r in rows:
        if "what" in r:
            print(f"{r['what']:30} {r['ms']:.3f} ms, {r['pct_of_floor']:.0f}% of the copy floor")


if __name__ == "__main__":
    main()
