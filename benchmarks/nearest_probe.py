"""Timing probe of the fused nearest-centroid kernel (:mod:`lik.compression.nearest`) on a GPU.

    python3 benchmarks/nearest_probe.py --tokens 50000000 --centroids 65536 --out $OUT/nearest

Assigns ``--tokens`` unit fp16 tokens (d = 128, made on the device in pieces of ``--piece`` tokens) to
``--centroids`` unit centroids, with and without the L2 bias and with and without the centroid loop's software
pipeline, and prints TFLOP/s (``2 * N * K * d`` per call); checks a 1 Mi-token slice against the PyTorch
reference (the rounded operands multiplied in fp32, then argmax: agreement and the reference's own time); times
k-means on ``--kmeans-tokens`` tokens (fp16 and fp32 products) and the codec's compression of 4 Mi tokens as it
is. Writes ``nearest_probe.json``; starts no new measurement past ``--time-budget-s``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # a checkout without installing lik

from lik.compression import ResidualCodec, kmeans  # noqa: E402
from lik.compression import nearest  # noqa: E402
from lik.compression.nearest import nearest_centroid, nearest_centroid_reference  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=50_000_000)
    parser.add_argument("--centroids", type=int, default=1 << 16)
    parser.add_argument("--piece", type=int, default=1 << 24, help="tokens per kernel call")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--kmeans-tokens", type=int, default=1 << 22, help="k-means training sample (GPU only)")
    parser.add_argument("--time-budget-s", type=float, default=60.0)
    parser.add_argument("--out", default=".")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "args": vars(args)}

    def save():
        (out / "nearest_probe.json").write_text(json.dumps(result, indent=1))

    g = torch.Generator(device=device).manual_seed(0)
    c = F.normalize(torch.randn(args.centroids, args.dim, generator=g, device=device), dim=-1).half()
    piece = F.normalize(torch.randn(min(args.piece, args.tokens), args.dim, generator=g, device=device), dim=-1)
    piece = piece.half()
    nearest_centroid(piece[:4096], c)  # compile
    nearest_centroid(piece[:4096], c, bias=None)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    runs = [("l2", 3), (None, 3), ("l2", 1)]  # (bias, pipeline stages of the centroid loop; 1: not pipelined)
    for bias, stages in runs:
        name = f"bias_{bias}_stages_{stages}"
        if time.perf_counter() - started > args.time_budget_s:
            result[name] = "past the time budget"
            break
        nearest.STAGES = stages
        nearest_centroid(piece[:4096], c, bias=bias)  # compile this variant
        sync()
        t0 = time.perf_counter()
        done = 0
        while done < args.tokens:
            n = min(piece.shape[0], args.tokens - done)
            nearest_centroid(piece[:n], c, bias=bias)
            done += n
        sync()
        seconds = time.perf_counter() - t0
        tflops = 2 * args.tokens * args.centroids * args.dim / seconds / 1e12
        result[name] = {"seconds": seconds, "tflops": tflops}
        size = f"{args.tokens} x {args.centroids}"
        print(f"nearest_centroid bias={bias} stages={stages}: {size} in {seconds:.2f} s = {tflops:.0f} TFLOP/s")
        save()
    nearest.STAGES = 3
    if time.perf_counter() - started < args.time_budget_s:
        x = piece[: 1 << 20]
        codes, scores = nearest_centroid(x, c)
        sync()
        t0 = time.perf_counter()
        ref_codes, ref_scores = nearest_centroid_reference(x, c)
        sync()
        ref_s = time.perf_counter() - t0
        agree = float((codes == ref_codes).float().mean())
        err = float((scores - ref_scores).abs().max())
        result["reference_1m"] = {"seconds": ref_s, "agreement": agree, "max_score_diff": err}
        print(
            f"reference (fp32 product of the fp16 operands + argmax), 1 Mi tokens: {ref_s * 1e3:.0f} ms; "
            f"codes agree {agree:.5f}, max score diff {err:.2e}"
        )
    train = piece[: args.kmeans_tokens].float()
    for dtype in (torch.float16, torch.float32):
        if time.perf_counter() - started > args.time_budget_s or device.type != "cuda":
            break
        sync()
        t0 = time.perf_counter()
        kmeans(train, args.centroids, niters=4, seed=0, matmul_dtype=dtype)
        sync()
        seconds = time.perf_counter() - t0
        result[f"kmeans_{dtype}"] = seconds
        print(f"kmeans {train.shape[0]} tokens -> {args.centroids}, 4 iterations, {dtype} products: {seconds:.2f} s")
        save()
    if time.perf_counter() - started < args.time_budget_s and device.type == "cuda":
        # The codec's compression as it is (its own assignment), on 4 Mi tokens: the build's per-token cost.
        codec = ResidualCodec(c.float(), torch.tensor([-0.02, 0.0, 0.02]), torch.tensor([-0.03, -0.01, 0.01, 0.03]), 2)
        x = piece[: 1 << 22]
        codec.compress(x[:4096])
        sync()
        t0 = time.perf_counter()
        codec.compress(x)
        sync()
        seconds = time.perf_counter() - t0
        result["codec_compress_4mi_s"] = seconds
        print(f"ResidualCodec.compress 4 Mi tokens ({args.centroids} centroids): {seconds:.2f} s")
        save()
    if device.type == "cuda":
        result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    save()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
