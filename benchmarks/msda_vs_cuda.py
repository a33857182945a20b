"""lik's deformable attention against the original Deformable-DETR CUDA op and the PyTorch grid_sample path, one
process, one GPU: decoder (N 4 at 800x1333, 300 and 900 queries) and encoder (N 2 at 1536x2048) scales, fp32 and
bf16 by default (``--dtypes`` adds fp16; the original op has no half precision), realistic sampling by default
(``--sampling realistic,uniform`` adds uniform locations; ``lik.bench.msda_cases.make_problem``).

Per method and problem: forward with gradients wanted (a training forward: through the autograd Function), forward
without (inference), backward alone (``autograd.grad`` on a retained graph): ``do_bench`` medians (L2 flushed),
each the median of ``--rounds`` rounds in which lik and the op alternate (every round is kept in the JSON), and the
host time per call (200 calls without synchronising: the wall time when the CPU, not the GPU, is the limit).
Also, at both decoder scales: kernels per call with their device time (torch.profiler); at 300 queries a cProfile
of lik's forward + backward host path.

    PYTHONPATH=src python3 benchmarks/msda_vs_cuda.py --original-src /path/to/Deformable-DETR --out $OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time

import torch
import triton
import triton.testing

import lik
from lik.bench.cases import host_us
from lik.bench.msda_cases import DECODER, ENCODER, detr_core, load_original_op, make_problem

DECODER_900 = dict(DECODER, name="decoder900", queries=900)
PAPER_H100_BF16 = dict(fwd_ms=1.15, bwd_ms=4.33)  # "Efficient Multi-Scale Deformable Attention on GPUs", Triton


def leaves(p):
    return [p[k].detach().clone().requires_grad_() for k in ("value", "loc", "weights")]


def make_methods(p, original):
    s, st, hw = p["shapes"], p["starts"], p["hw"]
    methods = {"lik": lambda v, lc, w: lik.ms_deform_attn(v, s, st, lc, w)}
    if original is not None and p["value"].dtype == torch.float32:
        methods["cuda-op"] = lambda v, lc, w: original.apply(v, s, st, lc, w, 64)
    methods["pytorch"] = lambda v, lc, w: detr_core(v, hw, lc, w)
    return methods


def time_methods(methods: dict, p, rounds: int) -> dict:
    """Per method: ``do_bench`` medians of the forward with gradients, inference and the backward, each the median
    of ``rounds`` rounds in which the methods alternate (host-bound cells move between stretches of one process,
    and a method timed first in a fresh process pays for it), with every round kept; then host time per call and
    peak memory."""
    bench = lambda f: triton.testing.do_bench(f, return_mode="median")  # noqa: E731
    state = {}
    for name, fn in methods.items():
        x = leaves(p)
        out = fn(*x)
        state[name] = (fn, x, [t.detach() for t in x], out,
                       lambda out=out, x=x: torch.autograd.grad(out, x, p["grad"], retain_graph=True))
    rows = {name: {"fwd_rounds": [], "infer_rounds": [], "bwd_rounds": []} for name in methods}
    for _ in range(rounds):
        for name, (fn, x, detached, _out, grad) in state.items():
            rows[name]["fwd_rounds"].append(bench(lambda: fn(*x)))
            rows[name]["infer_rounds"].append(bench(lambda: fn(*detached)))
            rows[name]["bwd_rounds"].append(bench(grad))
    for name, (fn, x, _detached, _out, grad) in state.items():
        row = rows[name]
        for phase in ("fwd", "infer", "bwd"):
            row[f"{phase}_ms"] = sorted(row[f"{phase}_rounds"])[len(row[f"{phase}_rounds"]) // 2]
        calls = 200 if row["bwd_ms"] < 1 else 10  # host time only matters (and is only cheap to take) on small calls
        row["fwd_host_us"] = host_us(lambda: fn(*x), calls)
        row["bwd_host_us"] = host_us(grad, calls)
    del state
    for name, fn in methods.items():
        x = leaves(p)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn(*x)
        torch.autograd.grad(out, x, p["grad"])
        del out
        torch.cuda.synchronize()
        rows[name]["peak_MB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        torch.cuda.empty_cache()
    return rows


def kernels_per_call(fn, p):
    """Device kernels (and memsets / copies) launched by one forward and one backward, with their device time."""
    x = leaves(p)
    out = fn(*x)
    torch.autograd.grad(out, x, p["grad"], retain_graph=True)
    torch.cuda.synchronize()
    counts = {}
    for phase, call in (("fwd", lambda: fn(*x)), ("bwd", lambda: torch.autograd.grad(out, x, p["grad"],
                                                                                      retain_graph=True))):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        counts[phase] = dict(count=len(kernels), device_us=sum(e.time_range.elapsed_us() for e in kernels),
                             kernels=[(e.name[:60], e.time_range.elapsed_us()) for e in kernels])
    return counts


def host_profile(p):
    """cProfile of 300 lik forward + backward calls (own time per function, top 25)."""
    x = leaves(p)
    s, st = p["shapes"], p["starts"]

    def step():
        out = lik.ms_deform_attn(x[0], s, st, x[1], x[2])
        torch.autograd.grad(out, x, p["grad"])

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        step()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def tile_sweep():
    """Forward (inference path) and backward under forced (rows, warps) tiles: encoder fp32 and bf16, decoder
    (900 queries) fp32; ms."""
    import lik._config as config

    results = []
    for scale, dtype in ((ENCODER, torch.float32), (ENCODER, torch.bfloat16), (DECODER_900, torch.float32)):
        p = make_problem(scale, "realistic", dtype)
        args = [p[k] for k in ("value", "shapes", "starts", "loc", "weights")]
        x = leaves(p)
        for rows, warps in ((4, 1), (2, 1), (8, 1), (8, 2), (16, 2), (16, 4)):
            tile = dict(block_rows=rows, block_points=4, block_d=32, num_warps=warps)
            with config.override(msda_forward=config.MsdaForwardConfig(**tile)):
                fwd = triton.testing.do_bench(lambda: lik.ms_deform_attn(*args), return_mode="median")
                out = lik.ms_deform_attn(x[0], p["shapes"], p["starts"], x[1], x[2])
            with config.override(msda_backward=config.MsdaBackwardConfig(gather_rows=32, **tile)):
                bwd = triton.testing.do_bench(lambda: torch.autograd.grad(out, x, p["grad"], retain_graph=True),
                                              return_mode="median")
            out = None  # the backward's graph, closed over above
            results.append(dict(scale=scale["name"], dtype=str(dtype)[6:], rows=rows, warps=warps, fwd_ms=fwd,
                                bwd_ms=bwd))
            print(f"tile {scale['name']} {str(dtype)[6:]} rows {rows} warps {warps}: fwd {fwd:.4f} bwd {bwd:.4f} ms",
                  flush=True)
        p = args = x = None  # closed over above: dropped before the next problem
        torch.cuda.empty_cache()
    return results


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def agreement(p, original):
    """lik against the original op (fp32): output and the three gradients."""
    got, want = [], []
    for fn, sink in ((lambda v, lc, w: lik.ms_deform_attn(v, p["shapes"], p["starts"], lc, w), got),
                     (lambda v, lc, w: original.apply(v, p["shapes"], p["starts"], lc, w, 64), want)):
        x = leaves(p)
        out = fn(*x)
        sink.extend([out.detach(), *torch.autograd.grad(out, x, p["grad"])])
    return {name: rel(g, w) for name, g, w in zip(("out", "grad_value", "grad_loc", "grad_weights"), got, want)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--original-src", default=os.environ.get("LIK_ORIGINAL_MSDA_SRC"))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--scales", default="decoder,decoder900,encoder")
    parser.add_argument("--profile", action="store_true", help="kernel counts and a cProfile at decoder scale")
    parser.add_argument("--sweep", action="store_true", help="encoder forward under forced tiles (rows, warps)")
    parser.add_argument("--tag", default="", help="suffix of the JSON file name")
    parser.add_argument("--rounds", type=int, default=5, help="alternating do_bench rounds per cell (median)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="of float32, bfloat16, float16")
    parser.add_argument("--sampling", default="realistic", help="of realistic, uniform")
    args = parser.parse_args()
    original = load_original_op(args.original_src) if args.original_src else None
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                commit=os.environ.get("LIK_COMMIT", "unknown"), time=time.strftime("%Y-%m-%d %H:%M:%S"))
    print(json.dumps(meta), flush=True)
    scales = {"decoder": DECODER, "decoder900": DECODER_900, "encoder": ENCODER}
    rows, extra = [], {}
    cells = [(scale_name, sampling, getattr(torch, dtype)) for scale_name in args.scales.split(",")
             for sampling in args.sampling.split(",") for dtype in args.dtypes.split(",")]
    for scale_name, sampling, dtype in cells:
        scale = scales[scale_name]
        p = make_problem(scale, sampling, dtype)
        row = dict(scale=scale_name, sampling=sampling, dtype=str(dtype)[6:], lq=p["loc"].shape[1],
                   s=p["value"].shape[1])
        if original is not None and dtype == torch.float32:
            row["lik_vs_cuda_op"] = agreement(p, original)
        methods = make_methods(p, original)
        # The stock path is 5-50x slower than both kernels: one round of it is enough.
        timed = time_methods({k: v for k, v in methods.items() if k != "pytorch"}, p, args.rounds)
        timed.update(time_methods({"pytorch": methods["pytorch"]}, p, 1))
        for name in methods:
            row[name] = timed[name]
            r = row[name]
            print(f"{scale_name:10} {sampling:9} {row['dtype']:8} {name:8} fwd {r['fwd_ms']:.4f} "
                  f"infer {r['infer_ms']:.4f} bwd {r['bwd_ms']:.4f} ms | "
                  f"host fwd {r['fwd_host_us']:.0f} bwd {r['bwd_host_us']:.0f} us | "
                  f"peak {r['peak_MB']:.0f} MB", flush=True)
        if args.profile and scale_name.startswith("decoder") and dtype == torch.float32 and sampling == "realistic":
            kernels = {name: kernels_per_call(fn, p) for name, fn in make_methods(p, original).items()
                       if name != "pytorch"}
            extra["kernels" if scale_name == "decoder" else f"kernels_{scale_name}"] = kernels
            print(scale_name, json.dumps({m: {ph: (k[ph]["count"], round(k[ph]["device_us"], 1)) for ph in k}
                                          for m, k in kernels.items()}))
            if scale_name == "decoder":
                extra["cprofile_lik"] = host_profile(p)
                print(extra["cprofile_lik"][:4000])
        rows.append(row)
        del p
        torch.cuda.empty_cache()

    if args.sweep:
        extra["tiles"] = tile_sweep()
    with open(os.path.join(args.out, f"msda_vs_cuda{args.tag}.json"), "w") as fh:
        json.dump(dict(meta=meta, rows=rows, paper_h100_bf16=PAPER_H100_BF16, **extra), fh, indent=1)
    print(f"\n{meta['device']} torch {meta['torch']} triton {meta['triton']} commit {meta['commit']}")
    print(f"{'scale':10} {'sampling':9} {'dtype':8} | {'lik fwd':>8} {'op32 fwd':>8} {'x':>5} | "
          f"{'lik bwd':>8} {'op32 bwd':>8} {'x':>5} | "
          f"{'pt fwd':>7} {'pt bwd':>7} | lik infer | max err vs op")
    # Half-precision rows against the op's fp32 at the same scale and sampling (it has no half precision), else
    # encoder bf16 against the paper's H100 Triton numbers.
    op_fp32 = {(r["scale"], r["sampling"]): r["cuda-op"] for r in rows if "cuda-op" in r}
    for r in rows:
        lk, op, pt = r["lik"], r.get("cuda-op") or op_fp32.get((r["scale"], r["sampling"])), r["pytorch"]
        if op is None:
            paper = r["scale"] == "encoder" and r["dtype"] == "bfloat16" and r["sampling"] == "realistic"
            op = dict(fwd_ms=PAPER_H100_BF16["fwd_ms"], bwd_ms=PAPER_H100_BF16["bwd_ms"]) if paper \
                else dict(fwd_ms=float("nan"), bwd_ms=float("nan"))
        err = max(r["lik_vs_cuda_op"].values()) if "lik_vs_cuda_op" in r else float("nan")
        print(f"{r['scale']:10} {r['sampling']:9} {r['dtype']:8} | {lk['fwd_ms']:8.4f} {op['fwd_ms']:8.4f} "
              f"{op['fwd_ms'] / lk['fwd_ms']:5.2f} | "
              f"{lk['bwd_ms']:8.4f} {op['bwd_ms']:8.4f} {op['bwd_ms'] / lk['bwd_ms']:5.2f} | {pt['fwd_ms']:7.3f} "
              f"{pt['bwd_ms']:7.3f} | {lk['infer_ms']:.4f} | {err:.1e}")


if __name__ == "__main__":
    main()
