"""What the 8-bit long-query probes share (``tokens_as_rows_probe.py``, ``long_query_gap_probe.py``; GPU).

The page shapes (a long query against B = 1 000 pages of 1 024 tokens, d = 128), their quantized operands with
``lik.maxsim``'s scores as the reference, the bare 8-bit loop both probes start from, ``do_bench`` rounds over a
set of methods, and the report.
"""

from __future__ import annotations

import json
import os

import torch
import triton
import triton.language as tl

import lik
from lik.core.reductions import nan_max

__all__ = [
    "PAGE_SHAPES", "page_operands", "quantized_operands", "timed_rounds", "median", "run_record", "round_lines",
    "write_report", "bare_page_max",
]

# query tokens of each probe shape, against B = 1 000 pages of 1 024 tokens
PAGE_SHAPES = {"colpali": 1024, "visual": 512}


def page_operands(q_len: int, device, n_pages: int = 1000, page_len: int = 1024, dim: int = 128):
    """A unit-norm fp16 query ``[q_len, dim]`` and pages ``[n_pages, page_len, dim]``."""
    q = torch.nn.functional.normalize(torch.randn(q_len, dim, device=device), dim=-1).half()
    d = torch.nn.functional.normalize(torch.randn(n_pages, page_len, dim, device=device), dim=-1).half()
    return q, d


def quantized_operands(q, d, dtype):
    """``(q8, q_scale, d8, d_scale, scores)``: both sides quantized per token to ``dtype`` and ``lik.maxsim``'s
    scores of them (what every probe is checked against)."""
    d8, d_scale = lik.quantize(d, dtype)
    q8, q_scale = lik.quantize(q, dtype)
    return q8, q_scale, d8, d_scale, lik.maxsim(q8, d8, q_scale=q_scale, d_scale=d_scale)


def timed_rounds(methods: dict, rounds: int, alternate: bool = False) -> dict:
    """``{name: [do_bench ms per round]}`` after one warm call of each method; with ``alternate``, every other
    round runs the methods in reverse order (so that a method's place in a round is not its bias)."""
    for fn in methods.values():
        fn()
    torch.cuda.synchronize()
    times = {name: [] for name in methods}
    for r in range(rounds):
        order = list(methods)[::-1] if alternate and r % 2 else list(methods)
        for name in order:
            times[name].append(triton.testing.do_bench(methods[name], warmup=25, rep=200))
    return times


def median(values):
    return sorted(values)[len(values) // 2]


def run_record(**extra) -> dict:
    """The JSON record of a probe run: device and versions, ``extra``, and its cells (filled by the probe)."""
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            **extra, "cells": {}}


def round_lines(shape: str, times: dict, detail=lambda name: "") -> list[str]:
    """One report line per method: its median, its ratio to ``lik fp16``'s median, ``detail(name)`` and the
    rounds."""
    fp16 = median(times["lik fp16"])
    return [f"{shape:8s} {name:22s} {median(t):.4f} ms (x fp16 {fp16 / median(t):.3f}){detail(name)}  rounds "
            f"{[round(x, 4) for x in t]}" for name, t in times.items()]


def write_report(out: str, filename: str, results: dict, lines: list[str]) -> None:
    """``results`` as JSON under ``out``, then the report lines on stdout."""
    with open(os.path.join(out, filename), "w") as f:
        json.dump(results, f, indent=1)
    print("\n".join(lines))


@triton.jit
def bare_page_max(q, doc_base, scale_base, doc_len, DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, INT8: tl.constexpr):
    """Each of ``q``'s ``BLOCK_M`` rows' max over one page of 8-bit tokens (``doc_len`` a multiple of ``BLOCK_N``,
    rows back to back): lik's tile loop without its features. A product per tile, the columns scaled by their
    tokens' scales, and a running max per column class (the four lanes that share a row) folded at the end."""
    k = tl.arange(0, DIM)
    running = tl.full((BLOCK_M, 4), float("-inf"), tl.float32)
    for start in tl.range(0, doc_len, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        scale = tl.load(scale_base + tokens)
        d_tile = tl.load(doc_base + tokens[:, None] * DIM + k[None, :])
        if INT8:
            s = tl.dot(q, tl.trans(d_tile), out_dtype=tl.int32).to(tl.float32)
        else:
            s = tl.dot(q, tl.trans(d_tile), max_num_imprecise_acc=DIM)
        s = s * scale[None, :]
        grouped = tl.reshape(s, (BLOCK_M, BLOCK_N // 8, 4, 2))
        running = nan_max(running, tl.reduce(tl.reduce(grouped, 3, nan_max), 1, nan_max))
    return tl.reduce(running, 1, nan_max)
