"""lik.Index search throughput and latency: a grid of query counts x dtypes x placements in one process, each cell
against its floor measured in the same process.

    python3 benchmarks/index_bench.py --docs 50000 --min-len 60 --max-len 140 --nq 1,32,256 \\
        --dtypes float16,int8,float8_e4m3fn --placements gpu,host,disk --time-budget-s 150 --out $OUT
    python3 benchmarks/index_bench.py --docs 3000 --doc-len 1030 --fixed-len --q-len 24   # ColPali pages
    python3 benchmarks/index_bench.py --cold ...   # also a cold-cache disk search (needs root to drop caches)
    python3 benchmarks/index_bench.py --smoke      # tiny sizes, any device (a check that the script runs)

The corpus (L2-normalised random tokens, d = 128) is drawn once on the device; each dtype's index is built once from
those device tensors (``build`` timed, GPU-resident), saved (timed) and searched resident (``gpu``), then loaded into
pinned host memory (``host``) and memory-mapped (``disk``, page cache warm unless ``--cold``); its directory is
deleted before the next dtype, so disk holds one index at a time. Document lengths: uniform in ``[min_len, max_len]``
when given, else in ``[1, 2 * doc_len)``, or all ``doc_len`` with ``--fixed-len``.

Each cell is ``Nq`` queries (``q_len`` tokens) searched for k = 10: the median of at least ``--min-runs`` timed
searches after one warm-up (on CUDA back to back, between events: throughput), more (up to 1000) while its timed
runs took under ``--cell-cap-s``. Floors: ``gpu`` one ``lik.maxsim_packed`` call over the whole resident corpus (the
same FLOPs, no chunking or merge; a cell of its own, ``kernel``); ``host`` max(a pinned host-to-device copy of the
corpus bytes, the kernel); ``disk`` max(reading the shard files once as the index reads them, the kernel). At
``Nq = 1`` the cell also gives the one-query latency, p50 / p99 of synchronised wall-clock searches (host time
included). Past ``--time-budget-s`` no further cell starts; the JSON (``index_bench.json``, ``--tag`` names it) is
rewritten after every cell, so a run stopped early keeps what it measured. A compact table is printed last. On a
CPU-only machine ``gpu`` is skipped and ``host`` / ``disk`` run the CPU reference, unfloored.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import lik
from lik.index.format import Shard
from lik.index.placement import coalesce, read_into, read_pool

K = 10
DTYPES = ("float16", "bfloat16", "int8", "float8_e4m3fn")
PLACEMENTS = ("gpu", "host", "disk")
SHORT = {"float16": "fp16", "bfloat16": "bf16", "int8": "int8", "float8_e4m3fn": "fp8"}


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def measure(fn, cuda: bool, cap_s: float, min_runs: int, latency: bool = False) -> dict:
    """``{"ms": median, "runs": n}`` of timed calls of ``fn`` after one warm-up (which also compiles): at least
    ``min_runs``, more (up to 1000) while the timed runs take under ``cap_s`` (on CUDA: as many as one synchronised
    call's time fits in ``cap_s``). On CUDA the calls run back to back, each between two events, as a stream of
    searches runs (and as ``triton.testing.do_bench`` times): host time under the device's is hidden, so ``Nq / ms``
    is the throughput. ``latency``: also ``p50_ms`` / ``p99_ms`` of single synchronised wall-clock calls."""
    fn()
    sync(cuda)

    def more(done: int, start: float) -> bool:
        return done < min_runs or (done < 1000 and time.perf_counter() - start < cap_s)

    times, start = [], time.perf_counter()
    if cuda:
        # Queued calls return before they run: their count comes from one synchronised call, not the host clock.
        fn()
        sync(cuda)
        planned = max(min_runs, min(1000, int(cap_s / max(time.perf_counter() - start, 1e-6))))
        pairs, start = [], time.perf_counter()
        while len(pairs) < planned:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            pairs.append((begin, end))
        sync(cuda)
        times = [begin.elapsed_time(end) for begin, end in pairs]
    out = {}
    if not cuda or latency:
        wall, start = [], time.perf_counter()
        while more(len(wall), start):
            t0 = time.perf_counter()
            fn()
            sync(cuda)
            wall.append((time.perf_counter() - t0) * 1e3)
        if latency:
            ordered = sorted(wall)
            out = {
                "p50_ms": statistics.median(ordered),
                "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            }
        times = times or wall
    return {"ms": statistics.median(times), "runs": len(times), **out}


def read_files(files) -> float:
    """Seconds to read ``files`` once as a ``"disk"`` index reads them: 256 MiB blocks, each split among threads."""
    block = torch.zeros(1 << 28, dtype=torch.uint8)  # (its pages touched before the clock starts)
    start = time.perf_counter()
    for f, size in ((f, f.stat().st_size) for f in files):
        with open(f, "rb", buffering=0) as handle:
            for at in range(0, size, block.numel()):
                read_into(handle, at, block[: min(block.numel(), size - at)], read_pool())
    return time.perf_counter() - start


def drop_page_cache() -> None:
    """Write back and drop the page cache, so the next read of a file comes from storage (root only)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        raise SystemExit(f"--cold needs root to drop the page cache: {exc}") from exc


def draw_lengths(args, rng: torch.Generator) -> list[int]:
    if args.fixed_len:
        return [args.doc_len] * args.docs
    if args.min_len is not None or args.max_len is not None:
        lo = args.doc_len if args.min_len is None else args.min_len
        hi = args.doc_len if args.max_len is None else args.max_len
        if not 0 <= lo <= hi:
            raise SystemExit(f"--min-len / --max-len must satisfy 0 <= min <= max, got {lo}, {hi}")
        return torch.randint(lo, hi + 1, (args.docs,), generator=rng).tolist()
    return torch.randint(1, 2 * args.doc_len, (args.docs,), generator=rng).tolist()


def draw_corpus(lengths: list[int], device: torch.device, seed: int) -> torch.Tensor:
    """Packed fp16 unit-norm tokens ``[sum(lengths), 128]`` on ``device``, drawn in runs of 4 Mi rows (fp32 scratch
    stays at 2 GiB at 50M tokens)."""
    total = sum(lengths)
    out = torch.empty(total, 128, dtype=torch.float16, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for a in range(0, total, 1 << 22):
        b = min(total, a + (1 << 22))
        block = torch.randn(b - a, 128, generator=gen, device=device)
        out[a:b] = torch.nn.functional.normalize(block, dim=-1)
    return out


class Grid:
    """The run's record, rewritten to ``path`` after every cell."""

    def __init__(self, path: Path, meta: dict, budget_s: float):
        self.path, self.start, self.budget_s = path, time.time(), budget_s
        self.result = {**meta, "builds": [], "cells": [], "stopped_early": False}

    def left(self) -> bool:
        if time.time() - self.start > self.budget_s:
            self.result["stopped_early"] = True
            return False
        return True

    def add(self, kind: str, row: dict) -> None:
        self.result[kind].append(row)
        self.write()

    def write(self) -> None:
        self.result["elapsed_s"] = time.time() - self.start
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=1))
        tmp.replace(self.path)


