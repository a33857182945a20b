"""A/B of ``lik.maxsim``'s inference replay (GPU): the same calls with replays on and off, in one process.

For each cell (canonical single-query shapes: fp16, 8-bit operands quantized outside the timing, and a float16
query against an 8-bit corpus, quantized inside the call as a serving loop does) it times
``lik.maxsim`` by ``triton.testing.do_bench`` (median, L2 flushed before each call, as ``lik bench`` does) with the
replay on and off in alternating rounds, checks that both give the same scores bit for bit, and measures the host
time of one call (the mean over 2 000 calls of a tiny problem enqueued without synchronising, GPU far from busy).

    python3 benchmarks/replay_ab.py --out OUT [--src OTHER_TREE/src]   (--src: time another tree's lik)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton

_SRC = sys.argv[sys.argv.index("--src") + 1] if "--src" in sys.argv else os.path.join(os.path.dirname(__file__), "..",
                                                                                       "src")
sys.path.insert(0, _SRC)
import lik  # noqa: E402
from lik.ops.maxsim import function as maxsim_function  # noqa: E402


def _replays(on: bool):
    maxsim_function.replay_key = REAL_KEY if on else (lambda *args: None)


REAL_KEY = maxsim_function.replay_key


def _unit(*shape):
    return torch.nn.functional.normalize(torch.randn(*shape, device="cuda"), dim=-1).half()


def _cells():
    cells = {}
    for name, (lq, ld, b) in {"textual B1000": (32, 300, 1000), "ColPali B1000": (1024, 1024, 1000),
                              "textual B10000": (32, 300, 10000)}.items():
        Q, D = _unit(lq, 128), _unit(b, ld, 128)
        cells[f"{name} fp16"] = ((Q, D), {})
        for dtype, tag in ((torch.int8, "int8"), (torch.float8_e4m3fn, "fp8")):
            d8, ds = lik.quantize(D, dtype)
            q8, qs = lik.quantize(Q, dtype)
            cells[f"{name} {tag}"] = ((q8, d8), {"q_scale": qs, "d_scale": ds})
            cells[f"{name} fp16 query, {tag} corpus"] = ((Q, d8), {"d_scale": ds})
    return cells


def host_us(args, kwargs, calls=2000):
    for _ in range(50):
        lik.maxsim(*args, **kwargs)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        lik.maxsim(*args, **kwargs)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--src", default=_SRC, help="the src/ directory of the lik to time (read at import)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "src": os.path.abspath(args.src), "cells": {}, "host_us": {}}
    lines = []
    cells = _cells()
    for name, (a, k) in cells.items():
        _replays(False)
        off = lik.maxsim(*a, **k)
        _replays(True)
        lik.maxsim(*a, **k)  # records
        on = lik.maxsim(*a, **k)  # replays
        same = torch.equal(on, off)
        times = {"on": [], "off": []}
        for _ in range(args.rounds):
            for mode in ("on", "off"):
                _replays(mode == "on")
                times[mode].append(triton.testing.do_bench(lambda: lik.maxsim(*a, **k), warmup=25, rep=100))
        med = {m: sorted(t)[len(t) // 2] for m, t in times.items()}
        record["cells"][name] = {"same_bits": same, **{f"{m}_ms": t for m, t in times.items()}}
        lines.append(f"{name:22s} replay on {med['on']:.4f} ms  off {med['off']:.4f} ms  "
                     f"(off / on {med['off'] / med['on']:.2f}x)  same bits {same}")
    tiny_q, tiny_d = _unit(32, 128), _unit(4, 64, 128)
    d8, ds = lik.quantize(tiny_d, torch.int8)
    q8, qs = lik.quantize(tiny_q, torch.int8)
    for name, (a, k) in {"tiny fp16": ((tiny_q, tiny_d), {}),
                         "tiny int8": ((q8, d8), {"q_scale": qs, "d_scale": ds}),
                         "tiny fp16 query, int8 corpus": ((tiny_q, d8), {"d_scale": ds})}.items():
        for mode in ("off", "on", "off", "on"):
            _replays(mode == "on")
            record["host_us"].setdefault(f"{name} {mode}", []).append(host_us(a, k))
    _replays(True)
    for name, values in record["host_us"].items():
        lines.append(f"host time per call, {name}: {', '.join(f'{v:.1f}' for v in values)} us")
    with open(os.path.join(args.out, "replay_ab.json"), "w") as f:
        json.dump(record, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
