"""Nearest neighbours and Chamfer under every product precision: float32 at "highest" (TF32-split), "high" /
"medium" (one TF32 product), and float16 / bfloat16 products, against float64.

The interpreter multiplies float32 exactly, but the TF32 route rounds its operands to TF32 on the host first, so
the interpreter's products *are* TF32 products here (only the accumulation order differs from the tensor cores).
Every mode must return, for each point, a neighbour whose distance is recomputed exactly (bit for bit the float32
distance to the returned index) and lies within the documented bound of the true nearest distance."""

import pytest
import torch

import lik
from lik import _config
from lik.config import nearest as nearest_config_module
from lik.ops.chamfer.kernel import tf32_round

# The dot route's TF32 launch (one pass and two), float32 products, the half-precision launch, and MaxSim's
# TF32-split loop ("highest"): small tiles so that several tiles and programs take part.
MODES = {
    "tf32": _config.NearestConfig("dot", "tf32", block_m=16, block_n=32),
    "tf32-two-pass": _config.NearestConfig("dot", "tf32", block_m=32, block_n=16, one_pass=False),
    "ieee": _config.NearestConfig("dot", "ieee", block_m=16, block_n=16),
    "tf32x3": _config.NearestConfig("core", "tf32x3"),
}


def _bound(mode: str, x, y, centre, chosen, nearest, d_near):
    """float64 bound on ``d(chosen) - d(nearest)`` (function.py's docstring): ``e_w + e_n + 2**-16 d_n``."""
    dim = x.shape[-1]
    a = (x - centre).norm(dim=-1)

    def err(j):
        b = (torch.gather(y, 0, j[:, None].expand(-1, dim)) - centre).norm(dim=-1)
        if mode in ("tf32", "tf32-two-pass"):
            return 2.0**-9 * (1 + dim * 2.0**-13) * a * b + (dim + 4) * 2.0**-24 * (a * a + b * b)
        if mode in ("float16", "bfloat16"):
            return (2 * dim + 4) * 2.0**-24 * (a * a + b * b)
        return (6 * dim + 102) * 2.0**-24 * (a * a + b * b)

    return err(chosen) + err(nearest) + 2.0**-16 * d_near + 1e-30


# A GPU sums a distance's terms in another order than the CPU check: a few float32 ulps apart.
GPU_RTOL = 4 * 2.0**-23


def _check_cloud(mode, x, y, dist, idx, centres, rtol=0.0):
    """One cloud: ``idx`` valid, ``dist`` the exact float32 distance to it (bit for bit, or within ``rtol`` when
    it was summed on a GPU), within the bound of float64's best (``centres``: the candidates for the centre the
    products used; the largest bound is taken)."""
    xd, yd = x.double(), y.double()
    d64 = torch.cdist(xd, yd) ** 2
    d_near, nearest = d64.min(1)
    assert ((idx >= 0) & (idx < y.shape[0])).all()
    exact32 = ((x.float() - y.float()[idx]) ** 2).sum(-1)
    torch.testing.assert_close(dist, exact32, rtol=rtol, atol=0)  # recomputed from the two points
    excess = d64.gather(1, idx[:, None])[:, 0] - d_near
    bound = torch.stack([_bound(mode, xd, yd, c, idx, nearest, d_near) for c in centres]).amax(0)
    assert (excess <= bound).all()
    return (idx != nearest).sum().item()


def _clouds(seed, p1, p2, dim, offset=0.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, p1, dim, generator=g) + offset
    y = torch.randn(1, p2, dim, generator=g) + offset
    # Near ties: y[1] and y[2] a hair apart around x[0]'s nearest region, and an exact duplicate.
    y[0, 1] = x[0, 0] + 0.05
    y[0, 2] = x[0, 0] - 0.05 * (1 + 1e-6)
    y[0, 3] = y[0, 1]
    return x.to(dtype), y.to(dtype)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dim, offset", [(12, 0.0), (48, 0.0), (48, 30.0)])
def test_each_precision_is_exact_for_its_choice_and_within_the_bound(mode, dim, offset):
    x, y = _clouds(dim, 45, 70, dim, offset)
    with _config.override(nearest=MODES[mode]):
        dx, dy = lik.chamfer_distance(x, y, batch_reduction=None, point_reduction=None)[0]
        dist, idx = lik.nearest_neighbors(x, y)
    centres = [x[0].double().mean(0), y[0].double().mean(0)]  # one pass centres on the larger cloud
    _check_cloud(mode, x[0], y[0], dist[0], idx[0], centres[:1])
    _check_cloud(mode, x[0], y[0], dx[0], _winners_of(dx[0], x[0], y[0]), centres)
    _check_cloud(mode, y[0], x[0], dy[0], _winners_of(dy[0], y[0], x[0]), centres)
    # The near tie at x[0]: one of the two (the duplicate y[3] of y[1] never wins: the lower index does).
    assert idx[0, 0].item() in (1, 2)


