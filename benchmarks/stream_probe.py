"""What read rate can a persistent tile loop reach on the 8-bit textual (or long-doc) corpus? (GPU)

    PYTHONPATH=src:benchmarks python3 benchmarks/stream_probe.py --out $OUT [--trees head=../head/src] [--doc-len 1024]

One int8 query of 32 tokens against B documents of 300 tokens (``--doc-len``; d = 128, fp32 scales per token) is
a cell where lik's int8 forward is memory-bound. This times, in one process with ``do_bench`` medians (L2 flushed,
as the benchmark times; CUDA-graph replays, so no host path) and interleaved rounds:

* ``read flat``: ``read_ceiling.py``'s kernel over the rows (as int32 words) and the scales (32 KB per program, one
  wave after another): what reading the bytes costs with no loop at all;
* ``loop ptr NxW/S/P``: lik's loop structure without its arithmetic: persistent programs (``P`` per SM) walking
  documents ``doc``, ``doc + programs``, ..., each in ``N``-token tiles (the last one ending at the document's end),
  ``W`` warps, ``S`` pipeline stages, tiles loaded by pointer (``cp.async``), scales a tile ahead; each tile is
  folded into a running sum so that nothing is dropped;
* ``loop tma NxW/S/P``: the same with tiles loaded through a tensor descriptor (TMA);
* ``read persistent PxS``: the same bytes read by ``P`` programs per SM, each walking 32 KB blocks with ``S``
  pipeline stages (``--reads``);
* ``read torch sum``: ``torch.sum`` of the rows (as int32 words) and of the scales;
* ``read cuda ldg`` / ``read cuda ldcs``: a CUDA C++ kernel (CuPy's NVRTC, where CuPy is installed) reading the
  rows and the scales as 16-byte vectors, eight in flight per thread, a full-occupancy grid; ``ldg`` loads through
  the read-only path, ``ldcs`` marks the lines evict-first (whether the dirty lines that the L2 flush leaves are
  still written back inside the timed call: measured, they are);
* ``lik``: ``lik.maxsim`` of the quantized operands, from this tree and from each ``--trees NAME=PATH``;
* ``flash-maxsim int8x8``: the peer's 8-bit scorer on its own quantization (fp16 scales: 1.5% fewer bytes), where
  it is installed (the benchmark's method, ``lik.bench.methods``).

Writes ``stream_probe.json``; prints one line per method (median ms, GB/s of the rows and scales, rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import triton
import triton.language as tl

from ab_trees import graph_replay, load_lik
from read_ceiling import read_kernel


@triton.jit
def stream_kernel(rows_ptr, rows_desc, scale_ptr, out_ptr, n_docs, doc_len, n_programs,
                  WORDS: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr):
    """Rows as int32 words ``[n_docs * doc_len, WORDS]`` (4 int8 features a word)."""
    pid = tl.program_id(0)
    my_docs = tl.cdiv(n_docs - pid, n_programs)
    tiles = tl.cdiv(doc_len, BLOCK_N)
    acc = tl.zeros((BLOCK_N, WORDS), tl.int32)
    scale_acc = tl.zeros((BLOCK_N,), tl.float32)
    doc = pid
    start = 0
    offs_n = tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, WORDS)
    for _ in tl.range(0, my_docs * tiles):
        first = tl.maximum(tl.minimum(start, doc_len - BLOCK_N), 0)
        row = doc.to(tl.int64) * doc_len + first
        if TMA:
            tile = rows_desc.load([row.to(tl.int32), 0])
        else:
            tile = tl.load(rows_ptr + (row + offs_n)[:, None] * WORDS + offs_w[None, :])
        scales = tl.load(scale_ptr + row + offs_n)
        acc ^= tile
        scale_acc += scales
        last = start + BLOCK_N >= doc_len
        doc = tl.where(last, doc + n_programs, doc)
        start = tl.where(last, 0, start + BLOCK_N)
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0).to(tl.float32) + tl.sum(scale_acc, axis=0))


@triton.jit
def read_persistent_kernel(src_ptr, out_ptr, n_words, n_programs, BLOCK_SIZE: tl.constexpr,
                           STAGES: tl.constexpr):
    """Program ``pid`` reads blocks ``pid``, ``pid + n_programs``, ... of ``BLOCK_SIZE`` int32 words."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK_SIZE)
    acc = tl.zeros((BLOCK_SIZE,), tl.int32)
    for block in tl.range(pid, tl.cdiv(n_words, BLOCK_SIZE), n_programs, num_stages=STAGES):
        word = block * BLOCK_SIZE + offs.to(tl.int64)  # int32 product: probes stay below 2**31 words
        acc ^= tl.load(src_ptr + word, mask=word < n_words, other=0)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


