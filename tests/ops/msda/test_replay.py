"""Replays of recorded deformable-attention launches: which addresses the backward passes, which inputs are
declined, what is remembered; on the GPU, that repeated forwards and backwards take them and give the general
path's numbers."""

from __future__ import annotations

import pytest
import torch

from lik import _launch
from lik._launch import dense_addresses, remember
from lik.ops.msda import backward as msda_backward_module
from lik.ops.msda import forward as msda_forward_module
from lik.ops.msda import ms_deform_attn
from lik.ops.msda.backward import _replay_atomic, msda_backward
from lik.ops.msda.forward import msda_forward

from ...launch_hooks import recorded_launches

from .helpers import rand_problem, reference64, rel_err, with_grads

HW = [(5, 6), (3, 3)]


def _inputs(rng, dtype=torch.float32):
    value, shapes, starts, loc, weights, grad = rand_problem(rng, 2, 4, 3, 8, HW, 2, dtype=dtype)
    return value, shapes, starts, loc, weights, grad


def test_backward_replay_passes_every_address_in_the_kernels_order(rng):
    calls = []
    value, shapes, starts, loc, attn, grad = _inputs(rng)
    addresses = dense_addresses((value, shapes, starts, loc, attn, grad))
    gvalue, gloc, gattn = _replay_atomic((lambda *a: calls.append(a), (1, 2, 3)), addresses, value, loc, attn)
    assert calls == [(
        value.data_ptr(), shapes.data_ptr(), starts.data_ptr(), starts.data_ptr(), loc.data_ptr(), attn.data_ptr(),
        grad.data_ptr(), gvalue.data_ptr(), gloc.data_ptr(), gattn.data_ptr(), gvalue.data_ptr(), 1, 2, 3,
    )]
    # The stand-in wrote nothing: the value gradient is the zeroed fp32 buffer the atomics add into.
    assert gvalue.dtype == torch.float32 and gvalue.shape == value.shape and not gvalue.any()
    assert (gloc.shape, gloc.dtype, gattn.shape, gattn.dtype) == (loc.shape, loc.dtype, attn.shape, attn.dtype)


def test_backward_replay_returns_the_value_gradient_in_values_dtype(rng):
    calls = []
    value, shapes, starts, loc, attn, grad = _inputs(rng, torch.float16)
    addresses = dense_addresses((value, shapes, starts, loc, attn, grad))
    gvalue, _, _ = _replay_atomic((lambda *a: calls.append(a), ()), addresses, value, loc, attn)
    assert gvalue.dtype == torch.float16
    # The kernel was given the fp32 buffer (also as the unused bucket pointer), not the returned copy.
    assert calls[0][7] != gvalue.data_ptr() and calls[0][7] == calls[0][10]


def _strided(t):
    if t.dim() == 1 or t.shape[-1] == 1:
        return torch.stack([t, t], dim=-1)[..., 0]
    return torch.cat([t, t], dim=-1)[..., : t.shape[-1]]


def _misaligned(t):
    return torch.cat([t.new_zeros(1), t.flatten()])[1:].view(t.shape)


@pytest.mark.parametrize("which", range(6))
@pytest.mark.parametrize("how", [_strided, _misaligned], ids=["strided", "misaligned"])
def test_dense_addresses_decline_what_a_recorded_launch_did_not_have(rng, which, how):
    """A recorded launch read dense, 16-byte aligned tensors (Triton specialises on the alignment): any other input
    goes the general way, which copies or recompiles as needed."""
    inputs = list(_inputs(rng))
    assert dense_addresses(tuple(inputs)) == tuple(t.data_ptr() for t in inputs)
    inputs[which] = how(inputs[which])
    assert not inputs[which].is_contiguous() or inputs[which].data_ptr() % 16
    assert dense_addresses(tuple(inputs)) is None


def test_remember_keeps_only_launches_of_dense_aligned_tensors(rng, monkeypatch):
    asked = []
    monkeypatch.setattr(_launch, "replay_of",
                        lambda kernel, grid, *args, **options: asked.append((kernel, grid, args, options)) or "replay")
    value, shapes, starts, loc, attn, grad = _inputs(rng)
    tensors = (value, shapes, starts, loc, attn, grad)
    table = {}
    remember(table, "key", "kernel", (3, 1), tensors, (5, 6), {"DIM": 8}, "extra")
    assert asked == [("kernel", (3, 1), (*tensors, 5, 6), {"DIM": 8})]
    assert table == {"key": ("replay", (5, 6), "extra")}
    remember(table, "other", "kernel", (3, 1), (_misaligned(value), *tensors[1:]), (5, 6), {"DIM": 8})
    remember(table, "third", "kernel", (3, 1), (_strided(value), *tensors[1:]), (5, 6), {"DIM": 8})
    assert list(table) == ["key"] and len(asked) == 1
    # Nothing recorded (Triton's own path): nothing remembered.
    monkeypatch.setattr(_launch, "replay_of", lambda *args, **options: None)
    remember(table, "fourth", "kernel", (3, 1), tensors, (5, 6), {"DIM": 8})
    assert list(table) == ["key"]