def _winners_of(dist, a, b, rtol=0.0, rows=64):
    """The lowest index in ``b`` whose exact float32 distance to each ``a`` point is ``dist`` (within ``rtol``),
    ``rows`` points of ``a`` at a time."""
    found = []
    for start in range(0, a.shape[0], rows):
        d32 = ((a[start:start + rows].float()[:, None] - b.float()[None]) ** 2).sum(-1)
        want = dist[start:start + rows, None]
        hit = (d32 - want).abs() <= rtol * want
        assert hit.any(1).all()
        found.append(hit.to(torch.int8).argmax(1))
    return torch.cat(found)


def test_tf32_products_can_choose_a_near_tie_and_the_bound_is_not_vacuous():
    """The emulated TF32 search (rounded operands, float32 accumulation) swaps some near ties on clustered data,
    and every swap stays within the bound; float32 products swap none of them."""
    g = torch.Generator().manual_seed(7)
    dim = 64
    x = torch.randn(300, dim, generator=g)
    # Each x point has two candidates at relative distance differences of 1e-4: within TF32's reach.
    y = torch.cat([x + 0.3 * torch.randn(300, dim, generator=g), torch.empty(300, dim)])
    direction = torch.randn(300, dim, generator=g)
    y[300:] = x + (y[:300] - x) * (1 + 1e-4 * torch.sign(torch.randn(300, 1, generator=g)))
    y[300:] += 1e-3 * direction / direction.norm(dim=-1, keepdim=True)
    centre = x.mean(0)
    xc, yc = x - centre, y - centre
    est = (xc * xc).sum(-1)[:, None] + (yc * yc).sum(-1)[None] - 2 * (tf32_round(xc) @ tf32_round(yc).T)
    chosen = est.argmin(1)
    d64 = torch.cdist(x.double(), y.double()) ** 2
    d_near, nearest = d64.min(1)
    swaps = (chosen != nearest).sum().item()
    assert swaps > 0
    excess = d64.gather(1, chosen[:, None])[:, 0] - d_near
    assert (excess <= _bound("tf32", x.double(), y.double(), centre.double(), chosen, nearest, d_near)).all()
    exact = (xc @ yc.T) * -2 + (xc * xc).sum(-1)[:, None] + (yc * yc).sum(-1)[None]
    assert (exact.argmin(1) != nearest).sum().item() < swaps


