"""Multi-scale deformable attention: kernels (Triton interpreter on CPU, compiled on GPU) against a float64
reference, which is itself checked against a point-by-point loop of the definition."""

from __future__ import annotations

import contextlib

import pytest
import torch

import lik._config as config
from lik.integrations.transformers import MultiScaleDeformableAttention
from lik.ops.msda import (
    MSDeformAttnFunction,
    MultiScaleDeformableAttnFunction,
    ms_deform_attn,
    ms_deform_attn_reference,
)

from .helpers import assert_matches, level_tensors, loop_spec, rand_problem, reference64, rel_err, with_grads

FP32_TOL = 2e-5


@contextlib.contextmanager
def _deterministic(enabled=True):
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved)

# (N, Lq, M, D, [(H, W) per level], P): every map kind, L in {1, 5}, P in {1, 3, 4, 8}, M in {1, 3, 8},
# D in {1, 3, 32, 64, 71, 256} (256 spans two channel blocks of the kernels).
CASES = [
    pytest.param(1, 5, 1, 1, [(1, 1)], 1, id="1x1-L1-P1-M1-D1"),
    pytest.param(2, 7, 3, 3, [(1, 9)], 3, id="1xW-P3-M3-D3"),
    pytest.param(1, 6, 8, 32, [(7, 1)], 4, id="Hx1-P4-M8-D32"),
    pytest.param(2, 5, 3, 71, [(7, 9), (4, 5), (1, 1), (1, 6), (5, 1)], 8, id="odd-L5-P8-M3-D71"),
    pytest.param(1, 4, 1, 256, [(3, 5), (2, 2)], 4, id="L2-P4-D256"),
    pytest.param(3, 4, 8, 64, [(5, 6), (3, 3)], 3, id="N3-P3-M8-D64"),
]


def check_against_reference(problem, tol=FP32_TOL, **kwargs):
    got = with_grads(ms_deform_attn, *problem, **kwargs)
    ref = reference64(*problem)
    for name, g, r in zip(("out", "grad_value", "grad_loc", "grad_weights"), got, ref):
        assert g.dtype == problem[{"out": 0, "grad_value": 0, "grad_loc": 3, "grad_weights": 4}[name]].dtype
        assert_matches(g, r, tol, name)
    return got


@pytest.mark.parametrize("n, lq, m, d, hw, p", CASES)
def test_matches_float64_reference(rng, n, lq, m, d, hw, p):
    check_against_reference(rand_problem(rng, n, lq, m, d, hw, p))


@pytest.mark.parametrize("case", [0, 2, 4])
def test_deterministic_backward_matches_and_repeats(rng, case):
    n, lq, m, d, hw, p = CASES[case].values
    problem = rand_problem(rng, n, lq, m, d, hw, p)
    with _deterministic():
        first = check_against_reference(problem)
        second = with_grads(ms_deform_attn, *problem)
    for a, b in zip(first, second):
        assert torch.equal(a, b), "deterministic backward is not bitwise repeatable"


def test_reference_matches_loop_definition(rng):
    value, shapes, starts, loc, weights, _ = rand_problem(rng, 2, 3, 2, 3, [(3, 4), (1, 1), (2, 5)], 3, spread=1.6)
    loc[0, 0, 0, 0, 0] = torch.tensor([0.0, 1.0])  # borders
    loc[0, 1, 0, 0, 0] = torch.tensor([0.5 / 4, 0.5 / 3])  # a pixel centre
    expected = loop_spec(value, shapes, starts, loc, weights)
    assert_matches(ms_deform_attn_reference(value.double(), shapes, starts, loc.double(), weights.double()),
                   expected, 1e-12, "reference")
    assert_matches(ms_deform_attn(value, shapes, starts, loc, weights), expected, FP32_TOL, "kernel")


def _border_locations(w, h):
    """x (and y) values exactly on borders, pixel centres and pixel edges, just outside, and far outside."""
    xs = [0.0, 1.0, 0.5 / w, 1.0 / w, 1.0 - 0.5 / w, -0.5 / w, 1.0 + 0.5 / w, -0.01, 1.01, -0.7, 1.7]
    ys = [0.0, 1.0, 0.5 / h, 1.0 / h, 1.0 - 0.5 / h, -0.5 / h, 1.0 + 0.5 / h, 0.3, -2.0, 0.99, 3.0]
    return torch.tensor(list(zip(xs, ys)), dtype=torch.float32)


