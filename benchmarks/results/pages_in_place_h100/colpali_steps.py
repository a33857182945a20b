"""Where a colpali-engine score_multi_vector call through lik spends its host time (page lists, 1 000 pages):
wall medians, and per-step host time from wrapped functions (median of 30 synchronised calls)."""
import json, statistics, sys, time, torch, triton
import lik.integrations.colpali as lc
from lik.ops.maxsim import document_list as dl

steps = {}
def wrap(owner, name, label):
    fn = getattr(owner, name)
    def timed(*a, **k):
        t0 = time.perf_counter(); r = fn(*a, **k); steps.setdefault(label, []).append((time.perf_counter() - t0) * 1e6); return r
    setattr(owner, name, timed)
sums = lc._QueryRows.sums
def timed_sums(self, rows):
    t0 = time.perf_counter(); r = sums(self, rows); steps.setdefault("sums", []).append((time.perf_counter() - t0) * 1e6); return r
lc._QueryRows.sums = timed_sums
wrap(lc, "_QueryRows", "query rows")
wrap(lc, "maxsim_document_list", "maxsim_document_list (launch + check)")
wrap(dl.DocumentList, "check", "check")

wrap(lc, "_needs_zero_token", "needs_zero_token")
build = dl.DocumentList.build.__func__
def timed_build(cls, *a, **k):
    t0 = time.perf_counter(); r = build(cls, *a, **k); steps.setdefault("build", []).append((time.perf_counter() - t0) * 1e6); return r
dl.DocumentList.build = classmethod(timed_build)

g = torch.Generator(device="cuda").manual_seed(0)
out = {}
for form in ("equal", "ragged"):
    lengths_d = [1030] * 1000 if form == "equal" else torch.randint(512, 1031, (1000,), generator=torch.Generator().manual_seed(1)).tolist()
    pages = [torch.nn.functional.normalize(torch.randn(n, 128, device="cuda", generator=g), dim=-1).bfloat16() for n in lengths_d]
    for nq in (16, 128):
        lengths = torch.randint(18, 23, (nq,), generator=torch.Generator().manual_seed(nq)).tolist()
        queries = [torch.nn.functional.normalize(torch.randn(n, 128, device="cuda", generator=g), dim=-1).bfloat16() for n in lengths]
        fn = lambda: lc.score_multi_vector(queries, pages, device="cuda")
        for _ in range(5): fn()
        steps.clear(); walls = []
        for _ in range(30):
            torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); walls.append((time.perf_counter() - t0) * 1e3)
        res = {"wall_ms": statistics.median(walls), "steps_us": {k: statistics.median(v) for k, v in steps.items()},
               "do_bench_ms": triton.testing.do_bench(fn, warmup=3, rep=200)}
        out[f"{form}_{nq}"] = res
        print(form, nq, f"wall {res['wall_ms']:.3f} do_bench {res['do_bench_ms']:.3f} |", " | ".join(f"{k} {v:.0f}" for k, v in res["steps_us"].items()), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
