"""RT-DETRv2 / D-FINE's deformable attention (a number of points per level, bilinear or nearest-pixel sampling):
the kernels (Triton interpreter on CPU, compiled on GPU) against the float64 reference, the reference against a
point-by-point loop and against transformers' own ``multi_scale_deformable_attention_v2``."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import lik.ops.msda.function as msda_function
from lik.ops.msda import ms_deform_attn, ms_deform_attn_v2, ms_deform_attn_v2_reference

from .helpers import assert_matches, level_tensors, rel_err, with_grads

FP32_TOL = 2e-5
METHODS = ("default", "discrete")


@contextlib.contextmanager
def _deterministic(enabled=True):
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved)


def rand_problem(rng, n, n_queries, heads, dim, hw, counts, *, spread=1.4, dtype=torch.float32, device="cpu"):
    """Random inputs in RT-DETRv2's layout; locations drawn so some fall off the maps."""
    shapes, starts, n_pixels = level_tensors(hw)
    total = sum(counts)
    value = torch.randn(n, n_pixels, heads, dim, generator=rng)
    loc = (torch.rand(n, n_queries, heads, total, 2, generator=rng) - 0.5) * spread + 0.5
    weights = torch.rand(n, n_queries, heads, total, generator=rng) + 0.1
    grad = torch.randn(n, n_queries, heads * dim, generator=rng)
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return cast(value), shapes.to(device), starts.to(device), cast(loc), cast(weights), cast(grad)


def reference64(problem, counts, method):
    return with_grads(ms_deform_attn_v2_reference, *problem, dtype=torch.float64, num_points_list=counts,
                      method=method)


def check(problem, counts, method, tol=FP32_TOL):
    got = with_grads(ms_deform_attn_v2, *problem, num_points_list=counts, method=method)
    ref = reference64(problem, counts, method)
    for name, g, r, source in zip(("out", "grad_value", "grad_loc", "grad_weights"), got, ref,
                                  (problem[0], problem[0], problem[3], problem[4])):
        assert g.dtype == source.dtype, name
        if name == "grad_loc" and method == "discrete":
            assert not g.any(), "a nearest pixel is piecewise constant: no location gradient"
            continue
        assert_matches(g, r, tol, f"{method} {name}")
    return got


def loop_spec(value, shapes, starts, loc, weights, counts, method):
    """The definition point by point in float64, independent of grid_sample and gather."""
    n, _, heads, dim = value.shape
    n_queries = loc.shape[1]
    out = torch.zeros(n, n_queries, heads, dim, dtype=torch.float64)
    v = value.double()
    for b in range(n):
        for q in range(n_queries):
            for m in range(heads):
                first = 0
                for level, count in enumerate(counts):
                    h, w = (int(s) for s in shapes[level])
                    start = int(starts[level])
                    for j in range(first, first + count):
                        x, y = float(loc[b, q, m, j, 0]), float(loc[b, q, m, j, 1])
                        a = float(weights[b, q, m, j])
                        if method == "discrete":
                            xi = min(max(int(x * w + 0.5), 0), w - 1)
                            yi = min(max(int(y * h + 0.5), 0), h - 1)
                            out[b, q, m] += a * v[b, start + yi * w + xi, m]
                            continue
                        px, py = x * w - 0.5, y * h - 0.5
                        x0, y0 = math.floor(px), math.floor(py)
                        for yy, xx, c in ((y0, x0, (x0 + 1 - px) * (y0 + 1 - py)),
                                          (y0, x0 + 1, (px - x0) * (y0 + 1 - py)),
                                          (y0 + 1, x0, (x0 + 1 - px) * (py - y0)),
                                          (y0 + 1, x0 + 1, (px - x0) * (py - y0))):
                            if 0 <= xx < w and 0 <= yy < h:
                                out[b, q, m] += a * c * v[b, start + yy * w + xx, m]
                    first += count
    return out.reshape(n, n_queries, heads * dim)


