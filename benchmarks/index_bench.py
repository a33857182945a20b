"""lik.Index search throughput per placement, against the ceilings measured in the same process.

    python3 benchmarks/index_bench.py [--docs 10000] [--doc-len 300] [--nq 32] [--dtype float16] [--out $OUT]
    python3 benchmarks/index_bench.py --docs 3000 --doc-len 1030 --fixed-len --q-len 24   # ColPali pages
    python3 benchmarks/index_bench.py --cold ...   # also a cold-cache disk search (needs root to drop caches)
    python3 benchmarks/index_bench.py --smoke      # tiny sizes, any device (a check that the script runs)

For each placement (gpu / host / disk; host and disk need CUDA to stream, on CPU they all run the reference):
the median search time of ``Nq`` queries (Lq = 32, d = 128, L2-normalised) for k = 10, peak device memory of one
search above what the index itself holds, and the floors: ``gpu`` against one ``lik.maxsim_packed`` call over
the whole resident corpus (the same FLOPs with no chunking or merge), ``host`` against a pinned host-to-device
copy of the corpus bytes, ``disk`` against reading the shard files once (page cache warm unless dropped).
Document lengths are drawn uniformly from ``[1, 2 * doc_len)``, or all ``doc_len`` with ``--fixed-len``.
``--cold`` adds a ``disk-cold`` row: the page cache is dropped (``/proc/sys/vm/drop_caches``) before one timed
read of the files and again before one timed search, so both run at the storage's own rate.
Writes ``index_bench.json`` (``--tag`` names it) and prints a short table.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

import lik


def timed(fn, cuda: bool) -> float:
    """Median milliseconds: do_bench on CUDA, five perf_counter runs on CPU."""
    fn()
    if cuda:
        import triton

        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=5, rep=100, return_mode="median")
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - start) * 1e3)
    return sorted(runs)[2]


def read_files(files) -> float:
    """Seconds to read ``files`` once, sequentially, in 16 MiB blocks."""
    start = time.perf_counter()
    for f in files:
        with open(f, "rb") as handle:
            while handle.read(1 << 24):
                pass
    return time.perf_counter() - start


def drop_page_cache() -> None:
    """Write back and drop the page cache, so the next read of a file comes from storage (root only)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        raise SystemExit(f"--cold needs root to drop the page cache: {exc}") from exc


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=10_000)
    parser.add_argument("--doc-len", type=int, default=300)
    parser.add_argument("--nq", type=int, default=32)
    parser.add_argument("--q-len", type=int, default=32)
    parser.add_argument("--fixed-len", action="store_true", help="every document doc_len tokens (ColPali pages)")
    parser.add_argument("--cold", action="store_true", help="add a cold-cache disk search (drops the page cache)")
    parser.add_argument("--tag", default="", help="suffix of the JSON file name")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "int8", "float8_e4m3fn"))
    parser.add_argument("--chunk-tokens", type=int, default=None, help="default: the index's own choice")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: check the script runs")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.docs, args.doc_len, args.nq, args.chunk_tokens = 64, 20, 2, 256
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    rng = torch.Generator().manual_seed(0)
    if args.fixed_len:
        lengths = [args.doc_len] * args.docs
    else:
        lengths = torch.randint(1, 2 * args.doc_len, (args.docs,), generator=rng).tolist()
    docs = (torch.nn.functional.normalize(torch.randn(n, 128, generator=rng), dim=-1) for n in lengths)
    Q = torch.nn.functional.normalize(torch.randn(args.nq, args.q_len, 128, generator=rng), dim=-1).to(device)
    Q = Q.half() if dtype in (torch.int8, torch.float8_e4m3fn) else Q.to(dtype)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ix"
        lik.Index.build(docs, dtype=dtype, out=path, progress=False, device="cpu")
        files = sorted(path.glob("shard-*.safetensors"))
        corpus_bytes = sum(f.stat().st_size for f in files)
        read_gbps = corpus_bytes / read_files(files) / 1e9
        ceilings = {"file read GB/s": read_gbps}
        if args.cold:
            drop_page_cache()
            ceilings["cold file read GB/s"] = corpus_bytes / read_files(files) / 1e9
        if cuda:
            pinned = torch.empty(corpus_bytes, dtype=torch.uint8).pin_memory()
            target = torch.empty(corpus_bytes, dtype=torch.uint8, device=device)
            ms = timed(lambda: target.copy_(pinned, non_blocking=True), cuda)
            ceilings["pinned H2D GB/s"] = corpus_bytes / ms / 1e6
            del pinned, target
        for placement in ("gpu", "host", "disk") if cuda else ("host", "disk"):
            index = lik.Index.load(path, placement=placement, device=device, chunk_tokens=args.chunk_tokens)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            ms = timed(lambda: index.search(Q, 10), cuda)
            peak = (torch.cuda.max_memory_allocated() - base) if cuda else 0
            if placement == "gpu":
                # The same FLOPs in one call over the whole resident corpus: no chunking, no merge.
                tokens = torch.cat([s.tokens for s in index.segments])
                scale = None if index.segments[0].scale is None else torch.cat([s.scale for s in index.segments])
                cu = torch.tensor([0] + lengths).cumsum(0).to(device=device, dtype=torch.int32)
                whole = timed(lambda: lik.maxsim_packed(Q, tokens, cu, max_seqlen_d=max(lengths), d_scale=scale),
                              cuda)
                del tokens, scale
                floor = whole
            elif placement == "host":
                floor = corpus_bytes / ceilings.get("pinned H2D GB/s", float("inf")) / 1e6
            else:
                floor = corpus_bytes / read_gbps / 1e6
            rows.append({"placement": placement, "ms": ms, "floor_ms": floor, "pct_of_floor": 100 * floor / ms,
                         "queries_per_s": args.nq / ms * 1e3, "peak_device_bytes": peak})
            del index
        if args.cold and cuda:
            # One search right after the page cache is dropped: every shard byte comes from storage.
            index = lik.Index.load(path, placement="disk", device=device, chunk_tokens=args.chunk_tokens, verify=False)
            drop_page_cache()
            torch.cuda.synchronize()
            start = time.perf_counter()
            index.search(Q, 10)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - start) * 1e3
            floor = corpus_bytes / ceilings["cold file read GB/s"] / 1e6
            rows.append({"placement": "disk-cold", "ms": ms, "floor_ms": floor, "pct_of_floor": 100 * floor / ms,
                         "queries_per_s": args.nq / ms * 1e3, "peak_device_bytes": None})
            del index
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "docs": args.docs, "tokens": sum(lengths), "fixed_len": args.fixed_len, "dtype": args.dtype, "nq": args.nq,
        "q_len": args.q_len, "corpus_bytes": corpus_bytes,
        "chunk_tokens": args.chunk_tokens, "ceilings": ceilings, "rows": rows,
    }
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, f"index_bench{args.tag}.json").write_text(json.dumps(result, indent=1))
    print(f"{result['device']}: {args.docs} docs, {sum(lengths)} tokens, {args.dtype}, Nq={args.nq} x {args.q_len}, "
          f"k=10, " + ", ".join(f"{k} {v:.1f}" for k, v in ceilings.items()))
    print(f"{'placement':>9} {'ms':>9} {'floor ms':>9} {'% floor':>8} {'q/s':>9} {'peak MiB':>9}")
    for row in rows:
        print(f"{row['placement']:>9} {row['ms']:9.3f} {row['floor_ms']:9.3f} {row['pct_of_floor']:8.1f} "
              f"{row['queries_per_s']:9.1f} {(row['peak_device_bytes'] or 0) / 2**20:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