@pytest.mark.parametrize("deterministic", [False, True])
def test_outside_partly_outside_and_exact_borders(rng, deterministic):
    # Power-of-two sizes make every border location exact in binary, so fp32 and float64 agree on which side of
    # a pixel edge (a kink of the bilinear map) a point lies, and the gradients are comparable there.
    hw = [(4, 8), (1, 2)]
    n, lq, m, d, p = 1, 11, 2, 4, 2
    value, shapes, starts, _, weights, grad = rand_problem(rng, n, lq, m, d, hw, p)
    loc = torch.empty(n, lq, m, len(hw), p, 2)
    for level, (h, w) in enumerate(hw):
        pts = _border_locations(w, h)
        loc[0, :, :, level, :, :] = pts[:, None, None, :]
        loc[0, :, 1, level, 1] = pts.flip(0)  # vary the mix per head and point
    problem = (value, shapes, starts, loc, weights, grad)
    expected = loop_spec(value, shapes, starts, loc, weights)
    with _deterministic(deterministic):
        out = check_against_reference(problem)[0]
    assert_matches(out, expected, FP32_TOL, "out vs loop definition")
    far = (loc < -0.5).any(-1) | (loc > 1.5).any(-1)
    assert far.any()


def test_nan_and_huge_locations_no_crash_no_out_of_bounds_read(rng):
    """The value sits between guard bands of NaN: any read outside it would turn finite rows NaN."""
    hw = [(3, 4), (2, 2)]
    n, lq, m, d, p = 2, 6, 2, 8, 2
    value, shapes, starts, loc, weights, grad = rand_problem(rng, n, lq, m, d, hw, p)
    s = value.shape[1]
    guarded = torch.full((n, s + 40, m + 2, d + 3), float("nan"))
    guarded[:, 20:20 + s, 1:1 + m, 1:1 + d] = value
    value_view = guarded[:, 20:20 + s, 1:1 + m, 1:1 + d]
    loc[0, 0, 0, 0, 0] = float("nan")
    loc[0, 1, 0, 1, 1, 0] = float("inf")
    loc[1, 2, 1, 0, 0] = torch.tensor([1e30, -1e30])
    loc[1, 3, 0, 1, 1] = torch.tensor([-3e9, 2e9])
    loc[1, 4, 1, 0, 1] = torch.tensor([0.5, 4e38])
    out, gv, gl, gw = with_grads(ms_deform_attn, value_view, shapes, starts, loc, weights, grad)
    ref_out = ms_deform_attn_reference(value.double(), shapes, starts, loc.double(), weights.double())
    # NaN / inf locations give NaN (as grid_sample does) in their own (query, head) only; huge ones read zeros.
    nan_rows = torch.isnan(ref_out)
    assert torch.equal(torch.isnan(out), nan_rows)
    assert nan_rows.any() and not nan_rows.all()
    assert_matches(out[~nan_rows], ref_out[~nan_rows], FP32_TOL, "finite rows")
    assert torch.isfinite(gv).all(), "no NaN may be scattered into grad_value"
    # The same problem without its NaN rows: the value gradient must not see them.
    finite_problem = (value, shapes, starts, loc.nan_to_num(0.25, 0.25, 0.25), weights, grad)
    clean = loc.isfinite().all(-1)
    mask = clean.all(-1).all(-1)[..., None].expand(n, lq, m, d).reshape(n, lq, m * d)
    ref = reference64(value, shapes, starts, loc.where(clean[..., None], 0.25), weights, grad * mask)
    gv_masked = with_grads(ms_deform_attn, *finite_problem[:5], grad * mask)[1]
    assert_matches(gv_masked, ref[1], FP32_TOL, "grad_value")
    with _deterministic():
        out_det, gv_det, _, _ = with_grads(ms_deform_attn, value_view, shapes, starts, loc, weights, grad)
    assert torch.equal(torch.isnan(out_det), nan_rows)
    assert torch.isfinite(gv_det).all()
    assert_matches(gv_det, gv, FP32_TOL, "deterministic grad_value with NaN locations")


