"""SM clock, power and throttle reasons (``nvidia-smi`` sampled every 50 ms) while lik's fp16 and fp8 ColPali cells
(1 024 x 1 024 tokens, B = 1 000) run in alternating phases of six ``do_bench`` medians each: whether a cell's
spread between runs follows the clock the power cap leaves it.

    PYTHONPATH=src python3 benchmarks/clock_probe.py OUTDIR      # writes OUTDIR/smi.csv and OUTDIR/clock_probe.json
"""
import json, os, subprocess, sys, time, statistics
import torch, triton
import lik
out = sys.argv[1]
torch.manual_seed(0)
q = torch.nn.functional.normalize(torch.randn(1, 1024, 128, device="cuda"), dim=-1)
d = torch.nn.functional.normalize(torch.randn(1000, 1024, 128, device="cuda"), dim=-1)
cells = {"fp16": (q.half(), d.half(), {}),}
dq, ds = lik.quantize(d, torch.float8_e4m3fn)
cells["fp8"] = (q, dq, {"d_scale": ds})
log = open(os.path.join(out, "smi.csv"), "w")
smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active",
                        "--format=csv,noheader,nounits", "-lms", "50"], stdout=log)
time.sleep(1.0)
phases = []
for name in ["fp16", "fp8", "fp16", "fp8", "fp16"]:
    Q, D, kw = cells[name]
    fn = lambda: lik.maxsim(Q, D, **kw)
    fn(); torch.cuda.synchronize()
    t0 = time.time()
    ms = [triton.testing.do_bench(fn, warmup=20, rep=300) for _ in range(6)]
    t1 = time.time()
    phases.append((name, t0, t1, ms))
    print(name, " ".join(f"{m:.4f}" for m in ms), flush=True)
    time.sleep(0.5)
smi.terminate(); smi.wait(); log.close()
rows = []
for line in open(os.path.join(out, "smi.csv")):
    parts = [p.strip() for p in line.split(",")]
    try:
        ts = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S")) + float("0." + parts[0].split(".")[1])
        rows.append((ts, float(parts[1]), float(parts[2]), float(parts[3]), float(parts[4]), parts[5]))
    except Exception:
        pass
summary = []
for name, t0, t1, ms in phases:
    inside = [r for r in rows if t0 <= r[0] <= t1]
    if inside:
        s = dict(cell=name, ms=ms, samples=len(inside), sm_mhz=statistics.median(r[1] for r in inside),
                 sm_mhz_min=min(r[1] for r in inside), mem_mhz=statistics.median(r[2] for r in inside),
                 power_w=statistics.median(r[3] for r in inside), power_w_max=max(r[3] for r in inside),
                 temp_c=statistics.median(r[4] for r in inside), throttle=sorted({r[5] for r in inside}))
    else:
        s = dict(cell=name, ms=ms, samples=0)
    summary.append(s)
    print(json.dumps(s), flush=True)
json.dump(dict(device=torch.cuda.get_device_name(), phases=summary), open(os.path.join(out, "clock_probe.json"), "w"), indent=1)
