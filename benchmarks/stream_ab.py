"""A/B on the GPU, one process: documents read as one token stream (tiles across document boundaries) against
the per-document tile loop, same kernel otherwise, at the shapes whose documents end on a ragged tile.

For each shape and dtype it checks that both launches give the same bits, then times them interleaved
(``do_bench`` medians with the L2 flushed) beside lik's fp16 time, and writes JSON plus a table. Usage::

    PYTHONPATH=src python3 benchmarks/stream_ab.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton

import lik
from lik.ops.maxsim import forward

SHAPES = {  # name: (Nq, Lq, B, Ld), d = 128
    "textual B 1 000": (1, 32, 1000, 300),
    "textual B 10 000": (1, 32, 10000, 300),
    "multi textual Nq 32, B 1 024": (32, 32, 1024, 300),
    "stacked ColBERT Nq 128, B 1 000 (180 tokens)": (128, 32, 1000, 180),
}
DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _time(fn, rounds: int = 3) -> float:
    return sorted(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") for _ in range(rounds))[
        rounds // 2
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    real = forward.streams_documents
    rows = []
    for name, (n_q, l_q, n_docs, l_d) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        Q = torch.nn.functional.normalize(torch.randn(n_q, l_q, 128, device="cuda", generator=gen), dim=-1)
        D = torch.nn.functional.normalize(torch.randn(n_docs, l_d, 128, device="cuda", generator=gen), dim=-1)
        Q = Q[0] if n_q == 1 else Q
        fp16 = _time(lambda: lik.maxsim(Q.half(), D.half()))
        for label, dtype in DTYPES.items():
            q, q_scale = lik.quantize(Q, dtype)
            d, d_scale = lik.quantize(D, dtype)
            call = lambda: lik.maxsim(q, d, q_scale=q_scale, d_scale=d_scale)  # noqa: E731
            timings, scores, used = {}, {}, {}
            for stream in (True, False, True, False):
                flags = []
                forward.streams_documents = lambda *a, _s=stream, _f=flags, **k: _f.append(real(*a, **k) and _s) or _f[-1]
                scores[stream] = call()
                timings.setdefault(stream, []).append(_time(call))
                used[stream] = flags[0]
            forward.streams_documents = real
            row = {
                "shape": name, "dtype": label, "fp16_ms": fp16, "stream_used": used[True],
                "stream_ms": min(timings[True]), "per_document_ms": min(timings[False]),
                "same_bits": bool(torch.equal(scores[True], scores[False])),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "commit": os.environ.get("LIK_COMMIT", "unknown"), "rows": rows}
    with open(os.path.join(args.out, "stream_ab.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['device']}, torch {result['torch']}, triton {result['triton']}, commit {result['commit']}")
    print(f"{'shape':46} {'dtype':5} {'fp16 ms':>8} {'per-doc ms':>10} {'stream ms':>9} {'x fp16':>7} {'same':>5}")
    for r in rows:
        print(f"{r['shape']:46} {r['dtype']:5} {r['fp16_ms']:8.4f} {r['per_document_ms']:10.4f} "
              f"{r['stream_ms']:9.4f} {r['fp16_ms'] / r['stream_ms']:6.2f}x {str(r['same_bits']):>5}"
              f"{'' if r['stream_used'] else ' (not streamed)'}")


if __name__ == "__main__":
    main()
