"""Compare the forward's running-max state (per row, reduced every tile; or per column slot, reduced once per
document) at the training and inference shapes, on the GPU.

    python3 benchmarks/probe_forward.py [--out $OUT] [--rep 100]

For each shape and variant: the forward with argmax (training shapes) and scores only (all shapes), do_bench
medians in ms, registers and spills of the compiled kernel, and whether scores and winners are bitwise equal to
the per-row variant's. Inference shapes also report the host time of one ``lik.maxsim`` call (a loop of calls
without synchronising: the launch-bound limit). Prints a table, writes ``probe_forward.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import lik  # noqa: E402
from lik import _config  # noqa: E402
from lik.ops.maxsim.forward import maxsim_forward, maxsim_fwd_kernel  # noqa: E402
from lik.ops.maxsim.validation import MaxSimInputs  # noqa: E402

# name: (Nq, Lq, B, Ld); training shapes are in-batch (Nq = B).
TRAIN = {
    "colbert-128": (128, 32, 128, 180), "colbert-512": (512, 32, 512, 180), "colbert-2048": (2048, 32, 2048, 180),
    "colpali-32": (32, 1024, 32, 1024), "colpali-64": (64, 1024, 64, 1024), "colpali-128": (128, 1024, 128, 1024),
}
INFER = {
    "textual-1000": (1, 32, 1000, 300), "long-doc-1000": (1, 32, 1000, 1024), "medium-1000": (1, 128, 1000, 1024),
    "visual-1000": (1, 512, 1000, 1024), "colpali-1000": (1, 1024, 1000, 1024),
    "multi-textual": (32, 32, 1024, 300),
}


def compiled_stats(before):
    stats = []
    for cache in maxsim_fwd_kernel.device_caches.values():
        for key, kernel in cache[0].items():
            if key in before:
                continue
            try:
                kernel._init_handles()
                stats.append({"n_regs": kernel.n_regs, "n_spills": kernel.n_spills})
            except Exception as exc:  # noqa: BLE001 (metadata only; never fail the probe for it)
                stats.append({"error": repr(exc)})
    return stats


def cache_keys():
    return {key for cache in maxsim_fwd_kernel.device_caches.values() for key in cache[0]}


def bench(fn, rep):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def variants(base):
    out = {"row": replace(base, slot_state=False), "slot": replace(base, slot_state=True)}
    if base.block_m >= 256:
        out["slot-128"] = replace(base, slot_state=True, groups=max(1, base.groups // 2)) if base.groups > 1 \
            else replace(base, slot_state=True, group_rows=base.group_rows // 2)
    return out


def probe(name, shape, train, rep):
    n_q, l_q, n_docs, l_d = shape
    dev, dtype, dim = torch.device("cuda"), torch.float16, 128
    gen = torch.Generator(device=dev).manual_seed(0)
    Q = torch.nn.functional.normalize(torch.randn(n_q, l_q, dim, device=dev, generator=gen), dim=-1).to(dtype)
    D = torch.nn.functional.normalize(torch.randn(n_docs, l_d, dim, device=dev, generator=gen), dim=-1).to(dtype)
    inputs = MaxSimInputs.build(Q, D, None, None, "exclude")
    base = _config.maxsim_forward_config(q_len=l_q, n_queries=n_q, dim=dim, dtype=dtype, per_query=False,
                                         device=dev)
    row = {"shape": name, "Nq": n_q, "Lq": l_q, "B": n_docs, "Ld": l_d, "base": base.__dict__.copy(), "variants": {}}
    ref = None
    for label, cfg in variants(base).items():
        entry = {"config": cfg.__dict__.copy()}
        with _config.override(maxsim_forward=cfg):
            before = cache_keys()
            scores, argmax = maxsim_forward(inputs, store_argmax=train)
            only = maxsim_forward(inputs, store_argmax=False)[0]
            torch.cuda.synchronize()
            entry["kernels"] = compiled_stats(before)
            if ref is None:
                ref = (scores, argmax, only)
            entry["scores_equal"] = bool(torch.equal(scores, ref[0]) and torch.equal(only, ref[2]))
            if train:
                entry["argmax_equal"] = bool(torch.equal(argmax, ref[1]))
                entry["fwd_argmax_ms"] = bench(lambda: maxsim_forward(inputs, store_argmax=True), rep)
            entry["fwd_scores_ms"] = bench(lambda: maxsim_forward(inputs, store_argmax=False), rep)
            if not train:
                with torch.no_grad():
                    for _ in range(20):
                        lik.maxsim(Q[0] if n_q == 1 else Q, D)
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    for _ in range(200):
                        lik.maxsim(Q[0] if n_q == 1 else Q, D)
                    entry["host_ms_per_call"] = (time.perf_counter() - started) / 200 * 1e3
                    torch.cuda.synchronize()
                    entry["maxsim_ms"] = bench(lambda: lik.maxsim(Q[0] if n_q == 1 else Q, D), rep)
        row["variants"][label] = entry
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--shapes", default="", help="comma-separated substrings of shape names")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    wanted = [s for s in args.shapes.split(",") if s]
    rows = []
    for table, train in ((TRAIN, True), (INFER, False)):
        for name, shape in table.items():
            if wanted and not any(w in name for w in wanted):
                continue
            rows.append(probe(name, shape, train, args.rep))
            print(json.dumps(rows[-1]), flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": os.environ.get("LIK_COMMIT", "unknown")}
    with open(os.path.join(args.out, "probe_forward.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\n{meta}")
    print(f"{'shape':15} {'variant':9} {'argmax ms':>10} {'scores ms':>10} {'host ms':>8} {'regs':>5} {'spill':>5} eq")
    for r in rows:
        for label, e in r["variants"].items():
            k = e["kernels"][0] if e["kernels"] else {}
            print(f"{r['shape']:15} {label:9} {e.get('fwd_argmax_ms', float('nan')):10.4f} "
                  f"{e['fwd_scores_ms']:10.4f} {e.get('host_ms_per_call', float('nan')):8.4f} "
                  f"{k.get('n_regs', -1):5} {k.get('n_spills', -1):5} "
                  f"{e['scores_equal'] and e.get('argmax_equal', True)}")


if __name__ == "__main__":
    main()
