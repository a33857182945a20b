"""A/B of the 128-row stacked launch: the heuristic (8 warps, 128-register cap) against 4 warps with no cap, same
process, alternating rounds (median of do_bench); scores compared bit for bit."""
import dataclasses, json, statistics, sys, torch, triton
import lik
from lik import _config
g = torch.Generator(device="cuda").manual_seed(0)
shapes = [(325, 1, 1000, 1030, torch.bfloat16), (10, 32, 1000, 1030, torch.float16), (10, 32, 10000, 128, torch.float16),
          (4, 32, 10000, 300, torch.float16), (2, 32, 10000, 300, torch.float16), (4, 32, 1000, 1024, torch.float16),
          (128, 1, 10000, 300, torch.bfloat16)]
out = {"device": torch.cuda.get_device_name(), "cells": []}
for nq, lq, B, L, dt in shapes:
    q = torch.nn.functional.normalize(torch.randn(nq, lq, 128, device="cuda", generator=g), dim=-1).to(dt)
    D = torch.nn.functional.normalize(torch.randn(B, L, 128, device="cuda", generator=g), dim=-1).to(dt)
    cfg = _config.maxsim_forward_config(q_len=lq, n_queries=nq, dim=128, dtype=dt, per_query=False, device=q.device, doc_len=L)
    new_cfg = dataclasses.replace(cfg, num_warps=4, max_registers=0)
    def run(c):
        with _config.override(maxsim_forward=c):
            return lik.maxsim(q, D)
    fns = {"heuristic": lambda: run(cfg), "w4_nocap": lambda: run(new_cfg)}
    same = torch.equal(fns["heuristic"](), fns["w4_nocap"]())
    times = {k: [] for k in fns}
    for _ in range(5):
        for k, fn in fns.items():
            times[k].append(triton.testing.do_bench(fn, warmup=5, rep=60))
    cell = {"shape": [nq, lq, B, L, str(dt)], "config": str(cfg), "same_bits": same, "rounds": times,
            **{f"{k}_ms": statistics.median(v) for k, v in times.items()}}
    out["cells"].append(cell)
    print(f"{nq}x{lq} vs {B}x{L} {dt}: rows/tile {cfg.group_rows * cfg.groups} warps {cfg.num_warps} cap {cfg.max_registers} | "
          f"heuristic {cell['heuristic_ms']:.4f} | w4 no cap {cell['w4_nocap_ms']:.4f} | ratio {cell['w4_nocap_ms'] / cell['heuristic_ms']:.3f} | same {same}", flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
