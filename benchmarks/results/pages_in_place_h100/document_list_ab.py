"""Documents read in place through an address table against the same documents joined first (GPU).

colpali-engine's per-row shapes: every query token a row (325 rows = 16 queries, 2 554 = 128) against 1 000 bf16
pages of 1 030 tokens, or of 512-1 030 tokens (ragged). Per shape, methods in alternating rounds (the median of
``--rounds`` rounds of ``do_bench``, L2 flushed by ``do_bench``):

* ``in_place``: ``DocumentList.build`` + ``maxsim_document_list`` (the list read where it lies, host checks included);
* ``joined``: ``torch.cat`` of the list, then ``lik.maxsim`` / ``lik.maxsim_packed`` (what the list path did before);
* ``kernel_table``: ``maxsim_document_list`` on a list already built and checked (the table kernel alone);
* ``kernel_strided``: ``lik.maxsim`` / ``lik.maxsim_packed`` on the joined tensor made beforehand (kernel alone).

Same bits asserted between the table and the strided kernels; peak memory above the inputs per method.

    python benchmarks/document_list_ab.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import triton

import lik
from lik.ops.maxsim.document_list import DocumentList, maxsim_document_list


def _peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pages", type=int, default=1000)
    args = parser.parse_args()
    torch.manual_seed(0)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "commit": os.environ.get("LIK_COMMIT", "unknown"), "rounds": args.rounds, "cells": []}
    dim = 128
    for form in ("equal", "ragged"):
        if form == "equal":
            lengths = [1030] * args.pages
        else:
            lengths = torch.randint(512, 1031, (args.pages,), generator=torch.Generator().manual_seed(1)).tolist()
        pages = [torch.nn.functional.normalize(torch.randn(n, dim, device="cuda"), dim=-1).bfloat16()
                 for n in lengths]
        cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
        joined_before = torch.cat(pages)
        for n_rows in (325, 2554):
            q = torch.nn.functional.normalize(torch.randn(n_rows, 1, dim, device="cuda"), dim=-1).bfloat16()

            def strided(joined):
                if form == "equal":
                    return lik.maxsim(q, joined.view(len(pages), lengths[0], dim))
                return lik.maxsim_packed(q, joined, cu, max_seqlen_d=max(lengths))

            built = DocumentList.build(pages, q)
            methods = {
                "in_place": lambda: maxsim_document_list(q, DocumentList.build(pages, q)),
                "joined": lambda: strided(torch.cat(pages)),
                "kernel_table": lambda: maxsim_document_list(q, built),
                "kernel_strided": lambda: strided(joined_before),
            }
            with torch.no_grad():
                assert torch.equal(methods["kernel_table"](), methods["kernel_strided"]())
                for fn in methods.values():
                    fn()
                times = {name: [] for name in methods}
                for _ in range(args.rounds):
                    for name, fn in methods.items():
                        times[name].append(triton.testing.do_bench(fn, warmup=5, rep=100))
                cell = {"pages": form, "rows": n_rows, "n_pages": len(pages), "tokens": sum(lengths),
                        "rounds_ms": times}
                for name, fn in methods.items():
                    cell[f"{name}_ms"] = statistics.median(times[name])
                    cell[f"{name}_peak_mib"] = _peak_mib(fn)
            record["cells"].append(cell)
            print(f"{form:6s} rows {n_rows:5d}: " + " | ".join(
                f"{name} {cell[name + '_ms']:.3f} ms {cell[name + '_peak_mib']:.0f} MiB" for name in methods),
                flush=True)
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
        del joined_before, pages


if __name__ == "__main__":
    main()
