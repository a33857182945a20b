"""lik.knn_points compiled for a real GPU: half precision, tensor-core products, atomics (``pytest -m gpu``)."""

import pytest
import torch

import lik
from lik.config import override
from lik.ops.knn import KnnConfig

from .test_knn import check_against_dense, dense_knn, dense_loss_grads


def _gpu_clouds(seed, n, p1_size, p2_size, dim, lengths1, lengths2, dtype):
    g = torch.Generator().manual_seed(seed)
    p1 = torch.randn(n, p1_size, dim, generator=g)
    p2 = torch.randn(n, p2_size, dim, generator=g)
    for t, lens in ((p1, lengths1), (p2, lengths2)):
        for c, length in enumerate(lens):
            t[c, length:] = float("nan")
    return (p1.to(dtype).cuda(), p2.to(dtype).cuda(), torch.tensor(lengths1).cuda(), torch.tensor(lengths2).cuda())


def _check_near_optimal(out, p1, p2, l1, l2, K, rel):
    """The listed distances are exact for the listed neighbours, sorted, and each is within ``rel`` of the true
    k-th distance (candidates that close may swap: products' error, or float32 rounding at these sizes). Returns
    the listed and the true indices."""
    p1c, p2c, l1c, l2c = p1.cpu(), p2.cpu(), l1.cpu(), l2.cpu()
    want, want_idx = dense_knn(p1c, p2c, l1c, l2c, K)
    dists, idx = out.dists.cpu().double(), out.idx.cpu()
    clouds = torch.arange(p1.shape[0])[:, None, None]
    near = p2c.double()[clouds, idx]
    exact = ((p1c.double()[:, :, None] - near) ** 2).sum(-1)
    valid = (torch.arange(p1.shape[1])[None, :, None] < l1c[:, None, None]) & (torch.arange(K) < l2c[:, None, None])
    torch.testing.assert_close(torch.where(valid, exact, 0), dists, rtol=1e-5, atol=1e-5)
    assert ((dists[..., 1:] >= dists[..., :-1]) | ~valid[..., 1:]).all()
    assert ((dists - want).abs() <= rel * want.abs() + 1e-4).all()
    return idx, want_idx


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("K", [1, 8, 32])
def test_gpu_point_clouds_match_dense(dtype, K):
    p1, p2, l1, l2 = _gpu_clouds(1, 3, 3000, 5000, 3, [3000, 1777, 0], [5000, 20, 4999], dtype)
    out = lik.knn_points(p1, p2, l1, l2, K=K, return_nn=True)
    idx, want_idx = _check_near_optimal(out, p1, p2, l1, l2, K, 1e-6)
    # Exact differences: only distances equal in float32 but not in float64 may order differently.
    assert (idx == want_idx).float().mean() > 0.999
    assert torch.equal(out.knn[0, :, :1], p2[0][out.idx[0, :, :1]])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, precision, rel", [
    (torch.float32, "highest", 1e-5), (torch.float32, "high", 1e-2), (torch.float16, "highest", 1e-2),
    (torch.bfloat16, "highest", 2e-2),
])
@pytest.mark.parametrize("K", [1, 32])
def test_gpu_feature_sets_on_tensor_cores(dtype, precision, rel, K):
    p1, p2, l1, l2 = _gpu_clouds(2, 2, 1500, 2500, 128, [1500, 1000], [2500, 31], dtype)
    saved = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision(precision)
        out = lik.knn_points(p1, p2, l1, l2, K=K)
    finally:
        torch.set_float32_matmul_precision(saved)
    _check_near_optimal(out, p1, p2, l1, l2, K, rel)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [KnnConfig("direct", block_m=64, block_n=32, num_warps=4),
                                 KnnConfig("products", "ieee", block_m=32, block_n=32, block_k=32)])
def test_gpu_forced_routes_with_non_finite_points(cfg):
    p1, p2, l1, l2 = _gpu_clouds(3, 2, 70, 90, 12, [70, 65], [90, 50], torch.float32)
    p2[0, 10, 3] = float("inf")
    p2[0, 11, 5] = float("nan")
    p1[1, 7, 0] = -float("inf")
    with override(knn=cfg):
        out = lik.knn_points(p1, p2, l1, l2, K=16)
    check_against_dense(type(out)(out.dists.cpu(), out.idx.cpu(), None), p1.cpu(), p2.cpu(), l1.cpu(), l2.cpu(), 16,
                        atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [3, 64])
def test_gpu_gradients_fast_and_deterministic(dim):
    p1, p2, l1, l2 = _gpu_clouds(4, 2, 2000, 1500, dim, [2000, 1200], [1500, 700], torch.float32)
    weights = torch.randn(2, 2000, 8, generator=torch.Generator().manual_seed(5)).cuda()
    want_a, want_b = dense_loss_grads(p1.cpu(), p2.cpu(), l1.cpu(), l2.cpu(), 8, 2, weights.cpu())
    grads = {}
    for mode in ("fast", "deterministic", "deterministic"):
        a, b = p1.clone().requires_grad_(), p2.clone().requires_grad_()
        (lik.knn_points(a, b, l1, l2, K=8, backward=mode).dists * weights).sum().backward()
        torch.testing.assert_close(a.grad.cpu().double(), want_a, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b.grad.cpu().double(), want_b, rtol=1e-4, atol=1e-4)
        grads.setdefault(mode, []).append(b.grad)
    assert torch.equal(*grads["deterministic"])


@pytest.mark.gpu
def test_gpu_large_cloud_memory_is_linear():
    n, p, K = 1, 200_000, 8
    p1 = torch.rand(n, p, 3, device="cuda")
    p2 = torch.rand(n, p, 3, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = lik.knn_points(p1, p2, K=K)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < 4 * n * p * K * 12 + (64 << 20)      # the outputs and the coordinate-major copies, no P x P
    sample = torch.randint(0, p, (64,), device="cuda")
    d = ((p1[0, sample, None] - p2[0, None]) ** 2).sum(-1)
    torch.testing.assert_close(out.dists[0, sample], d.topk(K, largest=False).values, rtol=1e-5, atol=1e-6)
