"""Profiler timeline of one colpali score_multi_vector call, previous (lik_prev) and this tree (lik), equal and
ragged 1 000-page lists at 16 / 128 queries: each device op's start after the call and its duration (median of 9)."""
import json, statistics, sys, torch
from torch.profiler import profile, ProfilerActivity
sys.path.append(".carry/v_prev/src")
import lik.integrations.colpali as new
assert hasattr(new, "DocumentList")
import lik_prev.integrations.colpali as prev
g = torch.Generator(device="cuda").manual_seed(0)
out = {}
for form in ("equal", "ragged"):
    lengths_d = [1030] * 1000 if form == "equal" else torch.randint(512, 1031, (1000,), generator=torch.Generator().manual_seed(1)).tolist()
    pages = [torch.nn.functional.normalize(torch.randn(n, 128, device="cuda", generator=g), dim=-1).bfloat16() for n in lengths_d]
    for nq in (16, 128):
        lengths = torch.randint(18, 23, (nq,), generator=torch.Generator().manual_seed(nq)).tolist()
        queries = [torch.nn.functional.normalize(torch.randn(n, 128, device="cuda", generator=g), dim=-1).bfloat16() for n in lengths]
        for name, mod in (("prev", prev), ("new", new)):
            fn = lambda: mod.score_multi_vector(queries, pages, device="cuda")
            for _ in range(5): fn()
            runs = []
            for _ in range(9):
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    with torch.profiler.record_function("CALL"):
                        fn()
                    torch.cuda.synchronize()
                ev = prof.events()
                call = [e for e in ev if e.name == "CALL" and e.device_type.name == "CPU"][0]
                t0 = call.time_range.start
                ks = sorted([e for e in ev if e.device_type.name == "CUDA"], key=lambda e: e.time_range.start)
                runs.append({"call_us": call.time_range.end - t0,
                             "ops": [(e.name[:40], e.time_range.start - t0, e.time_range.end - e.time_range.start) for e in ks]})
            mid = sorted(runs, key=lambda r: r["call_us"])[4]
            out[f"{form}_{nq}_{name}"] = mid
            print(f"{form} {nq}q {name}: call {mid['call_us']:.0f} us | " + " ; ".join(f"{n} @{s:.0f} +{d:.0f}" for n, s, d in mid["ops"]), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
