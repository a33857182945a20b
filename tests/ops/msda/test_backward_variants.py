"""The atomic backward's launch variants (``lik.ops.msda.backward.VARIANTS``: one level per program, half-height
row tiles, a pipelined level loop), run through Triton's interpreter against the float64 reference: the same
gradients as the default launch, the launch grid they promise, and (on the GPU) a replay key of their own."""

from __future__ import annotations

import pytest
import torch

from lik.ops.msda import backward as backward_module
from lik.ops.msda import ms_deform_attn, ms_deform_attn_v2
from lik.ops.msda.backward import VARIANTS, msda_backward

from .helpers import assert_matches, rand_problem, reference64, with_grads


@pytest.fixture
def grids(monkeypatch):
    """The grid and options of every backward kernel launch (the launch still runs)."""
    seen = []
    real = backward_module.launch

    def spy(kernel, grid, *args, **kwargs):
        seen.append((kernel, grid, kwargs))
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(backward_module, "launch", spy)
    return seen


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v])
@pytest.mark.parametrize("hw, points, dim", [([(5, 6), (3, 3), (1, 1)], 3, 5), ([(4, 7)], 1, 8)])
def test_each_variant_gives_the_reference_gradients(rng, monkeypatch, grids, variant, hw, points, dim):
    """Odd levels (a 1x1 one), P = 3 and 1, D = 5 (a masked channel tail); locations partly off the maps."""
    problem = rand_problem(rng, 2, 5, 3, dim, hw, points)
    value_device = problem[0].device
    ref = reference64(*problem)
    monkeypatch.setattr(backward_module, "_VARIANT", variant)
    got = with_grads(ms_deform_attn, *problem)
    for g, r, what in zip(got, ref, ("out", "value", "loc", "weights")):
        assert_matches(g, r, 2e-5, f"{variant} {what}")
    ((kernel, grid, options),) = grids
    rows = 2 * 5 * 3
    block_rows = options["BLOCK_R"]
    assert kernel is backward_module.msda_bwd_kernel
    parts = variant.split("+")
    split = "split" in parts or "auto" in parts  # auto: one or two row blocks, fewer than 64 per SM (1 off CUDA)
    assert grid[0] == -(-rows // block_rows) * (len(hw) if split else 1)
    assert options.get("SPLIT_LEVELS", False) == split
    assert options["num_stages"] == (3 if "s3" in parts else 1)
    config = backward_module.msda_backward_config(n_rows=rows, dim=dim, n_points=points, device=value_device)
    default = config.block_rows
    assert block_rows == max(1, default // (4 if "r4" in parts else 2 if "r2" in parts else 1))


@pytest.mark.parametrize("variant", ["split", "r4", "auto+r2"])
def test_variants_with_a_point_table_and_a_nan_location(rng, monkeypatch, variant):
    """RT-DETRv2's layout (unequal points per level through the point table) gives the default launch's gradients;
    so does a NaN location (it reaches no pixel: the other points' gradients stay finite)."""
    value, shapes, starts, loc, attn, grad = rand_problem(rng, 1, 4, 2, 8, [(5, 6), (3, 3)], 2)
    n, n_queries, heads = loc.shape[:3]
    loc5, attn4 = loc.reshape(n, n_queries, heads, 4, 2).clone(), attn.reshape(n, n_queries, heads, 4)
    loc5[0, 1, 0, 2] = float("nan")
    want = with_grads(lambda v, s, st, lc, w: ms_deform_attn_v2(v, s, st, lc, w, [1, 3]), value, shapes, starts, loc5,
                      attn4, grad)
    monkeypatch.setattr(backward_module, "_VARIANT", variant)
    got = with_grads(lambda v, s, st, lc, w: ms_deform_attn_v2(v, s, st, lc, w, [1, 3]), value, shapes, starts, loc5,
                     attn4, grad)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-6, atol=1e-6, equal_nan=True)
    assert torch.isfinite(got[1]).all() and torch.isfinite(got[2][0, 0]).all()


def test_the_deterministic_backward_ignores_the_variant(rng, monkeypatch, grids):
    problem = rand_problem(rng, 1, 3, 2, 4, [(3, 4)], 2)
    value, shapes, starts, loc, attn, grad = problem
    monkeypatch.setattr(backward_module, "_VARIANT", "split")
    got = msda_backward(grad, value, shapes, starts, loc, attn, deterministic=True)
    monkeypatch.setattr(backward_module, "_VARIANT", "")
    want = msda_backward(grad, value, shapes, starts, loc, attn, deterministic=True)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert grids[0][1:] == grids[2][1:] and "SPLIT_LEVELS" not in grids[0][2]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v])
def test_gpu_each_variant_matches_the_default_launch(rng, monkeypatch, variant, dtype):
    """Replayed calls included (the variant is part of the replay key): the same output, the point gradients up
    to the channel reduction's order (a tile of other rows may reduce in another order), the value gradient up to
    the atomics' order."""
    monkeypatch.setattr(backward_module, "_REPLAYS", {})
    problem = rand_problem(rng, 2, 60, 8, 32, [(20, 24), (10, 12), (5, 6), (3, 3)], 4, dtype=dtype, device="cuda")
    want = with_grads(ms_deform_attn, *problem)
    monkeypatch.setattr(backward_module, "_VARIANT", variant)
    for _ in range(2):
        got = with_grads(ms_deform_attn, *problem)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        assert torch.equal(got[0], want[0])
        for g, w in zip(got[1:], want[1:]):
            assert torch.allclose(g.float(), w.float(), rtol=tol, atol=tol)
    assert len(backward_module._REPLAYS) == 2
