"""How close can any single kernel get to the bandwidth floor at the memory-bound MaxSim shapes?

    python3 benchmarks/read_ceiling.py [--out $OUT]

The harness's floor is minimal bytes over the bandwidth of one large device copy. A forward that reads 77 MB
(textual, B = 1 000) also pays the launch, the ramp-up of the first wave and the tail of the last. This measures
those fixed costs with kernels that do nothing but move the same bytes, in the same way as the harness
(``triton.testing.do_bench`` medians, L2 flushed between calls):

* ``read``: a Triton kernel reading ``N`` bytes (32 KB or 8 KB per program, the faster; one fp32 partial sum
  written per program);
* ``copy``: ``dst.copy_(src)`` of ``N`` bytes (read + write; the harness's bandwidth ceiling at 2 GiB);
* ``empty``: a one-program kernel that does nothing (launch and event overhead).

For each size: time, the harness floor (``N`` / large-copy bandwidth with read + write counted) and the floor
over the time (the best % of floor any kernel reading those bytes once could report). Writes
``read_ceiling.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

SIZES_MB = {
    "textual B 1000 (32 x 300 docs)": 76.8, "long-doc B 1000": 262.1, "textual B 10000": 768.0,
    # the packed corpora of BENCHMARKS.md (lik bench --ops packed: bytes of the real tokens; floors 4.0 / 7.1 / 23.7 us
    # at 4.24 TB/s)
    "varlen corpus ragged": 17.0, "varlen corpus hotpotqa": 30.1, "varlen corpus uniform": 100.5,
    # 8-bit corpora (BENCHMARKS.md, 8-bit): 1-byte rows plus one fp32 scale per token, 300-token documents
    "8-bit textual B 1000": 1000 * 300 * 132 / 1e6, "8-bit textual B 10000": 10000 * 300 * 132 / 1e6,
    # 8-bit long documents (1 024 tokens): the 1-byte rows alone, and with their scales
    "8-bit long-doc B 10000 rows": 10000 * 1024 * 128 / 1e6, "8-bit long-doc B 10000": 10000 * 1024 * 132 / 1e6,
}
BLOCKS = (16384, 4096)  # fp16 elements per program (32 KB, 8 KB): the faster one is reported


@triton.jit
def read_kernel(src_ptr, partial_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    values = tl.load(src_ptr + offs, mask=offs < n_elements, other=0.0)
    tl.store(partial_ptr + tl.program_id(0), tl.sum(values.to(tl.float32), axis=0))


@triton.jit
def empty_kernel(ptr):
    pass


def bench(fn):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    big = torch.empty(1 << 30, dtype=torch.float16, device=dev)  # 2 GiB
    big_dst = torch.empty_like(big)
    copy_ms = bench(lambda: big_dst.copy_(big))
    copy_gbps = 2 * big.numel() * 2 / copy_ms / 1e6
    big_dst = None  # drop it before the smaller sizes (the lambda above closes over it)
    rows = []
    flag = torch.zeros(1, device=dev)
    empty_ms = bench(lambda: empty_kernel[(1,)](flag))
    for name, mb in SIZES_MB.items():
        n = int(mb * 1e6) // 2
        src = big[:n]
        partial = torch.empty(triton.cdiv(n, min(BLOCKS)), dtype=torch.float32, device=dev)
        dst = torch.empty_like(src)
        read_ms = min(
            bench(lambda: read_kernel[(triton.cdiv(n, block),)](src, partial, n, BLOCK_SIZE=block)) for block in BLOCKS
        )
        small_copy_ms = bench(lambda: dst.copy_(src))
        floor_ms = n * 2 / (copy_gbps * 1e6)
        rows.append({"shape": name, "bytes": n * 2, "floor_ms": floor_ms, "read_ms": read_ms,
                     "read_pct_of_floor": 100 * floor_ms / read_ms, "copy_ms": small_copy_ms,
                     "copy_pct_of_floor": 100 * 2 * floor_ms / small_copy_ms})
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "copy_GBps_2GiB": copy_gbps, "empty_kernel_ms": empty_ms}
    with open(os.path.join(args.out, "read_ceiling.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"{meta}")
    print(f"{'bytes of':32} {'floor ms':>9} {'read ms':>9} {'% floor':>8} {'copy ms':>9} {'% floor':>8}")
    for r in rows:
        print(f"{r['shape']:32} {r['floor_ms']:9.4f} {r['read_ms']:9.4f} {r['read_pct_of_floor']:7.0f}% "
              f"{r['copy_ms']:9.4f} {r['copy_pct_of_floor']:7.0f}%")


if __name__ == "__main__":
    main()
