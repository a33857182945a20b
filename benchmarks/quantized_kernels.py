"""Device time per call, kernel by kernel, of the 8-bit scorers at the memory-bound textual cells.

    PYTHONPATH=src:benchmarks python3 benchmarks/quantized_kernels.py [--out $OUT]

``lik bench`` reports ``do_bench`` medians (L2 flushed), which include the launch and the gap between the start
event and the first kernel. This lists, for lik fp16 / int8 / fp8, flash-maxsim's int8x8 and
late-interaction-kernels' fp8 (each on the operands its own quantizer made, as in ``lik bench``), the kernels one
call launches and their summed device time (torch.profiler, 20 calls, L2 flushed before each), beside the same
run's ``do_bench`` (median of five interleaved rounds of medians) and that of a kernel that only reads the 8-bit
corpus's bytes (``read_ceiling.py``'s).
Writes ``quantized_kernels.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton

from lik.bench.measure import make_inputs
from lik.bench.methods import METHODS
from lik.bench.shapes import Shape
from read_ceiling import BLOCKS, read_kernel  # benchmarks/ is the script's directory, so on sys.path

NAMES = ("lik", "lik-int8", "lik-fp8", "flash-maxsim-int8x8", "late-interaction-kernels-fp8")
CALLS = 20
ROUNDS = 5


def device_kernels(fn, flush):
    """``{kernel name: count and device us per call}`` of ``fn``, the L2 flushed before each call (the flush's
    own kernel left out)."""
    from torch.profiler import ProfilerActivity, profile

    def run(work):
        for _ in range(3):
            work()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(CALLS):
                work()
            torch.cuda.synchronize()
        times = {}
        for event in prof.events():
            if event.device_type.name == "CUDA":
                times.setdefault(event.name, []).append(event.device_time)
        return times

    flush_us = {name: sum(t) / len(t) for name, t in run(flush.zero_).items()}

    def flushed():
        flush.zero_()
        fn()

    kernels = {}
    for name, times in run(flushed).items():
        count, total = len(times) / CALLS, sum(times) / CALLS
        if name in flush_us:  # the flush's kernel, once per call; anything beyond is the method's
            count, total = count - 1, total - flush_us[name]
        if count > 0:
            kernels[name[:80]] = dict(count=count, us=total)
    return kernels


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    device = torch.device("cuda")
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device=device)
    methods = {m.name: m for m in METHODS if m.name in NAMES and m.unavailable_reason(device) is None}
    rows = []
    for b in (1000, 10000):
        shape = Shape("forward", "textual", 1, 32, 300, b)
        (Q, D), = make_inputs(shape, torch.float16, device, max_sets=1).sets
        calls = {}
        for name, method in methods.items():
            fn = method.build(shape)
            operands = method.prepare(shape, Q, D) if method.prepare else (Q, D)
            calls[name] = lambda fn=fn, operands=operands: fn(*operands)
        # Every do_bench before any profiling: once torch.profiler has run, the process's launches cost more
        # host time, which do_bench would see at these short calls.
        rounds = {name: [] for name in calls}
        for _ in range(ROUNDS):  # interleaved, so that a slow stretch of the host touches every method alike
            for name, call in calls.items():
                rounds[name].append(triton.testing.do_bench(call, return_mode="median"))
        timed = {name: sorted(times)[ROUNDS // 2] for name, times in rounds.items()}
        # The same bytes as an 8-bit corpus (rows and fp32 scales) read by a kernel that does nothing else.
        n = b * 300 * (128 + 4) // 2
        source = torch.empty(n, dtype=torch.float16, device=device)
        partial = torch.empty(triton.cdiv(n, min(BLOCKS)), dtype=torch.float32, device=device)
        read_ms = min(triton.testing.do_bench(
            lambda block=block: read_kernel[(triton.cdiv(n, block),)](source, partial, n, BLOCK_SIZE=block),
            return_mode="median") for block in BLOCKS)
        rows.append(dict(b=b, method="read the 8-bit corpus's bytes only", do_bench_ms=read_ms))
        print(f"B {b:5} {'read the bytes only':30} do_bench {read_ms * 1e3:6.1f} us", flush=True)
        for name, call in calls.items():
            kernels = device_kernels(call, flush)
            row = dict(b=b, method=name, do_bench_ms=timed[name], do_bench_rounds_ms=rounds[name],
                       device_us=sum(k["us"] for k in kernels.values()), kernels=kernels)
            rows.append(row)
            listed = ", ".join(f"{k[:40]} x{v['count']:.0f} {v['us']:.1f}" for k, v in kernels.items())
            print(f"B {b:5} {name:30} do_bench {row['do_bench_ms'] * 1e3:6.1f} us  device {row['device_us']:6.1f} us"
                  f"  {listed}", flush=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                commit=os.environ.get("LIK_COMMIT", "unknown"))
    with open(os.path.join(args.out, "quantized_kernels.json"), "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
