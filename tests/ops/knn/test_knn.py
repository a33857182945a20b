"""lik.knn_points against a dense float64 brute force with PyTorch3D's documented semantics.

PyTorch3D's ``knn_points`` (pytorch3d/ops/knn.py) lists each point's K nearest neighbours in ascending squared
distance and pads with zeros (distance 0, index 0) both where a cloud of p2 has fewer than K points and where a
cloud of p1 has fewer than P1 points; ``knn_gather`` zeroes the neighbours of the slots past lengths2. PyTorch3D
does not install here (no wheel for this torch), so the dense model below stands in for it. lik adds: ties go to
the lower index, a NaN distance orders after every number, and padded rows' ``knn`` are zeros too."""

import pytest
import torch

import lik
from lik.config import override
from lik.ops.knn import KnnConfig, knn_config, knn_reference

# Every route, forced with tiles smaller than the clouds below (several tiles and row blocks), beside the
# heuristic's choice (None): exact differences, and products with float32 and TF32-split operands.
LAUNCHES = {
    "heuristic": None,
    "direct": KnnConfig("direct", block_m=16, block_n=16),
    "products-ieee": KnnConfig("products", "ieee", block_m=16, block_n=16, block_k=16),
    "products-tf32x3": KnnConfig("products", "tf32x3", block_m=16, block_n=32, block_k=16),
}


@pytest.fixture(params=list(LAUNCHES))
def launch(request):
    cfg = LAUNCHES[request.param]
    if cfg is None:
        yield None
    else:
        with override(knn=cfg):
            yield cfg


def dense_knn(p1, p2, lengths1, lengths2, K, norm=2):
    """float64 ``(dists, idx)``: every distance, a stable sort (lower index first, NaN last), PyTorch3D's padding."""
    n, p1_size, _ = p1.shape
    dists = torch.zeros(n, p1_size, K, dtype=torch.float64)
    idx = torch.zeros(n, p1_size, K, dtype=torch.int64)
    for c in range(n):
        l1, l2 = int(lengths1[c]), int(lengths2[c])
        if l1 == 0 or l2 == 0:
            continue
        diff = p1[c, :l1, None, :].double() - p2[c, None, :l2, :].double()
        d = (diff**2).sum(-1) if norm == 2 else diff.abs().sum(-1)
        values, order = torch.sort(d, dim=1, stable=True)
        k = min(K, l2)
        dists[c, :l1, :k] = values[:, :k]
        idx[c, :l1, :k] = order[:, :k]
    return dists, idx


def clouds(rng, n, p1_size, p2_size, dim, lengths1=None, lengths2=None, garbage=True, dtype=torch.float32):
    """Random clouds with given (or random) lengths; NaN and inf in every padded position."""
    p1 = torch.randn(n, p1_size, dim, generator=rng, dtype=torch.float64)
    p2 = torch.randn(n, p2_size, dim, generator=rng, dtype=torch.float64)
    l1 = torch.tensor(lengths1) if lengths1 is not None else torch.randint(0, p1_size + 1, (n,), generator=rng)
    l2 = torch.tensor(lengths2) if lengths2 is not None else torch.randint(0, p2_size + 1, (n,), generator=rng)
    if garbage and dim:
        for t, lens in ((p1, l1), (p2, l2)):
            for c in range(n):
                t[c, lens[c]:, 0] = float("nan")
                t[c, lens[c]:, -1] = float("inf")
    return p1.to(dtype), p2.to(dtype), l1, l2


