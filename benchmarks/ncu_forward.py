"""Driver for Nsight Compute: one ``lik.maxsim`` forward launch of a chosen shape and storage, to profile (GPU).

Builds a unit-norm query ``[Lq, d]`` and ``B`` documents ``[B, Ld, d]``, quantizes both per token when ``--dtype``
is ``int8`` or ``fp8``, and calls ``lik.maxsim`` ``--calls`` times (the first compiles). Profile the last call:

    ncu --clock-control none -k regex:maxsim_fwd_kernel --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python3 benchmarks/ncu_forward.py --dtype fp8 --lq 1024 --ld 1024 --b 1000
"""

from __future__ import annotations

import argparse

import torch

import lik

DTYPES = {"fp16": torch.float16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--lq", type=int, default=1024)
    parser.add_argument("--ld", type=int, default=1024)
    parser.add_argument("--b", type=int, default=1000)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(args.lq, args.d, device="cuda"), dim=-1).half()
    d = torch.nn.functional.normalize(torch.randn(args.b, args.ld, args.d, device="cuda"), dim=-1).half()
    if args.dtype == "fp16":
        def score():
            return lik.maxsim(q, d)
    else:
        q8, q_scale = lik.quantize(q, DTYPES[args.dtype])
        d8, d_scale = lik.quantize(d, DTYPES[args.dtype])

        def score():
            return lik.maxsim(q8, d8, q_scale=q_scale, d_scale=d_scale)
    for _ in range(args.calls):
        scores = score()
    torch.cuda.synchronize()
    print(args.dtype, args.lq, args.ld, args.b, float(scores.sum()))


if __name__ == "__main__":
    main()
