"""lik.nearest_neighbors / lik.chamfer_distance against a dense float64 model of PyTorch3D's chamfer_distance.

The dense model below builds the full [N, P1, P2] distance matrix (fine at test sizes) and follows PyTorch3D's
code path by path: padded points score 0, an empty target cloud gives distance 0 and a zero neighbour normal,
"mean" divides by the clamped lengths, the batch "mean" by N or the weights' sum."""

import pytest
import torch
import torch.nn.functional as F

import lik
from lik import _config
from lik.ops.chamfer import nearest_neighbors_reference
from lik.ops.chamfer.kernel import AUGMENTED_MAX_DIM, BLOCK_M, BLOCK_N, POINT_MAX_DIM, nearest_indices

# Every route of the nearest-neighbour kernels, forced, beside the heuristic's choice (None): the direct
# differences, the Chamfer dot loop (one pass or two) and MaxSim's argmax forward, with float32 or TF32-split
# products: these tests expect float64's winners (one TF32 product: test_chamfer_precision.py).
LAUNCHES = {
    "heuristic": None,
    "direct": _config.NearestConfig("direct", block_m=32, block_n=16),
    "direct-two-pass": _config.NearestConfig("direct", block_m=16, block_n=32, one_pass=False),
    "dot-tf32x3": _config.NearestConfig("dot", "tf32x3", block_m=32, block_n=16),
    "dot-ieee": _config.NearestConfig("dot", "ieee", block_m=32, block_n=16),
    "dot-two-pass": _config.NearestConfig("dot", "ieee", block_m=16, block_n=32, one_pass=False),
    "core-tf32x3": _config.NearestConfig("core", "tf32x3"),
    "core-ieee": _config.NearestConfig("core", "ieee"),
}


@pytest.fixture(params=list(LAUNCHES))
def launch(request):
    cfg = LAUNCHES[request.param]
    if cfg is None:
        yield None
    else:
        with _config.override(nearest=cfg):
            yield cfg


def _dense_nearest(x, y, xl, yl, norm):
    n, p1, _ = x.shape
    dist = torch.zeros(n, p1, dtype=torch.float64)
    idx = torch.full((n, p1), -1, dtype=torch.int64)
    for c in range(n):
        if xl[c] == 0 or yl[c] == 0:
            continue
        diff = x[c, : xl[c], None, :].double() - y[c, None, : yl[c], :].double()
        d = (diff**2).sum(-1) if norm == 2 else diff.abs().sum(-1)
        best, arg = d.min(1)
        dist[c, : xl[c]] = best
        idx[c, : xl[c]] = arg
    return dist, idx


def _dense_chamfer(x, y, xl, yl, xn, yn, weights, batch_reduction, point_reduction, norm, single, abs_cosine):
    """Autograd-capable float64 model (gathers from the dense argmin)."""
    def one_way(a, b, al, bl, an, bn):
        n, p = a.shape[:2]
        _, idx = _dense_nearest(a.detach(), b.detach(), al, bl, norm)
        valid = torch.arange(p)[None] < torch.as_tensor(al)[:, None]
        paired = idx >= 0
        b_near = torch.gather(b, 1, idx.clamp(min=0)[..., None].expand(-1, -1, b.shape[2])) if b.shape[1] else a * 0
        a_clean = torch.where(valid[..., None], a, 0)
        diff = torch.where(paired[..., None], a_clean - b_near, 0)
        d = (diff**2).sum(-1) if norm == 2 else diff.abs().sum(-1)
        t = None
        if an is not None:
            if b.shape[1]:
                gathered = torch.gather(bn, 1, idx.clamp(min=0)[..., None].expand(-1, -1, bn.shape[2]))
                bn_near = torch.where(paired[..., None], gathered, 0)
            else:
                bn_near = an * 0
            cos = F.cosine_similarity(torch.where(valid[..., None], an, 0), bn_near, dim=2, eps=1e-6)
            t = torch.where(valid, 1 - (cos.abs() if abs_cosine else cos), 0)
        if weights is not None:
            d = d * weights[:, None]
            t = t * weights[:, None] if t is not None else None
        lens = torch.as_tensor(al).clamp(min=1).double()

        def red(v):
            if point_reduction is None:
                return v
            if point_reduction == "max":
                return v.max(1).values
            s = v.sum(1)
            return s / lens if point_reduction == "mean" else s
        return red(d), (red(t) if t is not None else None)

    cx, tx = one_way(x, y, xl, yl, xn, yn)
    if single:
        loss, ln = cx, tx
    else:
        cy, ty = one_way(y, x, yl, xl, yn, xn)
        if point_reduction == "max":
            loss, ln = torch.maximum(cx, cy), None
        elif point_reduction is None:
            loss, ln = (cx, cy), ((tx, ty) if tx is not None else None)
        else:
            loss, ln = cx + cy, (tx + ty if tx is not None else None)
    if batch_reduction is None:
        return loss, ln
    loss = loss.sum()
    ln = ln.sum() if ln is not None else None
    if batch_reduction == "mean":
        div = x.shape[0] if weights is None else (weights.sum() if weights.sum() > 0 else 1)
        loss = loss / div
        ln = ln / div if ln is not None else None
    return loss, ln