def run_dtype(grid: Grid, args, name: str, docs, lengths, Q, device, cuda: bool, ceilings: dict, work: Path):
    """Build, save and search one dtype's index over every placement and query count."""
    dtype = getattr(torch, name)
    cap, runs = args.cell_cap_s, args.min_runs
    kernel_ms: dict[int, float] = {}
    reference: dict[int, torch.Tensor] = {}  # the first placement's ids per Nq: every placement must agree

    def search_cells(placement: str, index, floor_bytes_ms) -> None:
        for nq in args.nq:
            if not grid.left():
                return
            q = Q[:nq]
            if cuda:
                sync(cuda)
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            last = {}  # the ids of the last timed search (no extra search of a 12.8 GB corpus for them)

            def search(q=q):
                last["ids"] = index.search(q, K)[1]

            got = measure(search, cuda, cap, runs, latency=nq == 1)
            ids = last["ids"].cpu()
            same = reference.setdefault(nq, ids)
            floor = kernel_ms.get(nq)
            if floor_bytes_ms is not None:
                floor = max(floor or 0.0, floor_bytes_ms)
            row = {
                "dtype": name,
                "placement": placement,
                "nq": nq,
                **got,
                "floor_ms": floor,
                "pct_of_floor": None if not floor else 100 * floor / got["ms"],
                "queries_per_s": nq / got["ms"] * 1e3,
                "same_ids": bool(torch.equal(same, ids)),
                "peak_device_bytes": (torch.cuda.max_memory_allocated() - base) if cuda else None,
            }
            grid.add("cells", row)

    path = work / f"ix-{name}"
    shutil.rmtree(path, ignore_errors=True)
    try:
        if not grid.left():
            return
        sync(cuda)
        start = time.perf_counter()
        built = lik.Index.build(
            docs,
            dtype=dtype,
            progress=False,
            device=device,
            placement="gpu" if cuda else "host",
            chunk_tokens=args.chunk_tokens,
        )
        sync(cuda)
        build_s = time.perf_counter() - start
        start = time.perf_counter()
        built.save(path, progress=False)
        save_s = time.perf_counter() - start
        files = sorted(path.rglob("shard-*.safetensors"))  # in the generation directory
        corpus_bytes = sum(f.stat().st_size for f in files)
        grid.add(
            "builds",
            {
                "dtype": name,
                "docs": len(lengths),
                "build_s": build_s,
                "docs_per_s": len(lengths) / build_s,
                "from": str(device),
                "save_s": save_s,
                "corpus_bytes": corpus_bytes,
            },
        )
        if cuda and "gpu" in args.placements:
            # The floor: the same FLOPs in one packed call over the whole resident corpus, no chunking or merge.
            parts = coalesce(built.segments)  # one view of the resident buffer (a copy if it is not one)
            whole = (
                parts[0]
                if len(parts) == 1
                else Shard(
                    torch.cat([p.tokens for p in parts]),
                    torch.tensor([0] + lengths).cumsum(0),
                    None if parts[0].scale is None else torch.cat([p.scale for p in parts]),
                )
            )
            del parts
            cu = whole.cu_seqlens.to(device=device, dtype=torch.int32)
            longest = max(lengths)
            for nq in args.nq:
                if not grid.left():
                    break
                q = Q[:nq]
                got = measure(
                    lambda: lik.maxsim_packed(q, whole.tokens, cu, max_seqlen_d=longest, d_scale=whole.scale),
                    cuda,
                    cap,
                    runs,
                    latency=nq == 1,
                )
                kernel_ms[nq] = got["ms"]
                grid.add(
                    "cells",
                    {
                        "dtype": name,
                        "placement": "kernel",
                        "nq": nq,
                        **got,
                        "floor_ms": got["ms"],
                        "pct_of_floor": 100.0,
                        "queries_per_s": nq / got["ms"] * 1e3,
                    },
                )
            del whole, cu
            search_cells("gpu", built, None)
        del built
        if cuda:
            torch.cuda.empty_cache()
        for placement in ("host", "disk"):
            if placement not in args.placements or not grid.left():
                continue
            start = time.perf_counter()
            index = lik.Index.load(
                path, placement=placement, device=device, chunk_tokens=args.chunk_tokens, verify=False
            )
            load_s = time.perf_counter() - start
            if placement == "host":
                floor = corpus_bytes / ceilings["pinned H2D GB/s"] / 1e6 if "pinned H2D GB/s" in ceilings else None
            else:
                read_gbps = corpus_bytes / read_files(files) / 1e9
                ceilings[f"file read GB/s {SHORT[name]}"] = read_gbps
                floor = corpus_bytes / read_gbps / 1e6 if cuda else None
            grid.result["builds"][-1][f"load_{placement}_s"] = load_s
            search_cells(placement, index, floor)
            if placement == "disk" and args.cold and cuda and grid.left():
                # One search right after the page cache is dropped: every shard byte comes from storage.
                drop_page_cache()
                cold_gbps = corpus_bytes / read_files(files) / 1e9
                drop_page_cache()
                sync(cuda)
                start = time.perf_counter()
                index.search(Q, K)
                sync(cuda)
                ms = (time.perf_counter() - start) * 1e3
                floor = max(corpus_bytes / cold_gbps / 1e6, kernel_ms.get(Q.shape[0], 0.0))
                grid.add(
                    "cells",
                    {
                        "dtype": name,
                        "placement": "disk-cold",
                        "nq": Q.shape[0],
                        "ms": ms,
                        "runs": 1,
                        "floor_ms": floor,
                        "pct_of_floor": 100 * floor / ms,
                        "queries_per_s": Q.shape[0] / ms * 1e3,
                    },
                )
            del index
    finally:
        shutil.rmtree(path, ignore_errors=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=10_000)
    parser.add_argument("--doc-len", type=int, default=300)
    parser.add_argument("--min-len", type=int, default=None, help="lengths uniform in [min-len, max-len]")
    parser.add_argument("--max-len", type=int, default=None)
    parser.add_argument("--fixed-len", action="store_true", help="every document doc_len tokens (ColPali pages)")
    parser.add_argument("--nq", default="32", help="query counts, comma separated: 1,32,256")
    parser.add_argument("--q-len", type=int, default=32)
    parser.add_argument("--dtypes", "--dtype", default="float16", help=f"comma separated, of {DTYPES}")
    parser.add_argument("--placements", default="gpu,host,disk", help="comma separated, of gpu,host,disk")
    parser.add_argument("--cold", action="store_true", help="add a cold-cache disk search (drops the page cache)")
    parser.add_argument("--chunk-tokens", type=int, default=None, help="default: the index's own choice")
    parser.add_argument("--min-runs", type=int, default=3, help="timed searches per cell, at least")
    parser.add_argument("--cell-cap-s", type=float, default=2.0, help="more runs while a cell is under this")
    parser.add_argument("--time-budget-s", type=float, default=float("inf"), help="no cell starts after this")
    parser.add_argument("--work-dir", default=None, help="where each dtype's index is saved (default: temp dir)")
    parser.add_argument("--tag", default="", help="suffix of the JSON file name")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: check the script runs")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args(argv)
    try:
        args.nq = [int(n) for n in str(args.nq).split(",") if n]
    except ValueError:
        parser.error(f"--nq must be comma-separated query counts, got {args.nq!r}")
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.placements = [p for p in args.placements.split(",") if p]
    for what, values, allowed in (("--dtypes", args.dtypes, DTYPES), ("--placements", args.placements, PLACEMENTS)):
        if not values or any(v not in allowed for v in values):
            parser.error(f"{what} must be a comma-separated subset of {allowed}, got {values}")
    if not args.nq or min(args.nq) < 1:
        parser.error(f"--nq must be positive query counts, got {args.nq}")
    if args.smoke:
        args.docs, args.doc_len, args.min_len, args.max_len, args.chunk_tokens = 48, 20, None, None, 256
        args.nq, args.min_runs, args.cell_cap_s = [n for n in args.nq if n <= 2] or [1, 2], 3, 0.05
    return args


