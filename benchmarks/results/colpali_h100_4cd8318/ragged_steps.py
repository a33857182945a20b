"""Host time per step of a colpali score_multi_vector call on a ragged 1 000-page GPU list (median of 30 synchronised
calls), and the call's wall time."""
import statistics, sys, time, torch
import lik.integrations.colpali as lc
steps = {}
def wrap(owner, name, label=None):
    fn = getattr(owner, name)
    def timed(*a, **k):
        t0 = time.perf_counter(); r = fn(*a, **k); steps.setdefault(label or name, []).append((time.perf_counter() - t0) * 1e6); return r
    setattr(owner, name, timed)
sums = lc._QueryRows.sums
def timed_sums(self, rows):
    t0 = time.perf_counter(); r = sums(self, rows); steps.setdefault("sums", []).append((time.perf_counter() - t0) * 1e6); return r
lc._QueryRows.sums = timed_sums
zs = lc._QueryRows.zero_similarity
def timed_zs(self):
    t0 = time.perf_counter(); r = zs(self); steps.setdefault("zero_similarity", []).append((time.perf_counter() - t0) * 1e6); return r
lc._QueryRows.zero_similarity = timed_zs
for name in ("_QueryRows", "_join_early", "_page_lengths", "_needs_zero_token", "_page_groups", "_join_pages", "maxsim_packed", "maxsim"):
    wrap(lc, name)
g = torch.Generator(device="cuda").manual_seed(0)
for form in ("ragged", "equal"):
    lengths_d = torch.randint(512, 1031, (1000,), generator=torch.Generator().manual_seed(1)).tolist() if form == "ragged" else [1030] * 1000
    pages = [torch.nn.functional.normalize(torch.randn(n, 128, device="cuda", generator=g), dim=-1).bfloat16() for n in lengths_d]
    for nq in (16, 128):
        lengths = torch.randint(18, 23, (nq,), generator=torch.Generator().manual_seed(nq)).tolist()
        queries = [torch.nn.functional.normalize(torch.randn(n, 128, device="cuda", generator=g), dim=-1).bfloat16() for n in lengths]
        fn = lambda: lc.score_multi_vector(queries, pages, device="cuda")
        for _ in range(5): fn()
        steps.clear(); walls = []
        for _ in range(30):
            torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); walls.append((time.perf_counter() - t0) * 1e3)
        print(form, nq, f"wall {statistics.median(walls):.3f} ms |", " | ".join(f"{k} {statistics.median(v):.0f}" for k, v in steps.items()), flush=True)
