"""Where a decoder-sized deformable-attention call spends its host time, piece by piece, on the device's host.

Each row is the host time per call of 300 calls without synchronising (``host_profile.host_us``: what a loop of
these calls costs when the CPU, not the GPU, is the limit), median of five loops. The forward is taken apart at
decoder scale (N 4 at 800x1333, 300 queries, fp32, realistic sampling), where its device time is below its host
time; the backward, whose device time at that scale is above its host time, on a tiny problem with the same code
path (N 1, two small levels, 16 queries), so that the loop times the host alone. lik's public call is taken apart
down to Triton's launcher (replayed with tensors and with their addresses, as ``lik._launch`` passes them); the
original Deformable-DETR op (built from its source, ``msda_original_op.py``) down to its C++ calls. With
``--rounds K`` the decoder forward and backward of lik and the op are also timed by ``do_bench`` (L2 flushed, as
``msda_vs_cuda.py``) in K alternating rounds at 300 and 900 queries, with each backward also timed behind a GPU
sleep (its device time under the same flush, the host out of the way). lik is measured with the replays of its
recorded launches (shipped) and without them (the general path), in the same process. Usage on the device::

    PYTHONPATH=src:benchmarks python3 benchmarks/msda_host_parts.py --original-src /path/to/Deformable-DETR \
        --rounds 5 --out $OUT
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
from lik.ops.msda import backward as msda_backward_module
from lik.ops.msda import forward as msda_forward_module
from lik.ops.msda.function import MSDeformAttnFunction
from lik.ops.msda.validation import check_inputs
from msda_bench import DECODER, make_problem
from msda_original_op import load_original_op


TINY = dict(name="tiny", n=1, hw=[(8, 12), (4, 6)], queries=16)


class _EmptyFunction(torch.autograd.Function):
    """An autograd Function that only allocates its output and hands back the gradients in ``grads`` (made in
    advance): the bookkeeping any Function-based op pays, forward and backward."""

    grads: tuple = ()

    @staticmethod
    def forward(ctx, value, shapes, starts, loc, attn):
        ctx.save_for_backward(value, shapes, starts, loc, attn)
        return torch.empty((loc.shape[0], loc.shape[1], value.shape[2] * value.shape[3]), device=value.device)

    @staticmethod
    def backward(ctx, grad):
        ctx.saved_tensors  # noqa: B018 - unpacked as a real backward does
        grad_value, grad_loc, grad_attn = _EmptyFunction.grads
        return grad_value, None, None, grad_loc, grad_attn


def capture_launch(module, call):
    """Run ``call`` once with ``module.launch`` wrapped; the first launch it made as ``(kernel, grid, args,
    kwargs)``, and a function replaying it through Triton's compiled launcher alone (with tensors, or with their
    addresses as ``lik._launch`` passes them)."""
    captured = []
    real_launch = module.launch

    def capture(kernel, grid, *a, **k):
        captured.append((kernel, grid, a, k))
        return real_launch(kernel, grid, *a, **k)

    module.launch = capture
    try:
        call()
        call()  # recorded by the first, replayed by the second
    finally:
        module.launch = real_launch
    kernel, grid, args, kwargs = captured[0]
    device = torch.cuda.current_device()
    run, function, packed, tail = kernel._lik_launch_table.entries[_launch.cache_key(kernel, device, args, kwargs)]
    stream = _launch._get_stream(device)
    addresses = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    grid = tuple(grid) + (1,) * (3 - len(grid))

    def replay(launch_args):
        return lambda: run(*grid, stream, function, packed, None, None, None, *launch_args, *tail)

    return (kernel, grid, args, kwargs), replay(args), replay(addresses)


def forward_parts(original) -> dict:
    p = make_problem(DECODER, "realistic", torch.float32)
    v, s, st, lc, w = (p[k] for k in ("value", "shapes", "starts", "loc", "weights"))
    leaves = [t.detach().clone().requires_grad_() for t in (v, lc, w)]
    out_shape = (lc.shape[0], lc.shape[1], v.shape[2] * v.shape[3])
    (kernel, grid, launch_args, launch_kwargs), with_tensors, with_addresses = capture_launch(
        msda_forward_module, lambda: msda_forward_module.msda_forward(v, s, st, lc, w))
    device = torch.cuda.current_device()
    table = kernel._lik_launch_table
    layout = table.layouts[tuple(launch_kwargs)]
    parts = {
        "lik.ms_deform_attn, inputs require grad (autograd Function)": lambda: lik.ms_deform_attn(
            leaves[0], s, st, leaves[1], leaves[2]),
        "lik.ms_deform_attn, inference": lambda: lik.ms_deform_attn(v, s, st, lc, w),
        "lik.ms_deform_attn, inputs require grad, replay off": without_replay(lambda: lik.ms_deform_attn(
            leaves[0], s, st, leaves[1], leaves[2])),
        "msda_forward (validated inputs: allocate, config, launch)": lambda: msda_forward_module.msda_forward(
            v, s, st, lc, w),
        "msda_forward, replay off": without_replay(lambda: msda_forward_module.msda_forward(v, s, st, lc, w)),
        "check_inputs": lambda: check_inputs(v, s, st, lc, w, 64),
        "torch.empty of the output": lambda: torch.empty(out_shape, device=v.device),
        "lik._launch.launch (key + Triton's launcher)": lambda: _launch.launch(kernel, grid, *launch_args,
                                                                                 **launch_kwargs),
        "Triton's compiled launcher alone, tensors": with_tensors,
        "Triton's compiled launcher alone, addresses": with_addresses,
        "  launch step: _launch._hooks_installed()": _launch._hooks_installed,
        "  launch step: the current device (torch._C._cuda_getDevice)": _launch._current_device,
        "  launch step: the current stream": lambda: _launch._get_stream(device),
        "  launch step: argument keys and addresses (the type layout's keyer)": lambda: _launch.argument_keyer(
            tuple(map(type, launch_args)))(launch_args),
        "  launch step: key and table lookup": lambda: table.entries.get((
            device, _launch.argument_keys(launch_args), layout.ident, layout.values(launch_kwargs))),
        "an empty autograd Function (save 5 tensors, allocate)": lambda: _EmptyFunction.apply(*leaves[:1], s, st,
                                                                                               *leaves[1:]),
    }
    if original is not None:
        cpp = sys.modules["MultiScaleDeformableAttention"]
        parts["original op, inputs require grad (its autograd Function)"] = lambda: original.apply(
            leaves[0], s, st, leaves[1], leaves[2], 64)
        parts["original op's C++ forward alone (zeros + launch)"] = lambda: cpp.ms_deform_attn_forward(
            v, s, st, lc, w, 64)
    return parts


def backward_parts(original) -> dict:
    p = make_problem(TINY, "realistic", torch.float32)
    v, s, st, lc, w, g = (p[k] for k in ("value", "shapes", "starts", "loc", "weights", "grad"))
    leaves = [t.detach().clone().requires_grad_() for t in (v, lc, w)]
    out = lik.ms_deform_attn(leaves[0], s, st, leaves[1], leaves[2])
    _EmptyFunction.grads = tuple(torch.zeros_like(t) for t in leaves)
    empty_out = _EmptyFunction.apply(leaves[0], s, st, leaves[1], leaves[2])
    (kernel, grid, launch_args, launch_kwargs), with_tensors, with_addresses = capture_launch(
        msda_backward_module, lambda: msda_backward_module.msda_backward(g, v, s, st, lc, w, deterministic=False))
    parts = {
        "backward: lik, autograd.grad": lambda: torch.autograd.grad(out, leaves, g, retain_graph=True),
        "backward: lik, autograd.grad, replay off": without_replay(
            lambda: torch.autograd.grad(out, leaves, g, retain_graph=True)),
        "backward: msda_backward, replay off": without_replay(
            lambda: msda_backward_module.msda_backward(g, v, s, st, lc, w, deterministic=False)),
        "backward: an empty autograd Function, autograd.grad": lambda: torch.autograd.grad(
            empty_out, leaves, g, retain_graph=True),
        "backward: msda_backward (validated inputs: allocate, config, launch)": lambda: (
            msda_backward_module.msda_backward(g, v, s, st, lc, w, deterministic=False)),
        "backward: torch.zeros of the fp32 value gradient": lambda: torch.zeros(
            v.shape, dtype=torch.float32, device=v.device),
        "backward: torch.empty_like of the location gradient": lambda: torch.empty_like(lc),
        "backward: lik._launch.launch (key + Triton's launcher)": lambda: _launch.launch(
            kernel, grid, *launch_args, **launch_kwargs),
        "backward: Triton's compiled launcher alone, tensors": with_tensors,
        "backward: Triton's compiled launcher alone, addresses": with_addresses,
    }
    ctx = _SavedContext((v, s, st, lc, w))
    parts["backward: lik's Function.backward called directly"] = lambda: MSDeformAttnFunction.backward(ctx, g)
    if original is not None:
        cpp = sys.modules["MultiScaleDeformableAttention"]
        op_out = original.apply(leaves[0], s, st, leaves[1], leaves[2], 64)
        parts["backward: original op, autograd.grad"] = lambda: torch.autograd.grad(
            op_out, leaves, g, retain_graph=True)
        parts["backward: original op's Function.backward called directly"] = lambda: original.backward(ctx, g)
        parts["backward: original op's C++ backward alone (zeros + launch)"] = lambda: cpp.ms_deform_attn_backward(
            v, s, st, lc, w, g, 64)
    return parts


def without_replay(fn):
    """``fn`` run with the replays of recorded launches switched off, forward and backward (the general path: tile
    choice, layout checks, launch key), for A/B against the shipped path in the same process."""
    def call():
        real = msda_forward_module.replay_allowed
        msda_forward_module.replay_allowed = lambda: False
        try:
            return fn()
        finally:
            msda_forward_module.replay_allowed = real
    return call


class _SavedContext:
    """What a Function's backward reads from its ``ctx``, for calling it outside the autograd engine."""

    def __init__(self, saved):
        self.saved_tensors = saved
        self.needs_input_grad = (True, False, False, True, True, False)
        self.kernels = True
        self.im2col_step = 64


