"""Probe: the 8-bit long-query loop with document tokens as the product's rows (GPU; not a library path).

lik's long-query loop computes ``S = Q_block @ D_tile^T`` ([query rows, tokens]) and multiplies each column by its
token's scale, which reaches the accumulator's layout through shared memory every tile. With the product
transposed, ``S^T = D_tile @ Q_block^T`` ([tokens, query rows]), a token's scale is a row factor: a thread holds
four rows of a 128-row tile, so it loads four scales and nothing is exchanged; the running max is kept per row
slot of the accumulator (the rows a thread holds are folded in registers) and the slots meet once per document.

Times, in one process and alternating: lik fp16 / int8 / fp8 (the shipped kernels), and this probe's int8 / fp8
in both orientations (columns: lik's layout without its features; rows: the transposed one), ColPali and visual
shapes (1 024 / 512 query tokens against B = 1 000 pages of 1 024 tokens, d = 128). Checks each probe against
lik's scores of the same quantized operands.

    python3 benchmarks/tokens_as_rows_probe.py --out OUT
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import lik  # noqa: E402
from probe_harness import (  # noqa: E402
    PAGE_SHAPES, bare_page_max, page_operands, quantized_operands, round_lines, run_record, timed_rounds, write_report,
)


DTYPES = {"both": ((torch.int8, "int8"), (torch.float8_e4m3fn, "fp8")), "fp8": ((torch.float8_e4m3fn, "fp8"),),
          "int8": ((torch.int8, "int8"),)}


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def probe_kernel(
    q_ptr, d_ptr, q_scale_ptr, d_scale_ptr, partial_ptr, n_docs, doc_len, q_len,
    DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INT8: tl.constexpr, TOKENS_AS_ROWS: tl.constexpr,
):
    row_block = tl.program_id(0)
    doc = tl.program_id(1)
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    k = tl.arange(0, DIM)
    q = tl.load(q_ptr + rows[:, None] * DIM + k[None, :])
    doc_base = d_ptr + doc.to(tl.int64) * doc_len * DIM
    scale_base = d_scale_ptr + doc.to(tl.int64) * doc_len
    if TOKENS_AS_ROWS:
        q_t = tl.trans(q)
        # row slot = (warp, lane // 4): tile row = 64 * rep + 16 * warp + 8 * half + lane // 4 (wgmma, 4 warps)
        running = tl.full((32, BLOCK_M), float("-inf"), tl.float32)
        for start in tl.range(0, doc_len, BLOCK_N):
            tokens = start + tl.arange(0, BLOCK_N)
            scale = tl.load(scale_base + tokens)
            d_tile = tl.load(doc_base + tokens[:, None] * DIM + k[None, :])
            if INT8:
                s = tl.dot(d_tile, q_t, out_dtype=tl.int32).to(tl.float32)
            else:
                s = tl.dot(d_tile, q_t, max_num_imprecise_acc=DIM)
            s = s * scale[:, None]
            grouped = tl.reshape(s, (BLOCK_N // 64, 4, 2, 8, BLOCK_M))
            folded = tl.reduce(tl.reduce(grouped, 2, _nan_max), 0, _nan_max)
            running = _nan_max(running, tl.reshape(folded, (32, BLOCK_M)))
        best = tl.reduce(running, 0, _nan_max)
    else:
        best = bare_page_max(q, doc_base, scale_base, doc_len, DIM, BLOCK_M, BLOCK_N, INT8)
    q_scale = tl.load(q_scale_ptr + rows)
    tl.store(partial_ptr + row_block * n_docs + doc, tl.sum(best * q_scale, axis=0))


def probe(q8, q_scale, d8, d_scale, tokens_as_rows, num_stages=3, num_warps=4, block_n=128):
    lq, dim = q8.shape
    n_docs, doc_len, _ = d8.shape
    partial = torch.empty(lq // 128, n_docs, device=q8.device, dtype=torch.float32)
    probe_kernel[(lq // 128, n_docs)](
        q8, d8, q_scale, d_scale, partial, n_docs, doc_len, lq,
        DIM=dim, BLOCK_M=128, BLOCK_N=block_n, INT8=q8.dtype == torch.int8, TOKENS_AS_ROWS=tokens_as_rows,
        num_stages=num_stages, num_warps=num_warps,
    )
    return partial.sum(0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", choices=sorted(DTYPES), default="both")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    results = run_record()
    lines = []
    for name, lq in PAGE_SHAPES.items():
        q, d = page_operands(lq, "cuda")
        methods = {"lik fp16": lambda q=q, d=d: lik.maxsim(q, d)}
        for dtype, tag in DTYPES[args.dtypes]:
            q8, qs, d8, ds, ref = quantized_operands(q, d, dtype)
            for rows, block_n in ((False, 128), (True, 128), (True, 64)):
                got = probe(q8, qs, d8, ds, rows, block_n=block_n)
                err = (got - ref).abs().max().item()
                label = f"{'rows' if rows else 'columns'}{' t64' if block_n == 64 else ''}"
                results["cells"][f"{name} probe {tag} {label} max err"] = err
                lines.append(f"{name} probe {tag} {label}: max |probe - lik| = {err:.3g}")
            methods[f"lik {tag}"] = lambda q8=q8, qs=qs, d8=d8, ds=ds: lik.maxsim(q8, d8, q_scale=qs, d_scale=ds)
            methods[f"probe {tag} columns"] = lambda q8=q8, qs=qs, d8=d8, ds=ds: probe(q8, qs, d8, ds, False)
            methods[f"probe {tag} rows"] = lambda q8=q8, qs=qs, d8=d8, ds=ds: probe(q8, qs, d8, ds, True)
            for stages in (3, 4):
                # 64-token tiles: 64 accumulator registers, four programs per SM
                methods[f"probe {tag} rows t64 s{stages}"] = (
                    lambda q8=q8, qs=qs, d8=d8, ds=ds, s=stages: probe(q8, qs, d8, ds, True, num_stages=s, block_n=64))
        times = timed_rounds(methods, args.rounds)
        results["cells"].update({f"{name} {m}": t for m, t in times.items()})
        lines += round_lines(name, times)
        del d
        torch.cuda.empty_cache()
    write_report(args.out, "tokens_as_rows_probe.json", results, lines)


if __name__ == "__main__":
    main()
