"""Host and device timeline of one colpali-engine score_multi_vector call through lik (128 queries x 1 000 pages of
512-1 030 tokens, bf16, as a list): where the non-kernel time goes."""
import json, sys, time, torch, triton
import lik.integrations.colpali as lc
from torch.profiler import profile, ProfilerActivity
g = torch.Generator(device="cuda").manual_seed(0)
page_lengths = torch.randint(512, 1031, (1000,), generator=torch.Generator().manual_seed(1)).tolist()
pages = [torch.nn.functional.normalize(torch.randn(n, 128, device="cuda", generator=g), dim=-1).bfloat16() for n in page_lengths]
out = {}
for nq in (16, 128):
    lengths = torch.randint(18, 23, (nq,), generator=torch.Generator().manual_seed(nq)).tolist()
    queries = [torch.nn.functional.normalize(torch.randn(n, 128, device="cuda", generator=g), dim=-1).bfloat16() for n in lengths]
    for form in ("ragged list",):
        corpus = pages
        fn = lambda: lc.score_multi_vector(queries, corpus, device="cuda")
        for _ in range(5): fn()
        torch.cuda.synchronize()
        walls = []
        for _ in range(30):
            torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); walls.append((time.perf_counter() - t0) * 1e3)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            torch.cuda.synchronize()
            with torch.profiler.record_function("CALL"):
                fn()
            torch.cuda.synchronize()
        ev = prof.events()
        call = [e for e in ev if e.name == "CALL" and e.device_type.name == "CPU"][0]
        t_call = call.time_range.start
        kernels = sorted([e for e in ev if e.device_type.name == "CUDA"], key=lambda e: e.time_range.start)
        rows = [(e.name[:60], round((e.time_range.start - t_call) / 1e3, 3), round((e.time_range.end - e.time_range.start) / 1e3, 3)) for e in kernels]
        res = dict(form=form, n_queries=nq, wall_ms_median=sorted(walls)[len(walls)//2], call_cpu_ms=(call.time_range.end - t_call) / 1e3, kernels=rows,
                   do_bench_ms=triton.testing.do_bench(fn, warmup=3, rep=200))
        out[f"{nq}_{form}"] = res
        print(f"{nq} {form}: wall median {res['wall_ms_median']:.3f} ms, do_bench {res['do_bench_ms']:.3f}, CALL cpu {res['call_cpu_ms']:.3f}")
        for r in rows: print("   ", r)
json.dump(out, open(sys.argv[1], "w"), indent=1)
