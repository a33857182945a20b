"""Host (CPU) cost of each piece of a MaxSim training step, for the launch-bound small shapes.

    python3 benchmarks/host_profile.py [--shape colbert-128] [--out $OUT]

Each piece is called 200 times in a row without synchronising; the wall time per call is its host cost when the
GPU keeps up (the pieces are small at ColBERT B 128). Whole steps are also timed with device events and with a
synchronise after each step. Also lists, from torch.profiler, the Python stack of any
host<->device copy in a deterministic step (a hidden copy there would serialise host and device), times
flash-maxsim's whole step when it is installed, and writes a cProfile of 300 fast steps (own time per function)
to ``host_profile_cprofile.txt``.
Writes ``host_profile.json``.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import lik  # noqa: E402
from lik.ops.maxsim import backward as bw  # noqa: E402
from lik.ops.maxsim.backward_sorted import launch_dd_sorted, sorted_winners  # noqa: E402
from lik.ops.maxsim.forward import maxsim_forward  # noqa: E402
from lik.ops.maxsim.validation import MaxSimInputs  # noqa: E402
from train_shapes import SHAPES, backward_problem, parse_shape_args  # noqa: E402


def host_us(fn, calls=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - started) / calls * 1e6
    torch.cuda.synchronize()
    return host


def step_costs(step, calls=200):
    """Host time per step without synchronising, wall time per step with a synchronise after each, and
    device-event time per step over the unsynchronised loop (equal to the host time when launch-bound)."""
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began = time.perf_counter()
    start.record()
    for _ in range(calls):
        step()
    end.record()
    host = (time.perf_counter() - began) / calls * 1e6
    torch.cuda.synchronize()
    events = start.elapsed_time(end) / calls * 1e3
    began = time.perf_counter()
    for _ in range(calls):
        step()
        torch.cuda.synchronize()
    synced = (time.perf_counter() - began) / calls * 1e6
    return {"host_us": host, "event_us": events, "synced_us": synced}


def main():
    args = parse_shape_args()
    _, n, l_d = SHAPES[args.shape]
    prob = backward_problem(args.shape)
    Q, D, inputs, q, d, argmax, grad = prob.Q, prob.D, prob.inputs, prob.q, prob.d, prob.argmax, prob.grad
    cfg, block_k, n_k, dtype, dev = prob.cfg, prob.block_k, prob.n_k, prob.dtype, Q.device
    labels = torch.arange(n, device=dev)
    dd = torch.empty(d.shape, dtype=dtype, device=dev)
    keys = argmax.permute(1, 0, 2).to(torch.int16).reshape(-1)
    sorted_keys = torch.sort(keys, stable=True)[0]
    bounds = torch.arange(n * l_d + 1, device=dev, dtype=torch.int16)
    pieces = {
        "MaxSimInputs.build": lambda: MaxSimInputs.build(Q, D, None, None, "exclude"),
        "forward with argmax": lambda: maxsim_forward(inputs, store_argmax=True),
        "dQ": lambda: bw.maxsim_backward_dq(grad, d, argmax, q.shape, dtype),
        "dD fast (atomic)": lambda: bw.maxsim_backward_dd(grad, q, argmax, d.shape, dtype, deterministic=False,
                                                          per_query=False),
        "dD deterministic (sorted)": lambda: bw.maxsim_backward_dd(grad, q, argmax, d.shape, dtype,
                                                                   deterministic=True, per_query=False),
        "  sorted_winners": lambda: sorted_winners(argmax, l_d, False),
        "  launch_dd_sorted": lambda: launch_dd_sorted(grad, q, argmax, dd, per_query=False, cfg=cfg,
                                                       block_k=block_k, n_k_blocks=n_k),
        "  torch.sort(stable) alone": lambda: torch.sort(keys, stable=True),
        "  torch.searchsorted alone": lambda: torch.searchsorted(sorted_keys, bounds),
        "  torch.arange alone": lambda: torch.arange(n * l_d + 1, device=dev, dtype=torch.int16),
        "empty kernel-free op (torch.empty)": lambda: torch.empty(16, device=dev),
    }
    try:  # the faster peer's whole step, for scale (its wheel is carried to the device)
        import flash_maxsim

        Qf, Df = Q.clone().requires_grad_(), D.clone().requires_grad_()

        def flash_step():
            Qf.grad = Df.grad = None
            scores = flash_maxsim.flash_maxsim_batched_train(Qf, Df, shared_docs=True)
            torch.nn.functional.cross_entropy(scores.float(), labels).backward()

        pieces["flash-maxsim whole step"] = flash_step
    except ImportError:
        pass
    steps = {}
    for mode in ("fast", "deterministic"):
        Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()

        def step(mode=mode, Qg=Qg, Dg=Dg):
            Qg.grad = Dg.grad = None
            torch.nn.functional.cross_entropy(lik.maxsim(Qg, Dg, backward=mode), labels).backward()

        pieces[f"whole step, {mode}"] = step
        steps[mode] = step
    result = {"shape": args.shape, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "host_us_per_call": {name: host_us(fn) for name, fn in pieces.items()},
              "steps": {mode: step_costs(step) for mode, step in steps.items()}}
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(3):
            Qg.grad = Dg.grad = None
            torch.nn.functional.cross_entropy(lik.maxsim(Qg, Dg, backward="deterministic"), labels).backward()
        torch.cuda.synchronize()
    copies = [e for e in prof.events() if "Memcpy" in e.name or "memcpy" in e.name or e.name == "aten::item"]
    result["copies"] = [{"name": e.name, "stack": list(e.stack)[:12]} for e in copies[:6]]
    with open(os.path.join(args.out, "host_profile.json"), "w") as f:
        json.dump(result, f, indent=1)
    for name, us in result["host_us_per_call"].items():
        print(f"{name:40} {us:8.1f} us")
    for mode, costs in result["steps"].items():
        print(f"step {mode:14} host {costs['host_us']:7.1f} us, events {costs['event_us']:7.1f} us, "
              f"synchronised {costs['synced_us']:7.1f} us")
    for c in result["copies"]:
        print(c["name"], "<-", " | ".join(c["stack"][:6]))
    # Python-level breakdown of the fast step: where its host time goes, by function (own time).
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(300):
        steps["fast"]()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    with open(os.path.join(args.out, "host_profile_cprofile.txt"), "w") as f:
        f.write(text.getvalue())
    print("\n".join(text.getvalue().splitlines()[:45]))


if __name__ == "__main__":
    main()