def engine_split(original) -> dict:
    """Where one ``autograd.grad`` of the tiny problem spends its host time, for lik and the op: from the call to
    the start of the kernel-side backward (engine, Function wrapper, ``ctx`` unpacking), that backward (lik's
    ``_backward_kernels``, the op's C++ ``ms_deform_attn_backward``), and from its end to the call's return.
    Medians of 300 calls, microseconds."""
    import time

    from lik.ops.msda import function as function_module

    p = make_problem(TINY, "realistic", torch.float32)
    s, st, g = p["shapes"], p["starts"], p["grad"]
    leaves = [p[k].detach().clone().requires_grad_() for k in ("value", "loc", "weights")]
    stamps = []

    def stamped(fn):
        def call(*args):
            stamps.append(time.perf_counter())
            result = fn(*args)
            stamps.append(time.perf_counter())
            return result
        return call

    class _Proxy:
        def __init__(self, module):
            self.module = module
            self.ms_deform_attn_backward = stamped(module.ms_deform_attn_backward)

        def __getattr__(self, name):
            return getattr(self.module, name)

    targets = {"lik": (function_module.__dict__, "_backward_kernels",
                       lambda: lik.ms_deform_attn(leaves[0], s, st, leaves[1], leaves[2]))}
    if original is not None:
        globals_ = original.backward.__globals__ if hasattr(original.backward, "__globals__") else None
        if globals_ is None or "MSDA" not in globals_:  # once_differentiable's wrapper: its wrapped function
            globals_ = original.backward.__wrapped__.__globals__
        targets["cuda-op"] = (globals_, "MSDA", lambda: original.apply(leaves[0], s, st, leaves[1], leaves[2], 64))
    split = {}
    for name, (namespace, attr, forward) in targets.items():
        out = forward()
        real = namespace[attr]
        namespace[attr] = _Proxy(real) if attr == "MSDA" else stamped(real)
        try:
            rows = []
            for i in range(330):
                stamps.clear()
                began = time.perf_counter()
                torch.autograd.grad(out, leaves, g, retain_graph=True)
                ended = time.perf_counter()
                if i >= 30:
                    rows.append((stamps[0] - began, stamps[1] - stamps[0], ended - stamps[1], ended - began))
        finally:
            namespace[attr] = real
        torch.cuda.synchronize()
        medians = [sorted(column)[len(column) // 2] * 1e6 for column in zip(*rows)]
        split[name] = dict(zip(("before_us", "kernel_backward_us", "after_us", "total_us"), medians))
        print(f"engine split {name:8} " + "  ".join(f"{k} {v:6.1f}" for k, v in split[name].items()), flush=True)
    return split


def backward_trace(original, out_dir: str) -> dict:
    """torch.profiler's host-side view of 50 backward calls on the tiny problem, lik and the op: the table of
    operators by self CPU time, and a Chrome trace of each (threads included)."""
    from torch.profiler import ProfilerActivity, profile

    p = make_problem(TINY, "realistic", torch.float32)
    s, st, g = p["shapes"], p["starts"], p["grad"]
    leaves = [p[k].detach().clone().requires_grad_() for k in ("value", "loc", "weights")]
    outs = {"lik": lik.ms_deform_attn(leaves[0], s, st, leaves[1], leaves[2])}
    if original is not None:
        outs["cuda-op"] = original.apply(leaves[0], s, st, leaves[1], leaves[2], 64)
    tables = {}
    for name, out in outs.items():
        for _ in range(20):
            torch.autograd.grad(out, leaves, g, retain_graph=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(50):
                torch.autograd.grad(out, leaves, g, retain_graph=True)
            torch.cuda.synchronize()
        prof.export_chrome_trace(os.path.join(out_dir, f"msda_backward_trace_{name}.json"))
        tables[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        print(f"--- {name}: 50 backward calls (autograd.grad, tiny problem)\n{tables[name]}", flush=True)
    return tables


def rounds(original, count: int, queries: int = 300) -> dict:
    """``do_bench`` medians (L2 flushed) of the decoder forward and backward, lik (replays on and off) and the op
    alternating. ``lag`` rows: the same backward behind a GPU sleep long enough that the host has issued
    everything before the GPU gets to it, minus the sleep alone: the device time under ``do_bench``'s
    conditions (flushed L2, no host in the way)."""
    p = make_problem(dict(DECODER, queries=queries), "realistic", torch.float32)
    s, st, g = p["shapes"], p["starts"], p["grad"]
    leaves = [p[k].detach().clone().requires_grad_() for k in ("value", "loc", "weights")]
    methods = {"lik": lambda v, lc, w: lik.ms_deform_attn(v, s, st, lc, w)}
    if original is not None:
        methods["cuda-op"] = lambda v, lc, w: original.apply(v, s, st, lc, w, 64)
    bench = lambda f: triton.testing.do_bench(f, return_mode="median")  # noqa: E731
    outs = {name: fn(*leaves) for name, fn in methods.items()}
    backward = {name: (lambda out=out: torch.autograd.grad(out, leaves, g, retain_graph=True))
                for name, out in outs.items()}
    backward["lik, replay off"] = without_replay(backward["lik"])
    sleep_cycles = 1_000_000  # ~0.5 ms at H100 / H200 clocks, longer than any host path here
    sleep = lambda: torch.cuda._sleep(sleep_cycles)  # noqa: E731
    times = {}
    for _ in range(count):
        for name, fn in methods.items():
            times.setdefault(f"{name} fwd", []).append(bench(lambda: fn(*leaves)))
        times.setdefault("lik, replay off fwd", []).append(bench(without_replay(lambda: methods["lik"](*leaves))))
        for name, fn in backward.items():
            times.setdefault(f"{name} bwd", []).append(bench(fn))
        slept = bench(sleep)
        for name, fn in backward.items():
            lagged = bench(lambda: (sleep(), fn()))
            times.setdefault(f"{name} bwd lag", []).append(lagged - slept)
        print(f"Lq {queries}  " + "  ".join(f"{k} {v[-1] * 1e3:.1f} us" for k, v in times.items()), flush=True)
    return {f"Lq{queries} {k}": v for k, v in times.items()}


def decoder_host(original, queries: int = 300) -> dict:
    """Host time per backward at decoder scale (300 calls without synchronising, median of five loops): what a
    loop of these calls costs the CPU; lik with and without the replay, the op."""
    p = make_problem(dict(DECODER, queries=queries), "realistic", torch.float32)
    s, st, g = p["shapes"], p["starts"], p["grad"]
    leaves = [p[k].detach().clone().requires_grad_() for k in ("value", "loc", "weights")]
    calls = {"lik": lik.ms_deform_attn(leaves[0], s, st, leaves[1], leaves[2])}
    if original is not None:
        calls["cuda-op"] = original.apply(leaves[0], s, st, leaves[1], leaves[2], 64)
    fns = {name: (lambda out=out: torch.autograd.grad(out, leaves, g, retain_graph=True))
           for name, out in calls.items()}
    fns["lik, replay off"] = without_replay(fns["lik"])
    rows = {}
    for name, fn in fns.items():
        rows[f"decoder Lq {queries} backward host: {name}"] = sorted(host_us(fn, 300) for _ in range(5))[2]
        print(f"{rows[f'decoder Lq {queries} backward host: {name}']:7.1f} us  decoder Lq {queries} backward host: "
              f"{name}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--original-src", default=os.environ.get("LIK_ORIGINAL_MSDA_SRC"))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--rounds", type=int, default=0, help="alternating do_bench rounds at decoder scale")
    parser.add_argument("--trace", action="store_true", help="torch.profiler tables and traces of the backward")
    args = parser.parse_args()
    original = load_original_op(args.original_src) if args.original_src else None
    rows = {}
    for parts in (forward_parts(original), backward_parts(original)):
        for name, fn in parts.items():
            rows[name] = sorted(host_us(fn, 300) for _ in range(5))[2]
            print(f"{rows[name]:7.1f} us  {name}", flush=True)
    for queries in (300, 900):
        rows.update(decoder_host(original, queries))
    split = engine_split(original)
    traces = backward_trace(original, args.out) if args.trace else {}
    timed = {}
    for queries in (300, 900) if args.rounds else ():
        timed.update(rounds(original, args.rounds, queries))
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                commit=os.environ.get("LIK_COMMIT", "unknown"), python=sys.version.split()[0])
    with open(os.path.join(args.out, "msda_host_parts.json"), "w") as fh:
        json.dump(dict(meta=meta, host_us=rows, do_bench_ms=timed, engine_split=split, backward_tables=traces), fh,
                  indent=1)
    print(json.dumps(meta))
    for name, values in timed.items():
        print(f"{name:28} do_bench median of rounds {sorted(values)[len(values) // 2] * 1e3:6.1f} us "
              f"(rounds {', '.join(f'{v * 1e3:.1f}' for v in values)})")


if __name__ == "__main__":
    main()
