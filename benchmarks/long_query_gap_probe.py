"""Probe: where do lik's 8-bit long-query launches lose to a bare loop of the same instructions per tile? (GPU)

``tokens_as_rows_probe.py``'s bare loop ("columns") ran float8 ColPali B = 1 000 5% faster than ``lik.maxsim``
on an H200 while int8 was 1% slower, with the loop bodies the same instructions. This kernel is that bare loop
with lik's parts switched in one at a time (constexpr flags, lik's own ``@triton.jit`` helpers):

* ``GRID_1D``: a 1-D grid, the row block and document from ``pid % n_row_blocks`` / ``pid // n_row_blocks``
  (lik's launch) instead of a 2-D grid;
* ``LIK_QUERY``: the query rows from ``tile.query_rows`` and loaded through lik's clamped row addresses;
* ``LIK_LOOP``: the document streamed by ``tile.stream_document`` (whole tiles, scales one tile ahead,
  per-class maxima), not the bare loop;
* ``LIK_WRITE``: the document written by ``forward_kernel.write_document`` (query scales loaded up front).

Each variant is checked against ``lik.maxsim`` on the same quantized operands, then timed with ``do_bench``
(alternating rounds, L2 flushed) and with torch.profiler (device time of its kernels alone,
``quantized_kernels.device_kernels``), beside ``lik.maxsim``.
Writes ``long_query_gap_probe.json``.

    PYTHONPATH=src:benchmarks python3 benchmarks/long_query_gap_probe.py [--every-combination] [--rounds N] --out OUT
    # the bare loop and lik's whole launch only, at B = 10 000:
    ... long_query_gap_probe.py --variants "bare,all four" --dtypes fp8 --pages 10000 --out OUT
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch
import triton
import triton.language as tl

import lik
from lik.core.division import divisor_constants
from lik.core.quantized import FP8, INT8, row_scales
from lik.ops.maxsim.forward_kernel import write_document
from lik.ops.maxsim.tile import NO_KEY, group_offsets, query_rows, stream_document
from probe_harness import (
    PAGE_SHAPES, bare_page_max, page_operands, quantized_operands, round_lines, run_record, timed_rounds,
    write_report,
)
from quantized_kernels import device_kernels


@triton.jit
def gap_kernel(
    q_ptr, d_ptr, q_scale_ptr, d_scale_ptr, partial_ptr, n_docs, doc_len, q_len, n_row_blocks, blocks_multiplier,
    blocks_shift,
    DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOADER: tl.constexpr,
    GRID_1D: tl.constexpr, LIK_QUERY: tl.constexpr, LIK_LOOP: tl.constexpr, LIK_WRITE: tl.constexpr,
):
    if GRID_1D:
        pid = tl.program_id(0).to(tl.int64)
        row_block = pid % n_row_blocks
        doc = pid // n_row_blocks
    else:
        row_block = tl.program_id(0)
        doc = tl.program_id(1)
    k = tl.arange(0, DIM)
    if LIK_QUERY:
        query, token, row_in_range, row_valid = query_rows(
            row_block.to(tl.int32), 1, q_len, n_row_blocks, blocks_multiplier, blocks_shift, q_ptr, 0, 0, BLOCK_M, 1,
            False,
        )
        clamped = q_ptr + tl.minimum(query, 0) * q_len * DIM + tl.minimum(token, q_len - 1) * DIM
        q = tl.load(clamped[:, None] + k[None, :])
    else:
        token = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        query = token * 0
        row_in_range = token < q_len
        row_valid = row_in_range
        q = tl.load(q_ptr + token[:, None] * DIM + k[None, :])
    if LIK_WRITE:
        q_scale = row_scales(q_scale_ptr + query * q_len + token, row_valid, LOADER)
    doc_base = d_ptr + doc.to(tl.int64) * doc_len * DIM
    scale_base = d_scale_ptr + doc.to(tl.int64) * doc_len
    if LIK_LOOP:
        best, key, n_valid = stream_document(
            q, q_ptr, row_valid, 1, doc_base, d_ptr, doc_len, DIM, 1, 0,
            tl.full((BLOCK_M,), float("-inf"), tl.float32), tl.full((BLOCK_M,), NO_KEY, tl.int32),
            scale_base, 1,
            DIM, BLOCK_M, BLOCK_N, DIM, 1, False, True, False, False, "ieee", 0, LOADER, True, 0,
        )
    else:
        best = bare_page_max(q, doc_base, scale_base, doc_len, DIM, BLOCK_M, BLOCK_N, LOADER == INT8)
        key = tl.full((BLOCK_M,), NO_KEY, tl.int32)
        n_valid = doc_len
    if LIK_WRITE:
        sum_offsets, sums_in_range = group_offsets(
            row_block.to(tl.int32), 1, n_row_blocks, blocks_multiplier, blocks_shift, n_docs, n_docs, 1,
        )
        write_document(
            best, key, n_valid, row_valid, row_in_range, query, token, sum_offsets, sums_in_range, doc, partial_ptr,
            partial_ptr, 1, 0, 0, 0, 0, q_scale,
            BLOCK_M, 1, True, False, LOADER,
        )
    else:
        q_scale = tl.load(q_scale_ptr + token)
        tl.store(partial_ptr + row_block * n_docs + doc, tl.sum(best * q_scale, axis=0))


FLAGS = ("GRID_1D", "LIK_QUERY", "LIK_LOOP", "LIK_WRITE")
VARIANTS = {"bare": (), **{f"+{f.lower()}": (f,) for f in FLAGS}, "all four": FLAGS}


def every_combination() -> dict:
    """All 16 subsets of :data:`FLAGS` (``--every-combination``), named by their flags."""
    return {"+".join(f.lower() for f in flags) or "bare": flags
            for flags in itertools.chain.from_iterable(itertools.combinations(FLAGS, n) for n in range(5))}


def gap(q8, q_scale, d8, d_scale, flags):
    lq, dim = q8.shape
    n_docs, doc_len, _ = d8.shape
    n_row_blocks = lq // 128
    partial = torch.empty(n_row_blocks, n_docs, device=q8.device, dtype=torch.float32)
    grid = (n_row_blocks * n_docs,) if "GRID_1D" in flags else (n_row_blocks, n_docs)
    gap_kernel[grid](
        q8, d8, q_scale, d_scale, partial, n_docs, doc_len, lq, n_row_blocks, *divisor_constants(n_row_blocks),
        DIM=dim, BLOCK_M=128, BLOCK_N=128, LOADER=INT8 if q8.dtype == torch.int8 else FP8,
        **{f: f in flags for f in FLAGS}, num_stages=3, num_warps=4,
    )
    return partial.sum(0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--shapes", default="colpali,visual")
    parser.add_argument("--dtypes", default="fp8,int8")
    parser.add_argument("--every-combination", action="store_true", help="time all 16 subsets of the flags")
    parser.add_argument("--variants", default=None, help="comma-separated variant names (default: all)")
    parser.add_argument("--pages", type=int, default=1000, help="documents of 1 024 tokens (B)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    dev = "cuda"
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device=dev)
    results = run_record(commit=os.environ.get("LIK_COMMIT", "unknown"), pages=args.pages)
    lines = []
    variants = every_combination() if args.every_combination else VARIANTS
    if args.variants:
        variants = {name: variants[name] for name in args.variants.split(",")}
    for name in args.shapes.split(","):
        q, d = page_operands(PAGE_SHAPES[name], dev, n_pages=args.pages)
        methods = {"lik fp16": lambda q=q, d=d: lik.maxsim(q, d)}
        for dtype, tag in ((torch.float8_e4m3fn, "fp8"), (torch.int8, "int8")):
            if tag not in args.dtypes.split(",") or (name == "visual" and dtype == torch.int8):
                continue
            q8, qs, d8, ds, ref = quantized_operands(q, d, dtype)
            methods[f"lik {tag}"] = lambda q8=q8, qs=qs, d8=d8, ds=ds: lik.maxsim(q8, d8, q_scale=qs, d_scale=ds)
            for variant, flags in variants.items():
                got = gap(q8, qs, d8, ds, flags)
                err = (got - ref).abs().max().item()
                results["cells"][f"{name} {tag} {variant} max err"] = err
                if not err <= 1e-3:
                    raise SystemExit(f"{name} {tag} {variant}: max |probe - lik| = {err}")
                methods[f"{tag} {variant}"] = lambda q8=q8, qs=qs, d8=d8, ds=ds, f=flags: gap(q8, qs, d8, ds, f)
        times = timed_rounds(methods, args.rounds, alternate=True)
        device = {m: {kernel: cell["us"] for kernel, cell in device_kernels(fn, flush).items()}
                  for m, fn in methods.items()}
        results["cells"].update({f"{name} {m}": dict(do_bench_ms=t, kernels_us=device[m]) for m, t in times.items()})
        lines += round_lines(name, times, lambda m: f"  main kernel {max(device[m].values(), default=0.0):7.1f} us  "
                                                    f"all kernels {sum(device[m].values()):7.1f} us")
        del d
        torch.cuda.empty_cache()
    write_report(args.out, "long_query_gap_probe.json", results, lines)


if __name__ == "__main__":
    main()
