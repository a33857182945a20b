"""Probe, not a library path: a Gluon MaxSim forward (TMA tiles, mbarrier ring, async wgmma) beside lik's Triton one.

    PYTHONPATH=src python3 benchmarks/gluon_probe.py [--rounds 2] [--fp8] [--out DIR]
    (Hopper GPU; writes gluon_probe.json, or gluon_probe_fp8.json with --fp8)

Question: is the gap between lik's forward and the cuBLAS rate a limit of the hardware, or of what
Triton's pipeliner makes of the tile loop (cp.async tiles with a CTA barrier per tile, each wgmma waited for at
once)? The kernel here has lik's loop structure (one program per (row block, document); the row max, and with
ARGMAX the lowest winning token, per tile) written in Gluon, Triton's lower-level dialect, where the schedule is
explicit: the query block and a ring of STAGES document tiles arrive by TMA, each with its mbarrier; a tile's
buffer is refilled as soon as the wgmma that read it has completed; only the last (ragged) tile pays the -inf
select. OVERLAP=True also issues tile t's wgmma before reducing tile t-1 (two accumulators), the
FlashAttention-3 way of hiding the reduction under the tensor cores. NaN semantics are not reproduced (random
data). Each variant is checked against lik (scores, and winners against lik's argmax forward) and timed with
do_bench, alternating with lik for ``--rounds`` rounds. Gluon has no CPU interpreter, which is why this stays a
probe (benchmarks/NOTES.md, "What bounds the compute-bound gap")."""

import json
import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def fold(sim, cols, doc_len, best, key, RAGGED: gl.constexpr, ARGMAX: gl.constexpr, scale_ptr=None,
         SCALED: gl.constexpr = False):
    """lik's per-tile step: row max, and the lowest token equal to it where the max improves (key = 2 * token).
    With SCALED (8-bit rows), each column is first multiplied by its token's fp32 scale, loaded straight into the
    accumulator's column layout (no exchange through shared memory)."""
    if SCALED:
        col_scale = gl.load(scale_ptr + cols, mask=cols < doc_len, other=0.0)
        sim = sim * gl.expand_dims(col_scale, 0)
    if RAGGED:
        sim = gl.where(gl.expand_dims(cols < doc_len, 0), sim, float("-inf"))
    tb = gl.max(sim, axis=1)
    if ARGMAX:
        tk = gl.min(gl.where(sim == gl.expand_dims(tb, 1), gl.expand_dims(cols * 2, 0), 2147483647), axis=1)
        key = gl.where(tb > best, tk, key)
    return gl.maximum(best, tb), key


