"""lik.maxsim_residual on a GPU: realistic shapes against decompress + maxsim_packed, the gradient at a training
shape, no decompressed copy in memory, and a speed print (``pytest -m gpu -s``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import lik
from lik.compression import ResidualCodec
from lik.compression.packing import pack_residual_bits
from lik.ops.maxsim.reference_varlen import maxsim_packed_reference
from lik.ops.residual import decode_tokens, maxsim_residual

pytestmark = pytest.mark.gpu
CUDA = "cuda"


def corpus(n_docs, mean_len, dim=128, nbits=2, k=4096, seed=0, centroid_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    centroids = F.normalize(torch.randn(k, dim, generator=g), dim=-1).to(centroid_dtype)
    weights = torch.linspace(-0.05, 0.05, 2**nbits)
    codec = ResidualCodec(centroids.to(CUDA), torch.zeros(2**nbits - 1), weights, nbits)
    lengths = torch.randint(mean_len // 2, mean_len * 3 // 2 + 1, (n_docs,), generator=g)
    lengths[::97] = 0  # some empty documents
    t = int(lengths.sum())
    codes = torch.randint(0, k, (t,), generator=g, dtype=torch.int32).to(CUDA)
    residuals = pack_residual_bits(torch.randint(0, 2**nbits, (t, dim), device=CUDA), nbits)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(CUDA, torch.int32)
    return codec, codes, residuals, cu


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nbits", [1, 2, 4])
def test_matches_decompress_then_maxsim_packed(dtype, nbits):
    codec, codes, residuals, cu = corpus(2000, 120, nbits=nbits)
    Q = F.normalize(torch.randn(4, 32, 128, device=CUDA), dim=-1).to(dtype)
    q_mask = torch.rand(4, 32, device=CUDA) > 0.1
    out = maxsim_residual(Q, codes, residuals, codec, cu, q_mask=q_mask)
    want = lik.maxsim_packed(Q, codec.decompress(codes, residuals, dtype), cu, q_mask=q_mask)
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("n_q", [1, 256])
def test_float64_decode_and_fp16_centroids(n_q):
    codec, codes, residuals, cu = corpus(300, 100, centroid_dtype=torch.float16)
    Q = F.normalize(torch.randn(n_q, 32, 128, device=CUDA), dim=-1)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # true fp32 products
    try:
        out = maxsim_residual(Q, codes, residuals, codec, cu)
    finally:
        torch.set_float32_matmul_precision(precision)
    want = maxsim_packed_reference(Q.double(), decode_tokens(codec, codes, residuals, torch.float64), cu)
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)


def test_gradient_at_training_shape():
    codec, codes, residuals, cu = corpus(64, 180)
    Q = F.normalize(torch.randn(8, 32, 128, device=CUDA), dim=-1)
    g = torch.randn(8, 64, device=CUDA)
    q = Q.clone().requires_grad_(True)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # true fp32 products: winners as float64's but for near-ties
    try:
        (maxsim_residual(q, codes, residuals, codec, cu) * g).sum().backward()
    finally:
        torch.set_float32_matmul_precision(precision)
    q64 = Q.double().requires_grad_(True)
    d = decode_tokens(codec, codes, residuals, torch.float64)
    (maxsim_packed_reference(q64, d, cu) * g.double()).sum().backward()
    close = torch.isclose(q.grad.double(), q64.grad, atol=1e-4, rtol=1e-4).all(dim=-1)
    assert int((~close).sum()) <= 2, f"{int((~close).sum())} of {close.numel()} query-token gradients differ"
    assert q.grad.abs().sum() > 0


def test_no_decompressed_copy():
    codec, codes, residuals, cu = corpus(20000, 100)
    Q = torch.randn(1, 32, 128, device=CUDA, dtype=torch.float16)
    maxsim_residual(Q, codes, residuals, codec, cu)  # compile first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    maxsim_residual(Q, codes, residuals, codec, cu)
    torch.cuda.synchronize()
    decoded_bytes = codes.shape[0] * 128 * 2
    assert torch.cuda.max_memory_allocated() - before < decoded_bytes // 16


@pytest.mark.parametrize("n_q", [1, 32, 256])
@pytest.mark.parametrize("path", ["stream", "fallback", "heuristic"])
def test_scan_paths_match_the_decoded_copy(n_q, path):
    from lik.config import override
    from lik.config.residual import ResidualStreamConfig, residual_stream_config
    from lik.ops.residual import score_residual_packed

    codec, codes, residuals, cu = corpus(3000, 100, centroid_dtype=torch.float16)
    Q = F.normalize(torch.randn(n_q, 32, 128, device=CUDA), dim=-1).half()
    q_mask = torch.rand(n_q, 32, device=CUDA) > 0.1
    want = lik.maxsim_packed(Q, codec.decompress(codes, residuals, torch.float16), cu, q_mask=q_mask)
    if path == "heuristic":
        out = score_residual_packed(Q, q_mask, codes, residuals, codec, cu)
    else:
        tiles = residual_stream_config(q_len=32, n_queries=n_q, dim=128, dtype=Q.dtype, device=Q.device)
        if path == "stream" and tiles.chunk_tokens:  # the heuristic's fallback: force the 256-row stream tiles
            tiles = ResidualStreamConfig(32, 8, 64, 8, 2, 2, 128)
        forced = tiles if path == "stream" else ResidualStreamConfig(chunk_tokens=1 << 16)
        forced = dataclasses.replace(forced, byte_table=n_q == 32)  # both loaders
        with override(residual_stream=forced):
            out = score_residual_packed(Q, q_mask, codes, residuals, codec, cu)
    torch.testing.assert_close(out, want, atol=3e-2, rtol=3e-3)


def scan_corpus(n_tokens, dim=128, nbits=2, k=4096, seed=0):
    """About ``n_tokens`` tokens in documents of 50-150 (mean 100), random codes and packed bytes (any byte is a
    valid packed residual), fp16 centroids as ColBERT stores them."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    centroids = F.normalize(torch.randn(k, dim, device=CUDA, generator=g), dim=-1).half()
    codec = ResidualCodec(centroids, torch.zeros(2**nbits - 1), torch.linspace(-0.05, 0.05, 2**nbits), nbits)
    lengths = torch.randint(50, 151, (n_tokens // 100,), device=CUDA, generator=g)
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
    t = int(cu[-1])
    codes = torch.randint(0, k, (t,), device=CUDA, generator=g, dtype=torch.int32)
    residuals = torch.randint(0, 256, (t, dim * nbits // 8), device=CUDA, generator=g, dtype=torch.uint8)
    return codec, codes, residuals, cu


@pytest.mark.parametrize("n_tokens", [1_000_000, 5_000_000])
@pytest.mark.parametrize("n_q", [1, 32, 256])
def test_speed_print(n_q, n_tokens):
    """Prints (asserts nothing about time): the fused stream, the bounded-scratch fallback, the heuristic's choice,
    torch decompress + maxsim_packed, and maxsim_packed on a resident fp16 copy; the floor is
    max(bytes / 4.3 TB/s, FLOPs / 750 TFLOP/s) of the compressed scan (codes + residual bytes read once)."""
    from triton.testing import do_bench

    from lik.config import override
    from lik.config.residual import ResidualStreamConfig, residual_stream_config
    from lik.ops.residual import score_residual_packed

    codec, codes, residuals, cu = scan_corpus(n_tokens)
    t = codes.shape[0]
    Q = F.normalize(torch.randn(n_q, 32, 128, device=CUDA), dim=-1).half()
    tiles = residual_stream_config(q_len=32, n_queries=n_q, dim=128, dtype=Q.dtype, device=Q.device)
    stream = tiles if not tiles.chunk_tokens else ResidualStreamConfig(32, 8, 64, 8, 2, 2, 128)

    def timed(fn, forced=None):
        if forced is None:
            return do_bench(fn)
        with override(residual_stream=forced):
            return do_bench(fn)

    call = lambda: score_residual_packed(Q, None, codes, residuals, codec, cu)  # noqa: E731
    fused = timed(call, stream)
    fused_table = timed(call, dataclasses.replace(stream, byte_table=True))
    # one query: 128-token tiles on 8 warps (the packed stream's 128-token tile) against the heuristic's 64 on 4
    wide = timed(call, dataclasses.replace(stream, block_t=128, num_warps=8)) if n_q == 1 else float("nan")
    fallback = timed(call, ResidualStreamConfig(chunk_tokens=1 << 18))
    chosen = timed(call)
    plain = do_bench(lambda: lik.maxsim_packed(Q, codec.decompress(codes, residuals, torch.float16), cu))
    d16 = codec.decompress(codes, residuals, torch.float16)
    exact = do_bench(lambda: lik.maxsim_packed(Q, d16, cu))
    d16 = None  # (freed before the next case)
    flops = 2 * n_q * 32 * t * 128
    floor = max(t * (4 + residuals.shape[1]) / 4.3e12, flops / 750e12) * 1e3
    exact_floor = max(t * 256 / 4.3e12, flops / 750e12) * 1e3
    print(
        f"\nresidual scan Nq={n_q} T={t}: fused {fused:.3f} ms ({fused / exact:.2f}x resident; byte-table loader "
        f"{fused_table:.3f} ms; 128-token tiles {wide:.3f} ms), fallback "
        f"{fallback:.3f} ms ({fallback / exact:.2f}x), heuristic {'fallback' if tiles.chunk_tokens else 'fused'} "
        f"{chosen:.3f} ms, decompress+maxsim_packed {plain:.3f} ms, maxsim_packed resident fp16 {exact:.3f} ms; "
        f"floor {floor:.3f} ms (resident's {exact_floor:.3f} ms)"
    )