def _clouds(rng, n, p1, p2, dim, dtype=torch.float32, garbage=True):
    x = torch.randn(n, p1, dim, generator=rng, dtype=torch.float64)
    y = torch.randn(n, p2, dim, generator=rng, dtype=torch.float64)
    xl = torch.randint(0, p1 + 1, (n,), generator=rng)
    yl = torch.randint(0, p2 + 1, (n,), generator=rng)
    if n:
        xl[0], yl[0] = p1, p2  # one full cloud
    if garbage:
        for t, lens in ((x, xl), (y, yl)):
            for c in range(n):
                t[c, lens[c]:, 0] = float("nan")
                t[c, lens[c]:, -1] = float("inf")
    return x.to(dtype), y.to(dtype), xl, yl


@pytest.mark.parametrize(
    "dim", [1, 2, 3, 5, POINT_MAX_DIM, POINT_MAX_DIM + 1, AUGMENTED_MAX_DIM, AUGMENTED_MAX_DIM + 1, 33, 64]
)
@pytest.mark.parametrize("norm", [1, 2])
def test_nearest_matches_dense_float64(dim, norm, rng, launch):
    x, y, xl, yl = _clouds(rng, 3, BLOCK_M + 9, BLOCK_N + 6, dim)
    if norm == 1 and launch is not None and launch.route != "direct":
        with pytest.raises(ValueError, match="norm=1"):
            lik.nearest_neighbors(x, y, xl, yl, norm=norm)
        return
    dist, idx = lik.nearest_neighbors(x, y, xl, yl, norm=norm)
    ref_dist, ref_idx = _dense_nearest(x, y, xl, yl, norm)
    assert dist.dtype == torch.float32 and idx.dtype == torch.int64
    # Random data has no near-ties at this size: the winners are the float64 winners.
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(dist.double(), ref_dist, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("p1,p2", [(0, 5), (5, 0), (1, 1), (1, 65), (65, 1), (0, 0)])
def test_sizes_zero_and_one(p1, p2, rng, launch):
    x, y, _, _ = _clouds(rng, 2, p1, p2, 3, garbage=False)
    dist, idx = lik.nearest_neighbors(x, y)
    ref_dist, ref_idx = _dense_nearest(x, y, [p1, p1], [p2, p2], 2)
    assert dist.shape == (2, p1) and torch.equal(idx, ref_idx)
    torch.testing.assert_close(dist.double(), ref_dist, rtol=2e-6, atol=1e-6)
    loss, normals = lik.chamfer_distance(x, y)
    assert normals is None and torch.isfinite(loss)


def test_reference_matches_dense_model(rng):
    x, y, xl, yl = _clouds(rng, 4, 20, 30, 7, torch.float64)
    dist, idx = nearest_neighbors_reference(x, y, xl, yl, 2, budget_bytes=512)  # many small chunks
    ref_dist, ref_idx = _dense_nearest(x, y, xl, yl, 2)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(dist, ref_dist)


@pytest.mark.parametrize("dim", [3, 40])
def test_ties_go_to_the_lowest_index(dim, rng, launch):
    y = torch.randn(1, 2 * BLOCK_N + 5, dim, generator=rng)
    copies = [BLOCK_N - 1, BLOCK_N + 3, 2 * BLOCK_N + 1]  # the same tile, and later tiles
    y[0, copies] = y[0, 2].clone()
    x = y[:, [2] + copies] + 0.0
    dist, idx = lik.nearest_neighbors(x, y)
    assert idx.tolist() == [[2, 2, 2, 2]]
    assert (dist == 0).all()


@pytest.mark.parametrize("dim", [3, 40])
def test_infinite_coordinates_in_valid_points(dim, rng, launch):
    x = torch.randn(2, 5, dim, generator=rng)
    y = torch.randn(2, 7, dim, generator=rng)
    x[0, 3, 1] = float("inf")
    y[1, 5, 0] = float("-inf")
    dist, idx = lik.nearest_neighbors(x, y)
    ref_dist, ref_idx = nearest_neighbors_reference(x, y, torch.tensor([5, 5]), torch.tensor([7, 7]))
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(dist, ref_dist, equal_nan=True)
    assert torch.isinf(dist[0, 3])


@pytest.mark.parametrize("dim", [3, 40])
def test_nan_in_a_valid_point(dim, rng, launch):
    x = torch.randn(1, 6, dim, generator=rng)
    y = torch.randn(1, 9, dim, generator=rng)
    x[0, 1, 0] = float("nan")
    y[0, 4, dim - 1] = float("nan")
    dist, idx = lik.nearest_neighbors(x, y)
    # Every x point meets y[4]: every minimum is NaN, the first NaN distance wins (index 4; x[1]: index 0).
    assert torch.isnan(dist).all()
    assert idx.tolist() == [[4, 0, 4, 4, 4, 4]]
    ref_dist, ref_idx = nearest_neighbors_reference(x, y, torch.tensor([6]), torch.tensor([9]))
    assert torch.equal(idx, ref_idx)


@pytest.mark.parametrize("dim", [3, 64])
def test_far_from_the_origin(dim, rng, launch):
    # Nearby points 1e4 away from the origin: |x|^2 + |y|^2 - 2 x.y would cancel ~8 digits of fp32.
    base = torch.randn(1, 1, dim, generator=rng, dtype=torch.float64) * 1e4
    x = base + torch.randn(1, 50, dim, generator=rng, dtype=torch.float64) * 0.1
    y = base + torch.randn(1, 60, dim, generator=rng, dtype=torch.float64) * 0.1
    x32, y32 = x.float(), y.float()
    dist, idx = lik.nearest_neighbors(x32, y32)
    ref_dist, ref_idx = _dense_nearest(x32, y32, [50], [60], 2)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(dist.double(), ref_dist, rtol=1e-3, atol=1e-6)


def test_noncontiguous_views(rng, launch):
    base = torch.randn(2, 40, 8, generator=rng)
    x = base[:, ::2, :3]  # strided points and coordinates
    y = base.transpose(0, 1)[:25].transpose(0, 1)[..., 4:7]
    assert not x.is_contiguous() and not y.is_contiguous()
    dist, idx = lik.nearest_neighbors(x, y)
    ref_dist, ref_idx = _dense_nearest(x, y, [20, 20], [25, 25], 2)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(dist.double(), ref_dist, rtol=2e-6, atol=1e-6)


def _both_ways(x, y, xl, yl, norm=2):
    """Both directions' winners as a Chamfer call finds them (one pass on the direct route)."""
    return nearest_indices(x, y, torch.as_tensor(xl), torch.as_tensor(yl), norm, both_ways=True)


@pytest.mark.parametrize("p1,p2", [(BLOCK_M + 9, BLOCK_N + 6), (7, 3 * BLOCK_N + 1), (1, 1), (0, 4), (4, 0)])
@pytest.mark.parametrize("norm", [1, 2])
def test_both_directions_match_dense_float64(p1, p2, norm, rng, launch):
    # Garbage in the padding of both clouds; more y than x points takes the swapped launch.
    x, y, xl, yl = _clouds(rng, 3, p1, p2, 3)
    if norm == 1 and launch is not None and launch.route != "direct":
        return
    idx_xy, idx_yx = _both_ways(x, y, xl, yl, norm)
    assert torch.equal(idx_xy.long(), _dense_nearest(x, y, xl, yl, norm)[1])
    assert torch.equal(idx_yx.long(), _dense_nearest(y, x, yl, xl, norm)[1])
    terms, _ = lik.chamfer_distance(x, y, xl, yl, batch_reduction=None, point_reduction=None, norm=norm)
    ref_terms, _ = _dense_chamfer(x.double(), y.double(), xl, yl, None, None, None, None, None, norm, False, True)
    for got, ref in zip(terms, ref_terms):
        torch.testing.assert_close(got.double(), ref, rtol=2e-6, atol=1e-6)


def test_both_directions_ties_go_to_the_lowest_index(rng, launch):
    # The same point in several x blocks and y tiles: each direction's winner is its lowest copy.
    p = 3 * BLOCK_M + 5
    x = torch.randn(1, p, 3, generator=rng)
    y = torch.randn(1, p + 2, 3, generator=rng)
    x_copies = [3, BLOCK_M - 1, BLOCK_M + 2, 2 * BLOCK_M + 4]
    y_copies = [5, BLOCK_N, 2 * BLOCK_N + 1]
    x[0, x_copies] = x[0, 3].clone()
    y[0, y_copies] = x[0, 3].clone()
    idx_xy, idx_yx = _both_ways(x, y, [p], [p + 2])
    assert idx_xy[0, x_copies].tolist() == [5] * 4
    assert idx_yx[0, y_copies].tolist() == [3] * 3
    ref_xy = nearest_neighbors_reference(x, y, torch.tensor([p]), torch.tensor([p + 2]))[1]
    ref_yx = nearest_neighbors_reference(y, x, torch.tensor([p + 2]), torch.tensor([p]))[1]
    assert torch.equal(idx_xy.long(), ref_xy) and torch.equal(idx_yx.long(), ref_yx)


def test_both_directions_with_non_finite_points(rng, launch):
    x = torch.randn(2, 40, 3, generator=rng)
    y = torch.randn(2, 33, 3, generator=rng)
    x[0, 5, 1] = float("nan")
    y[1, 7, 0] = float("inf")
    x[1, 3, 2] = float("-inf")
    terms, _ = lik.chamfer_distance(x, y, batch_reduction=None, point_reduction=None)
    ref_terms, _ = lik.chamfer_distance(x.double(), y.double(), batch_reduction=None, point_reduction=None)
    for got, ref in zip(terms, ref_terms):
        torch.testing.assert_close(got.double(), ref, rtol=2e-6, atol=1e-6, equal_nan=True)
    assert torch.isnan(terms[1][0]).all() and torch.isinf(terms[0][1, 3])


CASES = [
    dict(batch_reduction="mean", point_reduction="mean"),
    dict(batch_reduction="sum", point_reduction="sum"),
    dict(batch_reduction=None, point_reduction="mean"),
    dict(batch_reduction=None, point_reduction=None),
    dict(batch_reduction="mean", point_reduction="max"),
    dict(batch_reduction="mean", point_reduction="mean", single_directional=True),
    dict(batch_reduction=None, point_reduction=None, single_directional=True),
    dict(batch_reduction="sum", point_reduction="mean", norm=1),
]


def _flatten(out):
    loss, normals = out
    items = list(loss) if isinstance(loss, tuple) else [loss]
    if normals is not None:
        items += list(normals) if isinstance(normals, tuple) else [normals]
    return items


# Normals with point_reduction="max" are refused (test_bad_input_names_the_argument).
@pytest.mark.parametrize(
    "case,with_normals",
    [(c, n) for c in CASES for n in (False, True) if not (n and c["point_reduction"] == "max")],
)
@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chamfer_matches_dense_model(case, with_normals, with_weights, dtype, rng):
    x, y, xl, yl = _clouds(rng, 3, 17, 23, 3, dtype)
    x.requires_grad_(True)
    y.requires_grad_(True)
    xn = torch.randn(3, 17, 3, generator=rng, dtype=torch.float64).to(dtype).requires_grad_(with_normals)
    yn = torch.randn(3, 23, 3, generator=rng, dtype=torch.float64).to(dtype).requires_grad_(with_normals)
    w = torch.tensor([0.5, 2.0, 1.0], dtype=dtype, requires_grad=True) if with_weights else None
    kw = dict(case)
    norm = kw.pop("norm", 2)
    single = kw.pop("single_directional", False)
    out = lik.chamfer_distance(x, y, xl, yl, xn if with_normals else None, yn if with_normals else None, w,
                               norm=norm, single_directional=single, **kw)
    xd, yd = x.detach().double().requires_grad_(), y.detach().double().requires_grad_()
    xnd, ynd = xn.detach().double().requires_grad_(), yn.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_() if w is not None else None
    ref = _dense_chamfer(xd, yd, xl, yl, xnd if with_normals else None, ynd if with_normals else None, wd,
                         kw["batch_reduction"], kw["point_reduction"], norm, single, True)
    got, want = _flatten(out), _flatten(ref)
    assert len(got) == len(want)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-6)
    for g, r in zip(got, want):
        assert g.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        torch.testing.assert_close(g.double(), r.detach(), **tol)
    seed = torch.Generator().manual_seed(1)
    coeffs = [torch.rand(g.shape, generator=seed, dtype=torch.float64) for g in got]
    sum(((g.double() * c).sum() for g, c in zip(got, coeffs))).backward()
    sum(((r * c).sum() for r, c in zip(want, coeffs))).backward()
    pairs = [(x, xd), (y, yd)] + ([(xn, xnd), (yn, ynd)] if with_normals else []) + ([(w, wd)] if w is not None else [])
    for mine, theirs in pairs:
        assert mine.grad is not None and mine.grad.dtype == dtype
        assert torch.isfinite(mine.grad).all()  # garbage in padding never reaches a gradient
        torch.testing.assert_close(mine.grad.double(), theirs.grad, **tol)


