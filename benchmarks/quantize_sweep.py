"""Launch sweep of ``lik.quantize``'s kernel at the benchmark's ``[3 000 000, 128]`` fp16.

    PYTHONPATH=src python3 benchmarks/quantize_sweep.py OUT_DIR

Each (rows per program, warps) launch is timed by ``triton.testing.do_bench`` (medians of three interleaved
rounds) beside ``lik.quantize`` as shipped, and its output compared bit for bit with ``lik.quantize``'s. The floor
is the bytes read and written (x, x_q, scale) at the copy rate of a ``clone`` of that many bytes in the same
process. Writes ``OUT_DIR/qsweep.json`` and prints the eight fastest launches per dtype.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch
import triton

import lik
from lik._config import cdiv
from lik.ops.quantization import kernel as quantization_kernel

N_ROWS, DIM = 3_000_000, 128


def launch(x: torch.Tensor, dtype: torch.dtype, rows: int, warps: int):
    x_q = torch.empty(x.shape, dtype=dtype, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)

    def run():
        quantization_kernel.quantize_rows_kernel[(cdiv(x.shape[0], rows),)](
            x, x_q, scale, x.shape[0], DIM, x.stride(0), x_q.stride(0),
            QMAX_VALUE=quantization_kernel.QMAX[dtype], TO_INT8=dtype == torch.int8, BLOCK_ROWS=rows, BLOCK_D=DIM,
            SINGLE_CHUNK=True, num_warps=warps,
        )
        return x_q, scale

    return run


def main() -> None:
    out = sys.argv[1]
    x = torch.randn(N_ROWS, DIM, device="cuda", dtype=torch.float16)
    floor_bytes = N_ROWS * DIM * 3 + N_ROWS * 4  # read fp16 x, write 1-byte x_q and fp32 scales
    copy_source = torch.empty(floor_bytes // 2, dtype=torch.float16, device="cuda")
    # a clone moves its bytes twice (read and write): half its time moves the floor's bytes once
    floor_ms = triton.testing.do_bench(lambda: copy_source.clone(), warmup=10, rep=100) / 2
    results = []
    for dtype in (torch.int8, torch.float8_e4m3fn):
        expected_q, expected_scale = lik.quantize(x, dtype)
        launches = {}
        for rows in (4, 8, 16, 32, 64, 128):
            for warps in (1, 2, 4, 8):
                if rows * DIM // (warps * 32) < 4:  # fewer than 4 elements per thread
                    continue
                run = launch(x, dtype, rows, warps)
                x_q, scale = run()
                same = torch.equal(x_q.view(torch.int8), expected_q.view(torch.int8)) and torch.equal(
                    scale, expected_scale)
                launches[(rows, warps)] = (run, same)
        times = {key: [] for key in launches}
        shipped = []
        for _ in range(3):
            shipped.append(triton.testing.do_bench(lambda: lik.quantize(x, dtype), warmup=10, rep=100))
            for key, (run, _) in launches.items():
                times[key].append(triton.testing.do_bench(run, warmup=10, rep=100))
        ranked = sorted((statistics.median(ms), key) for key, ms in times.items())
        row = dict(dtype=str(dtype), floor_ms=floor_ms, shipped_ms=statistics.median(shipped),
                   configs=[dict(rows=key[0], warps=key[1], ms=ms, same=launches[key][1]) for ms, key in ranked])
        results.append(row)
        print(f"{dtype}: copy floor {floor_ms:.3f} ms, shipped {row['shipped_ms']:.3f} "
              f"({floor_ms / row['shipped_ms']:.0%})")
        for ms, key in ranked[:8]:
            print(f"  rows {key[0]:4} warps {key[1]}: {ms:.3f} ms ({floor_ms / ms:.0%}) same={launches[key][1]}")
    with open(os.path.join(out, "qsweep.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=results), f, indent=1)


if __name__ == "__main__":
    main()
