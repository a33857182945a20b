"""Host cost of launching lik's Triton kernels, piece by piece, for the launch-bound small calls.

    PYTHONPATH=src python3 benchmarks/launch_profile.py --out $OUT

Each lik kernel launch made by a small call (MSDA decoder forward and backward, MaxSim textual inference, a packed
corpus, the ColBERT B 128 training kernels) is captured once, then replayed 300 times without synchronising, by
Triton's JIT path (``kernel[grid](...)``: binder, cache key, launch) and by the compiled kernel's own launcher
(``CompiledKernel.run``), with the binder and the cache key also timed alone. The wall time per replay is its host
cost (the GPU keeps up: these kernels are small). The MSDA decoder backward is also broken into autograd.grad,
an autograd Function with an empty backward, ``msda_backward`` called directly and the zero fill, and a
torch.profiler timeline of the ``do_bench`` loop body (L2 flush, start event, autograd.grad, end event) is
summarised: when each kernel was launched on the host and when it ran on the GPU, relative to the flush.
Writes ``launch_profile.json`` and ``launch_trace.json`` (the chrome trace) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import triton
from triton.runtime import jit as triton_jit

import lik
from lik import _launch
from lik.bench.cases import host_us
from lik.ops.msda.backward import msda_backward

REPLAYS = 300


class Recorder:
    """Captures every ``JITFunction.run`` call (function, args, kwargs, grid, compiled kernel) while active."""

    def __init__(self):
        self.launches = []
        self._original = triton_jit.JITFunction.run

    def __enter__(self):
        original, launches = self._original, self.launches

        def run(fn, *args, grid, warmup, **kwargs):
            kernel = original(fn, *args, grid=grid, warmup=warmup, **kwargs)
            launches.append((fn, args, dict(kwargs), grid, kernel))
            return kernel

        triton_jit.JITFunction.run = run
        return self

    def __exit__(self, *exc):
        triton_jit.JITFunction.run = self._original


def launch_costs(fn, args, kwargs, grid, kernel):
    """Host us per launch of one captured kernel call, by path."""
    device = torch.cuda.current_device()
    kernel_cache, key_cache, _, _, binder = fn.device_caches[device]
    options = dict(kwargs, debug=False, instrumentation_mode=triton.knobs.compilation.instrumentation_mode)
    bound, specialization, opts = binder(*args, **options)
    values = tuple(bound.values())
    grid3 = tuple(grid) + (1,) * (3 - len(grid))
    stream = torch.cuda.current_stream().cuda_stream
    fast_key_ints = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    replay = lambda f: host_us(f, REPLAYS)  # noqa: E731
    costs = {
        "jit": replay(lambda: fn[grid](*args, **kwargs)),
        "binder": replay(lambda: binder(*args, **options)),
        "cache_key": replay(lambda: triton_jit.compute_cache_key(key_cache, specialization, opts)),
        "compiled_runner": replay(lambda: kernel[grid3](*values)),
        "raw_run": replay(lambda: kernel.run(*grid3, stream, kernel.function, kernel.packed_metadata, None, None,
                                             None, *values)),
        "python_key": replay(lambda: (tuple((v == 1) + ((v & 15) == 0) * 2 for v in fast_key_ints),
                                      tuple(t.data_ptr() & 15 == 0 for t in tensors))),
        "current_stream": replay(lambda: torch.cuda.current_stream().cuda_stream),
    }
    return {"kernel": fn.__name__, "n_args": len(args), "n_tensors": len(tensors), "n_ints": len(fast_key_ints),
            "grid": list(grid3), **{k: round(v, 2) for k, v in costs.items()}}


def msda_problem(dtype=torch.float32, n=4, queries=300, heads=8, dim=32, points=4):
    hw = [(100, 167), (50, 84), (25, 42), (13, 21)]
    shapes = torch.tensor(hw, device="cuda")
    sizes = shapes.prod(1)
    starts = sizes.cumsum(0) - sizes
    value = torch.randn(n, int(sizes.sum()), heads, dim, device="cuda", dtype=dtype)
    loc = torch.rand(n, queries, heads, len(hw), points, 2, device="cuda", dtype=dtype)
    weights = torch.rand(n, queries, heads, len(hw), points, device="cuda", dtype=dtype).softmax(-1)
    grad = torch.randn(n, queries, heads * dim, device="cuda", dtype=dtype)
    return value, shapes, starts, loc, weights, grad


class EmptyBackward(torch.autograd.Function):
    """Forward allocates the output; backward returns no gradients: autograd's own cost per call."""

    @staticmethod
    def forward(ctx, value, loc, weights):
        return value.new_empty((loc.shape[0], loc.shape[1], value.shape[2] * value.shape[3]))

    @staticmethod
    def backward(ctx, grad):
        return None, None, None