@pytest.mark.parametrize("deterministic", [False, True])
def test_many_queries_on_one_pixel(rng, deterministic):
    """Contention: every sample of every query lands on the same pixel centre (and one bilinear neighbourhood)."""
    hw = [(4, 8), (3, 3)]
    n, lq, m, d, p = 1, 16, 2, 8, 4
    value, shapes, starts, loc, weights, grad = rand_problem(rng, n, lq, m, d, hw, p)
    loc[..., 0, :, :] = torch.tensor([2.5 / 8, 1.5 / 4])  # exactly the centre of pixel (2, 1), a kink: exact in fp32
    loc[..., 1, :, :] = torch.tensor([0.4, 0.6])  # between four pixels
    with _deterministic(deterministic):
        check_against_reference((value, shapes, starts, loc, weights, grad))


@pytest.mark.parametrize("step", [1, 2, 64, 1000])
def test_im2col_step_is_ignored_and_n_need_not_divide(rng, step):
    problem = rand_problem(rng, 3, 4, 2, 5, [(3, 3)], 2)
    base = ms_deform_attn(*problem[:5])
    assert torch.equal(ms_deform_attn(*problem[:5], im2col_step=step), base)
    assert torch.equal(MSDeformAttnFunction.apply(*problem[:5], step), base)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_int32_and_int64_shape_tensors(rng, index_dtype):
    check_against_reference(rand_problem(rng, 2, 5, 2, 8, [(3, 4), (2, 3)], 2, index_dtype=index_dtype))


@pytest.mark.parametrize(
    "value_dtype, loc_dtype, weight_dtype",
    [
        (torch.float16, torch.float32, torch.float32),  # autocast: linear projections fp16, softmax fp32
        (torch.float32, torch.float16, torch.float16),
        (torch.float16, torch.float16, torch.float16),
    ],
)
def test_mixed_dtypes(rng, value_dtype, loc_dtype, weight_dtype):
    value, shapes, starts, loc, weights, grad = rand_problem(rng, 2, 5, 2, 16, [(4, 4), (2, 3)], 3)
    problem = (value.to(value_dtype), shapes, starts, loc.to(loc_dtype), weights.to(weight_dtype),
               grad.to(value_dtype))
    got = with_grads(ms_deform_attn, *problem)
    ref = reference64(*problem)
    for g, r, t, name in zip(got, ref, (value_dtype, value_dtype, loc_dtype, weight_dtype),
                             ("out", "grad_value", "grad_loc", "grad_weights")):
        assert g.dtype == t, name
        assert_matches(g, r, 2e-3, name)


def test_bfloat16_on_cpu_runs_the_reference(rng):
    problem = rand_problem(rng, 1, 3, 2, 4, [(3, 3)], 2, dtype=torch.bfloat16)
    got = with_grads(ms_deform_attn, *problem)
    ref = reference64(*problem)
    for g, r, src in zip(got, ref, (problem[0], problem[0], problem[3], problem[4])):
        assert g.dtype == torch.bfloat16 and g.dtype == src.dtype
        assert rel_err(g, r) < 2e-2


def test_non_contiguous_inputs(rng):
    value, shapes, starts, loc, weights, grad = rand_problem(rng, 2, 5, 3, 6, [(3, 5), (2, 2)], 3)
    n, m, d = 2, 3, 6
    value_nc = value.transpose(1, 2).contiguous().transpose(1, 2)  # [N, S, M, D] with head-major storage
    loc_nc = loc.permute(5, 0, 1, 2, 3, 4).contiguous().permute(1, 2, 3, 4, 5, 0)
    weights_nc = torch.stack([weights, weights * 0], -1)[..., 0]
    grad_nc = grad.t().contiguous().t() if grad.dim() == 2 else grad.transpose(0, 1).contiguous().transpose(0, 1)
    shapes_nc = torch.stack([shapes, shapes], 1)[:, 0]
    starts_nc = torch.stack([starts, starts], 1)[:, 1]
    assert not any(t.is_contiguous() for t in (value_nc, loc_nc, weights_nc, grad_nc))
    assert value_nc.shape == (n, value.shape[1], m, d) and loc_nc.shape == loc.shape
    problem = (value_nc, shapes_nc, starts_nc, loc_nc, weights_nc, grad_nc)
    check_against_reference(problem)
    with _deterministic():
        check_against_reference(problem)