def test_abs_cosine_false_and_zero_weights(rng):
    x, y, xl, yl = _clouds(rng, 2, 9, 11, 3, torch.float64, garbage=False)
    xn, yn = torch.randn(2, 9, 3, dtype=torch.float64), torch.randn(2, 11, 3, dtype=torch.float64)
    got = lik.chamfer_distance(x, y, xl, yl, xn, yn, abs_cosine=False)
    want = _dense_chamfer(x, y, xl, yl, xn, yn, None, "mean", "mean", 2, False, False)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    zero = torch.zeros(2, dtype=torch.float64)
    loss, _ = lik.chamfer_distance(x, y, weights=zero)
    assert loss.item() == 0.0


def test_deterministic_backward_is_repeatable_and_equal(rng):
    x = torch.randn(2, 64, 3, generator=rng, requires_grad=True)
    y = torch.randn(2, 16, 3, generator=rng, requires_grad=True)  # many x points share a winner
    grads = []
    for mode in ("fast", "deterministic", "deterministic"):
        x.grad = y.grad = None
        lik.chamfer_distance(x, y, backward=mode)[0].backward()
        grads.append((x.grad.clone(), y.grad.clone()))
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-6, atol=1e-7)
    assert torch.equal(grads[1][0], grads[2][0]) and torch.equal(grads[1][1], grads[2][1])


