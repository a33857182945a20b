"""ColPali's real page length: one 1 024-token query against pages of 1 030 tokens (1 024 patches and 6 text tokens),
every forward method of the harness that scores them, in one process.

    python3 benchmarks/colpali_pages_bench.py --out $OUT [--batches 1000,10000] [--page-tokens 1030]

The harness's canonical ColPali shape has 1 024-token documents (a whole number of tiles); this times the length
real pages have, where the kernels' last tile is ragged. Methods: lik fp16, lik int8 / fp8 (``lik.quantize`` per
token, outside the timing), flash-maxsim's int8x8 and late-interaction-kernels' fp8 with their own quantizers (when
installed). Each is checked against the fp16 scores (within the 8-bit quantization error) and timed by
``triton.testing.do_bench`` medians (L2 flushed) in interleaved rounds, each peer warmed once per shape first.
Writes ``colpali_pages.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton

import lik
from lik.bench.methods import peer_versions, select_methods
from lik.bench.shapes import Shape

METHODS = ["lik", "lik-int8", "lik-fp8", "flash-maxsim-int8x8", "late-interaction-kernels-fp8"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--batches", default="1000,10000")
    parser.add_argument("--page-tokens", type=int, default=1030)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")
    methods = [m for m in select_methods(METHODS) if m.unavailable_reason(device) is None]
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "peers": peer_versions(), "page_tokens": args.page_tokens, "cells": []}
    for b in (int(v) for v in args.batches.split(",")):
        shape = Shape("forward", "colpali-pages", 1, 1024, args.page_tokens, b)
        gen = torch.Generator(device=device).manual_seed(0)
        Q = torch.nn.functional.normalize(torch.randn(*shape.q_shape, device=device, generator=gen), dim=-1).half()
        D = torch.nn.functional.normalize(torch.randn(*shape.d_shape, device=device, generator=gen), dim=-1).half()
        reference = lik.maxsim(Q, D).float()
        calls = {}
        for method in methods:
            operands = method.prepare(shape, Q, D) if method.prepare else (Q, D)
            score = method.build(shape)
            scores = score(*operands).float().reshape(-1)  # (also the peer's warm-up)
            error = (scores - reference).abs().max().item()
            tolerance = 0.0 if method.storage is None else 0.05 * reference.abs().max().item()
            assert error <= max(tolerance, 1e-2), f"{method.name} at B = {b}: max |error| {error}"
            calls[method.name] = (lambda s=score, o=operands: s(*o)), error
        times = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, (call, _) in calls.items():
                times[name].append(triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median"))
        for name, (_, error) in calls.items():
            results["cells"].append({"b": b, "method": name, "ms": times[name], "max_abs_error": error})
        del Q, D, calls
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "colpali_pages.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"{'B':>6} {'method':30} {'ms (rounds)':>26} {'best':>8} {'lik fp16 / it':>14}")
    for b in sorted({c["b"] for c in results["cells"]}):
        cells = [c for c in results["cells"] if c["b"] == b]
        fp16 = min(next(c for c in cells if c["method"] == "lik")["ms"])
        for c in cells:
            rounds = " / ".join(f"{t:.4f}" for t in c["ms"])
            print(f"{b:>6} {c['method']:30} {rounds:>26} {min(c['ms']):8.4f} {fp16 / min(c['ms']):13.2f}x")


if __name__ == "__main__":
    main()
