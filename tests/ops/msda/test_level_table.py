"""Level tables that do not fit ``value``: every entry point refuses them with a ValueError naming the argument, a
checked table is not read again until it changes, and the kernels themselves never address a pixel outside
``[0, S)`` even when validation is bypassed (such a pixel reads zero and receives no gradient)."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from lik._config import cdiv, msda_backward_config
from lik import _launch
from lik._launch import launch
from lik.ops.msda import MSDeformAttnFunction, ms_deform_attn, ms_deform_attn_reference
from lik.ops.msda import forward as forward_module
from lik.ops.msda import validation
from lik.ops.msda.backward import msda_backward, msda_bwd_kernel
from lik.ops.msda.forward import msda_forward

from .helpers import assert_matches, rand_problem, reference64

S = 16
# (shapes, starts, the argument the error names): each against value with S = 16 pixels.
BAD_TABLES = {
    "past-the-end": ([[3, 4], [2, 2]], [0, 13], "value_level_start_index"),
    "negative-start": ([[3, 4], [2, 2]], [-2, 12], "value_level_start_index"),
    "far-outside": ([[3, 4], [2, 2]], [0, 40], "value_level_start_index"),
    "negative-shape": ([[-3, -4], [2, 2]], [0, 12], "value_spatial_shapes"),
    "levels-larger-than-S": ([[4, 4], [2, 2]], [0, 0], "value_spatial_shapes"),
}
# Tables that put some bilinear corner outside [0, S) (the overlapping one stays inside value).
SPILLING = ["past-the-end", "negative-start", "far-outside", "negative-shape"]


def _problem(rng, table, *, dtype=torch.float32, device="cpu", index_dtype=torch.int64):
    """A good problem over S = 16 pixels ([(3, 4), (2, 2)]) and the bad table ``table`` for the same value."""
    value, shapes, starts, loc, weights, grad = rand_problem(rng, 2, 6, 2, 8, [(3, 4), (2, 2)], 2, dtype=dtype,
                                                             device=device, index_dtype=index_dtype)
    assert value.shape[1] == S
    hw, offsets, name = BAD_TABLES[table]
    bad_shapes = torch.tensor(hw, dtype=index_dtype, device=device)
    bad_starts = torch.tensor(offsets, dtype=index_dtype, device=device)
    return (value, shapes, starts, loc, weights, grad), (bad_shapes, bad_starts), name


@contextlib.contextmanager
def _deterministic(enabled=True):
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved)


def _leaves(value, loc, weights):
    return [t.detach().clone().requires_grad_() for t in (value, loc, weights)]


# --------------------------------------------------------------------------------------- every path refuses


@pytest.mark.parametrize("table", list(BAD_TABLES))
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_bad_table_raises_on_every_eager_path(rng, table, index_dtype):
    (value, _, _, loc, weights, _), (shapes, starts), name = _problem(rng, table, index_dtype=index_dtype)
    v, lc, w = _leaves(value, loc, weights)
    paths = {
        "reference": lambda: ms_deform_attn_reference(value, shapes, starts, loc, weights),
        "inference": lambda: ms_deform_attn(value, shapes, starts, loc, weights),
        "no_grad": lambda: ms_deform_attn(v, shapes, starts, lc, w),
        "autograd": lambda: ms_deform_attn(v, shapes, starts, lc, w),
        "Function.apply": lambda: MSDeformAttnFunction.apply(v, shapes, starts, lc, w, 64),
        "custom op": lambda: torch.ops.lik.msda_forward(value, shapes, starts, loc, weights),
    }
    for path, call in paths.items():
        for deterministic in (False, True):
            with _deterministic(deterministic), pytest.raises(ValueError, match=name):
                if path == "no_grad":
                    with torch.no_grad():
                        call()
                else:
                    call()


def test_error_says_what_does_not_fit(rng):
    (value, _, _, loc, weights, _), (shapes, starts), _ = _problem(rng, "past-the-end")
    with pytest.raises(ValueError, match=r"value_level_start_index\[1\] = 13 .*H\*W = 4.* S = 16"):
        ms_deform_attn(value, shapes, starts, loc, weights)
    _, (shapes, starts), _ = _problem(rng, "levels-larger-than-S")
    with pytest.raises(ValueError, match=r"value_spatial_shapes: .*20.* S = 16"):
        ms_deform_attn(value, shapes, starts, loc, weights)


@pytest.mark.parametrize("table", ["past-the-end", "levels-larger-than-S"])
def test_bad_table_raises_under_torch_compile(rng, table):
    """Dynamo traces the call with shapes only; the custom operator checks the table's values when it runs."""
    (value, shapes, starts, loc, weights, _), (bad_shapes, bad_starts), name = _problem(rng, table)
    torch._dynamo.reset()
    compiled = torch.compile(lambda v, s, st, lc, w: ms_deform_attn(v, s, st, lc, w), backend="aot_eager",
                             fullgraph=True)
    assert torch.equal(compiled(value, shapes, starts, loc, weights), ms_deform_attn(value, shapes, starts, loc,
                                                                                     weights))
    with pytest.raises(ValueError, match=name):
        compiled(value, bad_shapes, bad_starts, loc, weights)
    v, lc, w = _leaves(value, loc, weights)
    with pytest.raises(ValueError, match=name):
        compiled(v, bad_shapes, bad_starts, lc, w)