def test_bad_input_names_the_argument():
    x, y = torch.randn(2, 5, 3), torch.randn(2, 4, 3)
    with pytest.raises(ValueError, match="y has 3 clouds"):
        lik.chamfer_distance(x, torch.randn(3, 4, 3))
    with pytest.raises(ValueError, match="D = 2"):
        lik.chamfer_distance(x, torch.randn(2, 4, 2))
    with pytest.raises(ValueError, match=r"x must have shape \(N, P, D\)"):
        lik.chamfer_distance(x[0], y)
    with pytest.raises(TypeError, match="y is torch.float64"):
        lik.chamfer_distance(x, y.double())
    with pytest.raises(ValueError, match="x_lengths must lie in"):
        lik.chamfer_distance(x, y, x_lengths=torch.tensor([6, 1]))
    with pytest.raises(ValueError, match="y_lengths must lie in"):
        lik.chamfer_distance(x, y, y_lengths=torch.tensor([-1, 1]))
    with pytest.raises(ValueError, match="x_lengths must have shape"):
        lik.chamfer_distance(x, y, x_lengths=torch.tensor([5]))
    with pytest.raises(TypeError, match="x_lengths must be an integer"):
        lik.chamfer_distance(x, y, x_lengths=torch.tensor([5.0, 5.0]))
    with pytest.raises(ValueError, match="point_reduction"):
        lik.chamfer_distance(x, y, point_reduction="median")
    with pytest.raises(ValueError, match="batch_reduction"):
        lik.chamfer_distance(x, y, batch_reduction="max")
    with pytest.raises(ValueError, match="batch_reduction must be None"):
        lik.chamfer_distance(x, y, point_reduction=None)
    with pytest.raises(ValueError, match="norm"):
        lik.chamfer_distance(x, y, norm=3)
    with pytest.raises(ValueError, match="must be None when point_reduction"):
        lik.chamfer_distance(x, y, x_normals=x, y_normals=y, point_reduction="max")
    with pytest.raises(ValueError, match="given together"):
        lik.chamfer_distance(x, y, x_normals=x)
    with pytest.raises(ValueError, match="weights cannot be negative"):
        lik.chamfer_distance(x, y, weights=torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="weights must have shape"):
        lik.chamfer_distance(x, y, weights=torch.ones(3))
    with pytest.raises(ValueError, match="backward"):
        lik.nearest_neighbors(x, y, backward="atomic")
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        lik.nearest_neighbors(x.numpy(), y)


