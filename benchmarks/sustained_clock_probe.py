"""SM clock and power while the compute-bound fp16 and fp8 cells run short (ColPali B = 1 000, 0.3-0.45 ms a
call) and long (B = 10 000, 3-4.5 ms a call), beside cuBLAS's fp16 and fp8 GEMMs of 8 192 x 8 192 x 16 384
(``torch._scaled_mm`` with fast accumulation): whether the fp8 / fp16 ratio of lik's long calls is set by the
clock the power cap leaves each, and what the same cap leaves cuBLAS.

    PYTHONPATH=src python3 benchmarks/sustained_clock_probe.py OUTDIR   # OUTDIR/smi.csv, OUTDIR/sustained.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch
import triton

import lik


def main() -> None:
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(1024, 128, device="cuda"), dim=-1)
    q16 = q.half()
    cells = {}
    for n_docs in (1000, 10000):
        d = torch.nn.functional.normalize(torch.randn(n_docs, 1024, 128, device="cuda"), dim=-1).half()
        (q8, qs), (d8, ds) = lik.quantize(q, torch.float8_e4m3fn), lik.quantize(d, torch.float8_e4m3fn)
        cells[f"lik fp16 B{n_docs}"] = (lambda d=d: lik.maxsim(q16, d), 2.0 * 1024 * n_docs * 1024 * 128)
        cells[f"lik fp8 B{n_docs}"] = (lambda q8=q8, qs=qs, d8=d8, ds=ds: lik.maxsim(q8, d8, q_scale=qs, d_scale=ds),
                                       2.0 * 1024 * n_docs * 1024 * 128)
    m, n, k = 8192, 8192, 16384
    a, b = torch.randn(m, k, device="cuda").half(), torch.randn(n, k, device="cuda").half()
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    cells["cuBLAS fp16"] = (lambda: a @ b.t(), 2.0 * m * n * k)
    cells["cuBLAS fp8"] = (lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16,
                                                    use_fast_accum=True), 2.0 * m * n * k)
    for fn, _ in cells.values():
        fn()
    torch.cuda.synchronize()
    log = open(os.path.join(out, "smi.csv"), "w")
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active",
                            "--format=csv,noheader,nounits", "-lms", "50", "-i", os.environ.get("SMI_GPU", "0")],
                           stdout=log)
    time.sleep(1.0)
    phases = []
    for _ in range(2):
        for name, (fn, flops) in cells.items():
            t0 = time.time()
            ms = [triton.testing.do_bench(fn, warmup=20, rep=300) for _ in range(3)]
            phases.append({"cell": name, "t0": t0, "t1": time.time(), "ms": ms, "tflops": flops / min(ms) / 1e9})
    time.sleep(0.5)
    smi.terminate()
    log.close()
    samples = []
    for line in open(os.path.join(out, "smi.csv")):
        parts = [p.strip() for p in line.split(",")]
        try:
            stamp = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S")) + float(
                "0." + parts[0].split(".")[1])
            samples.append((stamp, float(parts[1]), float(parts[2])))
        except (ValueError, IndexError):
            continue
    offset = 0.0
    if samples:  # nvidia-smi stamps local time; align its first sample with the probe's start
        offset = phases[0]["t0"] - 1.0 - samples[0][0]
    for phase in phases:
        inside = [(c, p) for s, c, p in samples if phase["t0"] <= s + offset <= phase["t1"]]
        phase["sm_clock_mhz"] = statistics.median(c for c, _ in inside) if inside else None
        phase["power_w"] = statistics.median(p for _, p in inside) if inside else None
    with open(os.path.join(out, "sustained.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "phases": phases}, f, indent=1)
    for p in phases:
        print(f"{p['cell']:18s} {min(p['ms']):8.4f} ms  {p['tflops']:7.1f} TFLOP/s  clock {p['sm_clock_mhz']} MHz  "
              f"power {p['power_w']} W")


if __name__ == "__main__":
    main()
