"""lik.knn_points under every product precision (float32 "highest" / "high", float16, bfloat16) against float64.

The TF32 launch rounds its operands to TF32 on the host, so the interpreter's float32 products are TF32 products
here. Every mode must list neighbours whose distances are the exact float32 distances to the listed indices,
sorted, each within the documented bound of float64's ``k``-th distance (function.py's docstring)."""

import pytest
import torch

import lik
from lik.config import override
from lik.ops.knn import KnnConfig

LAUNCHES = {
    "tf32": KnnConfig("products", "tf32", block_m=16, block_n=32, block_k=16),
    "tf32x3": KnnConfig("products", "tf32x3", block_m=16, block_n=16, block_k=32),
    "ieee": KnnConfig("products", "ieee", block_m=16, block_n=16, block_k=16),
}


def _estimate_error(mode, a, b, dim):
    """Each candidate's bound ``e_j`` (float64), ``a [P1, 1]`` and ``b [1, P2]`` the distances to the centre."""
    if mode == "tf32":
        return 2.0**-9 * (1 + dim * 2.0**-13) * a * b + (dim + 4) * 2.0**-24 * (a * a + b * b)
    if mode in ("float16", "bfloat16"):
        return (2 * dim + 4) * 2.0**-24 * (a * a + b * b)
    return (6 * dim + 102) * 2.0**-24 * (a * a + b * b)


def _check(mode, out, p1, p2, K, centre, rtol=0.0):
    """One cloud (``p1 [P1, D]``, ``p2 [P2, D]``; ``out`` fields ``[P1, K]``); ``rtol``: a GPU sums a distance's
    terms in another order than this CPU check."""
    dists, idx = out
    exact32 = ((p1.float()[:, None] - p2.float()[idx]) ** 2).sum(-1)
    torch.testing.assert_close(dists, exact32, rtol=rtol, atol=0)  # recomputed from the two points
    assert (dists[:, 1:] >= dists[:, :-1]).all()
    assert all(len(set(row)) == K for row in idx.tolist())  # K distinct neighbours
    d64 = torch.cdist(p1.double(), p2.double()) ** 2
    want = d64.topk(K, dim=1, largest=False).values
    a = (p1.double() - centre).norm(dim=-1)[:, None]
    b = (p2.double() - centre).norm(dim=-1)[None, :]
    slack = 2 * _estimate_error(mode, a, b, p1.shape[-1]).amax(1, keepdim=True)
    assert (d64.gather(1, idx) - want <= slack).all()
    return (idx != d64.topk(K, dim=1, largest=False).indices).sum().item()


def _clouds(seed, p1_size, p2_size, dim, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    p1 = torch.randn(1, p1_size, dim, generator=g) + offset
    p2 = torch.randn(1, p2_size, dim, generator=g) + offset
    # Near ties around p1[0]: two candidates a hair apart and a duplicate (the lower index lists first).
    p2[0, 4] = p1[0, 0] + 0.05
    p2[0, 5] = p1[0, 0] - 0.05 * (1 + 1e-6)
    p2[0, 6] = p2[0, 4]
    return p1, p2


@pytest.mark.parametrize("mode", list(LAUNCHES))
@pytest.mark.parametrize("dim, offset, K", [(12, 0.0, 1), (40, 0.0, 5), (40, 25.0, 8)])
def test_each_precision_lists_exact_distances_within_the_bound(mode, dim, offset, K):
    p1, p2 = _clouds(dim + K, 37, 60, dim, offset)
    with override(knn=LAUNCHES[mode]):
        out = lik.knn_points(p1, p2, K=K)
    _check(mode, (out.dists[0], out.idx[0]), p1[0], p2[0], K, p1[0].double().mean(0))
    first = out.idx[0, 0, :3].tolist()
    assert first[0] in (4, 5) and (K < 3 or sorted(first) == [4, 5, 6])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_within_the_bound(dtype):
    """float16: the products in float16 (interpreter); bfloat16: the reference on CPU (its kernel: GPU tests)."""
    p1, p2 = _clouds(11, 33, 50, 24)
    p1, p2 = p1.to(dtype), p2.to(dtype)
    out = lik.knn_points(p1, p2, K=6)
    assert out.dists.dtype == torch.float32
    _check(str(dtype).split(".")[-1], (out.dists[0], out.idx[0]), p1[0], p2[0], 6,
           torch.zeros(24, dtype=torch.float64))


def test_tf32_gradients_are_exact_for_the_listed_neighbours():
    p1, p2 = _clouds(3, 21, 30, 36)
    a, b = p1.clone().requires_grad_(), p2.clone().requires_grad_()
    with override(knn=LAUNCHES["tf32"]):
        out = lik.knn_points(a, b, K=4)
    weights = torch.randn(out.dists.shape, generator=torch.Generator().manual_seed(2))
    (out.dists * weights).sum().backward()
    ad, bd = p1.double().requires_grad_(), p2.double().requires_grad_()
    ref = ((((ad[0][:, None] - bd[0][out.idx[0]]) ** 2).sum(-1)) * weights[0].double()).sum()
    ga, gb = torch.autograd.grad(ref, (ad, bd))
    torch.testing.assert_close(a.grad.double(), ga, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad.double(), gb, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("setting, dtype", [("highest", torch.float32), ("high", torch.float32),
                                            ("medium", torch.float32), ("highest", torch.float16),
                                            ("highest", torch.bfloat16)])
@pytest.mark.parametrize("K", [1, 16])
def test_gpu_every_precision_within_the_bound(setting, dtype, K):
    g = torch.Generator(device="cuda").manual_seed(K)
    p1 = torch.rand(1, 2000, 128, device="cuda", generator=g).to(dtype)
    p2 = torch.rand(1, 3000, 128, device="cuda", generator=g).to(dtype)
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(setting)
    try:
        out = lik.knn_points(p1, p2, K=K)
    finally:
        torch.set_float32_matmul_precision(saved)
    mode = {"highest": "tf32x3", "high": "tf32", "medium": "tf32"}[setting] if dtype == torch.float32 else \
        str(dtype).split(".")[-1]
    centre = p1[0].cpu().double().mean(0) if dtype == torch.float32 else torch.zeros(128, dtype=torch.float64)
    _check(mode, (out.dists[0].cpu(), out.idx[0].cpu()), p1[0].cpu(), p2[0].cpu(), K, centre, 4 * 2.0**-23)
