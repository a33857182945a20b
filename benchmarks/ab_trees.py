"""A/B of two source trees of lik in one process: the canonical MaxSim cells, methods interleaved.

Each tree is imported by path under the name ``lik`` in turn (the first copy is kept by reference when the
second is imported; its custom operators are registered under another namespace so both can coexist), and
every cell is timed for both, interleaved round by round (the tree timed first alternates: the second timing of a
pair can read a few % fast), with ``triton.testing.do_bench`` medians. The ratio ``after / before`` per cell is
what carries; the spread between rounds says what noise is. ``--cells`` picks cells by substring, e.g. the 8-bit
ones (``int8``, ``fp8``: Q and D quantized once, outside the timing) or ``quantize`` (``lik.quantize`` of a
3 M-token fp16 corpus).

    python benchmarks/ab_trees.py --before ../before/src --after src --out $OUT
    python benchmarks/ab_trees.py --before ../before/src --after src --cells int8,fp8,quantize --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton.testing


def load_lik(src: str, namespace: str):
    """Import the ``lik`` package found under ``src`` (custom operators under ``namespace::``)."""
    for name in [n for n in sys.modules if n == "lik" or n.startswith("lik.")]:
        del sys.modules[name]
    original = torch.library.custom_op

    def renamed(name, *args, **kwargs):
        return original(name.replace("lik::", f"{namespace}::"), *args, **kwargs)

    torch.library.custom_op = renamed
    sys.path.insert(0, src)
    try:
        import lik
    finally:
        sys.path.remove(src)
        torch.library.custom_op = original
    return lik


def normalised(*shape, gen):
    return torch.nn.functional.normalize(torch.randn(*shape, device="cuda", generator=gen), dim=-1).half()


def quantize_once(x, dtype):
    """Per-token symmetric quantization in PyTorch (the contract of ``lik.quantize``), so that both trees score
    the same 8-bit operands whatever either's quantizer does. (On the GPU: the reference is device-agnostic, and a
    B = 10 000 corpus is 1.3 G elements.)"""
    from lik.ops.quantization.reference import quantize_reference  # noqa: PLC0415 (the tree imported last)

    return quantize_reference(x, dtype)


def cells(gen, wanted=lambda name: True):
    """``name -> (inputs, run(lik, inputs))`` for the canonical cells (DESIGN.md), d = 128, fp16. The 8-bit long
    queries at B = 10 000 (2.6 GB of fp16 pages each) are made only when ``wanted(name)``, from their own
    generator, so the other cells' inputs do not depend on the selection."""
    out = {}
    big = torch.Generator(device="cuda").manual_seed(1)
    for family, (lq, ld), b in [("textual", (32, 300), 1000), ("textual", (32, 300), 10000),
                                ("long-doc", (32, 1024), 1000), ("medium", (128, 1024), 1000),
                                ("visual", (512, 1024), 1000), ("colpali", (1024, 1024), 1000)]:
        out[f"forward/{family}/B{b}"] = ((normalised(lq, 128, gen=gen), normalised(b, ld, 128, gen=gen)),
                                         lambda lik, x: lik.maxsim(*x))
    for family, (lq, ld), b in [("textual", (32, 300), 1024), ("long-doc", (32, 1024), 1024),
                                ("colpali", (1024, 1024), 128)]:
        out[f"multi/{family}/Nq32xB{b}"] = ((normalised(32, lq, 128, gen=gen), normalised(b, ld, 128, gen=gen)),
                                            lambda lik, x: lik.maxsim(*x))

    for dtype, tag in ((torch.int8, "int8"), (torch.float8_e4m3fn, "fp8")):
        for family, (lq, ld), b in [("textual", (32, 300), 10000), ("visual", (512, 1024), 1000),
                                    ("colpali", (1024, 1024), 1000), ("visual", (512, 1024), 10000),
                                    ("colpali", (1024, 1024), 10000)]:
            name = f"{tag}/{family}/B{b}"
            source = gen if family == "textual" or b == 1000 else big
            if source is big and not wanted(name):
                continue
            q, d = normalised(lq, 128, gen=source), normalised(b, ld, 128, gen=source)
            (q8, qs), (d8, ds) = quantize_once(q, dtype), quantize_once(d, dtype)
            out[name] = ((q8, d8, qs, ds), lambda lik, x: lik.maxsim(x[0], x[1], q_scale=x[2], d_scale=x[3]))
        corpus = torch.randn(3_000_000, 128, device="cuda", generator=gen).half()
        out[f"quantize/{tag}/3Mx128"] = ((corpus, dtype), lambda lik, x: lik.quantize(*x))

    def train(lik, x):
        Q, D = (t.detach().requires_grad_() for t in x)
        scores = lik.maxsim(Q, D)
        loss = torch.nn.functional.cross_entropy(scores, torch.arange(scores.shape[0], device="cuda"))
        loss.backward()

    train_cells = [("colbert", (32, 180), 128), ("colbert", (32, 180), 512), ("colpali", (1024, 1024), 32)]
    for family, (lq, ld), b in train_cells:
        out[f"train/{family}/B{b}"] = ((normalised(b, lq, 128, gen=gen), normalised(b, ld, 128, gen=gen)), train)
    lengths = torch.clamp(torch.empty(1000).log_normal_(4.6, 0.6), 8, 512).long().tolist()
    d = normalised(sum(lengths), 128, gen=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    out["varlen/corpus/B1000"] = ((normalised(32, 128, gen=gen), d, cu, max(lengths)),
                                  lambda lik, x: lik.maxsim_packed(x[0], x[1], x[2], max_seqlen_d=x[3]))
    q_lengths = torch.randint(8, 33, (5000,)).tolist()
    d_lengths = torch.clamp(torch.empty(5000).log_normal_(4.6, 0.6), 8, 512).long().tolist()
    q = normalised(sum(q_lengths), 128, gen=gen)
    dd = normalised(sum(d_lengths), 128, gen=gen)
    cu_q = torch.tensor([0, *torch.tensor(q_lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_d = torch.tensor([0, *torch.tensor(d_lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    out["varlen/pairs/N5000"] = ((q, dd, cu_q, cu_d, max(q_lengths), max(d_lengths)),
                                 lambda lik, x: lik.maxsim_varlen(*x))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", required=True)
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rep-ms", type=float, default=60.0)
    parser.add_argument("--cells", default="", help="comma-separated substrings of the cell names to run")
    args = parser.parse_args()
    trees = {"before": load_lik(args.before, "lik_before"), "after": load_lik(args.after, "lik_after")}
    gen = torch.Generator(device="cuda").manual_seed(0)
    def wanted(name):
        return not args.cells or any(part in name for part in args.cells.split(","))

    table = {k: v for k, v in cells(gen, wanted).items() if wanted(k)}
    for name, (inputs, run) in table.items():  # compile and check agreement once
        results = {}
        for tree, lik in trees.items():
            with torch.no_grad() if not name.startswith("train") else torch.enable_grad():
                out = run(lik, inputs)
            results[tree] = out
        if name.startswith("quantize"):  # the contract is bit for bit
            assert all(torch.equal(b.view(torch.uint8) if b.dtype != torch.float32 else b,
                                   a.view(torch.uint8) if a.dtype != torch.float32 else a)
                       for b, a in zip(results["before"], results["after"])), name
        elif isinstance(results["before"], torch.Tensor):
            assert torch.allclose(results["before"], results["after"], rtol=1e-3, atol=1e-3), name
    times = {name: {tree: [] for tree in trees} for name in table}
    for round_index in range(args.rounds):
        for name, (inputs, run) in table.items():
            order = list(trees.items()) if round_index % 2 == 0 else list(trees.items())[::-1]
            for tree, lik in order:
                ms = triton.testing.do_bench(lambda: run(lik, inputs), warmup=20, rep=args.rep_ms,
                                             return_mode="median")
                times[name][tree].append(ms)
    rows = []
    print("| cell | before ms | after ms | after/before | spread before | spread after |")
    print("|---|---|---|---|---|---|")
    for name, per_tree in times.items():
        b, a = statistics.median(per_tree["before"]), statistics.median(per_tree["after"])
        spread = {t: 100 * (max(v) - min(v)) / statistics.median(v) for t, v in per_tree.items()}
        rows.append({"cell": name, "before_ms": b, "after_ms": a, "ratio": a / b, "rounds": per_tree,
                     "spread_pct": spread})
        print(f"| {name} | {b:.4f} | {a:.4f} | {a / b:.3f} | {spread['before']:.1f}% | {spread['after']:.1f}% |")
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "ab_trees.json").write_text(json.dumps({"environment": env, "cells": rows}, indent=1))


if __name__ == "__main__":
    main()
