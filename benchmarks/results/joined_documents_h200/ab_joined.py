"""In-process A/B of the joined-documents loop: every cell timed with the joined loop and with the document
loop (lik.ops.maxsim.forward.joined_documents forced False), rounds interleaved; scores compared bit for bit.
Then colpali-engine's score_multi_vector (stock einsum backend vs lik, both loops). Prints JSON lines and a table."""
import json, os, sys, statistics, torch, triton
sys.path.insert(0, "benchmarks")
import lik
import lik.ops.maxsim.forward as forward
out = sys.argv[1]
decide = forward.joined_documents
def use(joined):
    forward.joined_documents = decide if joined else (lambda *a: False)
torch.manual_seed(0)
def norm(*shape):
    return torch.nn.functional.normalize(torch.randn(*shape, device="cuda"), dim=-1)
CELLS = []  # (name, dtype, fn)
def add(name, q, d, dt):
    if dt in (torch.float16, torch.bfloat16):
        q, d, kw = q.to(dt), d.to(dt), {}
    else:
        (q, qs), (d, ds) = lik.quantize(q, dt), lik.quantize(d, dt); kw = dict(q_scale=qs, d_scale=ds)
    CELLS.append((name, str(dt).split(".")[-1], lambda: lik.maxsim(q, d, **kw)))
pages = norm(1000, 1030, 128)
lengths = torch.randint(18, 23, (128,), generator=torch.Generator().manual_seed(128)).tolist()
rows = norm(sum(lengths), 1, 128)
add("rows 2555 x 1000 x 1030", rows[:2555], pages, torch.bfloat16)
add("rows 325 x 1000 x 1030", rows[:325], pages, torch.bfloat16)
textual = norm(10000, 300, 128)
q1 = norm(32, 128)
for dt in (torch.int8, torch.float8_e4m3fn):
    add("textual B10000", q1, textual, dt)
    add("textual B1000", q1, textual[:1000], dt)
multi = norm(32, 32, 128)
for dt in (torch.float16, torch.int8, torch.float8_e4m3fn):
    add("multi textual Nq32 B1024", multi, textual[:1024], dt)
add("ColBERT B512 x 180 inference", norm(32, 32, 128), norm(512, 180, 128), torch.float16)
results = {}
for name, dt, fn in CELLS:
    use(True); a = fn(); use(False); b = fn(); torch.cuda.synchronize()
    same = torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    results[(name, dt)] = {"same_bits": same, "joined": [], "strided": []}
for rnd in range(5):
    for name, dt, fn in CELLS:
        for joined in ((True, False) if rnd % 2 == 0 else (False, True)):
            use(joined)
            ms = triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")
            results[(name, dt)]["joined" if joined else "strided"].append(ms)
use(True)
lines = []
for (name, dt), r in results.items():
    row = dict(cell=name, dtype=dt, same_bits=r["same_bits"], joined_ms=statistics.median(r["joined"]),
               strided_ms=statistics.median(r["strided"]), joined_rounds=r["joined"], strided_rounds=r["strided"])
    lines.append(row); print(json.dumps(row), flush=True)
# colpali-engine score_multi_vector, 128 and 16 queries, tensor and list pages
try:
    import integrations_bench as ib
    import lik.integrations.colpali as lc
    stock = ib._import_colpali_scoring().BaseVisualRetrieverProcessor.score_multi_vector
    page_list = [p.bfloat16() for p in pages]
    tensor = pages.bfloat16()
    for nq in (128, 16):
        ls = torch.randint(18, 23, (nq,), generator=torch.Generator().manual_seed(nq)).tolist()
        qs = [norm(n, 128).bfloat16() for n in ls]
        for form, corpus in (("tensor", tensor), ("list", page_list)):
            st = ib._with_env("COLPALI_SCORES_BACKEND", "torch", lambda: stock(qs, corpus, device="cuda"))
            fns = {"stock": st, "lik": lambda: lc.score_multi_vector(qs, corpus, device="cuda")}
            got = {"stock": [], "lik joined": [], "lik strided": []}
            st(); fns["lik"]()
            for rnd in range(3):
                got["stock"].append(triton.testing.do_bench(st, warmup=3, rep=300, return_mode="median"))
                for joined in (True, False):
                    use(joined)
                    got[f"lik {'joined' if joined else 'strided'}"].append(
                        triton.testing.do_bench(fns["lik"], warmup=3, rep=150, return_mode="median"))
            use(True)
            row = {k: statistics.median(v) for k, v in got.items()}
            row.update(cell=f"score_multi_vector Nq {nq} {form}", rounds=got)
            lines.append(row); print(json.dumps(row), flush=True)
except Exception as error:
    print("colpali part failed:", repr(error)[:500], flush=True)
json.dump(lines, open(os.path.join(out, "ab_joined.json"), "w"), indent=1)
print(f"\n{'cell':40} {'dtype':14} {'strided':>9} {'joined':>9} {'x':>6} same")
for r in lines:
    if "dtype" in r:
        print(f"{r['cell']:40} {r['dtype']:14} {r['strided_ms']:9.4f} {r['joined_ms']:9.4f} "
              f"{r['strided_ms'] / r['joined_ms']:6.3f} {r['same_bits']}")
    else:
        print(f"{r['cell']:40} stock {r['stock']:.3f} | lik joined {r['lik joined']:.3f} ({r['stock'] / r['lik joined']:.2f}x)"
              f" | strided {r['lik strided']:.3f} ({r['stock'] / r['lik strided']:.2f}x)")
