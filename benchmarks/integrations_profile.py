"""Where the time of PyLate's Contrastive step goes with lik.integrations.pylate enabled: torch.profiler over a
few steps (device-side work and host synchronisations), run beside integrations_bench.py on the device."""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, "benchmarks")
import integrations_bench as bench  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minilm", required=True)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    bench._stub_missing(["datasets", "ujson", "voyager", "sqlitedict", "fast_plaid", "fastkmeans", "pandas",
                         "accelerate"])
    step, lik_pylate = bench.pylate_step(args.minilm, args.batch)
    for use_lik in (False, True):
        if use_lik:
            lik_pylate.enable()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        lik_pylate.disable()
        events = prof.key_averages()
        print(f"===== lik={use_lik} B={args.batch}")
        syncs = [e for e in events if "Synchronize" in e.key or "DtoH" in e.key or "_local_scalar" in e.key
                 or "item" == e.key.split("::")[-1]]
        for e in syncs:
            print(f"sync-like {e.key}: count {e.count}, cpu total {e.cpu_time_total / 1e3:.2f} ms")
        print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
        print(events.table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=60))


if __name__ == "__main__":
    main()
