"""Launch sweep of lik.quantize's kernel at the benchmark's [3 000 000, 128] fp16 (do_bench medians, three interleaved
rounds; each launch's output compared bit for bit with lik.quantize's). Usage: PYTHONPATH=src python3 benchmarks/quantize_sweep.py OUT_DIR"""
import json, os, statistics, sys, torch, triton
import lik
from lik._config import cdiv
from lik.ops.quantization import kernel as qk
out = sys.argv[1]
x = torch.randn(3_000_000, 128, device="cuda", dtype=torch.float16)
copy_src = torch.empty(1_164_000_000 // 2, dtype=torch.float16, device="cuda")
floor_ms = triton.testing.do_bench(lambda: copy_src.clone(), warmup=10, rep=100) / 2  # a clone of the floor's bytes moves them twice
def launch(dtype, rows, warps):
    x_q = torch.empty(x.shape, dtype=dtype, device="cuda"); scale = torch.empty(x.shape[0], dtype=torch.float32, device="cuda")
    def fn():
        qk.quantize_rows_kernel[(cdiv(x.shape[0], rows),)](x, x_q, scale, x.shape[0], 128, x.stride(0), x_q.stride(0),
            QMAX_VALUE=qk.QMAX[dtype], TO_INT8=dtype == torch.int8, BLOCK_ROWS=rows, BLOCK_D=128, SINGLE_CHUNK=True,
            num_warps=warps)
        return x_q, scale
    return fn
rows_out = []
for dtype in (torch.int8, torch.float8_e4m3fn):
    ref_q, ref_s = lik.quantize(x, dtype)
    cfgs = [(r, w) for r in (4, 8, 16, 32, 64, 128) for w in (1, 2, 4, 8) if r * 128 // (w * 32) >= 4]
    fns = {}
    for r, w in cfgs:
        fn = launch(dtype, r, w); q, s = fn()
        fns[(r, w)] = (fn, torch.equal(q.view(torch.int8), ref_q.view(torch.int8)) and torch.equal(s, ref_s))
    times = {k: [] for k in fns}
    shipped = []
    for rnd in range(3):
        shipped.append(triton.testing.do_bench(lambda: lik.quantize(x, dtype), warmup=10, rep=100))
        for k, (fn, _) in fns.items():
            times[k].append(triton.testing.do_bench(fn, warmup=10, rep=100))
    res = sorted((statistics.median(v), k) for k, v in times.items())
    row = dict(dtype=str(dtype), floor_ms=floor_ms, shipped_ms=statistics.median(shipped),
               configs=[dict(rows=k[0], warps=k[1], ms=m, same=fns[k][1]) for m, k in res])
    rows_out.append(row)
    print(f"{dtype}: copy floor {floor_ms:.3f} ms, shipped {row['shipped_ms']:.3f} ({floor_ms / row['shipped_ms']:.0%})")
    for m, k in res[:8]:
        print(f"  rows {k[0]:4} warps {k[1]}: {m:.3f} ms ({floor_ms / m:.0%}) same={fns[k][1]}")
json.dump(dict(device=torch.cuda.get_device_name(), rows=rows_out), open(os.path.join(out, "qsweep.json"), "w"), indent=1)
