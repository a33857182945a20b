"""Where one MaxSim training step spends its time: device kernels and host gaps, per backward mode.

    python3 benchmarks/step_profile.py [--shape colbert-128] [--out $OUT]

In-batch step (fp16, d 128): ``lik.maxsim`` + cross-entropy + backward. For each mode prints the do_bench
median, the host time of one step (wall clock, synchronised), torch.profiler's CUDA kernel table (top 12 by
device time) and its host-op table (top 25 by self CPU time); writes ``$OUT/step_profile.txt``.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import lik  # noqa: E402
from train_shapes import SHAPES, in_batch_inputs, parse_shape_args  # noqa: E402


def main():
    args = parse_shape_args()
    l_q, n, l_d = SHAPES[args.shape]
    Q, D = in_batch_inputs(args.shape)
    labels = torch.arange(n, device=Q.device)
    lines = [f"{args.shape}: Nq = B = {n}, Lq {l_q}, Ld {l_d}, fp16, {torch.cuda.get_device_name()}"]
    for mode in ("fast", "deterministic"):
        Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()

        def step():
            Qg.grad = Dg.grad = None
            torch.nn.functional.cross_entropy(lik.maxsim(Qg, Dg, backward=mode), labels).backward()

        step()
        torch.cuda.synchronize()
        median = triton.testing.do_bench(step, warmup=10, rep=100, return_mode="median")
        started = time.perf_counter()
        for _ in range(20):
            step()
        host_ms = (time.perf_counter() - started) / 20 * 1e3  # launch-bound if close to the device time
        torch.cuda.synchronize()
        synced_ms = (time.perf_counter() - started) / 20 * 1e3
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        lines.append(f"\n== {mode}: do_bench {median:.3f} ms; 20 steps: host {host_ms:.3f} ms/step, "
                     f"with sync {synced_ms:.3f} ms/step")
        try:
            table = prof.key_averages().table(sort_by="device_time_total", row_limit=12, max_name_column_width=60)
        except (AttributeError, KeyError, ValueError):
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60)
        lines.append(table)
        # Host side: where the Python / dispatcher time of a step goes (self CPU time per op).
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as cpu_prof:
            for _ in range(20):
                step()
            torch.cuda.synchronize()
        lines.append(f"-- {mode}: host ops over 20 steps (self CPU time)")
        lines.append(cpu_prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25,
                                                   max_name_column_width=60))
    text = "\n".join(lines)
    with open(os.path.join(args.out, "step_profile.txt"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
