"""How fast can any gather-based kernel run the encoder-scale deformable attention?

    PYTHONPATH=src python3 benchmarks/msda_ceiling.py [--out $OUT]

lik's fp32 encoder kernels are bound by moving corner lines between L2 and the SMs, not by DRAM
(benchmarks/NOTES.md, "Bound by gathers, not DRAM"). This measures what moving exactly those lines costs with
kernels that do nothing else:

* ``gather``: for every sample, the four bilinear corners (``D`` = 32 fp32 channels: one 128-byte line each) of the
  same pixels the real forward reads, loaded unmasked from a precomputed int32 offset of the top-left corner
  (out-of-map corners clamped onto the map, which only removes distinct lines), summed without weights, one
  ``[rows, D]`` result written. Rows are ordered (batch, head, query) as in lik's kernels.
* ``atomic``: the backward's value-gradient traffic alone: a relaxed fp32 atomic add of a constant into the same
  four corners of every sample (no gathers).
* ``gather by-level`` / ``atomic by-level``: the same, one launch per level (every row's level-0 samples, then
  level 1, ...), so that the small maps of the coarse levels have L1 / L2 to themselves.
* ``gather+atomic``: both in one kernel (what the backward must at least do: read the corners for the
  location gradient and scatter into them for the value gradient).

Each runs over a few tiles (rows per program, warps); the fastest is the ceiling. The same process times
``lik``'s forward and backward kernels and the ``grid_sample`` reference, so the ratios BENCHMARKS.md's targets
ask for (forward >= 20x, backward >= 15x over grid_sample, fp32) can be set against what the line traffic allows.
Writes ``msda_ceiling.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl
import triton.testing

import lik.ops.msda as msda
from lik.bench.msda_cases import ENCODER, make_problem
from lik.ops.msda.backward import msda_backward
from lik.ops.msda.forward import msda_forward

BARS = (20.0, 15.0)  # the encoder's forward and backward bars: speed-ups over the grid_sample reference, fp32
TILES = [(2, 1), (4, 1), (8, 1), (16, 1), (4, 2), (8, 2), (16, 2), (8, 4), (16, 4), (32, 4)]  # (rows, warps)


@triton.jit
def corner_traffic_kernel(value_ptr, grad_ptr, offset_ptr, down_ptr, out_ptr, n_rows, n_levels, first_level,
                          end_level, stride_vs, BLOCK_R: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
                          GATHER: tl.constexpr, SCATTER: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    rows = tl.where(row_ok, rows, 0)
    chan = tl.arange(0, D)
    acc = tl.zeros((BLOCK_R, P, D), tl.float32)
    for level in range(first_level, end_level):
        down = tl.load(down_ptr + level)
        offset = tl.load(offset_ptr + (rows * n_levels + level)[:, None] * P + tl.arange(0, P)[None, :])
        corner = offset.to(tl.int64)[:, :, None] + chan[None, None, :]
        for step in tl.static_range(4):
            ptr = corner + (step % 2) * stride_vs + (step // 2) * down
            if GATHER:
                acc += tl.load(value_ptr + ptr)
            if SCATTER:
                tl.atomic_add(grad_ptr + ptr, tl.full((BLOCK_R, P, D), 1.0, tl.float32), mask=row_ok[:, None, None],
                              sem="relaxed")
    tl.store(out_ptr + rows[:, None] * D + chan[None, :], tl.sum(acc, axis=1), mask=row_ok[:, None])


def corner_offsets(p: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 element offset of each sample's top-left corner in ``value`` ([N, M, Lq, L, P], rows (batch, head,
    query)), clamped so that all four corners are on the map, and each level's row step (``W * stride_vs``)."""
    value, loc = p["value"], p["loc"].float()
    n, _, heads, _ = value.shape
    shapes = p["shapes"].to(loc.device)
    height, width = shapes[:, 0].float(), shapes[:, 1].float()
    x = (loc[..., 0] * width.view(1, 1, 1, -1, 1) - 0.5).floor()
    y = (loc[..., 1] * height.view(1, 1, 1, -1, 1) - 0.5).floor()
    x = torch.nan_to_num(x).clamp(min=0).minimum(width.view(1, 1, 1, -1, 1) - 2).clamp(min=0)
    y = torch.nan_to_num(y).clamp(min=0).minimum(height.view(1, 1, 1, -1, 1) - 2).clamp(min=0)
    pixel = p["starts"].view(1, 1, 1, -1, 1) + y.long() * shapes[:, 1].view(1, 1, 1, -1, 1) + x.long()
    batch = torch.arange(n, device=loc.device).view(-1, 1, 1, 1, 1)
    head = torch.arange(heads, device=loc.device).view(1, 1, -1, 1, 1)
    offset = batch * value.stride(0) + pixel * value.stride(1) + head * value.stride(2)
    assert int(offset.max()) < 2**31
    down = (shapes[:, 1] * value.stride(1)).to(torch.int32)
    return offset.permute(0, 2, 1, 3, 4).contiguous().to(torch.int32), down