def test_strided_views_in_no_dense_layout(rng):
    """Views that are dense in neither value layout (every other channel, every other pixel; locations and weights
    sliced out of larger tensors) are copied once by the launchers and give the reference's values and gradients."""
    value, shapes, starts, loc, weights, grad = rand_problem(rng, 2, 6, 2, 10, [(3, 4), (2, 3)], 2)
    value_strided = torch.stack([value, value * 0 + float("nan")], -1).flatten(-2)[..., ::2]
    value_strided = torch.stack([value_strided, value_strided], 2).flatten(1, 2)[:, ::2]
    loc_strided = torch.cat([loc, loc], 1)[:, 1::2]
    weights_strided = weights.repeat(1, 1, 1, 1, 2)[..., : weights.shape[-1]]
    assert value_strided.shape == value.shape and torch.equal(value_strided, value)
    assert not value_strided.is_contiguous() and not value_strided.transpose(1, 2).is_contiguous()
    assert not loc_strided.is_contiguous() and not weights_strided.is_contiguous()
    check_against_reference((value_strided, shapes, starts, loc_strided, weights_strided, grad))
    with _deterministic():
        check_against_reference((value_strided, shapes, starts, loc_strided, weights_strided, grad))


@pytest.mark.parametrize("n, lq", [(2, 0), (0, 4)])
def test_empty_queries_or_batch(rng, n, lq):
    value, shapes, starts, loc, weights, grad = rand_problem(rng, max(n, 1), max(lq, 1), 2, 4, [(2, 3)], 2)
    value = value[:n]
    loc, weights, grad = loc[:n, :lq], weights[:n, :lq], grad[:n, :lq]
    out, gv, gl, gw = with_grads(ms_deform_attn, value, shapes, starts, loc, weights, grad)
    assert out.shape == (n, lq, 8)
    assert gv.shape == value.shape and (gv == 0).all()
    assert gl.shape == loc.shape and gw.shape == weights.shape


def test_channel_split_and_small_tiles(rng):
    """Forced tiles: 4 rows, 4 point slots for 3 points (one masked slot), 16 channels, so D = 39 spans three
    channel blocks (partial point gradients, a ragged last block)."""
    problem = rand_problem(rng, 1, 5, 2, 39, [(3, 4), (2, 2)], 3)
    with config.override(
        msda_forward=config.MsdaForwardConfig(block_rows=4, block_points=4, block_d=16),
        msda_backward=config.MsdaBackwardConfig(block_rows=4, block_points=4, block_d=16, gather_rows=8),
    ):
        check_against_reference(problem)
        with _deterministic():
            check_against_reference(problem)


def test_forced_tile_must_hold_every_point(rng):
    problem = rand_problem(rng, 1, 2, 2, 8, [(3, 4)], 4)
    with config.override(msda_forward=config.MsdaForwardConfig(block_rows=4, block_points=2, block_d=8)):
        with pytest.raises(ValueError, match="block_points must be at least P"):
            with_grads(ms_deform_attn, *problem)
    with config.override(msda_backward=config.MsdaBackwardConfig(block_rows=4, block_points=2, block_d=8,
                                                                gather_rows=8)):
        with pytest.raises(ValueError, match="block_points must be at least P"):
            with_grads(ms_deform_attn, *problem)


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("case", [1, 2])
def test_transposed_value_and_multi_warp_tiles(rng, transpose, case):
    """The [N, S, M, D] and transposed [N, M, S, D] value layouts (the kernels take any strides), with a
    multi-warp tile of more rows than queries: forward, atomic and deterministic backward."""
    n, lq, m, d, hw, p = CASES[case].values
    problem = rand_problem(rng, n, lq, m, d, hw, p)
    block_d = min(triton_next_power_of_2(d), 64)
    block_p = triton_next_power_of_2(p)
    with config.override(
        msda_forward=config.MsdaForwardConfig(block_rows=8, block_points=block_p, block_d=block_d, num_warps=2,
                                              transpose=transpose),
        msda_backward=config.MsdaBackwardConfig(block_rows=8, block_points=block_p, block_d=block_d,
                                                gather_rows=8, num_warps=2, transpose=transpose),
    ):
        fast = check_against_reference(problem)
        with _deterministic():
            det = check_against_reference(problem)
    assert torch.equal(fast[0], det[0])


def triton_next_power_of_2(x):
    return 1 << max(0, (x - 1).bit_length())


