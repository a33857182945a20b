"""lik.quantize's kernel at d = 96 and 80: single masked chunk vs unmasked pow2 chunks (two passes)."""
import json, os, statistics, sys, torch, triton
import lik
from lik._config import cdiv
from lik.ops.quantization import kernel as qk
out = sys.argv[1]
rows_out = []
for dim in (96, 80):
    n = 384_000_000 // dim
    x = torch.randn(n, dim, device="cuda", dtype=torch.float16)
    ref_q, ref_s = lik.quantize(x, torch.int8)
    cfgs = [(128, True, r, w) for r, w in ((8, 2), (16, 4), (4, 1), (32, 8))] + \
           [(bd, False, r, w) for bd in (16, 32, 64) for r, w in ((8, 1), (16, 2), (32, 4), (64, 8))]
    for block_d, single, rows, warps in cfgs:
        x_q = torch.empty(x.shape, dtype=torch.int8, device="cuda"); scale = torch.empty(n, device="cuda")
        def fn():
            qk.quantize_rows_kernel[(cdiv(n, rows),)](x, x_q, scale, n, dim, x.stride(0), x_q.stride(0),
                QMAX_VALUE=127.0, TO_INT8=True, BLOCK_ROWS=rows, BLOCK_D=block_d, SINGLE_CHUNK=single, num_warps=warps)
        fn()
        same = torch.equal(x_q, ref_q) and torch.equal(scale, ref_s)
        ms = statistics.median(triton.testing.do_bench(fn, warmup=10, rep=100) for _ in range(3))
        row = dict(dim=dim, block_d=block_d, single=single, rows=rows, warps=warps, ms=ms, same=same,
                   gbps=(n * dim * 3 + n * 4) / ms / 1e6)
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    del x
json.dump(rows_out, open(os.path.join(out, "q96.json"), "w"), indent=1)