def decoder_backward_pieces():
    value, shapes, starts, loc, weights, grad = msda_problem()
    leaves = [t.clone().requires_grad_() for t in (value, loc, weights)]
    out = lik.ms_deform_attn(leaves[0], shapes, starts, leaves[1], leaves[2])
    empty_out = EmptyBackward.apply(*leaves)
    bench = lambda f: triton.testing.do_bench(f, return_mode="median") * 1e3  # noqa: E731
    grad_lik = lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)  # noqa: E731
    grad_empty = lambda: torch.autograd.grad(empty_out, leaves, grad, retain_graph=True, allow_unused=True)  # noqa: E731
    direct = lambda: msda_backward(grad, value, shapes, starts, loc, weights, deterministic=False)  # noqa: E731
    zeros = lambda: torch.zeros(value.shape, dtype=torch.float32, device="cuda")  # noqa: E731
    forward = lambda: lik.ms_deform_attn(value, shapes, starts, loc, weights)  # noqa: E731
    pieces = {}
    for name, f in (("autograd.grad lik", grad_lik), ("autograd.grad empty Function", grad_empty),
                    ("msda_backward direct", direct), ("zeros 91 MB", zeros), ("forward no grad", forward)):
        pieces[name] = {"host_us": round(host_us(f), 1), "do_bench_us": round(bench(f), 1)}
    return pieces, grad_lik