def test_inference_skips_autograd_with_the_same_bits(rng):
    """No gradient needed (plain tensors, or torch.no_grad): the kernels run without the autograd Function, and
    give the bits of the training call."""
    value, shapes, starts, loc, weights, _ = rand_problem(rng, 2, 5, 3, 8, [(3, 4), (2, 2)], 3)
    plain = ms_deform_attn(value, shapes, starts, loc, weights)
    leaves = [t.clone().requires_grad_() for t in (value, loc, weights)]
    trained = ms_deform_attn(leaves[0], shapes, starts, leaves[1], leaves[2])
    with torch.no_grad():
        no_grad = ms_deform_attn(leaves[0], shapes, starts, leaves[1], leaves[2])
    assert plain.grad_fn is None and no_grad.grad_fn is None and trained.grad_fn is not None
    assert torch.equal(plain, trained.detach()) and torch.equal(no_grad, plain)


def test_aliases_and_transformers_module(rng):
    value, shapes, starts, loc, weights, grad = rand_problem(rng, 2, 4, 2, 8, [(3, 4), (2, 2)], 2)
    base = ms_deform_attn(value, shapes, starts, loc, weights)
    assert MultiScaleDeformableAttnFunction is MSDeformAttnFunction
    assert torch.equal(MultiScaleDeformableAttnFunction.apply(value, shapes, starts, loc, weights, 64), base)
    module = MultiScaleDeformableAttention()
    assert list(module.parameters()) == []
    out = module(value, shapes, [(3, 4), (2, 2)], starts, loc, weights, 64)
    assert torch.equal(out, base)
    # transformers passes every argument positionally, im2col_step included; keywords work too.
    out = module(value=value, value_spatial_shapes=shapes, value_spatial_shapes_list=[(3, 4), (2, 2)],
                 level_start_index=starts, sampling_locations=loc, attention_weights=weights, im2col_step=64)
    assert torch.equal(out, base)
    with pytest.raises(ValueError, match="value_spatial_shapes_list"):
        module(value, shapes, [(3, 4)], starts, loc, weights, 64)


def test_function_float64_falls_back_to_reference_with_gradients(rng):
    value, shapes, starts, loc, weights, _ = rand_problem(rng, 1, 2, 2, 2, [(2, 3), (1, 2)], 2, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (value, loc, weights)]
    fn = lambda v, lc, w: MSDeformAttnFunction.apply(v, shapes, starts, lc, w, 64)  # noqa: E731
    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "mutate, error, name",
    [
        (lambda a: {**a, "value": a["value"][0]}, ValueError, "value"),
        (lambda a: {**a, "value": a["value"].long()}, TypeError, "value"),
        (lambda a: {**a, "value_spatial_shapes": a["value_spatial_shapes"].float()}, TypeError,
         "value_spatial_shapes"),
        (lambda a: {**a, "value_spatial_shapes": a["value_spatial_shapes"][:, :1]}, ValueError,
         "value_spatial_shapes"),
        (lambda a: {**a, "value_level_start_index": a["value_level_start_index"][:1]}, ValueError,
         "value_level_start_index"),
        (lambda a: {**a, "sampling_locations": a["sampling_locations"][..., :1]}, ValueError, "sampling_locations"),
        (lambda a: {**a, "sampling_locations": a["sampling_locations"][:, :, :1]}, ValueError, "sampling_locations"),
        (lambda a: {**a, "attention_weights": a["attention_weights"][..., :1]}, ValueError, "attention_weights"),
        (lambda a: {**a, "attention_weights": a["attention_weights"].int()}, TypeError, "attention_weights"),
        (lambda a: {**a, "im2col_step": 64.0}, TypeError, "im2col_step"),
        (lambda a: {**a, "sampling_locations": [1.0]}, TypeError, "sampling_locations"),
    ],
)
def test_bad_input_names_the_argument(rng, mutate, error, name):
    value, shapes, starts, loc, weights, _ = rand_problem(rng, 1, 2, 2, 4, [(2, 3), (1, 2)], 2)
    args = dict(value=value, value_spatial_shapes=shapes, value_level_start_index=starts, sampling_locations=loc,
                attention_weights=weights, im2col_step=64)
    # The Function checks on its own (drop-in users call .apply directly); ms_deform_attn checks once, before it.
    function_apply = lambda **a: MSDeformAttnFunction.apply(*a.values())  # noqa: E731
    for fn in (ms_deform_attn, ms_deform_attn_reference, function_apply):
        with pytest.raises(error, match=name):
            fn(**mutate(args))


