"""A/B of row maxima per column class in the persistent loop (stacked rows) and for fp32 products: run from a
variant root (PYTHONPATH=<root>/src); one JSON line per cell; scores saved for a bitwise comparison."""
import json, sys, torch, triton, lik
variant, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
n = lambda *s: torch.nn.functional.normalize(torch.randn(*s, device="cuda"), dim=-1)
CELLS = []
# name, Q, D, dtype
CELLS.append(("rows-2554x1000x1030", n(2554, 1, 128), n(1000, 1030, 128), "bfloat16"))
CELLS.append(("rows-325x1000x1030", n(325, 1, 128), n(1000, 1030, 128), "bfloat16"))
CELLS.append(("multi-textual-32x32vs1024x300", n(32, 32, 128), n(1024, 300, 128), "float16"))
CELLS.append(("multi-longdoc-32x32vs1024x1024", n(32, 32, 128), n(1024, 1024, 128), "float16"))
CELLS.append(("colbert-128x32vs512x180", n(128, 32, 128), n(512, 180, 128), "float16"))
CELLS.append(("multi-textual-fp8", n(32, 32, 128), n(1024, 300, 128), "float8_e4m3fn"))
CELLS.append(("multi-textual-int8", n(32, 32, 128), n(1024, 300, 128), "int8"))
CELLS.append(("visual-fp32", n(512, 128), n(1000, 1024, 128), "float32"))
CELLS.append(("textual-B10000-fp8", n(32, 128), n(10000, 300, 128), "float8_e4m3fn"))
for name, Qf, Df, dts in CELLS:
    dt = getattr(torch, dts)
    if dt in (torch.float16, torch.bfloat16, torch.float32):
        q, d, kw = Qf.to(dt), Df.to(dt), {}
    else:
        q, qs = lik.quantize(Qf, dt); d, ds = lik.quantize(Df, dt); kw = dict(q_scale=qs, d_scale=ds)
    fn = lambda: lik.maxsim(q, d, **kw)
    s = fn(); torch.cuda.synchronize()
    torch.save(s.cpu(), f"{out}/{variant}_{name}.pt")
    ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
    print(json.dumps(dict(variant=variant, shape=name, dtype=dts, ms=round(ms, 4))), flush=True)
    del q, d
