"""lik.quantize at other widths: the shipped launch against the previous one (64 rows / 8192 elements per program)."""
import json, os, statistics, sys, torch, triton
import lik
from lik._config import cdiv, next_power_of_2
from lik.ops.quantization import kernel as qk
out = sys.argv[1]
rows_out = []
for dim in (64, 80, 96, 128, 256, 384, 768, 1024, 4096):
    n = 384_000_000 // dim
    x = torch.randn(n, dim, device="cuda", dtype=torch.float16)
    for dtype in (torch.int8, torch.float8_e4m3fn):
        block_d = min(next_power_of_2(max(dim, 16)), 8192)
        rows = max(1, min(64, 8192 // block_d))
        warps = 8 if rows * block_d >= 8192 else 4
        x_q = torch.empty(x.shape, dtype=dtype, device="cuda"); scale = torch.empty(n, device="cuda")
        def old():
            qk.quantize_rows_kernel[(cdiv(n, rows),)](x, x_q, scale, n, dim, x.stride(0), x_q.stride(0),
                QMAX_VALUE=qk.QMAX[dtype], TO_INT8=dtype == torch.int8, BLOCK_ROWS=rows, BLOCK_D=block_d,
                SINGLE_CHUNK=dim <= block_d, num_warps=warps)
        old(); q, s = lik.quantize(x, dtype)
        same = torch.equal(q.view(torch.int8), x_q.view(torch.int8)) and torch.equal(s, scale)
        t = {"old": [], "new": []}
        for _ in range(3):
            t["old"].append(triton.testing.do_bench(old, warmup=10, rep=100))
            t["new"].append(triton.testing.do_bench(lambda: lik.quantize(x, dtype), warmup=10, rep=100))
        row = dict(device=torch.cuda.get_device_name(), dim=dim, dtype=str(dtype), same=same,
                   old_ms=statistics.median(t["old"]), new_ms=statistics.median(t["new"]))
        rows_out.append(row)
        print(f"d {dim:5} {str(dtype):22} old {row['old_ms']:.3f} new {row['new_ms']:.3f} ms x{row['old_ms'] / row['new_ms']:.3f} same={same}", flush=True)
    del x
json.dump(rows_out, open(os.path.join(out, "qwide.json"), "w"), indent=1)
