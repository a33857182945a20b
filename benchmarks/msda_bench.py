"""Multi-scale deformable attention on the GPU: correctness, then lik against grid_sample, forward and backward.

Shapes: encoder (N = 2 at 1536x2048: levels 192x256 .. 24x32, Lq = S = 65 280) and decoder (N = 4 at
800x1333: levels 100x167 .. 13x21, Lq = 300), M = 8, D = 32, L = 4, P = 4; fp32 and bf16; "realistic" sampling
(reference points plus Deformable DETR's initial offset pattern plus noise) and uniform random sampling.

Methods, all in one process and interleaved per shape:
  lik        lik.ms_deform_attn (atomic backward)
  lik-det    the deterministic backward (under torch.use_deterministic_algorithms)
  gs-lik     lik's grid_sample reference (levels accumulated one at a time, fp32 arithmetic)
  gs-detr    the Deformable-DETR / transformers PyTorch path (stack of all levels, native dtype)

Timing: triton.testing.do_bench medians (L2 flushed between runs); backward timed alone (autograd.grad on a
retained graph). Peak memory: forward + backward, above the inputs, fresh per method. The bandwidth floor uses the
measured device-to-device copy rate and the minimal bytes (each input read once, each output written once).

    PYTHONPATH=src python3 benchmarks/msda_bench.py [--out results.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.testing

import lik.ops.msda as msda

ENCODER = dict(name="encoder", n=2, hw=[(192, 256), (96, 128), (48, 64), (24, 32)], queries=None)
DECODER = dict(name="decoder", n=4, hw=[(100, 167), (50, 84), (25, 42), (13, 21)], queries=300)
HEADS, DIM, POINTS = 8, 32, 4
BARS = {"encoder": (20.0, 15.0), "decoder": (12.0, 7.0)}  # forward, backward speedups over grid_sample


def detr_core(value, shapes_list, loc, weights):
    """The Deformable-DETR / transformers PyTorch formulation: grid_sample per level, stack, weight, sum."""
    n, _, heads, dim = value.shape
    _, lq, _, levels, points, _ = loc.shape
    per_level = value.split([h * w for h, w in shapes_list], dim=1)
    grids = 2 * loc - 1
    sampled = []
    for level, (h, w) in enumerate(shapes_list):
        v = per_level[level].flatten(2).transpose(1, 2).reshape(n * heads, dim, h, w)
        g = grids[:, :, :, level].transpose(1, 2).flatten(0, 1)
        sampled.append(F.grid_sample(v, g, mode="bilinear", padding_mode="zeros", align_corners=False))
    w = weights.transpose(1, 2).reshape(n * heads, 1, lq, levels * points)
    out = (torch.stack(sampled, dim=-2).flatten(-2) * w).sum(-1).view(n, heads * dim, lq)
    return out.transpose(1, 2).contiguous()


def make_problem(scale, sampling, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hw = scale["hw"]
    shapes = torch.tensor(hw, dtype=torch.int64, device="cuda")
    sizes = shapes[:, 0] * shapes[:, 1]
    starts = torch.cumsum(sizes, 0) - sizes
    n_pixels = int(sizes.sum())
    n = scale["n"]
    lq = scale["queries"] or n_pixels
    levels = len(hw)
    value = torch.randn(n, n_pixels, HEADS, DIM, device="cuda", generator=gen)
    logits = torch.randn(n, lq, HEADS, levels * POINTS, device="cuda", generator=gen)
    weights = logits.softmax(-1).view(n, lq, HEADS, levels, POINTS)
    norm = torch.tensor([[w, h] for h, w in hw], dtype=torch.float32, device="cuda")  # (W, H) per level
    if sampling == "uniform":
        loc = torch.rand(n, lq, HEADS, levels, POINTS, 2, device="cuda", generator=gen)
    else:
        if scale["queries"] is None:  # encoder: every pixel of every level is a query at its own centre
            refs = []
            for h, w in hw:
                ys, xs = torch.meshgrid(torch.arange(h, device="cuda"), torch.arange(w, device="cuda"), indexing="ij")
                refs.append(torch.stack([(xs.flatten() + 0.5) / w, (ys.flatten() + 0.5) / h], -1))
            ref = torch.cat(refs).expand(n, lq, 2)
        else:  # decoder: learned reference points spread over the image
            ref = torch.rand(n, lq, 2, device="cuda", generator=gen)
        # Deformable DETR's sampling_offsets bias: head m looks along angle 2*pi*m/M, point p at (p+1) pixels.
        theta = torch.arange(HEADS, device="cuda", dtype=torch.float32) * (2 * math.pi / HEADS)
        direction = torch.stack([theta.cos(), theta.sin()], -1)
        direction = direction / direction.abs().max(-1, keepdim=True).values
        steps = torch.arange(1, POINTS + 1, device="cuda", dtype=torch.float32)
        offsets = direction[:, None, None, :] * steps[None, None, :, None]  # [M, 1, P, 2] pixels
        noise = torch.randn(n, lq, HEADS, levels, POINTS, 2, device="cuda", generator=gen)
        loc = ref[:, :, None, None, None, :] + (offsets + noise) / norm[None, None, None, :, None, :]
    grad = torch.randn(n, lq, HEADS * DIM, device="cuda", generator=gen)
    cast = lambda t: t.to(dtype).contiguous()  # noqa: E731
    return dict(value=cast(value), shapes=shapes, starts=starts, loc=cast(loc), weights=cast(weights),
                grad=cast(grad), hw=hw)


def methods(p):
    v, s, st, lc, w, hw = p["value"], p["shapes"], p["starts"], p["loc"], p["weights"], p["hw"]
    return {
        "lik": lambda a, b, c: msda.ms_deform_attn(a, s, st, b, c),
        "gs-lik": lambda a, b, c: msda.ms_deform_attn_reference(a, s, st, b, c),
        "gs-detr": lambda a, b, c: detr_core(a, hw, b, c),
    }


def leaves(p):
    return [p[k].detach().clone().requires_grad_() for k in ("value", "loc", "weights")]


def copy_bandwidth():
    """Bytes read plus written per second of a 2 GiB device-to-device copy."""
    src = torch.empty(2**29, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    del src, dst
    return 2 * 2**31 / (ms * 1e-3)


def minimal_bytes(p):
    es = lambda t: t.numel() * t.element_size()  # noqa: E731
    fwd = es(p["value"]) + es(p["loc"]) + es(p["weights"]) + es(p["grad"])  # grad has the output's size
    bwd = 2 * (es(p["value"]) + es(p["loc"]) + es(p["weights"])) + es(p["grad"])
    return fwd, bwd


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def check(p):
    """Relative errors of lik (fast and deterministic backward) against float64 grid_sample."""
    ref_in = [t.double().requires_grad_() for t in leaves(p)]
    ref_out = msda.ms_deform_attn_reference(ref_in[0], p["shapes"], p["starts"], ref_in[1], ref_in[2])
    ref = [ref_out.detach(), *torch.autograd.grad(ref_out, ref_in, p["grad"].double())]
    del ref_in, ref_out
    errs = {}
    for mode in ("fast", "deterministic"):
        torch.use_deterministic_algorithms(mode == "deterministic")
        x = leaves(p)
        out = msda.ms_deform_attn(x[0], p["shapes"], p["starts"], x[1], x[2])
        got = [out.detach(), *torch.autograd.grad(out, x, p["grad"])]
        torch.use_deterministic_algorithms(False)
        for name, g, r in zip(("out", "grad_value", "grad_loc", "grad_weights"), got, ref):
            errs[f"{mode}/{name}"] = rel(g, r)
    return errs


def time_method(fn, p, deterministic=False):
    x = leaves(p)
    fwd_ms = triton.testing.do_bench(lambda: fn(*[t.detach() for t in x]), return_mode="median")
    out = fn(*x)
    torch.use_deterministic_algorithms(deterministic)
    try:
        bwd_ms = triton.testing.do_bench(
            lambda: torch.autograd.grad(out, x, p["grad"], retain_graph=True), return_mode="median"
        )
    finally:
        torch.use_deterministic_algorithms(False)
    del out
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # Peak of a fresh forward + backward, above what the inputs already hold.
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.use_deterministic_algorithms(deterministic)
    try:
        out = fn(*x)
        torch.autograd.grad(out, x, p["grad"])
    finally:
        torch.use_deterministic_algorithms(False)
    del out
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    torch.cuda.empty_cache()
    return fwd_ms, bwd_ms, peak


def sweep():
    """lik's forward and backward under forced launch configurations: value in [N, S, M, D] or transposed to
    [N, M, S, D] (the copy is inside the timed call), (rows, warps) with all P points of a level per tile;
    encoder (realistic and uniform, fp32; realistic bf16) and decoder (realistic fp32)."""
    import lik._config as config

    tiles = [(4, 1), (8, 1), (8, 2), (16, 4), (32, 4), (2, 1)]  # (rows, warps)
    problems = [(ENCODER, "realistic", torch.float32), (ENCODER, "uniform", torch.float32),
                (ENCODER, "realistic", torch.bfloat16), (DECODER, "realistic", torch.float32)]
    results = []
    for scale, sampling, dtype in problems:
        p = make_problem(scale, sampling, dtype)
        fn = methods(p)["lik"]
        x = leaves(p)
        out = fn(*x)
        for transpose in (False, True):
            for rows, warps in tiles if not transpose else tiles[:1]:
                common = dict(block_rows=rows, block_points=POINTS, block_d=DIM, num_warps=warps, transpose=transpose)
                with config.override(msda_forward=config.MsdaForwardConfig(**common)):
                    fwd = triton.testing.do_bench(lambda: fn(*[t.detach() for t in x]), return_mode="median")
                with config.override(msda_backward=config.MsdaBackwardConfig(gather_rows=32, **common)):
                    bwd = triton.testing.do_bench(
                        lambda: torch.autograd.grad(out, x, p["grad"], retain_graph=True), return_mode="median"
                    )
                results.append(dict(scale=scale["name"], sampling=sampling, dtype=str(dtype)[6:], transpose=transpose,
                                    rows=rows, warps=warps, fwd_ms=fwd, bwd_ms=bwd))
                print(f"sweep {scale['name']} {sampling} {str(dtype)[6:]} transpose {transpose:d} rows {rows:3} "
                      f"warps {warps}: fwd {fwd:.3f} ms, bwd {bwd:.3f} ms", flush=True)
        del p, x, out
        torch.cuda.empty_cache()
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "msda_bench.json"))
    parser.add_argument("--quick", action="store_true", help="decoder scale and fp32 only")
    parser.add_argument("--sweep", action="store_true", help="also time lik under forced tile shapes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("msda_bench needs a CUDA GPU")

    # LIK_COMMIT names the commit when given (the device's copy of the tree may carry a stale .git).
    commit = os.environ.get("LIK_COMMIT", "")
    if not commit:
        try:
            done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
            commit = done.stdout.strip() if done.returncode == 0 else ""
        except OSError:
            commit = ""
    meta = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        commit=commit or "unknown", time=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    bandwidth = copy_bandwidth()
    meta["copy_bandwidth_GBps"] = bandwidth / 1e9
    print(json.dumps(meta), flush=True)

    tiles = sweep() if args.sweep else []
    scales = [DECODER] if args.quick else [ENCODER, DECODER]
    dtypes = [torch.float32] if args.quick else [torch.float32, torch.bfloat16]
    rows = []
    for scale in scales:
        for sampling in ("realistic", "uniform"):
            for dtype in dtypes:
                p = make_problem(scale, sampling, dtype)
                row = dict(scale=scale["name"], sampling=sampling, dtype=str(dtype).replace("torch.", ""),
                           lq=p["loc"].shape[1], s=p["value"].shape[1])
                if sampling == "realistic":
                    row["errors"] = check(p)
                fwd_bytes, bwd_bytes = minimal_bytes(p)
                row["floor_ms"] = dict(fwd=fwd_bytes / bandwidth * 1e3, bwd=bwd_bytes / bandwidth * 1e3)
                fns = methods(p)
                for name in ("lik", "gs-lik", "gs-detr"):
                    f, b, m = time_method(fns[name], p)
                    row[name] = dict(fwd_ms=f, bwd_ms=b, peak_MB=m / 2**20)
                    print(f"  {row['scale']} {sampling} {row['dtype']} {name}: fwd {f:.3f} ms, bwd {b:.3f} ms, "
                          f"peak {m / 2**20:.0f} MB", flush=True)
                f, b, m = time_method(fns["lik"], p, deterministic=True)
                row["lik-det"] = dict(bwd_ms=b, peak_MB=m / 2**20)
                rows.append(row)
                del p, fns
                torch.cuda.empty_cache()

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(dict(meta=meta, rows=rows, sweep=tiles), fh, indent=1)

    print(f"\n{meta['device']}  torch {meta['torch']}  triton {meta['triton']}  copy {bandwidth / 1e9:.0f} GB/s")
    head = (f"{'scale':8} {'sampling':9} {'dtype':8} | {'lik fwd':>8} {'gs fwd':>8} {'x':>5} {'%floor':>6} | "
            f"{'lik bwd':>8} {'gs bwd':>8} {'x':>5} {'%floor':>6} {'det bwd':>8} | {'peak lik/gs MB':>15} | max err")
    print(head)
    print("-" * len(head))
    for r in rows:
        # Speedups against the faster of the two grid_sample paths, peak memory against the smaller.
        gs_f = min(r["gs-lik"]["fwd_ms"], r["gs-detr"]["fwd_ms"])
        gs_b = min(r["gs-lik"]["bwd_ms"], r["gs-detr"]["bwd_ms"])
        gs_m = min(r["gs-lik"]["peak_MB"], r["gs-detr"]["peak_MB"])
        lk = r["lik"]
        r["speedup"] = dict(fwd=gs_f / lk["fwd_ms"], bwd=gs_b / lk["bwd_ms"], peak_ratio=lk["peak_MB"] / gs_m)
        r["pct_floor"] = dict(fwd=100 * r["floor_ms"]["fwd"] / lk["fwd_ms"], bwd=100 * r["floor_ms"]["bwd"] / lk["bwd_ms"])
        # Errors are checked on realistic sampling only ("-": not checked in this row).
        err = f'{max(r["errors"].values()):.1e}' if "errors" in r else "-"
        print(f"{r['scale']:8} {r['sampling']:9} {r['dtype']:8} | {lk['fwd_ms']:8.3f} {gs_f:8.3f} "
              f"{r['speedup']['fwd']:5.1f} {r['pct_floor']['fwd']:5.0f}% | {lk['bwd_ms']:8.3f} {gs_b:8.3f} "
              f"{r['speedup']['bwd']:5.1f} {r['pct_floor']['bwd']:5.0f}% {r['lik-det']['bwd_ms']:8.3f} | "
              f"{lk['peak_MB']:7.0f}/{gs_m:<7.0f} | {err}")
    with open(args.out, "w") as fh:
        json.dump(dict(meta=meta, rows=rows, bars=BARS, sweep=tiles), fh, indent=1)
    print(f"bars (fwd x, bwd x) fp32: {BARS}; results in {args.out}")


if __name__ == "__main__":
    main()
