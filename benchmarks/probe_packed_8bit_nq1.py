"""One-off probe (deleted after its finding went to NOTES.md): one 8-bit query against 50 000 packed documents of 60-140
tokens, the document loop and 76 token-stream tiles per dtype, do_bench medians of 3; JSON to $OUT/sweep8.json."""
import json, itertools, os, statistics, sys, time
import torch, triton
import lik
from lik.config import override
from lik.config.packed import PackedStreamConfig, packed_stream_tiles

dev = torch.device("cuda")
gen = torch.Generator().manual_seed(0)
lengths = torch.randint(60, 141, (50_000,), generator=gen).tolist()
g = torch.Generator(device=dev).manual_seed(0)
rows = torch.nn.functional.normalize(torch.randn(sum(lengths), 128, device=dev, generator=g), dim=-1).half()
cu = torch.zeros(len(lengths) + 1, dtype=torch.int32); cu[1:] = torch.tensor(lengths).cumsum(0); cu = cu.to(dev)
longest = max(lengths); tokens = sum(lengths)
# copy bandwidth: a 2 GiB device copy, read + write
a = torch.empty(2**30, dtype=torch.uint8, device=dev); b = torch.empty_like(a)
t = statistics.median(triton.testing.do_bench(lambda: b.copy_(a), warmup=25, rep=200) for _ in range(3))
bw = 2 * a.numel() / (t * 1e-3); del a, b
print(f"copy bandwidth {bw/1e12:.2f} TB/s", flush=True)
res = {"copy_bw": bw, "cells": []}
def bench(fn):
    return statistics.median(triton.testing.do_bench(fn, warmup=25, rep=100) for _ in range(3))
for dname, dt in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
    d, ds = lik.quantize(rows, dt)
    Q = torch.nn.functional.normalize(torch.randn(1, 32, 128, device=dev, generator=g), dim=-1).half()
    q, qs = lik.quantize(Q, dt)
    nbytes = 128 * (tokens + 32) + 4 * (tokens + 32) + 4 * (len(lengths) + 1) + 4 * len(lengths)
    floor = nbytes / bw * 1e3
    call = lambda: lik.maxsim_packed(q, d, cu, max_seqlen_d=longest, q_scale=qs, d_scale=ds)
    ref = None
    with override(packed_stream=PackedStreamConfig(stream=False)):
        ref = call().float()
        ms = bench(call)
    print(f"{dname} floor {floor:.4f} ms  loop {ms:.4f} ({floor/ms:.0%})", flush=True)
    res["cells"].append(dict(dtype=dname, cfg="loop", ms=ms, floor=floor))
    heur = packed_stream_tiles(q_len=32, n_queries=1, dim=128, dtype=dt, device=dev)
    ms = bench(call)
    print(f"{dname} heuristic(lik) {ms:.4f} ({floor/ms:.0%}) {heur}", flush=True)
    res["cells"].append(dict(dtype=dname, cfg="lik", ms=ms, floor=floor, tiles=str(heur)))
    grid = []
    for gr in sorted({heur.group_rows, 32, 64}):
        for bt, nw, st, pps in itertools.product((128, 256, 64), (4, 8), (2, 3, 4), (2, 3, 4)):
            if (bt == 256 and st == 4) or (bt == 64 and nw == 8) or (bt == 128 and nw == 8 and st == 2): continue
            grid.append(PackedStreamConfig(gr, 1, bt, nw, st, pps, 0, True, 3))
    grid.sort(key=lambda c: (c.group_rows != heur.group_rows, {128: 0, 256: 1, 64: 2}[c.block_t]))
    grid = [PackedStreamConfig(heur.group_rows, 1, 128, 4, 3, heur.programs_per_sm, 0, True, seg) for seg in (2, 4)] + grid
    t0 = time.time()
    for cfg in grid:
        if time.time() - t0 > float(os.environ.get("SWEEP_S", "100")): print("sweep time out"); break
        try:
            with override(packed_stream=cfg):
                err = (call().float() - ref).abs().max().item()
                ms = bench(call)
        except Exception as e:
            print(f"{dname} {cfg}: {type(e).__name__}: {str(e)[:80]}"); continue
        res["cells"].append(dict(dtype=dname, cfg=str(cfg), ms=ms, floor=floor, err=err))
        print(f"{dname} gr{cfg.group_rows} bt{cfg.block_t} w{cfg.num_warps} s{cfg.num_stages} p{cfg.programs_per_sm} seg{cfg.segments}: {ms:.4f} ({floor/ms:.0%}) err {err:.1e}", flush=True)
    best = sorted((c for c in res["cells"] if c["dtype"] == dname), key=lambda c: c["ms"])[:5]
    for c in best: print("BEST", dname, c["cfg"], f"{c['ms']:.4f} ({c['floor']/c['ms']:.0%})")
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "sweep8.json"), "w"), indent=1)
