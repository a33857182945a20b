"""Host time of score_multi_vector's steps before the kernel launch (128 / 16 ragged queries, 1 000 pages of 1 030
tokens, bf16): time to the maxsim call, time inside it (the launch), and the rest."""
import json, sys, time, statistics, torch
import lik.integrations.colpali as lc
g = torch.Generator(device="cuda").manual_seed(0)
pages = torch.nn.functional.normalize(torch.randn(1000, 1030, 128, device="cuda", generator=g), dim=-1).bfloat16()
real = lc.maxsim
stamps = {}
def timed(q, d):
    stamps["enter"] = time.perf_counter()
    out = real(q, d)
    stamps["leave"] = time.perf_counter()
    return out
lc.maxsim = timed
res = {}
for nq in (16, 128):
    lengths = torch.randint(18, 23, (nq,), generator=torch.Generator().manual_seed(nq)).tolist()
    queries = [torch.nn.functional.normalize(torch.randn(n, 128, device="cuda", generator=g), dim=-1).bfloat16() for n in lengths]
    pre, inside, total = [], [], []
    for i in range(60):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        lc.score_multi_vector(queries, pages, device="cuda")
        t1 = time.perf_counter()
        if i >= 10:
            pre.append((stamps["enter"] - t0) * 1e6); inside.append((stamps["leave"] - stamps["enter"]) * 1e6); total.append((t1 - t0) * 1e6)
    import triton
    tensor_ms = triton.testing.do_bench(lambda: lc.score_multi_vector(queries, pages, device="cuda"), warmup=3, rep=200)
    page_list = list(pages)
    list_ms = triton.testing.do_bench(lambda: lc.score_multi_vector(queries, page_list, device="cuda"), warmup=3, rep=200)
    res[nq] = dict(before_maxsim_us=statistics.median(pre), maxsim_call_us=statistics.median(inside), total_us=statistics.median(total),
                   do_bench_tensor_ms=tensor_ms, do_bench_list_ms=list_ms)
    print(nq, res[nq], flush=True)
json.dump(res, open(sys.argv[1], "a"), indent=1)