def test_kernels_reject_2_31_pixels():
    """S >= 2**31 pixels per image: the kernels index pixels inside a level with int32, so they refuse with a
    clear error instead of wrapping around (a stride-0 view stands in for the 8 GB tensor)."""
    from lik.ops.msda.backward import msda_backward
    from lik.ops.msda.forward import msda_forward

    value = torch.zeros(1, 1, 1, 1).expand(1, 2**31, 1, 1)
    shapes, starts, _ = level_tensors([(1, 1)])
    loc = torch.full((1, 1, 1, 1, 1, 2), 0.5)
    weights = torch.ones(1, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="2\\*\\*31"):
        msda_forward(value, shapes, starts, loc, weights)
    with pytest.raises(ValueError, match="2\\*\\*31"):
        msda_backward(torch.ones(1, 1, 1), value, shapes, starts, loc, weights, deterministic=False)


def test_reference_checks_levels_fit_in_value(rng):
    value, shapes, starts, loc, weights, _ = rand_problem(rng, 1, 2, 2, 4, [(2, 3), (1, 2)], 2)
    with pytest.raises(ValueError, match="value_level_start_index"):
        ms_deform_attn_reference(value, shapes, starts + 1, loc, weights)


# ------------------------------------------------------------------------------------------------- GPU only


def _cuda_problem(rng, n, lq, m, d, hw, p, dtype):
    return rand_problem(rng, n, lq, m, d, hw, p, dtype=dtype, device="cuda")


@pytest.mark.gpu
# fp32: 1e-4, not FP32_TOL: with 185 queries on a 1x1 map the value gradient is a sum of ~3000 terms that nearly
# cancel, accumulated by atomics in arbitrary order (seen: 6.5e-5 on an H200).
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.float16, 3e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_gpu_matches_float64_reference(rng, dtype, tol, case):
    n, lq, m, d, hw, p = CASES[case].values
    problem = _cuda_problem(rng, n, lq * 37, m, d, hw, p, dtype)
    got = with_grads(ms_deform_attn, *problem)
    ref = reference64(*problem)
    for g, r, name in zip(got, ref, ("out", "grad_value", "grad_loc", "grad_weights")):
        assert g.dtype == dtype
        assert rel_err(g, r) <= tol, name
    with _deterministic():
        det = with_grads(ms_deform_attn, *problem)
        again = with_grads(ms_deform_attn, *problem)
    for g, r, a, name in zip(det, ref, again, ("out", "grad_value", "grad_loc", "grad_weights")):
        assert rel_err(g, r) <= tol, name
        assert torch.equal(g, a), name


@pytest.mark.gpu
def test_gpu_encoder_like_and_autocast(rng):
    hw = [(48, 64), (24, 32), (12, 16), (6, 8)]
    value, shapes, starts, loc, weights, grad = _cuda_problem(rng, 2, 4080, 8, 32, hw, 4, torch.float32)
    proj = torch.nn.Linear(32, 32).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        v = proj(value)  # bf16
        w = weights.softmax(-1)  # fp32 under autocast
    assert v.dtype == torch.bfloat16 and w.dtype == torch.float32
    problem = (v.detach(), shapes, starts, loc, w.detach(), grad.bfloat16())
    got = with_grads(ms_deform_attn, *problem)
    ref = reference64(*problem)
    for g, r, t in zip(got, ref, (torch.bfloat16, torch.bfloat16, torch.float32, torch.float32)):
        assert g.dtype == t
        assert rel_err(g, r) <= 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_torch_compile_inductor(rng, dtype):
    """``torch.compile`` with inductor, fullgraph: a small Deformable-DETR-like block (projection, op, output
    projection) compiles in one graph and matches eager within rounding (atomics reorder the value gradient)."""
    hw = [(20, 24), (10, 12), (5, 6)]
    value, shapes, starts, loc, weights, grad = _cuda_problem(rng, 2, 100, 8, 32, hw, 4, dtype)
    proj = torch.nn.Linear(32, 32).to(device="cuda", dtype=dtype)

    def block(v, lc, w):
        return ms_deform_attn(proj(v), shapes, starts, lc, w.softmax(-1)) * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    got = with_grads(lambda v, s, st, lc, w: compiled(v, lc, w), value, shapes, starts, loc, weights, grad)
    want = with_grads(lambda v, s, st, lc, w: block(v, lc, w), value, shapes, starts, loc, weights, grad)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for g, w in zip(got, want):
        assert rel_err(g, w) <= tol