def test_replayed_call_checks_the_table(rng, monkeypatch):
    """A call whose shapes were launched before replays that launch (on the GPU); the replay must not skip the
    table. The interpreter never replays, so the replay is stood in for here (the GPU test does it for real)."""
    (value, shapes, starts, loc, weights, _), (bad_shapes, bad_starts), name = _problem(rng, "past-the-end")
    replays = []
    monkeypatch.setattr(forward_module, "_FORWARD_REPLAYS", {})
    monkeypatch.setattr(forward_module, "replay_key", lambda *args: ("fixed",))

    class StandIn:  # the recorded launch's launcher: files what a replay hands it
        grid, device, function, packed, tail = (1, 1, 1), 0, None, None, ()
        run = staticmethod(lambda *arguments: replays.append(arguments))

    monkeypatch.setattr(_launch, "replay_of", lambda *args, **kwargs: StandIn())
    monkeypatch.setattr(_launch, "_get_stream", lambda device: 0)
    ms_deform_attn(value, shapes, starts, loc, weights)  # recorded
    ms_deform_attn(value, shapes, starts, loc, weights)  # replayed
    assert len(replays) == 1
    v, lc, w = _leaves(value, loc, weights)
    for call in (lambda: ms_deform_attn(value, bad_shapes, bad_starts, loc, weights),
                 lambda: ms_deform_attn(v, bad_shapes, bad_starts, lc, w),
                 lambda: MSDeformAttnFunction.apply(v, bad_shapes, bad_starts, lc, w, 64)):
        with pytest.raises(ValueError, match=name):
            call()
    assert len(replays) == 1


def test_a_checked_table_is_read_again_only_when_it_changes(rng, monkeypatch):
    """The check is cached per table (identity and version counter) and per S: repeated calls read nothing, an
    in-place change or another S is checked again."""
    (value, shapes, starts, loc, weights, _), _, _ = _problem(rng, "past-the-end")
    reads = []
    real = validation.level_table
    monkeypatch.setattr(validation, "level_table", lambda *args: reads.append(args) or real(*args))
    monkeypatch.setattr(validation, "_FITTING_TABLES", {})
    for _ in range(3):
        ms_deform_attn(value, shapes, starts, loc, weights)
    assert len(reads) == 1
    starts[1] = 13  # in place: the version counter moves
    with pytest.raises(ValueError, match="value_level_start_index"):
        ms_deform_attn(value, shapes, starts, loc, weights)
    starts[1] = 12
    ms_deform_attn(value, shapes, starts, loc, weights)
    ms_deform_attn(value, shapes, starts, loc, weights)
    assert len(reads) == 3
    shapes.view(-1)[2] = 3  # a write through a view moves the shared counter too: level 1 is now 3 x 2
    with pytest.raises(ValueError, match="value_level_start_index"):
        ms_deform_attn(value, shapes, starts, loc, weights)
    shapes.view(-1)[2] = 2
    ms_deform_attn(value, shapes, starts, loc, weights)
    assert len(reads) == 5
    ms_deform_attn(torch.cat([value, value], 1), shapes, starts, loc, weights)  # another S: checked again
    assert len(reads) == 6


