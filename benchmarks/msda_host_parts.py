"""Where a decoder-sized deformable-attention forward spends its host time, piece by piece, on the device's host.

Each row is the host time per call of 200 calls without synchronising (``host_profile.host_us``: what a loop of
these calls costs when the CPU, not the GPU, is the limit), decoder scale (N 4 at 800x1333, 300 queries, fp32,
realistic sampling). lik's public call is taken apart down to Triton's launcher; the original Deformable-DETR op
(built from its source, ``msda_original_op.py``) down to its C++ forward. Usage on the device::

    PYTHONPATH=src:benchmarks python3 benchmarks/msda_host_parts.py --original-src /path/to/Deformable-DETR --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

import lik
from host_profile import host_us  # benchmarks/ is the script's directory, so on sys.path
from lik import _launch
from lik.ops.msda import forward as msda_forward_module
from lik.ops.msda.validation import check_inputs
from msda_bench import DECODER, make_problem
from msda_original_op import load_original_op


class _EmptyFunction(torch.autograd.Function):
    """An autograd Function that only allocates its output: the bookkeeping any Function-based op pays."""

    @staticmethod
    def forward(ctx, value, shapes, starts, loc, attn):
        ctx.save_for_backward(value, shapes, starts, loc, attn)
        return torch.empty((loc.shape[0], loc.shape[1], value.shape[2] * value.shape[3]), device=value.device)

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - never called here
        return None, None, None, None, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--original-src", default=os.environ.get("LIK_ORIGINAL_MSDA_SRC"))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    p = make_problem(DECODER, "realistic", torch.float32)
    v, s, st, lc, w = (p[k] for k in ("value", "shapes", "starts", "loc", "weights"))
    leaves = [t.detach().clone().requires_grad_() for t in (v, lc, w)]
    out_shape = (lc.shape[0], lc.shape[1], v.shape[2] * v.shape[3])

    # The exact launch msda_forward makes, captured once, to replay its parts.
    captured = {}
    real_launch = msda_forward_module.launch

    def capture(kernel, grid, *a, **k):
        captured.update(kernel=kernel, grid=grid, args=a, kwargs=k)
        return real_launch(kernel, grid, *a, **k)

    msda_forward_module.launch = capture
    msda_forward_module.msda_forward(v, s, st, lc, w)
    msda_forward_module.launch = real_launch
    kernel, grid, launch_args, launch_kwargs = (captured[k] for k in ("kernel", "grid", "args", "kwargs"))
    (entry,) = kernel._lik_launch_table.entries.values()
    run, function, packed, tail = entry
    device = torch.cuda.current_device()
    stream = _launch._get_stream(device)
    table = kernel._lik_launch_table
    layout = table.layouts[tuple(launch_kwargs)]

    def triton_launcher():
        run(grid[0], grid[1], 1, stream, function, packed, None, None, None, *launch_args, *tail)

    parts = {
        "lik.ms_deform_attn, inputs require grad (autograd Function)": lambda: lik.ms_deform_attn(
            leaves[0], s, st, leaves[1], leaves[2]),
        "lik.ms_deform_attn, inference": lambda: lik.ms_deform_attn(v, s, st, lc, w),
        "msda_forward (validated inputs: allocate, config, launch)": lambda: msda_forward_module.msda_forward(
            v, s, st, lc, w),
        "check_inputs": lambda: check_inputs(v, s, st, lc, w, 64),
        "torch.empty of the output": lambda: torch.empty(out_shape, device=v.device),
        "lik._launch.launch (key + Triton's launcher)": lambda: _launch.launch(kernel, grid, *launch_args,
                                                                                 **launch_kwargs),
        "Triton's compiled launcher alone (replayed by position)": triton_launcher,
        "  launch step: _launch._hooks_installed()": _launch._hooks_installed,
        "  launch step: the current device (torch._C._cuda_getDevice)": _launch._current_device,
        "    instead of torch.cuda.current_device()": torch.cuda.current_device,
        "  launch step: the current stream": lambda: _launch._get_stream(device),
        "  launch step: argument keys (the type layout's keyer)": lambda: _launch.argument_keys(launch_args),
        "  launch step: key and table lookup": lambda: table.entries.get((
            device, _launch.argument_keys(launch_args), layout.ident, layout.values(launch_kwargs))),
        "an empty autograd Function (save 5 tensors, allocate)": lambda: _EmptyFunction.apply(*leaves[:1], s, st,
                                                                                               *leaves[1:]),
    }
    if args.original_src:
        original = load_original_op(args.original_src)
        cpp = sys.modules["MultiScaleDeformableAttention"]
        parts["original op, inputs require grad (its autograd Function)"] = lambda: original.apply(
            leaves[0], s, st, leaves[1], leaves[2], 64)
        parts["original op's C++ forward alone (zeros + launch)"] = lambda: cpp.ms_deform_attn_forward(
            v, s, st, lc, w, 64)
    rows = {}
    for name, fn in parts.items():
        rows[name] = sorted(host_us(fn, 300) for _ in range(5))[2]
        print(f"{rows[name]:7.1f} us  {name}", flush=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                commit=os.environ.get("LIK_COMMIT", "unknown"), python=sys.version.split()[0])
    with open(os.path.join(args.out, "msda_host_parts.json"), "w") as fh:
        json.dump(dict(meta=meta, host_us=rows), fh, indent=1)
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