# (N, Lq, M, D, [(H, W) per level], num_points_list): odd maps and channels, a level with 0 points, one point,
# counts past a power of two, one channel and two channel blocks (D 256).
CASES = [
    pytest.param(1, 5, 1, 1, [(1, 1)], [1], id="1x1-L1-P1-D1"),
    pytest.param(2, 4, 3, 7, [(5, 7), (3, 4), (2, 2)], [3, 6, 3], id="dfine-3-6-3-D7"),
    pytest.param(1, 3, 2, 71, [(1, 9), (7, 1), (2, 3)], [0, 5, 2], id="zero-points-D71"),
    pytest.param(2, 3, 2, 256, [(3, 5), (2, 2)], [2, 1], id="two-channel-blocks"),
]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n, lq, m, d, hw, counts", CASES)
def test_matches_float64_reference(rng, n, lq, m, d, hw, counts, method):
    check(rand_problem(rng, n, lq, m, d, hw, counts), counts, method)


@pytest.mark.parametrize("method", METHODS)
def test_deterministic_backward_matches_and_repeats(rng, method):
    counts = [3, 6, 3]
    problem = rand_problem(rng, 2, 4, 3, 7, [(5, 7), (3, 4), (2, 2)], counts)
    with _deterministic():
        first = check(problem, counts, method)
        again = with_grads(ms_deform_attn_v2, *problem, num_points_list=counts, method=method)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


@pytest.mark.parametrize("method", METHODS)
def test_reference_matches_loop_definition(rng, method):
    counts = [2, 3]
    value, shapes, starts, loc, weights, _ = rand_problem(rng, 2, 3, 2, 3, [(3, 5), (2, 2)], counts, spread=1.8,
                                                          dtype=torch.float64)
    got = ms_deform_attn_v2_reference(value, shapes, starts, loc, weights, counts, method)
    assert_matches(got, loop_spec(value, shapes, starts, loc, weights, counts, method), 1e-12, method)


@pytest.mark.parametrize("method", METHODS)
def test_reference_matches_transformers(rng, method):
    """lik's reference and kernels against transformers' own function, float64 and float32, in and off the map."""
    modeling = pytest.importorskip("transformers.models.rt_detr_v2.modeling_rt_detr_v2")
    counts, hw = [3, 1, 2], [(5, 7), (3, 4), (2, 2)]
    value, shapes, starts, loc, weights, _ = rand_problem(rng, 2, 4, 2, 8, hw, counts)
    want = modeling.multi_scale_deformable_attention_v2(value.double(), hw, loc.double(), weights.double(), counts,
                                                        method)
    ref = ms_deform_attn_v2_reference(value.double(), shapes, starts, loc.double(), weights.double(), counts, method)
    assert_matches(ref, want, 1e-12, "reference")
    assert_matches(ms_deform_attn_v2(value, shapes, starts, loc, weights, counts, method), want, FP32_TOL, "kernels")


@pytest.mark.parametrize("deterministic", [False, True])
def test_discrete_ties_borders_nan_and_inf(rng, deterministic):
    """Exact ties (x * W + 0.5 = 2.5 reads pixel 2 and 2.0 pixel 2, as transformers' int()); below 0 and past
    the border clamp; NaN reads pixel 0 and +-inf the border; a NaN in a pixel nobody reads never leaks. Value sits
    between NaN guards."""
    counts, hw = [4, 3], [(4, 8), (2, 2)]
    value, shapes, starts, loc, weights, grad = rand_problem(rng, 1, 6, 2, 5, hw, counts)
    loc[0, 0, 0, 0] = torch.tensor([2 / 8, 1 / 4])  # x * 8 + 0.5 = 2.5: pixel 2 (exact in fp32)
    loc[0, 0, 0, 1] = torch.tensor([1.5 / 8, 0.5 / 4])  # exactly 2.0 and 1.0
    loc[0, 1, 1, 2] = torch.tensor([-7.0, 9.0])
    loc[0, 2, 0, 3] = torch.tensor([float("nan"), 0.5])
    loc[0, 3, 1, 4] = torch.tensor([float("inf"), -float("inf")])
    loc[0, 4, 0, 5] = torch.tensor([1e30, -1e30])
    s = value.shape[1]
    guarded = torch.full((1, s + 8, 4, 7), float("nan"))
    guarded[:, 4:4 + s, 1:3, 1:6] = value
    view = guarded[:, 4:4 + s, 1:3, 1:6]
    with _deterministic(deterministic):
        got = with_grads(ms_deform_attn_v2, view, shapes, starts, loc, weights, grad, num_points_list=counts,
                         method="discrete")
    ref = reference64((value, shapes, starts, loc, weights, grad), counts, "discrete")
    for g, r, name in zip(got, ref, ("out", "grad_value", "grad_loc", "grad_weights")):
        if name != "grad_loc":
            assert_matches(g, r, FP32_TOL, name)
    assert_matches(got[0], loop_spec(value, shapes, starts, loc.nan_to_num(0.0), weights, counts, "discrete"),
                   FP32_TOL, "loop")


