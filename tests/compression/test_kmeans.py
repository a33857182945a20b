"""k-means: convergence on separable clusters, determinism, k > N and empty clusters, refusals, GPU parity."""

from __future__ import annotations

import time

import pytest
import torch

from lik.compression import assign_to_centroids, kmeans


def _blobs(k=4, per=50, d=8, spread=0.01, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(k, d, generator=g) * 10
    x = (centers.unsqueeze(1) + spread * torch.randn(k, per, d, generator=g)).reshape(k * per, d)
    return x, centers


def test_finds_separable_clusters():
    x, centers = _blobs()
    blob = torch.arange(200) // 50
    # Lloyd's algorithm from random points (faiss's start, ColBERT's) can put two centroids in one blob; the claim is
    # convergence from a start with one point per blob. niters=0 returns the start, so the seed is chosen here.
    seed = next(
        s for s in range(100) if blob[assign_to_centroids(kmeans(x, 4, niters=0, seed=s), x)[0]].unique().numel() == 4
    )
    start = kmeans(x, 4, niters=0, seed=seed)
    c = kmeans(x, 4, niters=20, seed=seed)
    dist = torch.cdist(centers, c)
    assert (torch.cdist(centers, start).min(dim=1).values > 0.01).all()  # the start is not the answer already
    assert (dist.min(dim=1).values < 0.01).all()  # each true center has a centroid within the blob's spread
    assert dist.argmin(dim=1).unique().numel() == 4
    codes, _ = assign_to_centroids(x, c)
    assert codes.reshape(4, 50).unique(dim=1).shape[1] == 1  # a blob stays in one cluster


def test_centroids_are_cluster_means_at_convergence():
    x, _ = _blobs(k=3, per=20, d=5, spread=1.0, seed=2)
    c = kmeans(x.double(), 3, niters=50, seed=0)
    codes, _ = assign_to_centroids(x, c)
    for j in range(3):
        torch.testing.assert_close(c[j].double(), x[codes == j].double().mean(0), atol=1e-5, rtol=0)


def test_deterministic_with_a_seed():
    x, _ = _blobs(k=6, per=30, spread=3.0)
    assert torch.equal(kmeans(x, 6, seed=5), kmeans(x, 6, seed=5))
    assert not torch.equal(kmeans(x, 6, niters=0, seed=5), kmeans(x, 6, niters=0, seed=6))


def test_more_centroids_than_points():
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    c = kmeans(x, 9, niters=3)
    assert c.shape == (9, 8) and torch.isfinite(c).all()
    # Every point is a centroid (each its own cluster), the surplus repeat points.
    assert (torch.cdist(x, c).min(dim=1).values < 1e-5).all()
    assert (torch.cdist(c, x).min(dim=1).values < 1e-5).all()


def test_empty_cluster_is_reseeded():
    # Duplicate points: the start picks equal centroids, one of which can win no point and must move.
    x = torch.cat([torch.zeros(10, 4), torch.ones(10, 4) * 5, torch.full((1, 4), -7.0)])
    c = kmeans(x, 3, niters=10, seed=0)
    codes, _ = assign_to_centroids(x, c)
    assert torch.bincount(codes, minlength=3).min() > 0
    for target in (0.0, 5.0, -7.0):
        assert (c - target).abs().amax(dim=1).min() < 1e-6


def test_assignment_ties_go_to_the_lower_centroid():
    codes, dist = assign_to_centroids(torch.zeros(3, 2), torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]))
    assert codes.tolist() == [0, 0, 0] and torch.equal(dist, torch.ones(3))


def test_half_precision_input_accumulates_in_fp32():
    x, centers = _blobs(k=2, per=100, d=8, spread=0.1)
    c = kmeans(x.half(), 2, seed=0)
    assert c.dtype == torch.float32
    assert (torch.cdist(centers, c).min(dim=1).values < 0.1).all()


