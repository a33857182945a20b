"""d = 96 against d = 128: lik.quantize and lik.maxsim per byte (diagnostic)."""
import json, os, statistics, sys, torch, triton
import lik
out = sys.argv[1]
def bench(fn):
    fn(); torch.cuda.synchronize()
    return statistics.median(triton.testing.do_bench(fn, warmup=10, rep=100) for _ in range(3))
rows = []
def record(what, dim, ms, nbytes):
    rows.append(dict(what=what, dim=dim, ms=ms, gbps=nbytes / ms / 1e6))
    print(f"{what:40} d {dim:4} {ms:8.4f} ms {nbytes / ms / 1e6:8.0f} GB/s", flush=True)
for dim in (96, 128, 64, 80):
    n = 384_000_000 // dim
    x = torch.randn(n, dim, device="cuda", dtype=torch.float16)
    for dt in (torch.int8, torch.float8_e4m3fn):
        record(f"quantize {str(dt).split('.')[-1]}", dim, bench(lambda: lik.quantize(x, dt)), n * dim * 3 + n * 4)
    if dim == 96:
        wide = torch.randn(n, 128, device="cuda", dtype=torch.float16)[:, :96]
        record("quantize int8, rows of a [n,128] view", dim, bench(lambda: lik.quantize(wide, torch.int8)), n * dim * 3 + n * 4)
        del wide
    del x
    D = torch.nn.functional.normalize(torch.randn(10000, 300, dim, device="cuda"), dim=-1).half()
    Q = torch.nn.functional.normalize(torch.randn(32, dim, device="cuda"), dim=-1).half()
    record("maxsim fp16 textual B10000", dim, bench(lambda: lik.maxsim(Q, D)), D.numel() * 2)
    Dq, ds = lik.quantize(D, torch.int8); Qq, qs = lik.quantize(Q, torch.int8)
    record("maxsim int8 textual B10000", dim, bench(lambda: lik.maxsim(Qq, Dq, q_scale=qs, d_scale=ds)), Dq.numel() + ds.numel() * 4)
    del D, Dq
    D = torch.nn.functional.normalize(torch.randn(1000, 1024, dim, device="cuda"), dim=-1).half()
    Q = torch.nn.functional.normalize(torch.randn(1024, dim, device="cuda"), dim=-1).half()
    ms = bench(lambda: lik.maxsim(Q, D))
    rows.append(dict(what="maxsim fp16 ColPali B1000", dim=dim, ms=ms, tflops=2 * 1024 * 1024 * 1000 * dim / ms / 1e9))
    print(f"{'maxsim fp16 ColPali B1000':40} d {dim:4} {ms:8.4f} ms {2 * 1024 * 1024 * 1000 * dim / ms / 1e9:8.0f} TFLOP/s", flush=True)
    del D
json.dump(rows, open(os.path.join(out, "d96.json"), "w"), indent=1)
