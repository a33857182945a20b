"""Probe (device): does loading document tiles (and their scales) through TMA descriptors speed up the 8-bit
compute-bound MaxSim loop? A minimal kernel: a resident 128-row query block against one document per program,
tile product, column scale, row max; one sum per (row block, document). Timed beside lik's shipped fp8 / fp16
at ColPali B = 1 000 (Q 1024 x 128, D 1000 x 1024 x 128). Prints a table; JSON to argv[1]."""
import json, sys, itertools
import torch, triton, triton.language as tl
import lik


@triton.jit
def probe_kernel(q_ptr, d_ptr, qs_ptr, ds_ptr, out_ptr, n_rows, n_docs, doc_len,
                 DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, LOADER: tl.constexpr,
                 D_DESC: tl.constexpr, S_MODE: tl.constexpr, PROMOTE: tl.constexpr = 0):
    pid_m = tl.program_id(0)
    doc = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    offs_k = tl.arange(0, DIM)
    q = tl.load(q_ptr + rows[:, None].to(tl.int64) * DIM + offs_k[None, :])
    if D_DESC:
        d_desc = tl.make_tensor_descriptor(d_ptr, [n_docs * doc_len, DIM], [DIM, 1], [BN, DIM])
    if S_MODE == 2:
        s_desc = tl.make_tensor_descriptor(ds_ptr, [n_docs * doc_len], [1], [BN])
    best = tl.full((BM,), float("-inf"), tl.float32)
    base = doc.to(tl.int64) * doc_len
    for start in tl.range(0, doc_len, BN):
        if D_DESC:
            t = d_desc.load([(base + start).to(tl.int32), 0])
        else:
            cols = base + start + tl.arange(0, BN)
            t = tl.load(d_ptr + cols[:, None] * DIM + offs_k[None, :])
        if LOADER == 1:
            s = tl.dot(q, t.T, out_dtype=tl.int32).to(tl.float32)
        elif PROMOTE:
            s = tl.dot(q, t.T, max_num_imprecise_acc=PROMOTE)
        else:
            s = tl.dot(q, t.T)
        if S_MODE == 1:
            s = s * tl.load(ds_ptr + base + start + tl.arange(0, BN))[None, :]
        elif S_MODE == 2:
            s = s * s_desc.load([(base + start).to(tl.int32)])[None, :]
        best = tl.maximum(best, tl.max(s, 1), propagate_nan=tl.PropagateNan.ALL)
    if LOADER != 0:
        best = best * tl.load(qs_ptr + rows)
    tl.store(out_ptr + pid_m * n_docs + doc, tl.sum(best, 0))


def run_probe(q, d, qs, ds, *, bm=128, bn=128, d_desc=True, s_mode=1, warps=4, stages=3, loader=2):
    n_rows, dim = q.shape
    n_docs, doc_len, _ = d.shape
    grid = (n_rows // bm, n_docs)
    out = torch.empty(grid, device=q.device, dtype=torch.float32)
    probe_kernel[grid](q, d, qs, ds, out, n_rows, n_docs, doc_len, DIM=dim, BM=bm, BN=bn, LOADER=loader,
                       D_DESC=d_desc, S_MODE=s_mode, num_warps=warps, num_stages=stages)
    return out.sum(0)


def main(out_path):
    triton.set_allocator(lambda size, align, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    torch.manual_seed(0)
    nq, ld, b, dim = 1024, 1024, 1000, 128
    Q = torch.nn.functional.normalize(torch.randn(nq, dim, device="cuda"), dim=-1).half()
    D = torch.nn.functional.normalize(torch.randn(b, ld, dim, device="cuda"), dim=-1).half()
    bench = lambda f: triton.testing.do_bench(f, warmup=50, rep=300, return_mode="median")  # noqa: E731
    rows = []
    ref16 = lik.maxsim(Q, D)
    for dtype, loader in ((torch.float8_e4m3fn, 2), (torch.int8, 1)):
        q8, qs = lik.quantize(Q, dtype)
        d8, ds = lik.quantize(D, dtype)
        ref = lik.maxsim(q8, d8, q_scale=qs, d_scale=ds)
        name = "fp8" if loader == 2 else "int8"
        t_lik = bench(lambda: lik.maxsim(q8, d8, q_scale=qs, d_scale=ds))
        rows.append(dict(method=f"lik {name} shipped", ms=t_lik, err=0.0))
        variants = [dict(d_desc=dd, s_mode=sm, bn=bn, stages=st, warps=w)
                    for dd, sm, bn, st, w in itertools.product((False, True), (1, 2, 0), (128,), (3,), (4,))]
        variants += [dict(d_desc=True, s_mode=1, bn=bn, stages=st, warps=w)
                     for bn, st, w in ((128, 4, 4), (128, 2, 4), (64, 4, 4), (256, 2, 8), (128, 3, 8))]
        for v in variants:
            label = f"probe {name} {'tma' if v['d_desc'] else 'ptr'} scales={['none', 'ptr', 'tma'][v['s_mode']]} bn={v['bn']} st={v['stages']} w={v['warps']}"
            try:
                got = run_probe(q8, d8, qs, ds, loader=loader, **v)
                err = (got - ref).abs().max().item() if v["s_mode"] else float("nan")
                t = bench(lambda: run_probe(q8, d8, qs, ds, loader=loader, **v))
            except Exception as e:  # a variant that does not compile is reported, not fatal
                print(label, "FAILED", str(e)[:200], flush=True)
                continue
            rows.append(dict(method=label, ms=t, err=err, **v))
            print(f"{label:60} {t:.4f} ms  err {err:.2e}", flush=True)
    t16 = bench(lambda: lik.maxsim(Q, D))
    rows.append(dict(method="lik fp16 shipped", ms=t16, err=0.0))
    json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   rows=rows), open(out_path, "w"), indent=1)
    print(f"\n{'method':60} {'ms':>8} {'x fp16':>7}")
    for r in rows:
        print(f"{r['method']:60} {r['ms']:8.4f} {t16 / r['ms']:7.2f}")


if __name__ == "__main__":
    main(sys.argv[1])
