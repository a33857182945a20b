"""Tile sweep of the per-row stacked launch (colpali-engine's rows: 2 554 / 325 bf16 rows x 1 000 x 1 030 pages)
and the canonical stacked multi-query shapes (32 x 32 against 1 024 x 300 / 1 024 x 1 024, fp16), alternating
rounds, median of do_bench."""
import json, statistics, sys, torch, triton
import lik
from lik import _config
C = _config.MaxSimForwardConfig
def cfgs_for(rows):
    if rows >= 1024:
        return [None, C(1, 256, 64, 128, 8, 3, 2, 128), C(1, 512, 64, 128, 16, 3, 1, 0), C(1, 512, 64, 128, 16, 4, 1, 0),
                C(1, 512, 128, 128, 16, 2, 1, 0), C(1, 256, 128, 128, 8, 3, 1, 0), C(1, 512, 32, 128, 16, 4, 1, 0),
                C(1, 256, 32, 128, 8, 4, 2, 128), C(1, 256, 64, 128, 8, 2, 2, 128)]
    return [None, C(1, 128, 64, 128, 8, 3, 2, 128), C(1, 128, 64, 128, 4, 3, 2, 0), C(1, 128, 64, 128, 4, 4, 2, 0),
            C(1, 128, 128, 128, 4, 3, 2, 0), C(1, 128, 64, 128, 4, 3, 3, 0), C(1, 128, 32, 128, 4, 4, 3, 0)]
out = {"device": torch.cuda.get_device_name(), "cells": []}
g = torch.Generator(device="cuda").manual_seed(0)
shapes = [("rows", 2554, 1, 1000, 1030, torch.bfloat16), ("rows", 325, 1, 1000, 1030, torch.bfloat16),
          ("multi", 32, 32, 1024, 300, torch.float16), ("multi", 32, 32, 1024, 1024, torch.float16)]
for kind, nq, lq, B, L, dt in shapes:
    q = torch.nn.functional.normalize(torch.randn(nq, lq, 128, device="cuda", generator=g), dim=-1).to(dt)
    D = torch.nn.functional.normalize(torch.randn(B, L, 128, device="cuda", generator=g), dim=-1).to(dt)
    base = lik.maxsim(q, D)
    rows = nq * lq
    configs = cfgs_for(rows) if kind == "rows" else [None, C(32, 8, 64, 128, 8, 3, 2, 128), C(32, 16, 64, 128, 16, 3, 1, 0), C(32, 16, 64, 128, 16, 4, 1, 0), C(32, 8, 128, 128, 8, 3, 1, 0)]
    fns = {}
    for cfg in configs:
        name = "heuristic" if cfg is None else f"{cfg.group_rows}x{cfg.groups}/n{cfg.block_n}/w{cfg.num_warps}/s{cfg.num_stages}/p{cfg.programs_per_sm}/r{cfg.max_registers}"
        def fn(cfg=cfg):
            if cfg is None:
                return lik.maxsim(q, D)
            with _config.override(maxsim_forward=cfg):
                return lik.maxsim(q, D)
        try:
            got = fn()
            torch.cuda.synchronize()
            err = (got - base).abs().max().item()
            fns[name] = fn
            print(kind, rows, name, "ok err", err, flush=True)
        except Exception as e:
            print(kind, rows, name, "FAILED", type(e).__name__, str(e)[:100], flush=True)
    times = {k: [] for k in fns}
    for _ in range(5):
        for k, fn in fns.items():
            times[k].append(triton.testing.do_bench(fn, warmup=5, rep=60))
    flops = 2 * rows * B * L * 128
    cell = {"kind": kind, "rows": rows, "B": B, "L": L, "ms": {k: statistics.median(v) for k, v in times.items()}, "rounds": times}
    out["cells"].append(cell)
    for k, v in sorted(cell["ms"].items(), key=lambda kv: kv[1]):
        print(f"  {kind} {rows} {k}: {v:.4f} ms {flops / v / 1e9:.0f} TFLOP/s", flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
