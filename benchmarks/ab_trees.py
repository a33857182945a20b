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

``--also NAME=PATH`` (repeatable) adds more trees to the same rounds, each compared with ``before``; ``--graph``
times the replay of a CUDA graph captured from one call (the kernels alone, without the host path; scoring cells
only), where rounds agree within ~0.1%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import zlib
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
    """``name -> (inputs, run(lik, inputs))`` for the canonical cells (DESIGN.md), d = 128, fp16. The 8-bit cells
    other than textual B = 10 000 and the B = 1 000 long queries (2.6 GB of fp16 pages for a long query at
    B = 10 000) are made only when ``wanted(name)``, each from its own generator, so the other cells' inputs do not
    depend on the selection."""
    out = {}
    for family, (lq, ld), b in [("textual", (32, 300), 1000), ("textual", (32, 300), 10000),
                                ("long-doc", (32, 1024), 1000), ("medium", (128, 1024), 1000),
                                ("visual", (512, 1024), 1000), ("colpali", (1024, 1024), 1000)]:
        out[f"forward/{family}/B{b}"] = ((normalised(lq, 128, gen=gen), normalised(b, ld, 128, gen=gen)),
                                         lambda lik, x: lik.maxsim(*x))
    for family, (lq, ld), b in [("textual", (32, 300), 1024), ("long-doc", (32, 1024), 1024),
                                ("colpali", (1024, 1024), 128)]:
        out[f"multi/{family}/Nq32xB{b}"] = ((normalised(32, lq, 128, gen=gen), normalised(b, ld, 128, gen=gen)),
                                            lambda lik, x: lik.maxsim(*x))

    shared = {("textual", 10000), ("visual", 1000), ("colpali", 1000)}  # made from gen, always
    for dtype, tag in ((torch.int8, "int8"), (torch.float8_e4m3fn, "fp8")):
        for family, (lq, ld), b in [("textual", (32, 300), 1000), ("textual", (32, 300), 10000),
                                    ("long-doc", (32, 1024), 1000), ("long-doc", (32, 1024), 10000),
                                    ("visual", (512, 1024), 1000), ("colpali", (1024, 1024), 1000),
                                    ("visual", (512, 1024), 10000), ("colpali", (1024, 1024), 10000)]:
            name = f"{tag}/{family}/B{b}"
            source = gen
            if (family, b) not in shared:
                if not wanted(name):
                    continue
                source = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()))
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


def graph_replay(fn):
    """The replay of a CUDA graph captured from one call of ``fn`` (after a warm call, without autograd): its
    kernels, no host path. (Shared with the other probes: this module imports no ``lik``.)"""
    with torch.no_grad():
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    return graph.replay


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", required=True)
    parser.add_argument("--also", action="append", default=[], metavar="NAME=PATH",
                        help="another tree in the same rounds, compared with --before (repeatable)")
    parser.add_argument("--graph", action="store_true", help="time CUDA-graph replays (scoring cells only)")
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rep-ms", type=float, default=60.0)
    parser.add_argument("--cells", default="", help="comma-separated substrings of the cell names to run")
    args = parser.parse_args()
    paths = {"before": args.before, "after": args.after}
    for spec in args.also:
        name, _, path = spec.partition("=")
        if not name.isidentifier() or not path or name in paths:
            parser.error(f"--also wants a new NAME=PATH, got {spec!r}")
        paths[name] = path
    trees = {name: load_lik(path, f"lik_{name}") for name, path in paths.items()}
    gen = torch.Generator(device="cuda").manual_seed(0)
    def wanted(name):
        return not args.cells or any(part in name for part in args.cells.split(","))

    table = {k: v for k, v in cells(gen, wanted).items() if wanted(k)}
    if args.graph:
        table = {k: v for k, v in table.items() if k.split("/")[0] in ("forward", "multi", "int8", "fp8")}
    calls = {}
    for name, (inputs, run) in table.items():  # compile and check agreement once
        results = {}
        for tree, lik in trees.items():
            with torch.no_grad() if not name.startswith("train") else torch.enable_grad():
                out = run(lik, inputs)
            results[tree] = out
            call = lambda run=run, lik=lik, inputs=inputs: run(lik, inputs)  # noqa: E731
            calls[name, tree] = graph_replay(call) if args.graph else call
        before = results.pop("before")
        for tree, out in results.items():
            if name.startswith("quantize"):  # the contract is bit for bit
                assert all(torch.equal(b.view(torch.uint8) if b.dtype != torch.float32 else b,
                                       a.view(torch.uint8) if a.dtype != torch.float32 else a)
                           for b, a in zip(before, out)), (name, tree)
            elif isinstance(before, torch.Tensor):
                assert torch.allclose(before, out, rtol=1e-3, atol=1e-3), (name, tree)
    times = {name: {tree: [] for tree in trees} for name in table}
    for round_index in range(args.rounds):
        for name in table:
            order = list(trees) if round_index % 2 == 0 else list(trees)[::-1]
            for tree in order:
                ms = triton.testing.do_bench(calls[name, tree], warmup=20, rep=args.rep_ms, return_mode="median")
                times[name][tree].append(ms)
    rows = []
    others = [t for t in trees if t != "before"]
    print("| cell | before ms | " + " | ".join(f"{t} ms | {t}/before" for t in others) + " | spreads |")
    print("|---|---|" + "---|---|" * len(others) + "---|")
    for name, per_tree in times.items():
        medians = {t: statistics.median(v) for t, v in per_tree.items()}
        spread = {t: 100 * (max(v) - min(v)) / statistics.median(v) for t, v in per_tree.items()}
        b = medians["before"]
        rows.append({"cell": name, "before_ms": b, "after_ms": medians["after"], "ratio": medians["after"] / b,
                     "medians_ms": medians, "ratios": {t: medians[t] / b for t in others}, "rounds": per_tree,
                     "spread_pct": spread})
        print(f"| {name} | {b:.4f} | " + " | ".join(f"{medians[t]:.4f} | {medians[t] / b:.3f}" for t in others)
              + " | " + " / ".join(f"{spread[t]:.1f}%" for t in trees) + " |")
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "trees": paths, "graph": args.graph}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "ab_trees.json").write_text(json.dumps({"environment": env, "cells": rows}, indent=1))


if __name__ == "__main__":
    main()