CUDA_READ_SOURCE = r"""
extern "C" __global__ void read_two(const uint4* __restrict__ rows, unsigned long long n_rows,
                                    const uint4* __restrict__ scales, unsigned long long n_scales,
                                    unsigned int* out) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int acc = 0;
    unsigned long long i = first;
    for (; i + 7 * stride < n_rows; i += 8 * stride) {
        uint4 v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = LOAD(rows + i + k * stride);
#pragma unroll
        for (int k = 0; k < 8; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
    }
    for (; i < n_rows; i += stride) { uint4 v = LOAD(rows + i); acc ^= v.x ^ v.y ^ v.z ^ v.w; }
    for (i = first; i < n_scales; i += stride) { uint4 v = LOAD(scales + i); acc ^= v.x ^ v.y ^ v.z ^ v.w; }
    if (acc == 0x9e3779b9u) out[0] = acc;  // never true in practice; keeps every load live
}
"""


def cuda_readers(rows, scales):
    """``{name: fn}`` of the CUDA C++ reads of ``rows`` and ``scales`` (bytes divisible by 16), or a reason."""
    try:
        import cupy
    except ImportError:
        return {}, "CuPy is not installed"
    if rows.numel() * rows.element_size() % 16 or scales.numel() * scales.element_size() % 16:
        return {}, "sizes are not whole 16-byte vectors"
    rows_c, scales_c = cupy.asarray(rows.reshape(-1)), cupy.asarray(scales.reshape(-1))
    out = cupy.zeros(1, dtype=cupy.uint32)
    n_rows = rows.numel() * rows.element_size() // 16
    n_scales = scales.numel() * scales.element_size() // 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    readers = {}
    for name, load in (("ldg", "__ldg"), ("ldcs", "__ldcs")):
        kernel = cupy.RawKernel(f"#define LOAD {load}\n" + CUDA_READ_SOURCE, "read_two")

        def read(kernel=kernel):
            with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                kernel((sms * 8,), (256,), (rows_c, cupy.uint64(n_rows), scales_c, cupy.uint64(n_scales), out))
        readers[f"read cuda {name}"] = read
    return readers, None