def traffic(p: dict, offsets: torch.Tensor, down: torch.Tensor, mode: str) -> dict:
    """Fastest tile of one mode; ``by-level`` modes launch once per level (all rows gather level 0, then all rows
    level 1, ...: each level's map then has the caches to itself)."""
    value = p["value"]
    n, _, heads, dim = value.shape
    n_rows = n * heads * offsets.shape[2]
    n_levels = offsets.shape[3]
    grad = torch.zeros_like(value, dtype=torch.float32)
    out = torch.empty(n_rows, dim, device=value.device, dtype=torch.float32)
    spans = [(level, level + 1) for level in range(n_levels)] if "by-level" in mode else [(0, n_levels)]
    best = None
    for rows, warps in TILES:
        def run():
            for first, end in spans:
                corner_traffic_kernel[(triton.cdiv(n_rows, rows),)](
                    value, grad, offsets, down, out, n_rows, n_levels, first, end, value.stride(1),
                    BLOCK_R=rows, P=offsets.shape[4], D=dim, GATHER="gather" in mode, SCATTER="atomic" in mode,
                    num_warps=warps)
        ms = triton.testing.do_bench(run, return_mode="median")
        print(f"  {mode:14s} rows {rows:2d} warps {warps}: {ms:.3f} ms", flush=True)
        if best is None or ms < best["ms"]:
            best = dict(ms=ms, rows=rows, warps=warps)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--sampling", default="uniform,realistic")
    args = parser.parse_args()
    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   problems={})
    table = []
    for sampling in args.sampling.split(","):
        p = make_problem(ENCODER, sampling, torch.float32)
        offsets, down = corner_offsets(p)
        corners = offsets.numel() * 4
        print(f"encoder {sampling} fp32: {corners / 1e6:.1f} M corner lines of {p['value'].shape[-1] * 4} B",
              flush=True)
        row = dict(corners=corners)
        for mode in ("gather", "gather by-level", "atomic", "atomic by-level", "gather+atomic"):
            row[mode] = traffic(p, offsets, down, mode)
        del offsets
        args_ = (p["value"], p["shapes"], p["starts"], p["loc"], p["weights"])
        row["lik_forward_ms"] = triton.testing.do_bench(lambda: msda_forward(*args_), return_mode="median")
        row["lik_backward_ms"] = triton.testing.do_bench(
            lambda: msda_backward(p["grad"], *args_, deterministic=False), return_mode="median")
        x = [p[k].detach().clone().requires_grad_() for k in ("value", "loc", "weights")]
        reference = msda.ms_deform_attn_reference
        row["gs_forward_ms"] = triton.testing.do_bench(
            lambda: reference(p["value"], p["shapes"], p["starts"], p["loc"], p["weights"]), return_mode="median")
        out = reference(x[0], p["shapes"], p["starts"], x[1], x[2])
        row["gs_backward_ms"] = triton.testing.do_bench(
            lambda: torch.autograd.grad(out, x, p["grad"], retain_graph=True), return_mode="median")
        out = x = p = None  # the lambdas above close over them: drop the tensors before the next problem
        torch.cuda.empty_cache()
        results["problems"][sampling] = row
        fwd_bar, bwd_bar = BARS
        gather = min(row["gather"]["ms"], row["gather by-level"]["ms"])
        atomic = min(row["atomic"]["ms"], row["atomic by-level"]["ms"])
        table.append(
            f"| {sampling} | {gather:.3f} | {row['lik_forward_ms']:.3f} | {row['gs_forward_ms']:.2f} "
            f"| {row['gs_forward_ms'] / fwd_bar:.3f} | {atomic:.3f} | {row['gather+atomic']['ms']:.3f} "
            f"| {row['lik_backward_ms']:.3f} | {row['gs_backward_ms']:.2f} | {row['gs_backward_ms'] / bwd_bar:.3f} |")
    with open(os.path.join(args.out, "msda_ceiling.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("| sampling | gather-only ms | lik fwd | gs fwd | fwd bar (20x) | atomic-only | gather+atomic | lik bwd "
          "| gs bwd | bwd bar (15x) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(table))


if __name__ == "__main__":
    main()
