"""Time each kernel of the MaxSim training backward separately.

    python3 benchmarks/profile_backward.py [--shapes colbert-128,...]

Per in-batch training shape (d 128, fp16, L2-normalised random data): the forward with argmax, dQ (documents per
loop step 1 = the first version, and the configured / swept values), the atomic dD scatter through fp32
buffers of a few sizes, the sorted-winners gather over a few sort chunks and key widths (each with its peak
memory; the sort alone), and the whole step through ``lik.maxsim`` (fast / deterministic, with peaks). The
one-hot dD kernels this replaced were last profiled at commit 1e5e6cd (benchmarks/NOTES.md, "fast" dD).
Medians of ``triton.testing.do_bench`` (ms). Prints a table, writes ``$OUT/profile_backward.json`` (or --out).
``--parts forward,steps`` times only the two forwards and the whole steps (an A/B of a forward change);
``--parts forward-tiles`` times the argmax forward under forced tiles around the heuristic's (rows per program,
warps, persistent programs per SM).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import lik  # noqa: E402
from lik import _config  # noqa: E402
from lik.ops.maxsim import backward as bw  # noqa: E402
from lik.ops.maxsim.backward_sorted import launch_dd_sorted, sorted_winners  # noqa: E402
from lik.ops.maxsim.forward import maxsim_forward  # noqa: E402
from train_shapes import SHAPES, backward_problem  # noqa: E402
# sorted-winners dD: (sort workspace entries, contributions per block, warps)
# (sort workspace entries, contributions per block, warps, cap on a chunk's rows: 32 767 gives 16-bit keys)
SORTED = [(1 << 20, 8, 1, 0), (1 << 20, 8, 1, 32767), (1 << 22, 8, 1, 0)]


def bench(fn, rep):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


PARTS = ("forward", "backward", "steps")
# (query-row groups stacked per program, warps, persistent programs per SM, register cap) tried by
# --parts forward-tiles; the group size stays the heuristic's (the power-of-two bucket of Lq, capped at 256 rows).
FORWARD_TILES = [
    (8, 8, 0, 0), (8, 8, 2, 0), (4, 4, 0, 0), (4, 8, 0, 0), (4, 8, 1, 0), (4, 8, 2, 0), (4, 8, 0, 128), (4, 8, 1, 128),
    (4, 8, 2, 128), (2, 4, 0, 0), (2, 4, 2, 0), (1, 8, 0, 0), (1, 8, 0, 128),
]


def profile(name, rep, parts=PARTS):
    l_q, n, l_d = SHAPES[name]
    prob = backward_problem(name)
    row = {"shape": name, "Lq": l_q, "B": n, "Ld": l_d, "config": prob.cfg.__dict__.copy()}
    if "forward" in parts:
        row["fwd_argmax"] = bench(lambda: maxsim_forward(prob.inputs, store_argmax=True), rep)
        row["fwd_scores_only"] = bench(lambda: maxsim_forward(prob.inputs, store_argmax=False), rep)
    if "forward-tiles" in parts:
        profile_forward_tiles(row, prob, rep)
    if "backward" in parts:
        profile_backward_kernels(row, prob, rep)
    if "steps" in parts:
        profile_steps(row, prob.Q, prob.D, n, rep)
    return row


def profile_forward_tiles(row, prob, rep):
    """The argmax forward under forced tiles (rows = group_rows x groups); winners checked equal to the heuristic's."""
    base = prob.cfg_forward
    for groups, warps, per_sm, max_registers in FORWARD_TILES:
        if base.group_rows * groups > 256 or (groups > 1) != (base.groups > 1):
            continue
        cfg = replace(base, groups=groups, num_warps=warps, programs_per_sm=per_sm, max_registers=max_registers)
        with _config.override(maxsim_forward=cfg):
            key = f"fwd_argmax_g{groups}_w{warps}_p{per_sm}_r{max_registers}"
            row[key] = bench(lambda: maxsim_forward(prob.inputs, store_argmax=True), rep)
            row[key + "_same_winners"] = bool(torch.equal(maxsim_forward(prob.inputs, store_argmax=True)[1],
                                                          prob.argmax))