def read_methods(words, scales, persistent_specs):
    """The read-only kernels of the corpus: ``read_ceiling``'s flat read, persistent reads, ``torch.sum``, CUDA."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n_row_programs = triton.cdiv(words.numel(), 8192)
    flat = torch.empty(n_row_programs + triton.cdiv(scales.numel(), 8192), device="cuda")

    def read_flat():
        read_kernel[(n_row_programs,)](words, flat, words.numel(), BLOCK_SIZE=8192)
        read_kernel[(triton.cdiv(scales.numel(), 8192),)](scales, flat[n_row_programs:], scales.numel(),
                                                                BLOCK_SIZE=8192)

    methods = {"read flat": read_flat}
    row_words, scale_words = words.reshape(-1), scales.view(torch.int32).reshape(-1)
    for spec in filter(None, persistent_specs.split(",")):
        per_sm, stages = (int(v) for v in spec.split("x"))
        programs = per_sm * sms
        out = torch.empty(2 * programs, dtype=torch.int32, device="cuda")

        def run(programs=programs, stages=stages, out=out):
            for part, (source, n) in enumerate(((row_words, row_words.numel()), (scale_words, scale_words.numel()))):
                read_persistent_kernel[(programs,)](source, out[part * programs:], n, programs, BLOCK_SIZE=8192,
                                                    STAGES=stages)
        methods[f"read persistent {spec}"] = run
    methods["read torch sum"] = lambda: (row_words.sum(dtype=torch.int32), scales.sum())
    readers, reason = cuda_readers(words, scales)
    if reason:
        print(f"read cuda: {reason}", flush=True)
    methods.update(readers)
    return methods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--docs", type=int, default=10000)
    parser.add_argument("--doc-len", type=int, default=300, help="tokens per document (1 024: the long-doc cell)")
    parser.add_argument("--reads", default="4x3,8x2", help="comma-separated PxS persistent reads ('' for none)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loops", default="64x2/3/6,64x2/4/6,128x4/3/3,128x4/4/3,64x4/3/3,128x8/3/2,256x8/3/1",
                        help="comma-separated NxW/S/P: tile tokens, warps, stages, programs per SM")
    parser.add_argument("--trees", action="append", default=[], metavar="NAME=PATH")
    args = parser.parse_args()
    from triton.tools.tensor_descriptor import TensorDescriptor

    import lik
    from lik.bench.methods import select_methods
    from lik.bench.shapes import Shape

    torch.manual_seed(0)
    n_docs, doc_len, dim = args.docs, args.doc_len, 128
    q = torch.nn.functional.normalize(torch.randn(32, dim, device="cuda"), dim=-1).half()
    d = torch.nn.functional.normalize(torch.randn(n_docs, doc_len, dim, device="cuda"), dim=-1).half()
    q8, q_scale = lik.quantize(q, torch.int8)
    d8, d_scale = lik.quantize(d, torch.int8)
    methods = {}
    (peer,) = select_methods(["flash-maxsim-int8x8"])
    reason = peer.unavailable_reason(q.device)
    if reason is None:
        shape = Shape("forward", "textual" if doc_len == 300 else "long-doc", 1, 32, doc_len, n_docs)
        peer_operands, peer_score = peer.prepare(shape, q, d), peer.build(shape)
        methods["flash-maxsim int8x8"] = lambda: peer_score(*peer_operands)
    else:
        print(f"flash-maxsim int8x8: {reason}", flush=True)
    del d
    words = d8.view(torch.int32).view(n_docs * doc_len, dim // 4)
    scales = d_scale.reshape(-1)
    n_bytes = d8.numel() + 4 * scales.numel()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    methods.update(read_methods(words, scales, args.reads))
    for spec in filter(None, args.loops.split(",")):
        tiles, rest = spec.split("x")
        warps, stages, per_sm = (int(v) for v in rest.split("/"))
        block_n = int(tiles)
        programs = min(n_docs, per_sm * sms)
        out = torch.empty(programs, device="cuda")
        desc = TensorDescriptor.from_tensor(words, [block_n, dim // 4])
        for tma in (False, True):
            def run(block_n=block_n, warps=warps, stages=stages, programs=programs, out=out, desc=desc, tma=tma):
                stream_kernel[(programs,)](words, desc, scales, out, n_docs, doc_len, programs, WORDS=dim // 4,
                                           BLOCK_N=block_n, TMA=tma, num_warps=warps, num_stages=stages)
            methods[f"loop {'tma' if tma else 'ptr'} {spec}"] = run
    trees = {"lik": lik}
    for spec in args.trees:
        name, _, path = spec.partition("=")
        trees[f"lik {name}"] = load_lik(path, f"lik_{name}")
    for name, module in trees.items():
        methods[name] = lambda module=module: module.maxsim(q8, d8, q_scale=q_scale, d_scale=d_scale)
    replays = {}
    for name, fn in methods.items():
        try:
            replays[name] = graph_replay(fn)
        except Exception as error:  # a loop that does not compile for this machine is reported, not fatal
            print(f"{name}: {type(error).__name__}: {str(error)[:200]}", flush=True)
    times = {name: [] for name in replays}
    for r in range(args.rounds):
        for name in (list(replays) if r % 2 == 0 else list(replays)[::-1]):
            times[name].append(triton.testing.do_bench(replays[name], warmup=25, rep=100, return_mode="median"))
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "docs": n_docs, "doc_len": doc_len, "bytes": n_bytes, "methods": {}}
    for name, values in times.items():
        ms = statistics.median(values)
        record["methods"][name] = {"median_ms": ms, "rounds_ms": values, "GBps": n_bytes / ms / 1e6}
        print(f"{name:>24}: {ms:.4f} ms {n_bytes / ms / 1e6:7.0f} GB/s  rounds "
              + " ".join(f"{v:.4f}" for v in values), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "stream_probe.json"), "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
