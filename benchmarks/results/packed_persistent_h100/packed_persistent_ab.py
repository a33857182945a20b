"""A/B of the packed corpus launch for stacked query rows: persistent (programs walk their documents) against a
program per document, same process, alternating rounds (median of do_bench); same bits asserted. The padded
persistent launch on equal documents is timed beside it."""
import dataclasses, json, statistics, sys, torch, triton
import lik
from lik import _config
g = torch.Generator(device="cuda").manual_seed(0)
def lengths(n, lo, hi, seed):
    return torch.randint(lo, hi + 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
cells = [("colpali rows 16q, ragged pages", 325, 1, lengths(1000, 512, 1030, 1), torch.bfloat16),
         ("colpali rows 128q, ragged pages", 2554, 1, lengths(1000, 512, 1030, 1), torch.bfloat16),
         ("colpali rows 16q, equal pages", 325, 1, [1030] * 1000, torch.bfloat16),
         ("colpali rows 128q, equal pages", 2554, 1, [1030] * 1000, torch.bfloat16),
         ("32 x 32 queries, 10 000 docs 100-300", 32, 32, lengths(10000, 100, 300, 2), torch.float16),
         ("4 x 32 queries, 10 000 docs 100-300", 4, 32, lengths(10000, 100, 300, 2), torch.float16),
         ("32 x 32 queries, 1 000 docs 500-1 024", 32, 32, lengths(1000, 500, 1024, 3), torch.float16)]
out = {"device": torch.cuda.get_device_name(), "cells": []}
for name, nq, lq, lens, dt in cells:
    q = torch.nn.functional.normalize(torch.randn(nq, lq, 128, device="cuda", generator=g), dim=-1).to(dt)
    d = torch.nn.functional.normalize(torch.randn(sum(lens), 128, device="cuda", generator=g), dim=-1).to(dt)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    longest = max(lens)
    cfg = _config.maxsim_varlen_config(q_len=lq, n_queries=nq, dim=128, dtype=dt, pairs=False, device=q.device)
    per_doc = dataclasses.replace(cfg, programs_per_sm=0)
    def per_document():
        with _config.override(maxsim_varlen=per_doc):
            return lik.maxsim_packed(q, d, cu, max_seqlen_d=longest)
    fns = {"per_document": per_document, "persistent": lambda: lik.maxsim_packed(q, d, cu, max_seqlen_d=longest)}
    if len(set(lens)) == 1:
        padded = d.view(len(lens), lens[0], 128)
        fns["padded_persistent"] = lambda: lik.maxsim(q, padded)
    with torch.no_grad():
        ref = fns["per_document"]()
        same = {k: bool(torch.equal(fn(), ref)) for k, fn in fns.items()}
        times = {k: [] for k in fns}
        for _ in range(5):
            for k, fn in fns.items():
                times[k].append(triton.testing.do_bench(fn, warmup=5, rep=60))
    cell = {"name": name, "config": str(cfg), "same_bits": same, "rounds": times, **{f"{k}_ms": statistics.median(v) for k, v in times.items()}}
    out["cells"].append(cell)
    print(f"{name}: " + " | ".join(f"{k} {cell[k + '_ms']:.4f}" for k in fns) + f" | persistent/per_doc {cell['persistent_ms'] / cell['per_document_ms']:.3f} | same {same}", flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
