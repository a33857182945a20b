"""A/B of whole 8-bit tiles addressed from one base: run from a variant root (PYTHONPATH=<root>/src); one JSON line
per cell; every cell's scores saved for a bitwise comparison between variants."""
import json, sys, torch, triton, lik
variant, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
F16, I8, F8 = "float16", "int8", "float8_e4m3fn"
CELLS = [("colpali", 1, 1024, 1000, 1024, (F16, I8, F8)),
         ("visual", 1, 512, 1000, 1024, (F16, I8, F8)),
         ("colpali-1030", 1, 1024, 1000, 1030, (F16, F8)),
         ("visual-B10000", 1, 512, 10000, 1024, (F16, F8)),
         ("long-doc", 1, 32, 1000, 1024, (F16,)),
         ("textual-B10000", 1, 32, 10000, 300, (F16,))]
for name, nq, lq, b, ld, dts in CELLS:
    Qf = torch.nn.functional.normalize(torch.randn(nq, lq, 128, device="cuda"), dim=-1)
    Df = torch.nn.functional.normalize(torch.randn(b, ld, 128, device="cuda"), dim=-1)
    Qs = Qf[0] if nq == 1 else Qf
    for dts_ in dts:
        dt = getattr(torch, dts_)
        if dt in (torch.float16, torch.bfloat16):
            q, d, kw = Qs.to(dt), Df.to(dt), {}
        else:
            q, qs = lik.quantize(Qs, dt); d, ds = lik.quantize(Df, dt); kw = dict(q_scale=qs, d_scale=ds)
        fn = lambda: lik.maxsim(q, d, **kw)
        s = fn(); torch.cuda.synchronize()
        torch.save(s.cpu(), f"{out}/{variant}_{name}_{dts_}.pt")
        ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
        print(json.dumps(dict(variant=variant, shape=name, dtype=dts_, ms=round(ms, 4))), flush=True)
        del q, d
    del Df