@pytest.mark.gpu
def test_gpu_64bit_offsets(rng):
    """value has more than 2**31 elements; the samples read its far end (batch 1, last level)."""
    big, small = (2048, 2100), (4, 4)
    shapes, starts, n_pixels = level_tensors([big, small], device="cuda")
    n, m, d, lq, p = 2, 8, 32, 16, 2
    assert n * n_pixels * m * d > 2**31
    value = torch.empty(n, n_pixels, m, d, dtype=torch.float16, device="cuda").normal_()
    loc = torch.rand(n, lq, m, 2, p, 2, device="cuda", generator=None)
    weights = torch.rand(n, lq, m, 2, p, device="cuda")
    weights[:, :, :, 0] = 0  # only the small level counts, so a one-level reference checks it
    grad = torch.randn(n, lq, m * d, device="cuda", dtype=torch.float16)
    out, gv, _, _ = with_grads(ms_deform_attn, value, shapes, starts, loc, weights, grad)
    s1 = int(starts[1])
    tail = value[:, s1:].contiguous()
    sub = level_tensors([small], device="cuda")
    ref_out, ref_gv, _, _ = reference64(tail, sub[0], sub[1], loc[:, :, :, 1:], weights[:, :, :, 1:], grad)
    assert rel_err(out, ref_out) < 3e-3
    assert rel_err(gv[:, s1:], ref_gv) < 3e-3


def test_top_level_exports():
    import lik

    for name in ("ms_deform_attn", "ms_deform_attn_reference", "MSDeformAttnFunction",
                 "MultiScaleDeformableAttnFunction", "MultiScaleDeformableAttention"):
        assert name in lik.__all__ and hasattr(lik, name)


def test_transformers_one_line_switch(rng):
    """Patching transformers' module-level class swaps lik in, and matches transformers' own module."""
    mdd = pytest.importorskip("transformers.models.deformable_detr.modeling_deformable_detr")
    config = mdd.DeformableDetrConfig(d_model=16, encoder_attention_heads=2, num_feature_levels=2,
                                      encoder_n_points=2)
    original = mdd.MultiScaleDeformableAttention
    try:
        mdd.MultiScaleDeformableAttention = MultiScaleDeformableAttention  # the one line
        layer = mdd.DeformableDetrMultiscaleDeformableAttention(config, num_heads=2, n_points=2)
    finally:
        mdd.MultiScaleDeformableAttention = original
    assert isinstance(layer.attn, MultiScaleDeformableAttention)
    value, shapes, starts, loc, weights, _ = rand_problem(rng, 2, 6, 2, 8, [(3, 4), (2, 2)], 2)
    args = (value, shapes, [(3, 4), (2, 2)], starts, loc, weights, 64)
    assert_matches(layer.attn(*args), original()(*args), FP32_TOL, "lik vs transformers")


@pytest.mark.parametrize("deterministic", [False, True])
def test_torch_compile_traces_without_graph_break(rng, deterministic):
    """``torch.compile(fullgraph=True)`` over the op, its Function alias and the transformers module: one graph
    (the kernels are custom operators to Dynamo), same output and gradients as eager. ``aot_eager`` traces
    forward and backward exactly as inductor would, without generating code (CI has no GPU)."""
    problem = rand_problem(rng, 2, 5, 2, 8, [(3, 4), (2, 2)], 3)
    value, shapes, starts, loc, weights, grad = problem
    calls = {
        "ms_deform_attn": lambda v, lc, w: ms_deform_attn(v, shapes, starts, lc, w),
        "Function.apply": lambda v, lc, w: MSDeformAttnFunction.apply(v, shapes, starts, lc, w, 64),
        "module": lambda v, lc, w: MultiScaleDeformableAttention()(v, shapes, [(3, 4), (2, 2)], starts, lc, w, 64),
    }
    with _deterministic(deterministic):
        for name, call in calls.items():
            torch._dynamo.reset()
            compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
            got = with_grads(lambda v, s, st, lc, w, compiled=compiled: compiled(v, lc, w), *problem)
            want = with_grads(lambda v, s, st, lc, w, call=call: call(v, lc, w), *problem)
            for g, w in zip(got, want):
                assert torch.equal(g, w), name
            with torch.no_grad():
                assert torch.equal(compiled(value, loc, weights), want[0]), name