@pytest.mark.parametrize("matmul_dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_matmul_dtypes_find_the_same_clusters(matmul_dtype):
    x, _ = _blobs(k=3, per=40, d=8, spread=0.5, seed=4)
    ref = kmeans(x, 3, seed=2)
    other = kmeans(x, 3, seed=2, matmul_dtype=matmul_dtype)
    assert other.dtype == torch.float32
    # Well-separated blobs: the same partition, so the same means up to the sums' rounding.
    torch.testing.assert_close(other, ref, atol=1e-5, rtol=0)
    with pytest.raises(TypeError, match="matmul_dtype must be a floating dtype"):
        kmeans(x, 3, matmul_dtype=torch.int32)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="x must be a 2-D tensor"):
        kmeans(torch.zeros(4), 2)
    with pytest.raises(ValueError, match="at least one row"):
        kmeans(torch.zeros(0, 4), 2)
    with pytest.raises(TypeError, match="x must be a floating tensor"):
        kmeans(torch.zeros(4, 4, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="k must be a positive int"):
        kmeans(torch.zeros(4, 4), 0)
    with pytest.raises(ValueError, match="niters must be a non-negative int"):
        kmeans(torch.zeros(4, 4), 2, niters=-1)
    with pytest.raises(ValueError, match="x must be finite"):
        kmeans(torch.tensor([[float("inf"), 0.0]]), 1)


@pytest.mark.gpu
def test_gpu_matches_cpu_and_is_fast():
    g = torch.Generator().manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(200_000, 128, generator=g), dim=-1)
    torch.use_deterministic_algorithms(True)
    try:
        cpu = kmeans(x[:20_000], 256, niters=4, seed=0)
        gpu = kmeans(x[:20_000].cuda(), 256, niters=4, seed=0)
        # Same start, same assignments up to near-ties (cuBLAS and the CPU round the products differently; a
        # flipped point moves two centroids by about 1 / 80 of a point): most centroids agree to 1e-4.
        close = (gpu.cpu() - cpu).norm(dim=1) < 1e-4
        assert close.float().mean() > 0.9, close.float().mean()
        assert torch.equal(kmeans(x[:20_000].cuda(), 256, niters=4, seed=0), gpu)  # bitwise repeatable
    finally:
        torch.use_deterministic_algorithms(False)
    big = x.cuda().half()
    times = {}
    for dtype in (torch.float32, torch.float16):
        kmeans(big, 4096, niters=1, matmul_dtype=dtype)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        kmeans(big, 4096, niters=10, matmul_dtype=dtype)
        torch.cuda.synchronize()
        times[dtype] = time.perf_counter() - start
    print(
        f"kmeans 200k x 4096 x 128, 10 iterations: fp32 {times[torch.float32]:.3f} s, fp16 {times[torch.float16]:.3f} s"
    )
    # 10 iterations of a 200k x 4096 x 128 product (2.1 TFLOP in all) plus the updates: about 35 ms of fp32
    # (non-TF32) matmul and a few of fp16 on an H200; the bounds leave room for the updates and launches.
    assert times[torch.float32] < 1.0 and times[torch.float16] < 0.5, times


@pytest.mark.gpu
def test_gpu_speed_against_fastkmeans():
    # fast-plaid's k-means (PyLate's default index); install with
    # `pip install --no-deps .whl_pylate/fastkmeans-0.5.0-py3-none-any.whl`.
    fastkmeans = pytest.importorskip("fastkmeans")
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(2048, 128, generator=g)
    x = torch.nn.functional.normalize(
        centers[torch.randint(0, 2048, (1_000_000,), generator=g)] + 0.3 * torch.randn(1_000_000, 128, generator=g),
        dim=-1,
    ).half()
    data = x.float().numpy()
    theirs = fastkmeans.FastKMeans(128, 8192, niter=4, gpu=True, seed=0, dtype=torch.float16)
    theirs.train(data)  # warm-up (Triton compiles)
    torch.cuda.synchronize()
    start = time.perf_counter()
    theirs.train(data)
    torch.cuda.synchronize()
    t_theirs = time.perf_counter() - start
    resident = x.cuda()
    kmeans(resident, 8192, niters=4, matmul_dtype=torch.float16)
    torch.cuda.synchronize()
    start = time.perf_counter()
    ours = kmeans(resident, 8192, niters=4, matmul_dtype=torch.float16)
    torch.cuda.synchronize()
    t_ours = time.perf_counter() - start
    codes, dist = assign_to_centroids(resident, ours)
    their_c = torch.from_numpy(theirs.centroids).cuda()
    _, their_dist = assign_to_centroids(resident, their_c)
    print(
        f"k-means 1M x 128 -> 8192, 4 iterations: lik {t_ours:.3f} s, fastkmeans {t_theirs:.3f} s; "
        f"inertia lik {float(dist.sum()):.1f}, fastkmeans {float(their_dist.sum()):.1f}"
    )
    assert float(dist.sum()) <= 1.05 * float(their_dist.sum())  # as good a clustering (both start from random points)
    assert t_ours <= 1.2 * t_theirs  # and no slower (lik's data stays on the GPU; fastkmeans streams it)