def test_default_nan_location_gives_nan_in_its_row_only(rng):
    counts = [2, 3]
    value, shapes, starts, loc, weights, grad = rand_problem(rng, 1, 3, 2, 4, [(3, 4), (2, 2)], counts)
    loc[0, 1, 0, 3, 0] = float("nan")
    out = ms_deform_attn_v2(value, shapes, starts, loc, weights, counts)
    ref = ms_deform_attn_v2_reference(value.double(), shapes, starts, loc.double(), weights.double(), counts)
    assert torch.equal(out.isnan(), ref.isnan()) and ref.isnan().any() and not ref.isnan().all()
    assert_matches(out[~ref.isnan()], ref[~ref.isnan()], FP32_TOL, "finite rows")


@pytest.mark.parametrize("method", METHODS)
def test_empty_level_reads_nothing(rng, method):
    counts, hw = [2, 2, 1], [(3, 4), (0, 5), (2, 2)]
    check(rand_problem(rng, 1, 3, 2, 4, hw, counts), counts, method)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n, lq", [(2, 0), (0, 3)])
def test_empty_queries_or_batch(rng, method, n, lq):
    counts = [1, 2]
    problem = rand_problem(rng, n, lq, 2, 4, [(3, 3), (2, 2)], counts)
    got = with_grads(ms_deform_attn_v2, *problem, num_points_list=counts, method=method)
    assert got[0].shape == (n, lq, 8) and not any(g.any() for g in got[1:])


@pytest.mark.parametrize("method", METHODS)
def test_many_queries_on_one_pixel(rng, method):
    counts = [4, 1]
    value, shapes, starts, loc, weights, grad = rand_problem(rng, 1, 16, 2, 8, [(4, 8), (3, 3)], counts)
    loc[..., :4, :] = torch.tensor([2.5 / 8, 1.5 / 4])
    for deterministic in (False, True):
        with _deterministic(deterministic):
            check((value, shapes, starts, loc, weights, grad), counts, method)


def test_non_contiguous_inputs_and_mixed_dtypes(rng):
    counts = [3, 2]
    value, shapes, starts, loc, weights, grad = rand_problem(rng, 2, 4, 2, 6, [(3, 5), (2, 3)], counts)
    v = value.transpose(1, 2).contiguous().transpose(1, 2)  # strided, not dense in [N, S, M, D]
    lc = torch.cat([loc, loc], -1)[..., :2]
    w = weights.transpose(0, 1).contiguous().transpose(0, 1)
    for method in METHODS:
        check((v, shapes, starts[:], lc, w.half(), grad), counts, method, tol=1e-3)
        check((v, shapes.int(), starts.int(), lc, w, grad), counts, method)


def test_equal_counts_with_bilinear_run_deformable_detrs_op(rng, monkeypatch):
    counts = [2, 2]
    value, shapes, starts, loc, weights, _ = rand_problem(rng, 1, 3, 2, 4, [(3, 4), (2, 2)], counts)
    want = ms_deform_attn(value, shapes, starts, loc.view(1, 3, 2, 2, 2, 2), weights.view(1, 3, 2, 2, 2))
    seen = []
    monkeypatch.setattr(msda_function, "msda_forward", lambda *a: seen.append(a) or want)
    routed = __import__("lik.ops.msda.v2", fromlist=["v2"])
    monkeypatch.setattr(routed, "ms_deform_attn", lambda *a: seen.append(a) or want)
    assert torch.equal(ms_deform_attn_v2(value, shapes, starts, loc, weights, counts), want) and seen


def test_float64_and_cpu_bfloat16_run_the_reference(rng):
    counts = [1, 3]
    problem = rand_problem(rng, 1, 3, 2, 4, [(3, 4), (2, 2)], counts, dtype=torch.float64)
    got = with_grads(ms_deform_attn_v2, *problem, num_points_list=counts, method="discrete")
    for g, r in zip(got, reference64(problem, counts, "discrete")):
        assert torch.equal(g, r)
    bf = [t.bfloat16() if t.is_floating_point() else t for t in problem]
    out = ms_deform_attn_v2(*bf[:5], counts, "discrete")
    assert out.dtype == torch.bfloat16 and rel_err(out, got[0]) < 2e-2