def _gpu_clouds(seed, dim, dtype, x_lengths, y_lengths):
    """Three random clouds each side, padded to the longest length with NaN (x) and inf (y) garbage."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(3, max(x_lengths), dim, device="cuda", generator=g).to(dtype)
    y = torch.randn(3, max(y_lengths), dim, device="cuda", generator=g).to(dtype)
    for c in range(3):
        x[c, x_lengths[c]:] = float("nan")
        y[c, y_lengths[c]:] = float("inf")
    return x, y, torch.tensor(x_lengths, device="cuda"), torch.tensor(y_lengths, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [3, 8, 16, 128, 1000])
@pytest.mark.parametrize("norm", [1, 2])
def test_gpu_nearest_matches_reference(dtype, dim, norm):
    x, y, xl, yl = _gpu_clouds(dim, dim, dtype, [777, 500, 0], [1031, 0, 9])
    dist, idx = lik.nearest_neighbors(x, y, xl, yl, norm=norm)
    ref_dist, ref_idx = nearest_neighbors_reference(x.cpu().double(), y.cpu().double(), xl.cpu(), yl.cpu(), norm)
    # fp32 rounding may pick another point among near-ties: check the chosen point is as near as the best.
    chosen = torch.where(idx.cpu() >= 0, idx.cpu(), 0)
    assert torch.equal(idx.cpu() >= 0, ref_idx >= 0)
    torch.testing.assert_close(dist.cpu().double(), ref_dist, rtol=1e-4, atol=1e-4)
    agree = (chosen == torch.where(ref_idx >= 0, ref_idx, 0)).double().mean().item()
    assert agree > 0.99


@pytest.mark.gpu
def test_gpu_million_points_memory_is_linear():
    torch.cuda.reset_peak_memory_stats()
    x = torch.rand(1, 1_000_000, 3, device="cuda", requires_grad=True)
    y = torch.rand(1, 1_000_000, 3, device="cuda")
    base = torch.cuda.max_memory_allocated()
    loss, _ = lik.chamfer_distance(x, y)
    loss.backward()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 200 * 1_000_000  # O(P): a few hundred bytes per point, never P^2
    sub = torch.randint(0, 1_000_000, (2000,), device="cuda")
    dist, idx = lik.nearest_neighbors(x[:, sub].detach(), y)
    ref, _ = nearest_neighbors_reference(x[:, sub].detach().cpu(), y.cpu(), torch.tensor([2000]),
                                         torch.tensor([1_000_000]))
    torch.testing.assert_close(dist.cpu(), ref, rtol=2e-5, atol=1e-9)


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["dot-tf32x3", "core-tf32x3", "core-ieee"])
@pytest.mark.parametrize("dim", [3, 40, 128, 1000])
def test_gpu_forced_routes_match_reference(route, dim):
    # TF32-split products must choose winners as float32 products do: one-pass TF32 (10 mantissa bits) would
    # pick a farther point for many of these (the nearest-neighbour gaps are ~1e-3 relative at D = 128).
    g = torch.Generator(device="cuda").manual_seed(dim)
    x = torch.randn(2, 1500, dim, device="cuda", generator=g) + 100.0
    y = torch.randn(2, 2100, dim, device="cuda", generator=g) + 100.0
    xl, yl = torch.tensor([1500, 700], device="cuda"), torch.tensor([2100, 1999], device="cuda")
    y[1, 1999:] = float("nan")
    with _config.override(nearest=LAUNCHES[route]):
        dist, idx = lik.nearest_neighbors(x, y, xl, yl)
    ref_dist, ref_idx = nearest_neighbors_reference(x.cpu().double(), y.cpu().double(), xl.cpu(), yl.cpu(), 2)
    torch.testing.assert_close(dist.cpu().double(), ref_dist, rtol=1e-5, atol=1e-6)
    assert (idx.cpu() == ref_idx).double().mean().item() > 0.999


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dim", [3, 8])
@pytest.mark.parametrize("norm", [1, 2])
def test_gpu_one_pass_equals_two_passes_and_reference(dtype, dim, norm):
    # The one pass folds the reverse winners in with int64 atomics: same keys as two passes with square tiles,
    # so the same winners, bit for bit.
    x, y, xl, yl = _gpu_clouds(dim + norm, dim, dtype, [2900, 1111, 0], [2100, 2099, 17])
    y[0, :40] = y[0, 40:80]  # exact ties across tiles
    tiles = dict(block_m=64, block_n=64, num_warps=4)
    with _config.override(nearest=_config.NearestConfig("direct", **tiles)):
        one = _both_ways(x, y, xl, yl, norm)
    with _config.override(nearest=_config.NearestConfig("direct", one_pass=False, **tiles)):
        two = _both_ways(x, y, xl, yl, norm)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    xs, ys, xlc, ylc = x.cpu().double(), y.cpu().double(), xl.cpu(), yl.cpu()
    for got, (a, b, al, bl) in zip(one, [(xs, ys, xlc, ylc), (ys, xs, ylc, xlc)]):
        ref_dist, ref_idx = nearest_neighbors_reference(a, b, al, bl, norm)
        assert torch.equal(got.cpu() >= 0, ref_idx >= 0)
        chosen = got.cpu().long().clamp(min=0)
        near = torch.gather(b, 1, chosen[..., None].expand(-1, -1, dim))
        diff = torch.where((ref_idx >= 0)[..., None], a - near, 0)
        dist = (diff**2).sum(-1) if norm == 2 else diff.abs().sum(-1)
        torch.testing.assert_close(dist, ref_dist, rtol=1e-4, atol=1e-4)
        assert (chosen == ref_idx.clamp(min=0)).double().mean().item() > 0.99
