"""colpali-engine score_multi_vector through lik: the previous commit's package (lik_prev, page lists joined) against
this tree's (page lists read in place), in one process, alternating rounds; GPU page lists of 1 000 pages."""
import json, os, statistics, sys, torch, triton
sys.path.append(".carry/v_prev/src")
import lik.integrations.colpali as new
assert "v_prev" not in new.__file__ and hasattr(new, "DocumentList"), new.__file__
import lik_prev.integrations.colpali as prev
rounds = int(os.environ.get("ROUNDS", "7"))
N_PAGES = int(os.environ.get("N_PAGES", "1000"))
g = torch.Generator(device="cuda").manual_seed(0)
out = {"device": torch.cuda.get_device_name(), "rounds": rounds, "cells": []}
def peak(fn):
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); before = torch.cuda.memory_allocated()
    fn(); torch.cuda.synchronize(); return (torch.cuda.max_memory_allocated() - before) / 2**20
for form in os.environ.get("FORMS", "equal,ragged").split(","):
    lengths_d = [1030] * N_PAGES if form == "equal" else torch.randint(512, 1031, (N_PAGES,), generator=torch.Generator().manual_seed(1)).tolist()
    pages = [torch.nn.functional.normalize(torch.randn(n, 128, device="cuda", generator=g), dim=-1).bfloat16() for n in lengths_d]
    for nq in (16, 128):
        lengths = torch.randint(18, 23, (nq,), generator=torch.Generator().manual_seed(nq)).tolist()
        queries = [torch.nn.functional.normalize(torch.randn(n, 128, device="cuda", generator=g), dim=-1).bfloat16() for n in lengths]
        fns = {"prev": lambda: prev.score_multi_vector(queries, pages, device="cuda"),
               "new": lambda: new.score_multi_vector(queries, pages, device="cuda")}
        assert torch.equal(fns["prev"](), fns["new"]())
        times = {k: [] for k in fns}
        for _ in range(rounds):
            for k, fn in fns.items():
                times[k].append(triton.testing.do_bench(fn, warmup=3, rep=100))
        cell = {"pages": form, "n_queries": nq, "rounds_ms": times, **{f"{k}_ms": statistics.median(v) for k, v in times.items()},
                **{f"{k}_peak_mib": peak(fn) for k, fn in fns.items()},
                "new_faster_in": sum(a < b for a, b in zip(times["new"], times["prev"]))}
        out["cells"].append(cell)
        print(f"{form:6s} {nq:4d}q: prev {cell['prev_ms']:.3f} ms {cell['prev_peak_mib']:.0f} MiB | new {cell['new_ms']:.3f} ms "
              f"{cell['new_peak_mib']:.0f} MiB | new faster in {cell['new_faster_in']}/{rounds} | rounds prev "
              + " ".join(f"{t:.2f}" for t in times["prev"]) + " new " + " ".join(f"{t:.2f}" for t in times["new"]), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