@pytest.mark.parametrize(
    "change, error, name",
    [
        (lambda a: a.update(method="nearest"), ValueError, "method"),
        (lambda a: a.update(num_points_list=torch.tensor([1, 2])), TypeError, "num_points_list"),
        (lambda a: a.update(num_points_list=[1, 2.0]), TypeError, "num_points_list"),
        (lambda a: a.update(num_points_list=[4, -1]), ValueError, "num_points_list"),
        (lambda a: a.update(num_points_list=[1, 1, 1]), ValueError, "num_points_list"),
        (lambda a: a.update(num_points_list=[1, 1]), ValueError, "sampling_locations"),
        (lambda a: a.update(sampling_locations=a["sampling_locations"][..., :1]), ValueError, "sampling_locations"),
        (lambda a: a.update(attention_weights=a["attention_weights"][:, :1]), ValueError, "attention_weights"),
        (lambda a: a.update(value=a["value"][:, :, :1]), ValueError, "sampling_locations"),
        (lambda a: a.update(value=a["value"].int()), TypeError, "value"),
        (lambda a: a.update(value_level_start_index=a["value_level_start_index"] + 30), ValueError,
         "value_level_start_index"),
    ],
)
def test_bad_input_names_the_argument(rng, change, error, name):
    counts = [1, 2]
    value, shapes, starts, loc, weights, _ = rand_problem(rng, 1, 2, 2, 3, [(3, 4), (2, 2)], counts)
    args = dict(value=value, value_spatial_shapes=shapes, value_level_start_index=starts, sampling_locations=loc,
                attention_weights=weights, num_points_list=counts, method="discrete")
    change(args)
    for fn in (ms_deform_attn_v2, ms_deform_attn_v2_reference):
        with pytest.raises(error, match=name):
            fn(**args)


def test_torch_compile_traces_without_graph_break(rng):
    counts = [3, 1]
    value, shapes, starts, loc, weights, grad = rand_problem(rng, 1, 3, 2, 4, [(3, 4), (2, 2)], counts)
    call = lambda v, lc, w: ms_deform_attn_v2(v, shapes, starts, lc, w, counts, "discrete")  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
    got = with_grads(lambda v, s, st, lc, w: compiled(v, lc, w), value, shapes, starts, loc, weights, grad)
    want = with_grads(lambda v, s, st, lc, w: call(v, lc, w), value, shapes, starts, loc, weights, grad)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


# ------------------------------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.float16, 3e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_gpu_matches_float64_reference(rng, dtype, tol, method, case):
    n, lq, m, d, hw, counts = CASES[case].values
    problem = rand_problem(rng, n, lq * 37, m, d, hw, counts, dtype=dtype, device="cuda")
    ref = reference64(problem, counts, method)
    for deterministic in (False, True):
        with _deterministic(deterministic):
            got = with_grads(ms_deform_attn_v2, *problem, num_points_list=counts, method=method)
            again = with_grads(ms_deform_attn_v2, *problem, num_points_list=counts, method=method)
        for g, r, a, name in zip(got, ref, again, ("out", "grad_value", "grad_loc", "grad_weights")):
            assert g.dtype == dtype
            if not (name == "grad_loc" and method == "discrete"):
                assert rel_err(g, r) <= tol, name
            if deterministic:
                assert torch.equal(g, a), name


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
def test_gpu_torch_compile_inductor(rng, method):
    counts = [3, 6, 3]
    value, shapes, starts, loc, weights, grad = rand_problem(rng, 2, 300, 8, 32, [(40, 40), (20, 20), (10, 10)],
                                                             counts, device="cuda")
    call = lambda v, lc, w: ms_deform_attn_v2(v, shapes, starts, lc, w, counts, method)  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True)
    got = with_grads(lambda v, s, st, lc, w: compiled(v, lc, w), value, shapes, starts, loc, weights, grad)
    want = with_grads(lambda v, s, st, lc, w: call(v, lc, w), value, shapes, starts, loc, weights, grad)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-5
