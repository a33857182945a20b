"""The machine's ceilings, measured in one process: what "% of floor" in BENCHMARKS.md is relative to.

``lik bench --ceilings --out DIR`` measures, with the same timer as the benchmark (``do_bench`` medians, L2
flushed):

* device memory bandwidth: a large device-to-device ``copy_`` (counted read + write, as the floors count bytes);
* matmul rate per dtype: a square ``a @ b`` through cuBLAS for float16, bfloat16, float32 with TF32 (the
  precision ``torch.set_float32_matmul_precision("high")`` gives) and float32 in full precision; int8
  (``torch._int_mm``, int32 accumulation) and float8 e4m3 (``torch._scaled_mm``) where the GPU and torch have them;
* host streaming: a pinned host-to-device copy (the ceiling of a corpus searched from host RAM) and its reverse.

Writes ``DIR/ceilings.json`` and prints one line per ceiling. ``--smoke`` runs small sizes on the CPU (no
pinned copies, no 8-bit matmuls): it checks the plumbing, not the machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .measure import Timer, eight_bit_matmuls, free_memory, matmul_rate, median_rate

__all__ = ["measure_all", "format_ceilings", "main"]


def measure_all(timer: Timer, *, copy_bytes: int, matmul_n: int, host_bytes: int) -> dict:
    """Measure every ceiling on ``timer.device``; failures are recorded per ceiling, not raised."""
    device = timer.device
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    gen = torch.Generator(device=device).manual_seed(1)
    src = torch.randn(copy_bytes // 2, device=device, dtype=torch.float16, generator=gen)
    dst = torch.empty_like(src)
    rate, ms = median_rate(timer, lambda dst=dst, src=src: dst.copy_(src), 2.0 * copy_bytes)
    results["device_copy"] = {"what": f"copy_ of {copy_bytes / 2**20:.0f} MiB (read + write)", "median_ms": ms,
                              "GBps": rate / 1e9}
    del src, dst
    free_memory(device)

    results["matmul"] = {}
    for name in ["fp16", "bf16", "fp32-tf32", "fp32", *eight_bit_matmuls(device)]:
        try:
            results["matmul"][name] = matmul_rate(timer, name, matmul_n, device)
        except Exception as exc:  # an op this torch / GPU lacks: recorded, the others still run
            results["matmul"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        free_memory(device)

    if device.type == "cuda":
        host = torch.empty(host_bytes, dtype=torch.uint8, pin_memory=True)
        on_device = torch.empty(host_bytes, dtype=torch.uint8, device=device)
        rate, ms = median_rate(timer, lambda: on_device.copy_(host, non_blocking=True), float(host_bytes))
        results["pinned_h2d"] = {"what": f"{host_bytes / 2**20:.0f} MiB pinned host -> device", "median_ms": ms,
                                 "GBps": rate / 1e9}
        rate, ms = median_rate(timer, lambda: host.copy_(on_device, non_blocking=True), float(host_bytes))
        results["pinned_d2h"] = {"what": f"{host_bytes / 2**20:.0f} MiB device -> pinned host", "median_ms": ms,
                                 "GBps": rate / 1e9}
        del host, on_device
        free_memory(device)
    return results


def format_ceilings(results: dict) -> str:
    """One line per ceiling."""
    lines = [f"ceilings on {results['device']}"]
    for key in ("device_copy", "pinned_h2d", "pinned_d2h"):
        if key in results:
            r = results[key]
            lines.append(f"  {key:16s} {r['GBps']:9.1f} GB/s     ({r['what']}, {r['median_ms']:.3f} ms)")
    for name, r in results["matmul"].items():
        if "error" in r:
            lines.append(f"  matmul {name:9s} unavailable: {r['error']}")
        else:
            lines.append(f"  matmul {name:9s} {r['TFLOPps']:9.1f} TFLOP/s  ({r['what']}, {r['median_ms']:.3f} ms)")
    return "\n".join(lines)


def main(out: str, *, smoke: bool, warmup_ms: float = 25.0, rep_ms: float = 100.0) -> dict:
    """Entry point of ``lik bench --ceilings``: measure, write ``out/ceilings.json``, print the lines."""
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    if device.type != "cuda" and not smoke:
        raise SystemExit("lik bench --ceilings: no CUDA device; add --smoke for the CPU plumbing check")
    timer = Timer(device, warmup_ms=warmup_ms, rep_ms=20.0 if smoke else rep_ms)
    sizes = dict(copy_bytes=2**22, matmul_n=128, host_bytes=2**20) if smoke else dict(
        copy_bytes=2**30, matmul_n=8192, host_bytes=2**30)
    results = measure_all(timer, **sizes)
    results["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "ceilings.json").write_text(json.dumps(results, indent=1, default=str))
    print(format_ceilings(results))
    return results
