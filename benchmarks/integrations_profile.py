"""Where the time and memory of the host-library integrations go, on the device, beside integrations_bench.py.

Parts (``--parts``, comma-separated):

* ``profile``: torch.profiler over a few PyLate ``Contrastive`` steps, stock and with ``enable()`` (device work
  and host synchronisations);
* ``rounds``: the step's wall time, stock and lik alternating for many rounds of a few steps each (a B = 32 step
  is host-bound, and one ``do_bench`` per method is at the mercy of the host's state at that moment);
* ``memory``: which allocations are alive at the step's peak (CUDA allocator history), stock and lik, and the
  scoring call alone (forward + backward of ``ColBERTScores`` on the step's embeddings, peak above its inputs);
* ``colpali``: host and device time of each phase of ``score_multi_vector`` on a list of 1 000 pages.

    python benchmarks/integrations_profile.py --minilm DIR --parts rounds,memory,colpali --out results.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
import integrations_bench as bench  # noqa: E402


def _stock_env(fn):
    return bench._with_env("PYLATE_SCORES_BACKEND", "torch", fn)


def profile(step, lik_pylate, batch):
    for use_lik in (False, True):
        if use_lik:
            lik_pylate.enable()
        run = step if use_lik else _stock_env(step)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                run()
            torch.cuda.synchronize()
        lik_pylate.disable()
        events = prof.key_averages()
        print(f"===== lik={use_lik} B={batch}")
        syncs = [e for e in events if "Synchronize" in e.key or "DtoH" in e.key or "_local_scalar" in e.key
                 or "item" == e.key.split("::")[-1]]
        for e in syncs:
            print(f"sync-like {e.key}: count {e.count}, cpu total {e.cpu_time_total / 1e3:.2f} ms")
        print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
        print(events.table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=60))


def rounds(step, lik_pylate, batch, n_rounds=15, steps_per_round=8):
    """Median wall ms per step of each method over alternating rounds, and the median of the paired ratios."""
    runs = {"stock": _stock_env(step), "lik": step}
    times = {name: [] for name in runs}
    for name, run in runs.items():  # warm-up (compilation, allocator)
        with lik_pylate.enabled() if name == "lik" else contextlib.nullcontext():
            for _ in range(5):
                run()
    for _ in range(n_rounds):
        for name, run in runs.items():
            with lik_pylate.enabled() if name == "lik" else contextlib.nullcontext():
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(steps_per_round):
                    run()
                torch.cuda.synchronize()
                times[name].append((time.perf_counter() - start) * 1e3 / steps_per_round)
    ratios = [stock / mine for stock, mine in zip(times["stock"], times["lik"])]
    out = {"batch": batch, "rounds": n_rounds, "steps_per_round": steps_per_round,
           **{f"{name}_ms_median": statistics.median(t) for name, t in times.items()},
           **{f"{name}_ms_all": t for name, t in times.items()},
           "paired_speedup_median": statistics.median(ratios),
           "lik_faster_rounds": sum(r > 1 for r in ratios)}
    print(f"rounds B={batch}: stock {out['stock_ms_median']:.2f} ms | lik {out['lik_ms_median']:.2f} ms | paired "
          f"speed-up median {out['paired_speedup_median']:.3f} | lik faster in {out['lik_faster_rounds']}/"
          f"{n_rounds} rounds", flush=True)
    return out


def _alive_at_peak(fn, top=12):
    """Run ``fn`` under the allocator's history; the allocations alive at its peak, largest first, each with the
    innermost Python frames that are not torch's."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.memory._record_memory_history(max_entries=500000, stacks="python")
    try:
        fn()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    alive, current, peak, peak_index = {}, 0, 0, -1
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            alive[event["addr"]] = event
            current += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in alive:
            current -= alive.pop(event["addr"])["size"]
        if current > peak:
            peak, peak_index = current, index
    alive = {}
    for event in trace[:peak_index + 1]:
        if event["action"] == "alloc":
            alive[event["addr"]] = event
        elif event["action"] == "free_completed":
            alive.pop(event["addr"], None)

    def where(event):
        frames = [f for f in event.get("frames", []) if "/torch/" not in f["filename"]]
        return " < ".join(f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in frames[:3])

    by_site = collections.defaultdict(lambda: [0, 0])
    for event in alive.values():
        site = where(event)
        by_site[site][0] += event["size"]
        by_site[site][1] += 1
    largest = sorted(by_site.items(), key=lambda kv: -kv[1][0])[:top]
    return {"peak_mib": peak / 2**20, "alive_at_peak": [
        {"mib": size / 2**20, "count": count, "site": site} for site, (size, count) in largest]}