def timeline(step, out_dir, iterations=12):
    """torch.profiler over do_bench's loop body; per iteration, host launch and GPU run times relative to the
    L2 flush's launch, for the middle iterations."""
    cache = torch.empty(256 * 1024**2 // 4, dtype=torch.int, device="cuda")
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iterations)]
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for start, end in events:
            cache.zero_()
            start.record()
            step()
            end.record()
        torch.cuda.synchronize()
    measured = [round(s.elapsed_time(e) * 1e3, 1) for s, e in events]
    path = os.path.join(out_dir, "launch_trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)["traceEvents"]
    runtime = sorted((e for e in trace if e.get("cat") in ("cuda_runtime", "cuda_driver")), key=lambda e: e["ts"])
    kernels = sorted((e for e in trace if e.get("cat") in ("kernel", "gpu_memset")), key=lambda e: e["ts"])
    by_corr = {e["args"].get("correlation"): e for e in kernels}
    rows = []
    launches = [e for e in runtime if e["name"] in ("cudaLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernel",
                                                    "cudaLaunchKernelExC", "cudaEventRecord",
                                                    "cudaEventRecordWithFlags", "cudaMemsetAsync")]
    # Group by iteration: each begins with the flush (the first kernel launched after the previous end event).
    iteration, t0, per_iter = -1, 0.0, []
    for e in launches:
        gpu = by_corr.get(e["args"].get("correlation"))
        name = gpu["name"][:60] if gpu else e["name"]
        if gpu and "FillFunctor" in gpu["name"] and gpu["dur"] > 30 and (not per_iter or per_iter[-1]):
            iteration += 1
            t0 = e["ts"]
            per_iter.append([])
        if iteration < 0:
            continue
        row = {"what": name, "host_launch_us": round(e["ts"] - t0, 1)}
        if gpu:
            row.update(gpu_start_us=round(gpu["ts"] - t0, 1), gpu_us=round(gpu["dur"], 1))
        per_iter[-1].append(row)
    middle = per_iter[len(per_iter) // 2: len(per_iter) // 2 + 2]
    for rows in middle:
        for r in rows:
            print("   ", r)
        print()
    return {"measured_us": measured, "iterations": middle}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="launch_out")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "commit": os.environ.get("LIK_COMMIT", "unknown")}

    calls = {}
    value, shapes, starts, loc, weights, grad = msda_problem()
    calls["msda decoder forward"] = lambda: lik.ms_deform_attn(value, shapes, starts, loc, weights)
    calls["msda decoder backward"] = lambda: msda_backward(grad, value, shapes, starts, loc, weights,
                                                           deterministic=False)
    q = torch.randn(32, 128, device="cuda", dtype=torch.float16)
    docs = torch.randn(1000, 300, 128, device="cuda", dtype=torch.float16)
    calls["maxsim textual B1000"] = lambda: lik.maxsim(q, docs)
    lengths = torch.randint(20, 300, (1000,)).tolist()
    packed, cu, max_len = lik.pack([torch.randn(n, 128, device="cuda", dtype=torch.float16) for n in lengths])
    calls["maxsim_packed 1000 docs"] = lambda: lik.maxsim_packed(q, packed, cu, max_seqlen_d=max_len)
    qb = torch.randn(128, 32, 128, device="cuda", dtype=torch.float16, requires_grad=True)
    db = torch.randn(128, 180, 128, device="cuda", dtype=torch.float16, requires_grad=True)
    labels = torch.arange(128, device="cuda")

    def colbert_step():
        loss = torch.nn.functional.cross_entropy(lik.maxsim(qb, db).float(), labels)
        loss.backward()

    calls["ColBERT B128 training step"] = colbert_step

    # Whole calls through Triton's launch path and through lik's cached one (lik._launch), alternated.
    per_call = {name: {"triton": [], "cached": []} for name in calls}
    for _ in range(3):
        for mode in ("triton", "cached"):
            _launch.ENABLED = mode == "cached"
            for name, call in calls.items():
                per_call[name][mode].append(round(host_us(call, 100), 1))
    _launch.ENABLED = False  # the captures below must see Triton's JIT path
    for name in per_call:
        per_call[name] = {mode: statistics.median(v) for mode, v in per_call[name].items()}
    launches = []
    for name, call in calls.items():
        with Recorder() as rec:
            call()
        torch.cuda.synchronize()
        for launch in rec.launches:
            row = launch_costs(*launch)
            row["call"] = name
            launches.append(row)
    result["host_us_per_call"] = per_call
    result["launches"] = launches

    pieces = {}
    for mode in ("triton", "cached"):
        _launch.ENABLED = mode == "cached"
        pieces[mode], grad_lik = decoder_backward_pieces()
    result["msda_decoder_backward_pieces"] = pieces
    result["msda_decoder_backward_timeline"] = timeline(grad_lik, args.out)

    with open(os.path.join(args.out, "launch_profile.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['device']}, torch {result['torch']}, triton {result['triton']}")
    print("host us per call (median of 3 x 100 calls):")
    for name, v in per_call.items():
        print(f"  {name:32s} triton {v['triton']:7.1f}  cached {v['cached']:7.1f}")
    print("decoder backward pieces (host us / do_bench us):")
    for name in pieces["triton"]:
        a, b = pieces["triton"][name], pieces["cached"][name]
        print(f"  {name:32s} triton {a['host_us']:6.1f} / {a['do_bench_us']:6.1f}   "
              f"cached {b['host_us']:6.1f} / {b['do_bench_us']:6.1f}")
    print("do_bench-style measured us:", result["msda_decoder_backward_timeline"]["measured_us"])
    cols = ["jit", "binder", "cache_key", "compiled_runner", "raw_run", "python_key", "current_stream"]
    print(f"\n{'call / kernel':58s} args " + " ".join(f"{c:>15s}" for c in cols))
    for r in launches:
        label = f"{r['call']} / {r['kernel']}"[:58]
        print(f"{label:58s} {r['n_args']:4d} " + " ".join(f"{r[c]:15.1f}" for c in cols))
    print("median jit / raw:", statistics.median(r["jit"] / r["raw_run"] for r in launches))


if __name__ == "__main__":
    main()