def check_against_dense(out, p1, p2, l1, l2, K, norm=2, rtol=1e-5, atol=1e-5):
    dists, idx = dense_knn(p1, p2, l1, l2, K, norm)
    assert out.dists.dtype == (torch.float64 if p1.dtype == torch.float64 else torch.float32)
    assert out.idx.dtype == torch.int64 and out.dists.shape == out.idx.shape == (p1.shape[0], p1.shape[1], K)
    assert torch.equal(out.idx, idx)
    torch.testing.assert_close(out.dists.double(), dists, rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.parametrize("dim", [1, 3, 7, 128])
def test_matches_dense_float64(dim, rng, launch):
    # Lengths 0 and 1 on both sides, a full cloud, K past most lengths2 (K = 32 > 21).
    p1, p2, l1, l2 = clouds(rng, 4, 37, 21, dim, lengths1=[37, 0, 1, 20], lengths2=[21, 1, 0, 13])
    # The wide set's runtime coordinate loop is slow in the interpreter: two list sizes there.
    for K in (1, 2, 5, 32) if dim < 128 else (2, 32):
        out = lik.knn_points(p1, p2, l1, l2, K=K)
        check_against_dense(out, p1, p2, l1, l2, K, rtol=1e-5, atol=1e-4 if dim == 128 else 1e-6)


@pytest.mark.parametrize("dim", [3, 20])
def test_norm_1_matches_dense_float64(dim, rng, launch):
    p1, p2, l1, l2 = clouds(rng, 2, 19, 40, dim, lengths1=[19, 7], lengths2=[40, 3])
    out = lik.knn_points(p1, p2, l1, l2, norm=1, K=4)
    check_against_dense(out, p1, p2, l1, l2, 4, norm=1)


def test_reference_matches_dense_float64(rng):
    p1, p2, l1, l2 = clouds(rng, 3, 30, 25, 5, dtype=torch.float64)
    for K, norm in ((1, 2), (7, 2), (32, 1)):
        # A tiny budget: one row per chunk.
        dists, idx = knn_reference(p1, p2, l1, l2, K, norm, budget_bytes=1)
        want_d, want_i = dense_knn(p1, p2, l1, l2, K, norm)
        assert torch.equal(idx, want_i)
        torch.testing.assert_close(dists, want_d, rtol=1e-12, atol=0)


def test_k_past_the_cloud_pads_as_pytorch3d(rng, launch):
    p1, p2, l1, l2 = clouds(rng, 3, 6, 4, 3, lengths1=[6, 2, 6], lengths2=[4, 3, 0])
    out = lik.knn_points(p1, p2, l1, l2, K=6, return_nn=True)
    assert out.dists[0, :, 4:].eq(0).all() and out.idx[0, :, 4:].eq(0).all()          # slots past lengths2
    assert out.dists[0, :, :4].gt(0).all()
    assert out.dists[1, 2:].eq(0).all() and out.idx[1, 2:].eq(0).all()          # rows past lengths1
    assert out.dists[1, :2, 3:].eq(0).all() and out.dists[1, :2, :3].gt(0).all()
    assert out.dists[2].eq(0).all() and out.idx[2].eq(0).all()                  # an empty p2 cloud
    assert out.knn[0, :, 4:].eq(0).all() and out.knn[1, 2:].eq(0).all() and out.knn[2].eq(0).all()
    torch.testing.assert_close(out.knn[0, :, :4], p2[0][out.idx[0, :, :4]])
    assert torch.isfinite(out.knn).all() and torch.isfinite(out.dists).all()


@pytest.mark.parametrize("dim", [2, 16])
def test_duplicate_points_go_to_the_lowest_index(dim, rng, launch):
    # Every p2 point three times, in different tiles. Small integers make every distance exact whatever the order of
    # its sums (a CPU BLAS orders them by column), and p1's mean 0 makes the float32 centring exact: the copies tie
    # exactly on every route.
    half = torch.randint(-4, 5, (2, 11, dim), generator=rng).float()
    p1 = torch.cat([half, -half, torch.zeros(2, 1, dim)], dim=1)
    base = torch.randint(-4, 5, (2, 9, dim), generator=rng).float()
    p2 = torch.cat([base, base, base.flip(1)], dim=1)
    n1, n2 = torch.tensor([23, 23]), torch.tensor([27, 20])
    for K in (1, 3, 8):
        out = lik.knn_points(p1, p2, n1, n2, K=K)
        check_against_dense(out, p1, p2, n1, n2, K)


# Float32 products multiply centred operands, which may order coincident distances either way (the docstring's
# margin; duplicates, above, tie exactly on every route); half-precision inputs are multiplied as they are.
@pytest.mark.parametrize("name, dim, dtype", [
    ("heuristic", 2, torch.float32), ("direct", 2, torch.float32), ("direct", 16, torch.float16),
    ("heuristic", 16, torch.float16), ("products-ieee", 16, torch.float16),
])
def test_equal_distances_go_to_the_lowest_index(name, dim, dtype, rng):
    # Small integer coordinates: distinct points at equal distances.
    p1 = torch.randint(-3, 4, (2, 23, dim), generator=rng).to(dtype)
    p2 = torch.randint(-3, 4, (2, 27, dim), generator=rng).to(dtype)
    n1, n2 = torch.tensor([23, 23]), torch.tensor([27, 20])
    with override(**({} if LAUNCHES[name] is None else {"knn": LAUNCHES[name]})):
        for K in (1, 3, 8):
            out = lik.knn_points(p1, p2, n1, n2, K=K)
            check_against_dense(out, p1, p2, n1, n2, K, rtol=0, atol=0)


@pytest.mark.parametrize("dim", [3, 12])
def test_non_finite_valid_points_rank_as_the_reference(dim, rng, launch):
    p1, p2, l1, l2 = clouds(rng, 2, 20, 33, dim, lengths1=[20, 20], lengths2=[30, 30])
    p2[0, 4, 1] = float("nan")       # NaN distance to every row: listed after every number
    p2[0, 7, 0] = float("inf")       # +inf to finite rows, NaN to row 3 (inf - inf)
    p2[0, 9, 2] = -float("inf")
    p1[0, 3, 0] = float("inf")       # every distance of row 3 is inf or NaN
    p1[1, 5, 1] = float("nan")       # row 5 of cloud 1: all NaN, so the first indices in order
    for K in (3, 32):
        out = lik.knn_points(p1, p2, l1, l2, K=K)
        check_against_dense(out, p1, p2, l1, l2, K, atol=1e-4)
    assert torch.equal(out.idx[0, 0, 27:], torch.tensor([7, 9, 4, 0, 0]))
    assert out.dists[0, 0, 27:29].isinf().all() and out.dists[0, 0, 29].isnan() and out.dists[0, 0, 30:].eq(0).all()
    assert torch.equal(out.idx[1, 5], torch.arange(32) * (torch.arange(32) < 30))
    assert out.dists[1, 5, :30].isnan().all() and out.dists[1, 5, 30:].eq(0).all()


def test_padding_garbage_never_reaches_results_or_gradients(rng, launch):
    p1, p2, l1, l2 = clouds(rng, 3, 21, 18, 3, lengths1=[21, 9, 0], lengths2=[5, 18, 11], garbage=False)
    clean = lik.knn_points(p1, p2, l1, l2, K=8, return_nn=True)
    dirty1, dirty2 = p1.clone(), p2.clone()
    for t, lens in ((dirty1, l1), (dirty2, l2)):
        for c in range(3):
            t[c, lens[c]:, 0] = float("nan")
            t[c, lens[c]:, 1] = float("inf")
            t[c, lens[c]:, 2] = -1e-3  # close to every point: would be chosen if read
    a, b = dirty1.requires_grad_(), dirty2.requires_grad_()
    out = lik.knn_points(a, b, l1, l2, K=8, return_nn=True)
    assert torch.equal(out.idx, clean.idx) and torch.equal(out.dists, clean.dists) and torch.equal(out.knn, clean.knn)
    (out.dists.sum() + out.knn.sum()).backward()
    for grad, lens in ((a.grad, l1), (b.grad, l2)):
        assert torch.isfinite(grad).all()
        for c in range(3):
            assert grad[c, lens[c]:].eq(0).all()


def test_noncontiguous_views(rng, launch):
    big1 = torch.randn(2, 50, 9, generator=rng)
    big2 = torch.randn(9, 41, 2, generator=rng)
    p1 = big1[:, ::2, 1:8]                      # strided points and coordinates
    p2 = big2[2:9].permute(2, 1, 0)             # [2, 41, 7], coordinate-major storage
    assert not p1.is_contiguous() and not p2.is_contiguous()
    l1, l2 = torch.tensor([25, 11]), torch.tensor([41, 30])
    out = lik.knn_points(p1, p2, l1, l2, K=5, return_nn=True)
    want = lik.knn_points(p1.contiguous(), p2.contiguous(), l1, l2, K=5, return_nn=True)
    assert torch.equal(out.idx, want.idx) and torch.equal(out.dists, want.dists) and torch.equal(out.knn, want.knn)
    check_against_dense(out, p1, p2, l1, l2, 5)


@pytest.mark.parametrize("shape1, shape2", [((0, 5, 3), (0, 4, 3)), ((2, 0, 3), (2, 4, 3)), ((2, 5, 3), (2, 0, 3)),
                                            ((2, 5, 0), (2, 4, 0))])
def test_empty_sizes(shape1, shape2, launch):
    p1 = torch.randn(shape1, requires_grad=True)
    p2 = torch.randn(shape2, requires_grad=True)
    out = lik.knn_points(p1, p2, K=3, return_nn=True)
    assert out.dists.shape == out.idx.shape == (shape1[0], shape1[1], 3)
    assert out.knn.shape == (shape1[0], shape1[1], 3, shape1[2])
    if shape1[2] == 0 and shape1[1]:
        # D = 0: every distance is 0, so the lowest indices.
        assert torch.equal(out.idx, torch.arange(3).expand(2, 5, 3)) and out.dists.eq(0).all()
    else:
        assert out.dists.eq(0).all() and out.idx.eq(0).all()
    (out.dists.sum() + out.knn.sum()).backward()
    assert p1.grad.eq(0).all() and p2.grad.eq(0).all()


def test_half_precision(rng):
    p1, p2, l1, l2 = clouds(rng, 2, 30, 40, 3, lengths1=[30, 17], lengths2=[40, 9], dtype=torch.float16)
    out = lik.knn_points(p1, p2, l1, l2, K=4)
    check_against_dense(out, p1, p2, l1, l2, 4)      # distances of the fp16 values, in float32
    bf = lik.knn_points(p1.bfloat16(), p2.bfloat16(), l1, l2, K=4)   # CPU bfloat16: the reference
    check_against_dense(bf, p1.bfloat16(), p2.bfloat16(), l1, l2, 4)


@pytest.mark.parametrize("norm", [1, 2])
def test_gradcheck_of_the_reference(norm, rng):
    p1, p2, l1, l2 = clouds(rng, 2, 6, 5, 3, lengths1=[6, 3], lengths2=[5, 2], garbage=False, dtype=torch.float64)
    p1.requires_grad_()
    p2.requires_grad_()

    def f(a, b):
        out = lik.knn_points(a, b, l1, l2, norm=norm, K=3, return_nn=True)
        return out.dists, out.knn

    assert torch.autograd.gradcheck(f, (p1, p2))


def dense_loss_grads(p1, p2, l1, l2, K, norm, weights):
    """Gradients of sum(weights * dists) through the dense model's indices, by autograd in float64."""
    a = p1.detach().double().requires_grad_()
    b = p2.detach().double().requires_grad_()
    _, idx = dense_knn(a.detach(), b.detach(), l1, l2, K, norm)
    rows = torch.arange(p1.shape[1])[None, :, None] < l1[:, None, None]
    valid = rows & (torch.arange(K)[None, None] < l2[:, None, None])
    near = b[torch.arange(p1.shape[0])[:, None, None], idx]
    diff = torch.where(valid[..., None], a[:, :, None] - near, 0)
    d = (diff**2).sum(-1) if norm == 2 else diff.abs().sum(-1)
    (d * weights.double()).sum().backward()
    return a.grad, b.grad


@pytest.mark.parametrize("backward", ["fast", "deterministic"])
@pytest.mark.parametrize("dim, norm", [(3, 2), (3, 1), (24, 2)])
def test_kernel_gradients_match_dense(dim, norm, backward, rng, launch):
    p1, p2, l1, l2 = clouds(rng, 2, 19, 23, dim, lengths1=[19, 8], lengths2=[23, 4], garbage=False)
    a, b = p1.clone().requires_grad_(), p2.clone().requires_grad_()
    out = lik.knn_points(a, b, l1, l2, norm=norm, K=6, backward=backward)
    weights = torch.randn(out.dists.shape, generator=rng)
    (out.dists * weights).sum().backward()
    want_a, want_b = dense_loss_grads(p1, p2, l1, l2, 6, norm, weights)
    torch.testing.assert_close(a.grad.double(), want_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad.double(), want_b, rtol=1e-5, atol=1e-5)
    assert a.grad.dtype == b.grad.dtype == torch.float32


def test_gradients_through_the_neighbours(rng):
    p1, p2, l1, l2 = clouds(rng, 2, 9, 7, 3, lengths1=[9, 4], lengths2=[7, 2], garbage=False)
    b = p2.clone().requires_grad_()
    out = lik.knn_points(p1, b, l1, l2, K=3, return_nn=True)
    weights = torch.randn(out.knn.shape, generator=rng)
    (out.knn * weights).sum().backward()
    want = torch.zeros_like(p2)
    for c in range(2):
        for i in range(int(l1[c])):
            for k in range(min(3, int(l2[c]))):
                want[c, out.idx[c, i, k]] += weights[c, i, k]
    torch.testing.assert_close(b.grad, want)


def test_pytorch3d_argument_order_and_result_type(rng):
    p1, p2, l1, l2 = clouds(rng, 2, 8, 9, 3, garbage=False)
    out = lik.knn_points(p1, p2, l1, l2, 2, 4, -1, True, False)  # norm, K, version, return_nn, return_sorted
    assert type(out).__name__ == "KNN" and out._fields == ("dists", "idx", "knn")
    dists, idx, knn = out
    assert dists.shape == (2, 8, 4) and knn.shape == (2, 8, 4, 3)
    check_against_dense(out, p1, p2, l1, l2, 4)
    assert lik.knn_points(p1, p2).knn is None


def test_torch_compile_aot_eager(rng):
    p1, p2, l1, l2 = clouds(rng, 2, 12, 10, 3, lengths1=[12, 5], lengths2=[10, 7], garbage=False)

    def loss(a, b):
        out = lik.knn_points(a, b, l1, l2, K=3, return_nn=True)
        return out.dists.sum() + out.knn.square().sum(), out.idx

    compiled = torch.compile(loss, backend="aot_eager")
    a, b = p1.clone().requires_grad_(), p2.clone().requires_grad_()
    value, idx = compiled(a, b)
    value.backward()
    a2, b2 = p1.clone().requires_grad_(), p2.clone().requires_grad_()
    want, want_idx = loss(a2, b2)
    want.backward()
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(value, want)
    torch.testing.assert_close(a.grad, a2.grad)
    torch.testing.assert_close(b.grad, b2.grad)
    with torch.no_grad():
        torch.testing.assert_close(compiled(p1, p2)[0], want.detach())


BAD = [
    (dict(p1=[[[0.0]]]), TypeError, "p1 must be a torch.Tensor"),
    (dict(p2=torch.zeros(2, 3)), ValueError, "p2 must have shape"),
    (dict(p1=torch.zeros(2, 3, 3, dtype=torch.int32)), TypeError, "p1 must be float16"),
    (dict(p2=torch.zeros(3, 4, 3)), ValueError, "p2 has 3 clouds"),
    (dict(p2=torch.zeros(2, 4, 2)), ValueError, "p2 has D = 2"),
    (dict(p2=torch.zeros(2, 4, 3, dtype=torch.float64)), TypeError, "p2 is torch.float64"),
    (dict(K=0), ValueError, "K must lie in"),
    (dict(K=33), ValueError, "K must lie in"),
    (dict(K=2.0), TypeError, "K must be an int"),
    (dict(K=True), TypeError, "K must be an int"),
    (dict(norm=3), ValueError, "norm must be 1 or 2"),
    (dict(lengths1=[5, 5]), TypeError, "lengths1 must be a torch.Tensor"),
    (dict(lengths1=torch.tensor([1.0, 2.0])), TypeError, "lengths1 must be an integer tensor"),
    (dict(lengths2=torch.tensor([1, 2, 3])), ValueError, "lengths2 must have shape"),
    (dict(lengths2=torch.tensor([1, 5])), ValueError, r"lengths2 must lie in \[0, 4\]"),
    (dict(lengths1=torch.tensor([-1, 2])), ValueError, r"lengths1 must lie in \[0, 5\]"),
    (dict(return_nn="yes"), TypeError, "return_nn must be True or False"),
    (dict(return_sorted=None), TypeError, "return_sorted must be True or False"),
    (dict(version="v1"), TypeError, "version must be an int"),
    (dict(backward="slow"), ValueError, "backward must be one of"),
]


@pytest.mark.parametrize("change, error, message", BAD, ids=[m for _, _, m in BAD])
def test_bad_input_names_the_argument(change, error, message):
    args = dict(p1=torch.zeros(2, 5, 3), p2=torch.zeros(2, 4, 3))
    args.update(change)
    with pytest.raises(error, match=message):
        lik.knn_points(**args)


def test_heuristic_follows_dimension_norm_and_matmul_precision(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert knn_config(dim=3, k=8, norm=2, dtype=torch.float32, device=cpu).route == "direct"
    assert knn_config(dim=128, k=8, norm=1, dtype=torch.float32, device=cpu).route == "direct"
    wide = knn_config(dim=128, k=8, norm=2, dtype=torch.float32, device=cpu)
    assert wide.route == "products" and wide.precision == "ieee"       # the interpreter multiplies in float32
    monkeypatch.setattr(lik._device, "interpreting", lambda: False)
    monkeypatch.setattr(lik._device, "arch", lambda device: (9, 0))
    saved = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert knn_config(dim=128, k=8, norm=2, dtype=torch.float32, device=cuda).precision == "tf32x3"
        torch.set_float32_matmul_precision("high")
        assert knn_config(dim=128, k=8, norm=2, dtype=torch.float32, device=cuda).precision == "tf32"
        assert knn_config(dim=128, k=8, norm=2, dtype=torch.float16, device=cuda).precision == "ieee"
    finally:
        torch.set_float32_matmul_precision(saved)
    monkeypatch.setattr(lik._device, "arch", lambda device: (7, 5))
    assert knn_config(dim=128, k=8, norm=2, dtype=torch.float32, device=cuda).precision == "ieee"


def test_products_route_resorts_by_exact_distance():
    """The products route's list is re-sorted after the exact distances are recomputed: by distance, the lower
    index among equals, NaN after every number, empty slots last."""
    from lik.ops.knn.gather import sort_neighbours

    nan = float("nan")
    dists = torch.tensor([[[3.0, 1.0, nan, 1.0, 0.0, 0.0], [2.0, 2.0, 0.0, 0.0, 0.0, 0.0]]])
    idx = torch.tensor([[[7, 9, 2, 4, 0, 0], [5, 3, 0, 0, 0, 0]]])
    valid = torch.tensor([[[True] * 4 + [False] * 2, [True] * 2 + [False] * 4]])
    got_d, got_i = sort_neighbours(dists, idx, valid)
    assert torch.equal(got_i, torch.tensor([[[4, 9, 7, 2, 0, 0], [3, 5, 0, 0, 0, 0]]]))
    torch.testing.assert_close(got_d, torch.tensor([[[1.0, 1.0, 3.0, nan, 0.0, 0.0], [2.0, 2.0, 0, 0, 0, 0]]]),
                               equal_nan=True)