def memory(step, lik_pylate, batch):
    out = {"batch": batch}
    for name in ("stock", "lik"):
        run = _stock_env(step) if name == "stock" else step
        with lik_pylate.enabled() if name == "lik" else contextlib.nullcontext():
            run()
            out[name] = _alive_at_peak(run)
        print(f"memory B={batch} {name}: step peak {out[name]['peak_mib']:.1f} MiB above its start; alive at peak:")
        for row in out[name]["alive_at_peak"]:
            print(f"    {row['mib']:8.2f} MiB x{row['count']:<4d} {row['site'][:160]}")
    # The scoring call alone, on the step's shapes: fp32 embeddings (PyLate normalises in fp32 under autocast).
    from pylate.scores import ColBERTScores
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, 32, 128, device="cuda", generator=g).requires_grad_()
    d = torch.randn(batch, 2, 180, 128, device="cuda", generator=g).requires_grad_()
    q_mask = torch.ones(batch, 32, dtype=torch.bool, device="cuda")
    d_mask = torch.rand(batch, 2, 180, device="cuda", generator=g) > 0.1
    scorer = ColBERTScores()

    def scoring():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            scores = scorer(q, d, queries_mask=q_mask, documents_mask=d_mask)
        scores.logsumexp(1).sum().backward()
        q.grad = d.grad = None

    for name in ("stock", "lik"):
        run = _stock_env(scoring) if name == "stock" else scoring
        with lik_pylate.enabled() if name == "lik" else contextlib.nullcontext():
            run()
            out[f"scoring_only_{name}_peak_mib"] = bench._peak(run)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(100):
                run()
            torch.cuda.synchronize()
            out[f"scoring_only_{name}_ms"] = (time.perf_counter() - start) * 10
    print(f"scoring alone B={batch} (fwd + bwd, bf16 autocast): stock {out['scoring_only_stock_ms']:.3f} ms "
          f"{out['scoring_only_stock_peak_mib']:.2f} MiB | lik {out['scoring_only_lik_ms']:.3f} ms "
          f"{out['scoring_only_lik_peak_mib']:.2f} MiB", flush=True)
    return out


