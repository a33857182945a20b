"""lik.knn_points against a chunked torch.cdist + topk (and PyTorch3D's knn_points where it imports), one process,
one GPU: N = 1 and 4 clouds of P = 10K and 100K points (P1 = P2), D = 3 (point clouds) and 128 (feature sets),
K = 1, 8, 32, float32 (matmul precision "highest"; "high" too at D = 128) and float16 (``--dtype`` also takes bf16).
PyTorch3D runs float32 cells only (its kernels have no half precision); without it the table's speed-up is against
the chunked cdist + topk.

Per cell and method: the forward (``do_bench`` median, L2 flushed; methods alternating over ``--rounds`` rounds; a
method whose single call exceeds a second is timed by single calls), the
forward + backward of ``dists.sum()`` where the method can (the cdist baseline keeps its ``[N, P1, P2]`` graph, so
only while that fits ``--graph-gib``), peak memory of one forward beyond the inputs, and the error of the listed
distances against float64 on 256 sampled rows (max over the rows of |d_k - d_k(float64)| / d_k(float64) for each
slot k: a swapped near-tie counts only its distance difference). Cells run cheapest first; those left when
``--deadline-s`` comes are listed as skipped.

    PYTHONPATH=src python3 benchmarks/knn_bench.py --out $OUT            # knn_bench.json and knn_bench.md in $OUT
    PYTHONPATH=src python3 benchmarks/knn_bench.py --quick --out $OUT    # P = 10K only
    PYTHONPATH=src python3 benchmarks/knn_bench.py --N 1 --P 100000 --D 128 --K 8 --out $OUT    # some cells
    PYTHONPATH=src python3 benchmarks/knn_bench.py --tiles --out $OUT    # candidate tiles against the heuristic's
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import time

import torch
import triton
import triton.testing

import lik

SAMPLE_ROWS = 256


def cdist_topk(p1, p2, K, chunk_bytes=1 << 30):
    """The baseline a user writes: squared ``torch.cdist`` over row chunks of ``[N, rows, P2]``, then ``topk``."""
    n, p1_size, _ = p1.shape
    rows = max(1, chunk_bytes // max(1, n * p2.shape[1] * p1.element_size()))
    dists, idx = [], []
    for start in range(0, p1_size, rows):
        d = torch.cdist(p1[:, start:start + rows], p2).square()
        top = d.topk(min(K, p2.shape[1]), dim=-1, largest=False, sorted=True)
        dists.append(top.values)
        idx.append(top.indices)
    return torch.cat(dists, 1), torch.cat(idx, 1)


def load_pytorch3d():
    try:
        from pytorch3d.ops import knn_points
    except Exception as exc:  # noqa: BLE001 (any import failure means the peer is unavailable)
        return None, f"{type(exc).__name__}: {exc}"
    return knn_points, None


def sampled_error(dists, p1, p2, rows):
    """Largest relative error of each listed distance against float64 on ``rows`` of cloud 0."""
    d64 = ((p1[0, rows, None].double() - p2[0, None].double()) ** 2).sum(-1)
    want = d64.topk(dists.shape[-1], dim=-1, largest=False).values
    got = dists[0, rows].double()
    return float(((got - want).abs() / want.clamp(min=1e-30)).max())


def peak_mib(fn, device):
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    return round(peak / 2**20, 1)


def methods_for(cell, p1, p2, pytorch3d_knn, graph_gib):
    n, p, _, K = cell["N"], cell["P"], cell["D"], cell["K"]
    methods = {"lik": dict(fwd=lambda a, b: lik.knn_points(a, b, K=K).dists)}
    graph_bytes = 3 * n * p * p * p1.element_size()
    methods["cdist+topk"] = dict(fwd=lambda a, b: cdist_topk(a, b, K)[0], graph=graph_bytes <= graph_gib * 2**30)
    if pytorch3d_knn is not None and p1.dtype == torch.float32:
        methods["pytorch3d"] = dict(fwd=lambda a, b: pytorch3d_knn(a, b, K=K).dists)
    return methods


# A method whose one call takes longer than this is timed by that call alone (PyTorch3D's generic kernel at
# D = 128 and 100K points can take seconds: do_bench's rounds would outlast the run).
ONE_SHOT_MS = 1000.0


def once_ms(fn, device):
    """Wall time of one synchronised call, in ms."""
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def bench_ms(fn, device):
    """``do_bench``'s median, or one call's time when that call alone exceeds :data:`ONE_SHOT_MS`."""
    first = once_ms(fn, device)
    if first > ONE_SHOT_MS:
        return first
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def time_cell(cell, rounds, pytorch3d_knn, graph_gib, device):
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(cell["dtype"], torch.float32)
    shape1 = (cell["N"], cell["P"], cell["D"])
    p1 = torch.rand(shape1, device=device, generator=gen).to(dtype)
    p2 = torch.rand(shape1, device=device, generator=gen).to(dtype)
    torch.set_float32_matmul_precision(cell.get("precision", "highest"))
    rows = torch.randperm(cell["P"], device=device, generator=gen)[:SAMPLE_ROWS]
    methods = methods_for(cell, p1, p2, pytorch3d_knn, graph_gib)
    result = {}
    for name, m in methods.items():
        try:
            dists = m["fwd"](p1, p2)
            result[name] = dict(error=sampled_error(dists, p1, p2, rows), fwd_ms=[], fwd_bwd_ms=[],
                                peak_mib=peak_mib(lambda m=m: m["fwd"](p1, p2), device))
        except torch.cuda.OutOfMemoryError:
            result[name] = dict(failed="OOM")
        except Exception as exc:  # noqa: BLE001 (a failing method is recorded, the run goes on)
            result[name] = dict(failed=f"{type(exc).__name__}: {exc}"[:300])
    a, b = p1.clone().requires_grad_(), p2.clone().requires_grad_()
    for r in range(rounds):
        order = list(methods) if r % 2 == 0 else list(reversed(methods))
        for name in order:
            if "failed" in result[name]:
                continue
            fwd = methods[name]["fwd"]
            result[name]["fwd_ms"].append(bench_ms(lambda fwd=fwd: fwd(p1, p2), device))
            if methods[name].get("graph", True):
                try:
                    step = lambda fwd=fwd: torch.autograd.grad(fwd(a, b).sum(), (a, b))  # noqa: E731
                    result[name]["fwd_bwd_ms"].append(bench_ms(step, device))
                except torch.cuda.OutOfMemoryError:
                    methods[name]["graph"] = False
    for res in result.values():
        for key in ("fwd_ms", "fwd_bwd_ms"):
            if key in res:
                res[key] = sorted(res[key])[len(res[key]) // 2] if res[key] else None
    torch.set_float32_matmul_precision("highest")
    return result


def cells(quick, ns=(1, 4), ps=(10_000, 100_000), ds=(3, 128), ks=(1, 8, 32), dtypes=("fp32", "fp16")):
    out = []
    for n, p, d, k, dtype in itertools.product(ns, ps, ds, ks, dtypes):
        if quick and p > 10_000:
            continue
        out.append(dict(N=n, P=p, D=d, K=k, dtype=dtype))
        if dtype == "fp32" and d == 128:
            out.append(dict(N=n, P=p, D=d, K=k, dtype=dtype, precision="high"))
    # Cheapest first: a deadline leaves out the largest cells.
    return sorted(out, key=lambda c: (c["N"] * c["P"] ** 2 * max(c["D"], 16), c["K"]))


def fmt(v, digits=3):
    return "n/a" if v is None else f"{v:.{digits}g}"


def _ratio(peer, mine, key):
    return peer[key] / mine[key] if peer.get(key) and mine.get(key) else None


def markdown(rows):
    head = ["N", "P", "D", "K", "dtype", "lik fwd ms", "cdist+topk fwd ms", "speed-up", "lik fwd+bwd ms",
            "cdist+topk fwd+bwd ms", "lik MiB", "cdist MiB", "lik err", "cdist err", "pytorch3d fwd ms",
            "pytorch3d fwd+bwd ms", "vs pytorch3d fwd / fwd+bwd", "pytorch3d err"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def ms(res, key):
        return res["failed"][:24] if "failed" in res else fmt(res.get(key))

    for row in rows:
        c, res = row["cell"], row["result"]
        lk, cd, p3 = res.get("lik", {}), res.get("cdist+topk", {}), res.get("pytorch3d", {})
        dtype = c["dtype"] + ("/tf32" if c.get("precision") == "high" else "")
        ratio = cd["fwd_ms"] / lk["fwd_ms"] if lk.get("fwd_ms") and cd.get("fwd_ms") else None
        cols = [c["N"], c["P"], c["D"], c["K"], dtype, ms(lk, "fwd_ms"), ms(cd, "fwd_ms"), f"{fmt(ratio)}x",
                fmt(lk.get("fwd_bwd_ms")), fmt(cd.get("fwd_bwd_ms")), fmt(lk.get("peak_mib"), 4),
                fmt(cd.get("peak_mib"), 4), fmt(lk.get("error"), 2), fmt(cd.get("error"), 2), ms(p3, "fwd_ms"),
                fmt(p3.get("fwd_bwd_ms")), f"{fmt(_ratio(p3, lk, 'fwd_ms'))}x / {fmt(_ratio(p3, lk, 'fwd_bwd_ms'))}x",
                fmt(p3.get("error"), 2)]
        lines.append("| " + " | ".join(str(v) for v in cols) + " |")
    return "\n".join(lines)


# Candidate tiles for --tiles: (block_m, block_n, num_warps). The heuristic's build without spills at every K; some
# others spill at K = 32 (one warp, 64-row direct tiles, 4-warp fp16 products): the sweep shows what that costs.
DIRECT_TILES = [(32, 64, 4), (64, 64, 4), (128, 64, 8), (32, 32, 1), (32, 64, 1), (64, 32, 2)]
PRODUCT_TILES = [(64, 64, 8), (64, 32, 4), (32, 32, 4), (64, 128, 8)]


def sweep_tiles(n, p, rounds, device):
    """lik's forward under each candidate tile against the heuristic's, at N x P points: the data behind
    ``knn_config`` (``lik.ops.knn.heuristic``). Returns rows of (D, K, dtype, tile, median ms)."""
    from lik.config import override
    from lik.ops.knn import KnnConfig, knn_config

    rows = []
    for dim, dtype, K in itertools.product((3, 128), (torch.float32, torch.float16), (1, 8, 32)):
        gen = torch.Generator(device=device).manual_seed(1)
        p1 = torch.rand(n, p, dim, device=device, generator=gen).to(dtype)
        p2 = torch.rand(n, p, dim, device=device, generator=gen).to(dtype)
        chosen = knn_config(dim=dim, k=K, norm=2, dtype=dtype, device=device)
        tiles = DIRECT_TILES if chosen.route == "direct" else PRODUCT_TILES
        configs = {"heuristic": None}
        for bm, bn, warps in tiles:
            configs[f"{bm}x{bn}/{warps}w"] = KnnConfig(chosen.route, chosen.precision, block_m=bm, block_n=bn,
                                                      block_k=chosen.block_k, num_warps=warps)
        times = {name: [] for name in configs}
        for r in range(rounds):
            for name in (list(configs) if r % 2 == 0 else list(reversed(configs))):
                cfg = configs[name]
                try:
                    with override(**({} if cfg is None else {"knn": cfg})):
                        lik.knn_points(p1, p2, K=K)
                        times[name].append(triton.testing.do_bench(lambda: lik.knn_points(p1, p2, K=K), warmup=10,
                                                                   rep=40, return_mode="median"))
                except Exception as exc:  # noqa: BLE001 (a tile that fails is reported, the sweep goes on)
                    times[name] = f"{type(exc).__name__}: {exc}"[:120]
        for name, t in times.items():
            ms = sorted(t)[len(t) // 2] if isinstance(t, list) and t else None
            rows.append(dict(N=n, P=p, D=dim, K=K, dtype=str(dtype).split(".")[1], tile=name,
                             chosen=f"{chosen.block_m}x{chosen.block_n}/{chosen.num_warps}w", ms=ms,
                             failed=t if isinstance(t, str) else None))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def tiles_markdown(rows):
    lines = ["| N | P | D | K | dtype | heuristic (tile) ms | best tile | best ms |", "|---" * 8 + "|"]
    for key, group in itertools.groupby(rows, key=lambda r: (r["N"], r["P"], r["D"], r["K"], r["dtype"])):
        group = list(group)
        timed = [r for r in group if r["ms"] is not None]
        heuristic = next((r for r in group if r["tile"] == "heuristic"), None)
        best = min(timed, key=lambda r: r["ms"]) if timed else None
        lines.append(f"| {' | '.join(str(v) for v in key)} | {fmt(heuristic and heuristic['ms'])} "
                     f"({heuristic and heuristic['chosen']}) | {best and best['tile']} | {fmt(best and best['ms'])} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--quick", action="store_true", help="P = 10K only")
    parser.add_argument("--rounds", type=int, default=3, help="alternating do_bench rounds per cell (median)")
    parser.add_argument("--deadline-s", type=float, default=540, help="cells not started by then are skipped")
    parser.add_argument("--graph-gib", type=float, default=24, help="largest cdist autograd graph timed")
    ints = lambda text: tuple(int(v) for v in text.split(","))  # noqa: E731
    parser.add_argument("--N", type=ints, default=(1, 4), help="clouds, comma-separated")
    parser.add_argument("--P", type=ints, default=(10_000, 100_000), help="points per cloud, comma-separated")
    parser.add_argument("--D", type=ints, default=(3, 128), help="dimensions, comma-separated")
    parser.add_argument("--K", type=ints, default=(1, 8, 32), help="neighbours, comma-separated")
    parser.add_argument("--dtype", type=lambda text: tuple(text.split(",")), default=("fp32", "fp16"))
    parser.add_argument("--tiles", action="store_true",
                        help="instead: time candidate tiles of lik's kernel at N = 1, P = 100K (--P's largest)")
    args = parser.parse_args()
    if args.tiles:
        rows = sweep_tiles(1, max(args.P), args.rounds, torch.device("cuda"))
        table = tiles_markdown(rows)
        print(table)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "knn_tiles.json"), "w") as fh:
            json.dump(rows, fh, indent=1)
        with open(os.path.join(args.out, "knn_tiles.md"), "w") as fh:
            fh.write(table + "\n")
        return
    start = time.monotonic()
    device = torch.device("cuda")
    pytorch3d_knn, pytorch3d_missing = load_pytorch3d()
    commit = os.environ.get("LIK_COMMIT")
    if commit is None:
        try:
            done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
            commit = done.stdout.strip()
        except OSError:
            commit = None
    meta = dict(device=torch.cuda.get_device_name(device), torch=torch.__version__, triton=triton.__version__,
                commit=commit or None, pytorch3d=pytorch3d_missing or "available", rounds=args.rounds)
    print(json.dumps(meta), flush=True)
    rows, skipped = [], []
    for cell in cells(args.quick, args.N, args.P, args.D, args.K, args.dtype):
        if time.monotonic() - start > args.deadline_s:
            skipped.append(cell)
            continue
        result = time_cell(cell, args.rounds, pytorch3d_knn, args.graph_gib, device)
        rows.append(dict(cell=cell, result=result))
        print(json.dumps(rows[-1]), flush=True)
    table = markdown(rows)
    if skipped:
        shapes = sorted({"N {N} P {P} D {D}".format(**c) for c in skipped})
        table += f"\n\nSkipped at the deadline: {len(skipped)} cells ({', '.join(shapes)})."
    print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "knn_bench.json"), "w") as fh:
        json.dump(dict(meta=meta, rows=rows, skipped=skipped), fh, indent=1)
    with open(os.path.join(args.out, "knn_bench.md"), "w") as fh:
        fh.write(table + "\n")


if __name__ == "__main__":
    main()