def report(result: dict) -> None:
    """The compact table: one row per cell, then the builds."""
    print(
        f"{result['device']}: {result['docs']} docs, {result['tokens']} tokens, Lq {result['q_len']}, k {K}; "
        + ", ".join(f"{k} {v:.2f}" for k, v in result["ceilings"].items())
        + (" (stopped at the time budget)" if result["stopped_early"] else "")
    )
    print(f"{'cell':>22} {'floor ms':>9} {'ms':>9} {'% floor':>7} {'q/s':>9} {'p50 ms':>7} {'p99 ms':>7} {'runs':>4}")
    for row in result["cells"]:
        cell = f"{SHORT[row['dtype']]} {row['placement']} Nq{row['nq']}"
        floor = "-" if row["floor_ms"] is None else f"{row['floor_ms']:.3f}"
        pct = "-" if row["pct_of_floor"] is None else f"{row['pct_of_floor']:.0f}"
        p50, p99 = (f"{row[key]:.3f}" if key in row else "-" for key in ("p50_ms", "p99_ms"))
        flag = "" if row.get("same_ids", True) else "  IDS DIFFER"
        print(
            f"{cell:>22} {floor:>9} {row['ms']:9.3f} {pct:>7} {row['queries_per_s']:9.0f} {p50:>7} {p99:>7} "
            f"{row['runs']:>4}{flag}"
        )
    for row in result["builds"]:
        loads = ", ".join(f"{k} {v:.1f} s" for k, v in row.items() if k.startswith("load_"))
        print(
            f"build {SHORT[row['dtype']]} from {row['from']}: {row['build_s']:.2f} s ({row['docs_per_s']:.0f} docs/s), "
            f"save {row['save_s']:.1f} s, {row['corpus_bytes'] / 1e9:.2f} GB" + (f", {loads}" if loads else "")
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        args.placements = [p for p in args.placements if p != "gpu"]
    rng = torch.Generator().manual_seed(0)
    lengths = draw_lengths(args, rng)
    corpus = draw_corpus(lengths, device, 0)
    docs = list(corpus.split(lengths))
    Q = torch.nn.functional.normalize(torch.randn(max(args.nq), args.q_len, 128, generator=rng), dim=-1)
    Q = Q.to(device, torch.float16)
    ceilings = {}
    if cuda:
        size = min(sum(lengths) * 256, 1 << 31)  # the copy rate is reached well below 2 GiB
        pinned = torch.empty(size, dtype=torch.uint8).pin_memory()
        target = torch.empty(size, dtype=torch.uint8, device=device)
        got = measure(lambda: target.copy_(pinned, non_blocking=True), cuda, 1.0, 5)
        ceilings["pinned H2D GB/s"] = size / got["ms"] / 1e6
        del pinned, target
    os.makedirs(args.out, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "docs": args.docs,
        "tokens": sum(lengths),
        "min_len": min(lengths),
        "max_len": max(lengths),
        "fixed_len": args.fixed_len,
        "q_len": args.q_len,
        "k": K,
        "nq": args.nq,
        "dtypes": args.dtypes,
        "placements": args.placements,
        "chunk_tokens": args.chunk_tokens,
        "ceilings": ceilings,
    }
    grid = Grid(Path(args.out, f"index_bench{args.tag}.json"), meta, args.time_budget_s)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="index_bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        for name in args.dtypes:
            run_dtype(grid, args, name, docs, lengths, Q, device, cuda, ceilings, work)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    grid.write()  # also when no cell ran (a budget of 0)
    report(grid.result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
