"""A/B of source trees (one process per tree): lik fp16 / fp8 / int8 at visual and ColPali B = 1 000, do_bench
(L2 flushed) medians over alternating rounds, fp8 and int8 checked against the dequantized reference."""
import json, os, sys
import torch, triton
import lik

tag = sys.argv[1]
out = os.environ.get("OUT", ".")
rounds = int(os.environ.get("ROUNDS", "5"))
torch.manual_seed(0)
cells = {}
lines = []
for name, q_len in (("visual", 512), ("colpali", 1024)):
    q = torch.nn.functional.normalize(torch.randn(q_len, 128, device="cuda"), dim=-1).half()
    d = torch.nn.functional.normalize(torch.randn(1000, 1024, 128, device="cuda"), dim=-1).half()
    methods = {"fp16": lambda q=q, d=d: lik.maxsim(q, d)}
    for dtype, t in ((torch.float8_e4m3fn, "fp8"), (torch.int8, "int8")):
        q8, qs = lik.quantize(q, dtype)
        d8, ds = lik.quantize(d, dtype)
        got = lik.maxsim(q8, d8, q_scale=qs, d_scale=ds)
        ref = lik.maxsim_reference(q8[:].double() * qs.double()[:, None], (d8[:50].double() * ds[:50].double()[..., None]))
        err = ((got[:50].double() - ref).abs() / ref.abs()).max().item()
        assert err < 1e-4, (tag, name, t, err)
        methods[t] = lambda q8=q8, qs=qs, d8=d8, ds=ds: lik.maxsim(q8, d8, q_scale=qs, d_scale=ds)
    for fn in methods.values():
        fn()
    times = {m: [] for m in methods}
    for r in range(rounds):
        order = list(methods) if r % 2 == 0 else list(methods)[::-1]
        for m in order:
            times[m].append(triton.testing.do_bench(methods[m], warmup=25, rep=200, return_mode="median"))
    med = {m: sorted(v)[len(v) // 2] for m, v in times.items()}
    for m, v in times.items():
        cells[f"{name} {m}"] = v
        lines.append(f"{tag:8s} {name:8s} {m:5s} {med[m]:.4f} ms  x fp16 {med['fp16'] / med[m]:.3f}  rounds {[round(x, 4) for x in v]}")
    del d
    torch.cuda.empty_cache()
json.dump(cells, open(os.path.join(out, f"ab_{tag}.json"), "w"), indent=1)
print("\n".join(lines), flush=True)