def test_tf32_round_is_to_nearest_even_and_keeps_specials():
    ulp = 2.0**-10
    values = torch.tensor([1.0, 1 + ulp / 2, 1 + 3 * ulp / 2, 1 + ulp / 2 + 2**-20, -(1 + ulp / 2 + 2**-20), 0.0,
                           float("inf"), -float("inf"), float("nan"), torch.finfo(torch.float32).max])
    got = tf32_round(values)
    want = torch.tensor([1.0, 1.0, 1 + 2 * ulp, 1 + ulp, -(1 + ulp), 0.0, float("inf"), -float("inf"),
                         float("nan"), float("inf")])
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    r = tf32_round(torch.randn(1000, generator=torch.Generator().manual_seed(1)))
    assert ((r.view(torch.int32) & 0x1FFF) == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    """float16 runs the dot route's half-precision products in the interpreter; bfloat16 the reference on CPU (its
    kernel: the GPU tests). Both are exact for the neighbour returned, within the bound, padding never read."""
    x, y = _clouds(3, 40, 57, 24, dtype=dtype)
    x = torch.cat([x, x.roll(1, 1)]).clone()
    y = torch.cat([y, y.flip(1)]).clone()
    xl, yl = torch.tensor([40, 29]), torch.tensor([57, 31])
    x[1, 29:] = float("nan")
    y[1, 31:] = float("inf")
    dist, idx = lik.nearest_neighbors(x, y, xl, yl)
    assert dist.dtype == torch.float32
    for c, (lx, ly) in enumerate(zip(xl.tolist(), yl.tolist())):
        _check_cloud(str(dtype).split(".")[-1], x[c, :lx], y[c, :ly], dist[c, :lx], idx[c, :lx],
                     [torch.zeros(x.shape[-1], dtype=torch.float64)])
        assert (idx[c, lx:] == -1).all() and (dist[c, lx:] == 0).all()
    loss, _ = lik.chamfer_distance(x.float().requires_grad_(), y.float(), xl, yl)
    assert torch.isfinite(loss)


def test_half_precision_inputs_with_non_finite_valid_points():
    x, y = _clouds(4, 33, 35, 16, dtype=torch.float16)
    x[0, 5, 3] = float("nan")
    x[0, 6, 0] = float("inf")
    y[0, 9, 2] = float("inf")
    want_dist, want_idx = lik.ops.chamfer.nearest_neighbors_reference(x.double(), y.double(), torch.tensor([33]),
                                                                     torch.tensor([35]))
    dist, idx = lik.nearest_neighbors(x, y)
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(dist.double(), want_dist, equal_nan=True, rtol=1e-6, atol=1e-6)


def test_gradients_are_exact_for_the_chosen_neighbour():
    x, y = _clouds(5, 31, 44, 40)
    x.requires_grad_()
    y.requires_grad_()
    with _config.override(nearest=MODES["tf32"]):
        loss, _ = lik.chamfer_distance(x, y, point_reduction="sum")
        dx, dy = lik.chamfer_distance(x.detach(), y.detach(), batch_reduction=None, point_reduction=None)[0]
    gx, gy = torch.autograd.grad(loss, (x, y))
    ixy, iyx = _winners_of(dx[0], x[0].detach(), y[0].detach()), _winners_of(dy[0], y[0].detach(), x[0].detach())
    xd, yd = x.detach().double().requires_grad_(), y.detach().double().requires_grad_()
    ref = ((xd[0] - yd[0][ixy]) ** 2).sum() + ((yd[0] - xd[0][iyx]) ** 2).sum()
    rx, ry = torch.autograd.grad(ref, (xd, yd))
    torch.testing.assert_close(gx.double(), rx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gy.double(), ry, rtol=1e-5, atol=1e-5)


def test_the_launch_follows_the_matmul_precision(monkeypatch):
    monkeypatch.setattr(nearest_config_module, "_tensor_cores", lambda device: True)
    cpu = torch.device("cpu")
    saved = torch.get_float32_matmul_precision()
    try:
        for setting, route, precision in [("highest", "core", "tf32x3"), ("high", "dot", "tf32"),
                                          ("medium", "dot", "tf32")]:
            torch.set_float32_matmul_precision(setting)
            cfg = _config.nearest_config(dim=128, norm=2, device=cpu)
            assert (cfg.route, cfg.precision) == (route, precision), setting
            for dtype in (torch.float16, torch.bfloat16):
                assert _config.nearest_config(dim=128, norm=2, device=cpu, dtype=dtype).route == "dot"
            # Point clouds and norm=1 stay exact whatever the setting.
            assert _config.nearest_config(dim=3, norm=2, device=cpu).route == "direct"
            assert _config.nearest_config(dim=128, norm=1, device=cpu, dtype=torch.float16).route == "direct"
    finally:
        torch.set_float32_matmul_precision(saved)
    monkeypatch.setattr(nearest_config_module, "_tensor_cores", lambda device: False)
    assert _config.nearest_config(dim=128, norm=2, device=cpu).precision == "ieee"


# GPU: the real tensor cores, at sizes where near ties abound.


def _gpu_check(mode, x, y, dist, idx, centred=True):
    for c in range(x.shape[0]):
        xc, yc = x[c].cpu(), y[c].cpu()
        centres = [xc.double().mean(0), yc.double().mean(0)] if centred else [torch.zeros(x.shape[-1]).double()]
        _check_cloud(mode, xc, yc, dist[c].cpu(), idx[c].cpu(), centres, GPU_RTOL)


@pytest.mark.gpu
@pytest.mark.parametrize("setting", ["highest", "high", "medium"])
@pytest.mark.parametrize("dim", [16, 128, 200])
def test_gpu_float32_follows_the_matmul_precision(setting, dim):
    g = torch.Generator(device="cuda").manual_seed(dim)
    x = torch.rand(2, 3000, dim, device="cuda", generator=g)
    y = torch.rand(2, 2500, dim, device="cuda", generator=g)
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(setting)
    try:
        dist, idx = lik.nearest_neighbors(x, y)
        dx, dy = lik.chamfer_distance(x, y, batch_reduction=None, point_reduction=None)[0]
    finally:
        torch.set_float32_matmul_precision(saved)
    mode = "tf32" if setting != "highest" else "tf32x3"
    _gpu_check(mode, x, y, dist, idx)
    for c in range(2):  # both directions of the one pass: exact for their winners, within the bound
        xc, yc = x[c].cpu(), y[c].cpu()
        centres = [xc.double().mean(0), yc.double().mean(0)]
        _check_cloud(mode, xc, yc, dx[c].cpu(), _winners_of(dx[c].cpu(), xc, yc, GPU_RTOL), centres, GPU_RTOL)
        _check_cloud(mode, yc, xc, dy[c].cpu(), _winners_of(dy[c].cpu(), yc, xc, GPU_RTOL), centres, GPU_RTOL)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 128])
def test_gpu_half_precision_products(dtype, dim):
    g = torch.Generator(device="cuda").manual_seed(dim + 1)
    x = torch.randn(2, 3001, dim, device="cuda", generator=g).to(dtype)
    y = torch.randn(2, 2999, dim, device="cuda", generator=g).to(dtype)
    dist, idx = lik.nearest_neighbors(x, y)
    _gpu_check(str(dtype).split(".")[-1], x, y, dist, idx, centred=False)
    xg = x.clone().requires_grad_()
    loss, _ = lik.chamfer_distance(xg, y)
    loss.backward()
    assert torch.isfinite(xg.grad.float()).all()