def test_remembered_replays_are_bounded(rng, monkeypatch):
    monkeypatch.setattr(_launch, "REPLAY_LIMIT", 3)
    monkeypatch.setattr(_launch, "replay_of", lambda *args, **options: "replay")
    tensors = _inputs(rng)
    table = {}
    for key in range(5):
        remember(table, key, "kernel", (1, 1), tensors, (), {})
        assert len(table) <= 3 and key in table


def test_no_replay_off_the_gpu(rng):
    """CPU tensors (the interpreter's) never replay: Triton's interpreter has no compiled launcher."""
    from lik.ops.msda.forward import replay_key

    value, shapes, starts, loc, attn, _ = _inputs(rng)
    assert replay_key(value, shapes, starts, loc, attn) is None


# ------------------------------------------------------------------------------------------------- GPU only


def _counting_launch(monkeypatch, module=msda_backward_module):
    launches = []
    real = module.launch

    def launch(kernel, grid, *args, **kwargs):
        launches.append(kernel)
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(module, "launch", launch)
    return launches


def _decoder_like(rng, dtype=torch.float32):
    return rand_problem(rng, 2, 60, 8, 32, [(20, 24), (10, 12), (5, 6), (3, 3)], 4, dtype=dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_gpu_repeated_calls_replay_with_the_general_paths_numbers(rng, monkeypatch, dtype, tol):
    monkeypatch.setattr(msda_backward_module, "_REPLAYS", {})
    monkeypatch.setattr(msda_forward_module, "_FORWARD_REPLAYS", {})
    backward_launches = _counting_launch(monkeypatch)
    forward_launches = _counting_launch(monkeypatch, msda_forward_module)
    problem = _decoder_like(rng, dtype)
    first = with_grads(ms_deform_attn, *problem)
    assert len(forward_launches) == len(backward_launches) == 1
    assert len(msda_forward_module._FORWARD_REPLAYS) == len(msda_backward_module._REPLAYS) == 1
    second = with_grads(ms_deform_attn, *problem)
    assert len(forward_launches) == len(backward_launches) == 1  # both replayed
    # The output, location and weight gradients involve no atomics: the same bits; the value gradient is summed by
    # atomics in any order.
    assert torch.equal(first[0], second[0]) and torch.equal(first[2], second[2]) and torch.equal(first[3], second[3])
    assert second[1].dtype == dtype and rel_err(second[1], first[1]) <= (1e-6 if dtype == torch.float32 else 1e-2)
    for got, want in zip(second, reference64(*problem)):
        assert rel_err(got, want) <= tol
    # Inference reaches the same forward launcher: replayed too.
    with torch.no_grad():
        assert torch.equal(ms_deform_attn(*problem[:5]), first[0])
    assert len(forward_launches) == 1


@pytest.mark.gpu
def test_gpu_replays_decline_strided_inputs_a_forced_tile_and_a_launch_hook(rng, monkeypatch):
    import lik._config as config

    monkeypatch.setattr(msda_backward_module, "_REPLAYS", {})
    monkeypatch.setattr(msda_forward_module, "_FORWARD_REPLAYS", {})
    launches = _counting_launch(monkeypatch)
    forward_launches = _counting_launch(monkeypatch, msda_forward_module)
    value, shapes, starts, loc, weights, grad = _decoder_like(rng)
    msda_backward(grad, value, shapes, starts, loc, weights, deterministic=False)
    msda_forward(value, shapes, starts, loc, weights)
    assert len(launches) == len(forward_launches) == 1
    want = reference64(value, shapes, starts, loc, weights, grad)
    strided = _strided(grad)
    got = msda_backward(strided, value, shapes, starts, loc, weights, deterministic=False)
    assert len(launches) == 2  # the general path, which copies the gradient dense
    for g, w in zip(got, want[1:]):
        assert rel_err(g, w) <= 1e-5
    assert rel_err(msda_forward(value, shapes, starts, _strided(loc), weights), want[0]) <= 1e-5
    assert len(forward_launches) == 2
    forced = config.MsdaBackwardConfig(2, 4, 32, 32)
    with config.override(msda_backward=forced, msda_forward=config.MsdaForwardConfig(2, 4, 32)):
        got = msda_backward(grad, value, shapes, starts, loc, weights, deterministic=False)
        assert rel_err(msda_forward(value, shapes, starts, loc, weights), want[0]) <= 1e-5
    assert len(launches) == 3 and len(forward_launches) == 3  # forced tiles: the general path
    for g, w in zip(got, want[1:]):
        assert rel_err(g, w) <= 1e-5
    with recorded_launches() as seen:
        if seen is None:
            return  # Triton without HookChain launch hooks
        msda_backward(grad, value, shapes, starts, loc, weights, deterministic=False)
        msda_forward(value, shapes, starts, loc, weights)
    assert len(launches) == 4 and len(forward_launches) == 4 and len(seen) == 2  # a profiler's hook sees both


@pytest.mark.gpu
def test_gpu_deterministic_backward_is_never_replayed(rng, monkeypatch):
    monkeypatch.setattr(msda_backward_module, "_REPLAYS", {})
    launches = _counting_launch(monkeypatch)
    value, shapes, starts, loc, weights, grad = _decoder_like(rng)
    for _ in range(2):
        msda_backward(grad, value, shapes, starts, loc, weights, deterministic=True)
    assert len(launches) == 4 and msda_backward_module._REPLAYS == {}