def test_inference_mode_tables_are_cached_by_identity_and_held_weakly(rng, monkeypatch):
    """An inference tensor has no version counter: its check is cached by identity (no error from the missing
    counter). The cache holds no table alive."""
    (value, shapes, starts, loc, weights, _), (bad_shapes, bad_starts), name = _problem(rng, "past-the-end")
    reads = []
    real = validation.level_table
    monkeypatch.setattr(validation, "level_table", lambda *args: reads.append(args) or real(*args))
    monkeypatch.setattr(validation, "_FITTING_TABLES", {})
    with torch.inference_mode():
        shapes, starts = shapes.clone(), starts.clone()
        bad_shapes, bad_starts = bad_shapes.clone(), bad_starts.clone()
        for _ in range(2):
            ms_deform_attn(value, shapes, starts, loc, weights)
        with pytest.raises(ValueError, match=name):
            ms_deform_attn(value, bad_shapes, bad_starts, loc, weights)
    assert len(reads) == 2
    ms_deform_attn(value, shapes, starts, loc, weights)
    assert len(reads) == 2
    (entry,) = validation._FITTING_TABLES.values()
    assert entry[0]() is shapes
    del shapes, starts, reads[:]
    gc.collect()
    assert entry[0]() is None and entry[1]() is None


def test_the_table_cache_is_bounded(rng, monkeypatch):
    (value, shapes, starts, loc, weights, _), _, _ = _problem(rng, "past-the-end")
    monkeypatch.setattr(validation, "_FITTING_TABLES", {})
    monkeypatch.setattr(validation, "FITTING_TABLES_LIMIT", 3)
    for _ in range(5):
        ms_deform_attn(value, shapes.clone(), starts.clone(), loc, weights)
        assert len(validation._FITTING_TABLES) <= 3


# ------------------------------------------------------------------- the kernels mask, validation or not


def _guarded(t, guard, fill):
    """``t`` copied into the middle of a flat buffer with ``guard`` elements of ``fill`` either side: a contiguous
    view, so the launchers use it in place and any access outside it lands in the guard."""
    buffer = torch.full((2 * guard + t.numel(),), fill, dtype=t.dtype, device=t.device)
    inner = buffer[guard:guard + t.numel()].view(t.shape)
    inner.copy_(t)
    return buffer, inner


def _guard_size(value, shapes, starts):
    n, n_pixels, heads, dim = value.shape
    reach = int((starts.abs() + shapes.abs().prod(1)).max()) + n_pixels
    return 16 * cdiv(n * reach * heads * dim, 16)


def _zero_outside_reference(value, shapes, starts, loc, weights, grad):
    """What the kernels compute for a table that does not fit ``value``, in float64: each pixel index outside
    ``[0, S)`` reads zero and receives no gradient; a level with a negative side has no pixels. Built as the
    reference over ``value`` padded with zeros on both sides, with the table shifted to fit."""
    n, n_pixels, heads, dim = value.shape
    empty = (shapes < 0).any(1, keepdim=True)
    shapes = torch.where(empty, 0, shapes)
    starts = torch.where(empty[:, 0], 0, starts)
    left = max(0, -int(starts.min()))
    right = max(0, int((starts + shapes.prod(1)).max()) - n_pixels, int(shapes.prod(1).sum()) - n_pixels)
    padded = torch.cat([value.new_zeros(n, left, heads, dim), value, value.new_zeros(n, right, heads, dim)], 1)
    out, grad_padded, grad_loc, grad_weights = reference64(padded, shapes, starts + left, loc, weights, grad)
    return out, grad_padded[:, left:left + n_pixels], grad_loc, grad_weights