@gluon.jit
def gl_maxsim_kernel(q_desc, d_desc, out_ptr, key_ptr, q_len, doc_len, n_row_blocks,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DIM: gl.constexpr, STAGES: gl.constexpr,
                     ARGMAX: gl.constexpr, OVERLAP: gl.constexpr, num_warps: gl.constexpr,
                     q_scale_ptr=None, d_scale_ptr=None, SCALED: gl.constexpr = False, INSTR_K: gl.constexpr = 16):
    """Per (row block, document): ``out[doc, row block]`` = the block's sum of row maxima; ``key[doc, token]``.
    SCALED: float8 rows with per-token scales (``d_scale [B, Ld]``, ``q_scale [Lq]``), lik's 8-bit contract."""
    pid = gl.program_id(0)
    rb = pid % n_row_blocks
    doc = pid // n_row_blocks
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, INSTR_K])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, DIM], q_desc.layout)
    d_smem = gl.allocate_shared_memory(d_desc.dtype, [STAGES, BLOCK_N, DIM], d_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(qbar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    mbarrier.expect(qbar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [rb * BLOCK_M, 0], qbar, q_smem)
    n_tiles = (doc_len + BLOCK_N - 1) // BLOCK_N
    base = doc * doc_len
    doc_scales = d_scale_ptr
    if SCALED:
        doc_scales = d_scale_ptr + base
    for s in gl.static_range(STAGES):
        pred = s < n_tiles
        mbarrier.expect(bars.index(s), d_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(d_desc, [base + s * BLOCK_N, 0], bars.index(s), d_smem.index(s), pred=pred)
    mbarrier.wait(qbar, phase=0)
    best = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_layout)
    key = gl.full([BLOCK_M], 2147483647, gl.int32, layout=row_layout)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma_layout)
    cols0 = gl.arange(0, BLOCK_N, layout=col_layout)
    # Tile 0's wgmma is issued before the loop: each iteration then reduces the tile before its own.
    mbarrier.wait(bars.index(0), 0)
    prev = warpgroup_mma(q_smem, d_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
    for t in range(1, n_tiles):
        buf = t % STAGES
        mbarrier.wait(bars.index(buf), (t // STAGES) & 1)
        if OVERLAP:
            cur = warpgroup_mma(q_smem, d_smem.index(buf).permute((1, 0)), zero, use_acc=False, is_async=True)
            prev = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))
        else:
            prev = warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
        # tile t-1's buffer is free: load tile t-1+STAGES into it
        nt = t - 1 + STAGES
        ns = nt % STAGES
        pred = nt < n_tiles
        mbarrier.expect(bars.index(ns), d_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(d_desc, [base + nt * BLOCK_N, 0], bars.index(ns), d_smem.index(ns), pred=pred)
        best, key = fold(prev, (t - 1) * BLOCK_N + cols0, doc_len, best, key, False, ARGMAX, doc_scales, SCALED)
        if OVERLAP:
            prev = cur
        else:
            prev = warpgroup_mma(q_smem, d_smem.index(buf).permute((1, 0)), zero, use_acc=False, is_async=True)
    prev = warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
    best, key = fold(prev, (n_tiles - 1) * BLOCK_N + cols0, doc_len, best, key, True, ARGMAX, doc_scales, SCALED)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    mbarrier.invalidate(qbar)
    rows = rb * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)
    if SCALED:
        best = best * gl.load(q_scale_ptr + rows, mask=rows < q_len, other=0.0)
    gl.store(out_ptr + doc * n_row_blocks + rb, gl.sum(gl.where(rows < q_len, best, 0.0), axis=0))
    if ARGMAX:
        gl.store(key_ptr + doc * q_len + rows, key, mask=rows < q_len)


def run(Q, D, block_m, block_n, stages, argmax, overlap, warps, descs):
    """Scores ``[B]`` of one query ``Q [Lq, 128]`` (fp16) against ``D [B, Ld, 128]``, and the int32 keys."""
    lq, dim = Q.shape
    b, ld, _ = D.shape
    nrb = triton.cdiv(lq, block_m)
    out = torch.empty(b * nrb, device=Q.device)
    keys = torch.empty(b * lq, dtype=torch.int32, device=Q.device)
    q_desc, d_desc = descs
    gl_maxsim_kernel[(nrb * b,)](q_desc, d_desc, out, keys, lq, ld, nrb, BLOCK_M=block_m, BLOCK_N=block_n, DIM=dim,
                                 STAGES=stages, ARGMAX=argmax, OVERLAP=overlap, num_warps=warps)
    return out.view(b, nrb).sum(1), keys


def run_scaled(Q8, D8, q_scale, d_scale, block_m, block_n, stages, overlap, warps, descs):
    """Scores ``[B]`` of one float8 query ``Q8 [Lq, 128]`` against float8 ``D8 [B, Ld, 128]`` with their scales."""
    lq, dim = Q8.shape
    b, ld, _ = D8.shape
    nrb = triton.cdiv(lq, block_m)
    out = torch.empty(b * nrb, device=Q8.device)
    gl_maxsim_kernel[(nrb * b,)](*descs, out, out, lq, ld, nrb, BLOCK_M=block_m, BLOCK_N=block_n, DIM=dim,
                                 STAGES=stages, ARGMAX=False, OVERLAP=overlap, num_warps=warps, q_scale_ptr=q_scale,
                                 d_scale_ptr=d_scale, SCALED=True, INSTR_K=32)
    return out.view(b, nrb).sum(1)


def make_descs(Q, D, block_m, block_n, dtype=gl.float16):
    """TMA descriptors of the query block and of the document tiles (documents flattened to rows)."""
    lq, dim = Q.shape
    flat = D.view(-1, dim)
    q_layout = gl.NVMMASharedLayout.get_default_for([block_m, dim], dtype)
    d_layout = gl.NVMMASharedLayout.get_default_for([block_n, dim], dtype)
    return (TensorDescriptor(Q, [lq, dim], [dim, 1], [block_m, dim], q_layout),
            TensorDescriptor(flat, list(flat.shape), [dim, 1], [block_n, dim], d_layout))


def time_rounds(name, runs, row, res, rounds, path):
    """Time every entry of ``runs`` once per round (alternating), keep the medians in ``row``, print each one's
    best and rewrite the JSON at ``path``."""
    for _ in range(rounds):
        for tag, fn in runs.items():
            row.setdefault(tag, []).append(triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median"))
    res[name] = row
    best = {t: min(v) for t, v in row.items() if isinstance(v, list)}
    print(name, {t: round(v, 4) for t, v in sorted(best.items(), key=lambda x: x[1])}, flush=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


def main():
    import argparse

    import lik
    from lik.ops.maxsim.forward import maxsim_forward
    from lik.ops.maxsim.validation import MaxSimInputs

    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--fp8", action="store_true", help="float8 rows with per-token scales (lik's 8-bit contract)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.fp8:
        return fp8_main(args)
    shapes = {"medium": (128, 1024, 1000), "visual": (512, 1024, 1000), "colpali": (1024, 1024, 1000),
              "long-doc": (32, 1024, 1000)}
    variants = [(128, 64, 3, 8), (256, 64, 3, 8), (128, 64, 3, 4), (64, 64, 4, 4)]

    res = {"meta": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}}
    for name, (lq, ld, b) in shapes.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        Q = torch.nn.functional.normalize(torch.randn(lq, 128, device="cuda", generator=g), dim=-1).half()
        D = torch.nn.functional.normalize(torch.randn(b, ld, 128, device="cuda", generator=g), dim=-1).half()
        ref = lik.maxsim(Q, D)
        inputs = MaxSimInputs.build(Q, D)
        with_argmax = lq >= 512
        ref_keys = maxsim_forward(inputs, store_argmax=True)[1].long().flatten() if with_argmax else None
        runs = {"lik": lambda: lik.maxsim(Q, D)}
        if with_argmax:
            runs["lik_argmax"] = lambda: maxsim_forward(inputs, store_argmax=True)
        row = {}
        for bm, bn, st, w in variants:
            if (lq < 64) != (bm == 64) or bm > max(lq, 128):
                continue
            descs = make_descs(Q, D, bm, bn)
            for argmax in ((False, True) if with_argmax else (False,)):
                for overlap in (False, True):
                    tag = f"gl_m{bm}n{bn}s{st}w{w}{'_argmax' if argmax else ''}{'_overlap' if overlap else ''}"
                    s, k = run(Q, D, bm, bn, st, argmax, overlap, w, descs)
                    row[tag + "_scores_ok"] = bool(torch.allclose(s, ref, rtol=1e-4, atol=1e-3))
                    if argmax:
                        row[tag + "_winners_equal"] = bool(torch.equal(k.long() >> 1, ref_keys))
                    runs[tag] = (lambda bm=bm, bn=bn, st=st, argmax=argmax, overlap=overlap, w=w, descs=descs:
                                 run(Q, D, bm, bn, st, argmax, overlap, w, descs))
        time_rounds(name, runs, row, res, args.rounds, os.path.join(args.out, "gluon_probe.json"))
        print("  checks", all(v for k, v in row.items() if k.endswith(("_ok", "_equal"))), flush=True)


def fp8_main(args):
    """float8 ColPali / visual shapes: lik fp16 and fp8 beside the Gluon schedule with scales loaded in the
    accumulator's layout, without and with the overlap of one tile's fold with the next tile's wgmma."""
    import lik

    shapes = {"visual": (512, 1024, 1000), "colpali": (1024, 1024, 1000), "colpali-10k": (1024, 1024, 10000)}
    variants = [(128, 128, 3, 4), (128, 64, 3, 4), (128, 64, 4, 4), (128, 128, 3, 8), (128, 64, 3, 8)]
    res = {"meta": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}}
    for name, (lq, ld, b) in shapes.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        Q = torch.nn.functional.normalize(torch.randn(lq, 128, device="cuda", generator=g), dim=-1).half()
        D = torch.nn.functional.normalize(torch.randn(b, ld, 128, device="cuda", generator=g), dim=-1).half()
        Q8, q_scale = lik.quantize(Q, torch.float8_e4m3fn)
        D8, d_scale = lik.quantize(D, torch.float8_e4m3fn)
        ref = lik.maxsim(Q8, D8, q_scale=q_scale, d_scale=d_scale)
        runs = {"lik_fp16": lambda: lik.maxsim(Q, D),
                "lik_fp8": lambda: lik.maxsim(Q8, D8, q_scale=q_scale, d_scale=d_scale)}
        row = {}
        for bm, bn, st, w in variants:
            descs = make_descs(Q8, D8, bm, bn, gl.float8e4nv)
            for overlap in (False, True):
                tag = f"gl_m{bm}n{bn}s{st}w{w}{'_overlap' if overlap else ''}"
                try:
                    got = run_scaled(Q8, D8, q_scale, d_scale, bm, bn, st, overlap, w, descs)
                except Exception as e:  # a variant the compiler rejects is recorded, not fatal
                    row[tag + "_error"] = repr(e)[:300]
                    continue
                row[tag + "_scores_ok"] = bool(torch.allclose(got, ref, rtol=1e-4, atol=1e-3))
                runs[tag] = (lambda bm=bm, bn=bn, st=st, overlap=overlap, w=w, descs=descs:
                             run_scaled(Q8, D8, q_scale, d_scale, bm, bn, st, overlap, w, descs))
        time_rounds(name, runs, row, res, args.rounds, os.path.join(args.out, "gluon_probe_fp8.json"))
        print("  checks", {k: v for k, v in row.items() if k.endswith(("_ok", "_error"))}, flush=True)


if __name__ == "__main__":
    main()