def colpali_phases(n_pages=1000, page_len=1030, dim=128, query_counts=(16, 128), repeats=50):
    """Wall time (synchronised) of each phase of ``score_multi_vector`` on a list of pages, and of the call."""
    import lik.integrations.colpali as lik_colpali
    import lik.integrations.colpali_pages as pages_module
    from lik import maxsim

    g = torch.Generator(device="cuda").manual_seed(0)
    pages = [torch.nn.functional.normalize(torch.randn(page_len, dim, device="cuda", generator=g), dim=-1)
             .bfloat16() for _ in range(n_pages)]

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3 / repeats

    out = []
    for n_queries in query_counts:
        lengths = torch.randint(18, 23, (n_queries,), generator=torch.Generator().manual_seed(n_queries)).tolist()
        queries = [torch.nn.functional.normalize(torch.randn(n, dim, device="cuda", generator=g), dim=-1)
                   .bfloat16() for n in lengths]
        rows = pages_module.QueryRows(queries, "cuda")
        dense = torch.cat(pages).view(n_pages, page_len, dim)
        row_scores = maxsim(rows.rows, dense)
        row = {"n_queries": n_queries, "n_pages": n_pages,
               "check_pages_ms": timed(lambda: pages_module.checked_sizes("ps", pages_module.as_items("ps", pages))),
               "lengths_ms": timed(lambda: pages_module.needs_zero_token(
                   pages_module.page_lengths(pages)[0], 128)),
               "query_rows_ms": timed(lambda: pages_module.QueryRows(queries, "cuda")),
               "cat_ms": timed(lambda: torch.cat(pages)),
               "kernel_ms": timed(lambda: maxsim(rows.rows, dense)),
               "sums_ms": timed(lambda: rows.sums(row_scores)),
               "to_cpu_ms": timed(lambda: rows.sums(row_scores).cpu()),
               "call_tensor_ms": timed(lambda: lik_colpali.score_multi_vector(queries, dense, device="cuda"))}
        # The page list joined before or after the host's shape pass, alternating (the host's speed drifts).
        calls = {True: [], False: []}
        saved = pages_module.overlaps_host
        try:
            for _ in range(5):
                for early in (True, False):
                    pages_module.overlaps_host = lambda device, early=early: early and device.type != "cpu"
                    calls[early].append(timed(lambda: lik_colpali.score_multi_vector(queries, pages,
                                                                                     device="cuda")))
        finally:
            pages_module.overlaps_host = saved
        row["call_list_join_early_ms"] = statistics.median(calls[True])
        row["call_list_join_after_ms"] = statistics.median(calls[False])
        row["host_timeline_us"] = _host_timeline(lik_colpali, queries, pages)
        print(f"host timeline Nq={n_queries} (us from the call's start: name start-end):",
              " | ".join(f"{name} {a:.0f}-{b:.0f}" for name, a, b in row["host_timeline_us"]), flush=True)
        if n_queries == query_counts[0]:
            # One list call under the profiler: host operations and device kernels, with their times.
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    lik_colpali.score_multi_vector(queries, pages, device="cuda")
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=50))
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=8,
                                            max_name_column_width=50))
        out.append(row)
        print(f"colpali phases Nq={n_queries}: " + " | ".join(
            f"{k[:-3]} {v:.3f}" for k, v in row.items() if k.endswith("_ms")), flush=True)
    return out


def _host_timeline(module, queries, pages, repeats=20):
    """When, on the host, each step of one ``score_multi_vector`` list call starts and ends (median over calls,
    microseconds from the call's start; no synchronisation added, so device work overlaps as in a real call)."""
    names = ["_items", "_QueryRows", "_join_early", "_sizes", "_lengths", "_needs_zero_token", "maxsim",
             "maxsim_packed"]
    saved = {name: getattr(module, name) for name in names}
    marks = []

    def wrap(name, fn):
        def call(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                marks.append((name, begin, time.perf_counter()))
        return call

    runs = []
    try:
        for name in names:
            setattr(module, name, wrap(name, saved[name]))
        cpu = torch.Tensor.cpu
        torch.Tensor.cpu = wrap("cpu (waits for the device)", cpu)
        try:
            for _ in range(repeats):
                marks.clear()
                torch.cuda.synchronize()
                start = time.perf_counter()
                module.score_multi_vector(queries, pages, device="cuda")
                runs.append([(name, (a - start) * 1e6, (b - start) * 1e6) for name, a, b in marks]
                            + [("end", (time.perf_counter() - start) * 1e6, (time.perf_counter() - start) * 1e6)])
        finally:
            torch.Tensor.cpu = cpu
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
    return [(runs[0][i][0], statistics.median(r[i][1] for r in runs), statistics.median(r[i][2] for r in runs))
            for i in range(len(runs[0]))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minilm", required=True)
    parser.add_argument("--batches", default="32")
    parser.add_argument("--parts", default="profile")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    bench._stub_missing(["datasets", "ujson", "voyager", "sqlitedict", "fast_plaid", "fastkmeans", "pandas",
                         "accelerate"])
    parts = args.parts.split(",")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for batch in map(int, args.batches.split(",")):
        if not {"profile", "rounds", "memory"} & set(parts):
            break
        step, lik_pylate = bench.pylate_step(args.minilm, batch)
        if "profile" in parts:
            profile(step, lik_pylate, batch)
        if "rounds" in parts:
            results.setdefault("rounds", []).append(rounds(step, lik_pylate, batch))
        if "memory" in parts:
            results.setdefault("memory", []).append(memory(step, lik_pylate, batch))
    if "colpali" in parts:
        results["colpali_phases"] = colpali_phases()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