def _atomic_backward_into(value, shapes, starts, loc, weights, grad, guard):
    """The atomic backward kernel launched by hand with its fp32 value gradient in the middle of a zeroed buffer
    (``msda_backward`` allocates its own, where a stray atomic would go unseen). One channel block (D <= 128)."""
    n, n_pixels, heads, dim = value.shape
    _, n_queries, _, n_levels, n_points, _ = loc.shape
    n_rows = n * n_queries * heads
    cfg = msda_backward_config(n_rows=n_rows, dim=dim, n_points=n_points, device=value.device)
    assert cfg.block_d >= dim and not cfg.transpose
    buffer, grad_value = _guarded(torch.zeros(value.shape, dtype=torch.float32, device=value.device), guard, 0.0)
    grad_loc, grad_weights = torch.empty_like(loc), torch.empty_like(weights)
    launch(msda_bwd_kernel, (cdiv(n_rows, cfg.block_rows), 1),
           value, shapes, starts, starts, starts, loc, weights, grad, grad_value, grad_loc, grad_weights, grad_value,
           n_rows, n_pixels, n_queries, heads, n_levels, n_points, 0, 0, n_rows * n_levels * n_points,
           DIM=dim, BLOCK_R=cfg.block_rows, BLOCK_P=cfg.block_points, BLOCK_D=cfg.block_d, HEAD_MAJOR=False,
           ATOMIC_VALUE=True, WRITE_BUCKETS=False, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return buffer, grad_value, grad_loc, grad_weights


def check_kernels_mask_outside_value(rng, table, monkeypatch, device, index_dtype=torch.int64):
    """Forward, deterministic backward and atomic backward on a table that skips validation: value sits between
    NaN guards (a read outside it would show as NaN), the atomic value gradient between zero guards (a write
    outside it would show as a non-zero guard); results equal the zero-outside reference."""
    (value, _, _, loc, weights, grad), (shapes, starts), _ = _problem(rng, table, device=device,
                                                                      index_dtype=index_dtype)
    # Validation bypassed (were it still on, the call would raise and the test fail).
    monkeypatch.setattr(forward_module, "check_level_table", lambda *args: None, raising=False)
    want = _zero_outside_reference(value.cpu(), shapes.cpu(), starts.cpu(), loc.cpu(), weights.cpu(), grad.cpu())
    guard = _guard_size(value, shapes, starts)
    _, guarded_value = _guarded(value, guard, float("nan"))
    cpu = lambda ts: [t.cpu() for t in ts]  # noqa: E731

    out = msda_forward(guarded_value, shapes, starts, loc, weights)
    assert_matches(out.cpu(), want[0], 2e-5, "forward")
    grads = msda_backward(grad, guarded_value, shapes, starts, loc, weights, deterministic=True)
    for got, ref, name in zip(cpu(grads), want[1:], ("grad_value", "grad_loc", "grad_weights")):
        assert_matches(got, ref, 2e-5, f"deterministic {name}")
    buffer, *grads = _atomic_backward_into(guarded_value, shapes, starts, loc, weights, grad, guard)
    assert not buffer[:guard].any() and not buffer[-guard:].any(), "an atomic add landed outside the value gradient"
    for got, ref, name in zip(cpu(grads), want[1:], ("grad_value", "grad_loc", "grad_weights")):
        assert_matches(got, ref, 2e-5, f"atomic {name}")


@pytest.mark.parametrize("table", SPILLING)
def test_kernels_never_address_outside_value(rng, monkeypatch, table):
    check_kernels_mask_outside_value(rng, table, monkeypatch, "cpu")


def test_zero_outside_reference_is_the_reference_on_a_fitting_table(rng):
    """The padded reference above changes nothing when the table fits."""
    value, shapes, starts, loc, weights, grad = rand_problem(rng, 2, 4, 2, 4, [(3, 4), (2, 2)], 2)
    for got, want in zip(_zero_outside_reference(value, shapes, starts, loc, weights, grad),
                         reference64(value, shapes, starts, loc, weights, grad)):
        assert torch.equal(got, want)


# ------------------------------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("table", SPILLING)
def test_gpu_kernels_never_address_outside_value(rng, monkeypatch, table, index_dtype):
    check_kernels_mask_outside_value(rng, table, monkeypatch, "cuda", index_dtype)


@pytest.mark.gpu
def test_gpu_replayed_call_checks_the_table(rng, monkeypatch):
    """Real replays: after a good call of the same shapes, a bad table (a new tensor, or the checked one changed in
    place) is still refused, forward and training."""
    monkeypatch.setattr(forward_module, "_FORWARD_REPLAYS", {})
    (value, shapes, starts, loc, weights, _), (bad_shapes, bad_starts), name = _problem(rng, "past-the-end",
                                                                                        device="cuda")
    want = ms_deform_attn(value, shapes, starts, loc, weights)
    assert len(forward_module._FORWARD_REPLAYS) == 1
    assert torch.equal(ms_deform_attn(value, shapes, starts, loc, weights), want)
    v, lc, w = _leaves(value, loc, weights)
    with pytest.raises(ValueError, match=name):
        ms_deform_attn(value, bad_shapes, bad_starts, loc, weights)
    with pytest.raises(ValueError, match=name):
        ms_deform_attn(v, bad_shapes, bad_starts, lc, w)
    starts[1] = 13
    with pytest.raises(ValueError, match=name):
        ms_deform_attn(value, shapes, starts, loc, weights)


@pytest.mark.gpu
def test_gpu_capture_of_a_new_table_does_not_synchronise(rng):
    """Under CUDA graph capture a table cannot be read; an unchecked one is left to the kernels' masks instead of
    failing the capture (this table fits, so the replayed graph gives the eager result)."""
    value, shapes, starts, loc, weights, _ = rand_problem(rng, 2, 6, 2, 8, [(3, 4), (2, 2)], 2, device="cuda")
    want = ms_deform_attn(value, shapes, starts, loc, weights)  # compiles the kernel outside the capture
    fresh_shapes, fresh_starts = shapes.clone(), starts.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ms_deform_attn(value, fresh_shapes, fresh_starts, loc, weights)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