def profile_backward_kernels(row, prob, rep):
    """dQ over documents per step, the atomic and sorted dD variants, and the deterministic path's repeatability."""
    q, d, argmax, grad = prob.q, prob.d, prob.argmax, prob.grad
    cfg, block_k, n_k, dtype, l_d = prob.cfg, prob.block_k, prob.n_k, prob.dtype, prob.d.shape[-2]
    dq_ref = None
    for docs in (1, 2, 4, 8):
        c = replace(cfg, dq_docs=docs)
        with _config.override(maxsim_backward=c):
            row[f"dq_docs{docs}"] = bench(lambda: bw.maxsim_backward_dq(grad, d, argmax, q.shape, dtype), rep)
            out = bw.maxsim_backward_dq(grad, d, argmax, q.shape, dtype)
        dq_ref = out if dq_ref is None else dq_ref
        row[f"dq_docs{docs}_bitwise_same"] = bool(torch.equal(out, dq_ref))
    # Atomic scatter through fp32 buffers of 8 MiB, 16 MiB (default) and all documents at once.
    dd_ref = None
    for name, workspace in (("ws8", 8 << 20), ("ws16", 16 << 20), ("full", 1 << 40)):
        c = replace(cfg, atomic_workspace_bytes=workspace)
        key = f"dd_atomic_{name}"
        row[key] = bench(lambda: bw.scatter_dd_atomic(grad, q, argmax, d.shape, dtype, cfg=c, block_k=block_k,
                                                      n_k_blocks=n_k), rep)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = bw.scatter_dd_atomic(grad, q, argmax, d.shape, dtype, cfg=c, block_k=block_k, n_k_blocks=n_k)
        row[key + "_peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        dd_ref = out if dd_ref is None else dd_ref
        row[key + "_relerr_vs_ws8"] = rel(out, dd_ref)
    dd = torch.empty(d.shape, dtype=dtype, device=d.device)
    # Sorted-winners gather: sort chunk (workspace) x contributions per block x warps.
    row["sort_only"] = bench(lambda: sorted_winners(argmax, l_d, per_query=False), rep)
    for workspace, entries, warps, rows in SORTED:
        c = replace(cfg, sort_workspace_entries=workspace, sort_entries=entries, sort_warps=warps,
                    sort_chunk_rows=rows)
        key = f"dd_sorted_ws{workspace.bit_length() - 1}_e{entries}_w{warps}" + ("_k16" if rows else "")
        row[key] = bench(lambda: launch_dd_sorted(grad, q, argmax, dd, per_query=False, cfg=c, block_k=block_k,
                                                  n_k_blocks=n_k), rep)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        launch_dd_sorted(grad, q, argmax, dd, per_query=False, cfg=c, block_k=block_k, n_k_blocks=n_k)
        row[key + "_peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        row[key + "_relerr_vs_atomic"] = rel(dd, dd_ref)
    row["argmax_dtype"] = str(argmax.dtype)
    # determinism of the default deterministic path
    a = bw.maxsim_backward_dd(grad, q, argmax, d.shape, dtype, deterministic=True, per_query=False)
    b = bw.maxsim_backward_dd(grad, q, argmax, d.shape, dtype, deterministic=True, per_query=False)
    row["det_bitwise_repeatable"] = bool(torch.equal(a, b))
    row["det_relerr_vs_atomic"] = rel(a, dd_ref)


def profile_steps(row, Q, D, n, rep):
    """The whole training step through ``lik.maxsim`` (in-batch cross-entropy), fast and deterministic, with peaks."""
    dev = Q.device
    for mode in ("fast", "deterministic"):
        Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
        labels = torch.arange(n, device=dev)

        def step():
            s = lik.maxsim(Qg, Dg, backward=mode)
            torch.nn.functional.cross_entropy(s, labels).backward()
        row[f"step_{mode}"] = bench(step, rep)
        Qg.grad = Dg.grad = None
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        row[f"step_{mode}_peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        Qg.grad = Dg.grad = None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rep", type=int, default=60)
    p.add_argument("--parts", default=",".join(PARTS),
                   help="comma-separated subset of " + ", ".join(PARTS) + ", forward-tiles")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    for name in args.shapes.split(","):
        rows.append(profile(name, args.rep, args.parts.split(",")))
        with open(os.path.join(args.out, "profile_backward.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(json.dumps(rows[-1]), flush=True)
    keys = [k for k in rows[0] if isinstance(rows[0][k], float) and "relerr" not in k and "peak" not in k]
    print(meta)
    print("ms".ljust(36) + "".join(r["shape"].rjust(13) for r in rows))
    for k in keys:
        print(k.ljust(36) + "".join((f"{r[k]:.3f}" if isinstance(r.get(k), float) else "-").rjust(13) for r in rows))


if __name__ == "__main__":
    main()
