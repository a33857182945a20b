"""ResidualCodec: compress / decompress against float64 references, training as ColBERT trains, refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lik.compression import ResidualCodec, unpack_residual_bits
from lik.compression.sampling import (
    bucket_cutoffs_and_weights,
    num_partitions,
    num_sampled_documents,
    quantile,
    sample_document_ids,
    split_heldout,
)

from .helpers import decode_reference, encode_reference


def _unit(n, d, seed, dtype=torch.float32):
    return F.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed)), dim=-1).to(dtype)


def _codec(nbits, d=24, k=16, seed=0):
    sample = _unit(600, d, seed).half()
    return ResidualCodec.train(sample, k, nbits, niters=5, seed=seed)


@pytest.mark.parametrize("nbits", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_compress_and_decompress_match_float64_reference(nbits, dtype):
    codec = _codec(nbits)
    x = _unit(37, 24, 1, dtype)
    codes, residuals = codec.compress(x)
    assert codes.dtype == torch.int32 and residuals.dtype == torch.uint8 and residuals.shape == (37, 24 * nbits // 8)
    ref_codes, ref_buckets = encode_reference(x, codec.centroids, codec.bucket_cutoffs)
    assert torch.equal(codes.long(), ref_codes)
    assert torch.equal(unpack_residual_bits(residuals, nbits).long(), ref_buckets)
    out = codec.decompress(codes, residuals)
    expected = decode_reference(ref_codes, ref_buckets, codec.centroids, codec.bucket_weights)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=0)
    assert torch.equal(codec.decompress(codes.long(), residuals, dtype=torch.float16), out.half())


def test_more_bits_reconstruct_better():
    x = _unit(300, 32, 5)
    errors = []
    for nbits in (1, 2, 4):
        codec = ResidualCodec.train(x, 8, nbits, niters=5)
        errors.append(float((codec.decompress(*codec.compress(x)) - x).norm(dim=1).mean()))
    assert errors[0] > errors[1] > errors[2]


def test_empty_and_single_row():
    codec = _codec(2)
    codes, residuals = codec.compress(torch.empty(0, 24))
    assert codes.shape == (0,) and residuals.shape == (0, 6)
    assert codec.decompress(codes, residuals).shape == (0, 24)
    one = _unit(1, 24, 3)
    assert codec.decompress(*codec.compress(one)).shape == (1, 24)


def test_non_contiguous_input():
    codec = _codec(2)
    x = _unit(24, 40, 4).T[:, :24]  # [40, 24] strided view
    assert not x.is_contiguous()
    codes, residuals = codec.compress(x)
    c2, r2 = codec.compress(x.contiguous())
    assert torch.equal(codes, c2) and torch.equal(residuals, r2)


def test_bucket_boundaries_follow_bucketize():
    # A residual equal to a cutoff goes to the lower bucket (cutoffs[i-1] < r <= cutoffs[i]), as torch.bucketize.
    centroids = torch.zeros(1, 8)
    codec = ResidualCodec(centroids, torch.tensor([-0.5, 0.0, 0.5]), torch.tensor([-1.0, -0.25, 0.25, 1.0]), 2)
    x = torch.tensor([[-0.6, -0.5, -0.1, 0.0, 0.1, 0.5, 0.6, 2.0]])
    _, residuals = codec.compress(x)
    assert unpack_residual_bits(residuals, 2).tolist() == [[0, 0, 1, 1, 2, 2, 3, 3]]


def test_train_follows_colberts_recipe():
    sample = _unit(1000, 16, 7).half()
    codec = ResidualCodec.train(sample, 8, 2, niters=3, seed=3)
    assert codec.num_centroids == 8 and codec.dim == 16 and codec.nbits == 2 and codec.packed_dim == 4
    torch.testing.assert_close(codec.centroids.norm(dim=1), torch.ones(8))
    _, heldout = split_heldout(sample, seed=3)
    assert heldout.shape[0] == 50  # 5% of 1000
    residual = heldout.float() - codec.centroids[codec.compress_into_codes(heldout).long()]
    levels = torch.tensor([0.25, 0.5, 0.75])
    assert torch.equal(codec.bucket_cutoffs, torch.quantile(residual, levels))
    assert torch.equal(codec.bucket_weights, torch.quantile(residual, torch.tensor([0.125, 0.375, 0.625, 0.875])))
    assert float(codec.avg_residual) == pytest.approx(float(residual.abs().mean()), rel=1e-5)


@pytest.mark.parametrize("n", [1, 2, 3, 10, 1001])
def test_quantile_equals_torch_quantile(n):
    values = torch.randn(n, 3, generator=torch.Generator().manual_seed(n))
    q = torch.tensor([0.0, 0.0625, 0.25, 0.5, 0.9375, 1.0])
    assert torch.equal(quantile(values, q), torch.quantile(values, q))


def test_buckets_from_a_known_distribution():
    cutoffs, weights = bucket_cutoffs_and_weights(torch.arange(9.0).reshape(9, 1), 1)
    assert cutoffs.tolist() == [4.0] and weights.tolist() == [2.0, 6.0]


def test_colbert_plan_numbers():
    assert num_partitions(5_000_000) == 2**15
    assert num_partitions(1) == 16
    assert num_sampled_documents(10) == 10
    assert num_sampled_documents(1_000_000) == 1 + int(16 * (120 * 1_000_000) ** 0.5)
    ids = sample_document_ids(100_000, seed=1)
    assert ids.shape == (num_sampled_documents(100_000),) and ids.unique().numel() == ids.numel()
    assert torch.equal(ids, sample_document_ids(100_000, seed=1))
    train, held = split_heldout(torch.randn(10, 8))
    assert train.shape == (10, 8) and held.shape == (0, 8)


def test_bad_arguments_are_refused():
    c = torch.zeros(4, 16)
    cut, w = torch.zeros(3), torch.zeros(4)
    with pytest.raises(ValueError, match="nbits must be 1, 2 or 4"):
        ResidualCodec(c, cut, w, 3)
    with pytest.raises(ValueError, match="dim must be a positive multiple of 8"):
        ResidualCodec(torch.zeros(4, 12), cut, w, 2)
    with pytest.raises(ValueError, match="bucket_cutoffs must have 3 values"):
        ResidualCodec(c, torch.zeros(2), w, 2)
    with pytest.raises(ValueError, match="bucket_weights must have 4 values"):
        ResidualCodec(c, cut, torch.zeros(5), 2)
    with pytest.raises(ValueError, match="non-decreasing"):
        ResidualCodec(c, torch.tensor([1.0, 0.0, 2.0]), w, 2)
    with pytest.raises(TypeError, match="centroids must be a floating tensor"):
        ResidualCodec(c.long(), cut, w, 2)
    codec = ResidualCodec(c, cut, w, 2)
    with pytest.raises(ValueError, match="embs must have 16 columns"):
        codec.compress(torch.zeros(2, 8))
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 4\)"):
        codec.decompress(torch.tensor([4], dtype=torch.int32), torch.zeros(1, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"residuals must have shape \[1, 4\]"):
        codec.decompress(torch.tensor([0]), torch.zeros(1, 8, dtype=torch.uint8))
    with pytest.raises(TypeError, match="codes must be int32 or int64"):
        codec.decompress(torch.tensor([0.0]), torch.zeros(1, 4, dtype=torch.uint8))
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="embs must be finite"):
            codec.compress(torch.tensor([[0.0] * 15 + [bad]]))
    with pytest.raises(ValueError, match="num_centroids must be a positive int"):
        ResidualCodec.train(torch.randn(10, 8), 0, 2)
    with pytest.raises(ValueError, match="x must be finite"):
        ResidualCodec.train(torch.full((10, 8), float("nan")), 2, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("nbits", [1, 2, 4])
def test_gpu_codec_equals_cpu_codec(nbits):
    codec = _codec(nbits, d=128, k=64)
    x = _unit(5000, 128, 9)
    codes, residuals = codec.compress(x)
    gpu = codec.to("cuda")
    g_codes, g_residuals = gpu.compress(x.cuda())
    # The argmax may differ on a near-tie of two centroids (cuBLAS vs CPU rounding); allow a handful.
    assert (g_codes.cpu() != codes).sum() <= 5
    same = g_codes.cpu() == codes
    assert (g_residuals.cpu()[same] != residuals[same]).any(dim=1).sum() <= 5
    torch.testing.assert_close(gpu.decompress(codes.cuda(), residuals.cuda()).cpu(), codec.decompress(codes, residuals))


def test_train_codec_follows_colberts_plan():
    from lik.compression import train_codec

    g = torch.Generator().manual_seed(11)
    lengths = torch.randint(0, 9, (300,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    tokens = F.normalize(torch.randn(int(cu[-1]), 16, generator=g), dim=-1).half()
    codec = train_codec(tokens, cu.int(), 2, seed=1)
    sampled = sample_document_ids(300, seed=1)
    assert sampled.numel() == 300  # 16 * sqrt(120 * 300) > 300: every document
    assert codec.num_centroids == num_partitions(300 * int(lengths.sum()) / 300)
    # The same codec as training on the sampled documents' tokens directly.
    rows = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in sampled.tolist()])
    direct = ResidualCodec.train(tokens[rows], codec.num_centroids, 2, seed=1)
    assert torch.equal(codec.centroids, direct.centroids) and torch.equal(codec.bucket_weights, direct.bucket_weights)
    assert train_codec(tokens, cu, 1, num_centroids=8, niters=1).num_centroids == 8
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0"):
        train_codec(tokens, cu[:-1], 2)
    with pytest.raises(TypeError, match="cu_seqlens must be an integer tensor"):
        train_codec(tokens, cu.float(), 2)
    with pytest.raises(ValueError, match="hold no token"):
        train_codec(tokens[:0], torch.zeros(4, dtype=torch.int64), 2)
