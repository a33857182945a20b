"""The atomic backward's replay of a recorded launch: which addresses it passes, what it declines, and (GPU) that a
repeated decoder backward takes it and gives the general path's numbers."""

from __future__ import annotations

import pytest
import torch

from lik.ops.msda import backward as msda_backward_module
from lik.ops.msda import ms_deform_attn
from lik.ops.msda.backward import _AtomicReplay, _record_replay, msda_backward

from .helpers import rand_problem, reference64, rel_err, with_grads

HW = [(5, 6), (3, 3)]


class _Launcher:
    """Stands in for Triton's compiled launcher: records each call's arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, *launch_args):
        self.calls.append(launch_args)


def _replay(monkeypatch, grid=(7, 1), ints=(1, 2, 3), tail=("T",)):
    monkeypatch.setattr(msda_backward_module, "_get_stream", lambda device: 99)
    run = _Launcher()
    return _AtomicReplay((run, "function", "packed", tail), grid, ints, device=0), run


def _inputs(rng, dtype=torch.float32):
    value, shapes, starts, loc, weights, grad = rand_problem(rng, 2, 4, 3, 8, HW, 2, dtype=dtype)
    return grad, value, shapes, starts, loc, weights


def test_replay_passes_every_address_in_the_kernels_order(rng, monkeypatch):
    replay, run = _replay(monkeypatch)
    grad, value, shapes, starts, loc, attn = _inputs(rng)
    gvalue, gloc, gattn = replay(grad, value, shapes, starts, loc, attn)
    (launch_args,) = run.calls
    assert launch_args == (
        7, 1, 1, 99, "function", "packed", None, None, None,
        value.data_ptr(), shapes.data_ptr(), starts.data_ptr(), starts.data_ptr(), loc.data_ptr(), attn.data_ptr(),
        grad.data_ptr(), gvalue.data_ptr(), gloc.data_ptr(), gattn.data_ptr(), gvalue.data_ptr(), 1, 2, 3, "T",
    )
    # The stand-in wrote nothing: the value gradient is the zeroed fp32 buffer the atomics add into.
    assert gvalue.dtype == torch.float32 and gvalue.shape == value.shape and not gvalue.any()
    assert (gloc.shape, gloc.dtype, gattn.shape, gattn.dtype) == (loc.shape, loc.dtype, attn.shape, attn.dtype)


def test_replay_returns_the_value_gradient_in_values_dtype(rng, monkeypatch):
    replay, run = _replay(monkeypatch)
    grad, value, shapes, starts, loc, attn = _inputs(rng, torch.float16)
    gvalue, _, _ = replay(grad, value, shapes, starts, loc, attn)
    assert gvalue.dtype == torch.float16
    # The kernel was given the fp32 buffer, not the returned copy.
    assert run.calls[0][16] != gvalue.data_ptr() and run.calls[0][16] == run.calls[0][19]


@pytest.mark.parametrize("which", range(6))
@pytest.mark.parametrize("how", ["strided", "misaligned"])
def test_replay_declines_inputs_the_recorded_launch_did_not_have(rng, monkeypatch, which, how):
    """The recorded launch read dense, 16-byte aligned tensors (Triton specialises on the alignment): any other
    input goes the general way, which copies or recompiles as needed."""
    replay, run = _replay(monkeypatch)
    inputs = list(_inputs(rng))
    t = inputs[which]
    if how == "strided":
        if t.dim() == 1 or t.shape[-1] == 1:
            t = torch.stack([t, t], dim=-1)[..., 0]
        else:
            t = torch.cat([t, t], dim=-1)[..., : t.shape[-1]]
        assert not t.is_contiguous()
    else:
        t = torch.cat([t.new_zeros(1), t.flatten()])[1:].view(t.shape)
        assert t.is_contiguous() and t.data_ptr() % 16 != 0
    inputs[which] = t
    assert replay(*inputs) is None
    assert run.calls == []


def test_record_keeps_only_launches_of_dense_aligned_tensors(rng, monkeypatch):
    monkeypatch.setattr(msda_backward_module, "_REPLAYS", {})
    monkeypatch.setattr(msda_backward_module, "_current_device", lambda: 0)
    asked = []
    monkeypatch.setattr(msda_backward_module, "recorded",
                        lambda kernel, *args, **options: asked.append((args, options)) or ("run", "f", "p", ()))
    grad, value, shapes, starts, loc, attn = _inputs(rng)
    tensors = (value, shapes, starts, starts, loc, attn, grad, value, loc, attn, value)
    _record_replay("key", (3, 1), tensors, (5, 6), {"DIM": 8})
    assert asked == [((*tensors, 5, 6), {"DIM": 8})]
    replay = msda_backward_module._REPLAYS["key"]
    assert (replay.grid, replay.ints, replay.device, replay.run) == ((3, 1), (5, 6), 0, "run")
    misaligned = torch.cat([value.new_zeros(1), value.flatten()])[1:].view(value.shape)
    _record_replay("other", (3, 1), (misaligned, *tensors[1:]), (5, 6), {"DIM": 8})
    assert "other" not in msda_backward_module._REPLAYS and len(asked) == 1


def test_replays_are_bounded(rng, monkeypatch):
    monkeypatch.setattr(msda_backward_module, "_REPLAYS", {})
    monkeypatch.setattr(msda_backward_module, "_REPLAYS_MAX", 3)
    monkeypatch.setattr(msda_backward_module, "_current_device", lambda: 0)
    monkeypatch.setattr(msda_backward_module, "recorded", lambda kernel, *args, **options: ("run", "f", "p", ()))
    grad, value, shapes, starts, loc, attn = _inputs(rng)
    tensors = (value, shapes, starts, starts, loc, attn, grad, value, loc, attn, value)
    for key in range(5):
        _record_replay(key, (1, 1), tensors, (), {})
        assert len(msda_backward_module._REPLAYS) <= 3 and key in msda_backward_module._REPLAYS


# ------------------------------------------------------------------------------------------------- GPU only


def _counting_launch(monkeypatch):
    launches = []
    real = msda_backward_module.launch

    def launch(kernel, grid, *args, **kwargs):
        launches.append(kernel)
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(msda_backward_module, "launch", launch)
    return launches


def _decoder_like(rng, dtype=torch.float32):
    return rand_problem(rng, 2, 60, 8, 32, [(20, 24), (10, 12), (5, 6), (3, 3)], 4, dtype=dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_gpu_repeated_backward_replays_with_the_general_paths_numbers(rng, monkeypatch, dtype, tol):
    monkeypatch.setattr(msda_backward_module, "_REPLAYS", {})
    launches = _counting_launch(monkeypatch)
    problem = _decoder_like(rng, dtype)
    first = with_grads(ms_deform_attn, *problem)
    assert len(launches) == 1 and len(msda_backward_module._REPLAYS) == 1
    second = with_grads(ms_deform_attn, *problem)
    assert len(launches) == 1  # replayed: no launch through the general path
    # Location and weight gradients involve no atomics: the same bits; the value gradient is summed by atomics in
    # any order.
    assert torch.equal(first[2], second[2]) and torch.equal(first[3], second[3])
    assert second[1].dtype == dtype and rel_err(second[1], first[1]) <= (1e-6 if dtype == torch.float32 else 1e-2)
    for got, want in zip(second, reference64(*problem)):
        assert rel_err(got, want) <= tol


@pytest.mark.gpu
def test_gpu_replay_declines_a_strided_gradient_and_a_launch_hook(rng, monkeypatch):
    import triton

    monkeypatch.setattr(msda_backward_module, "_REPLAYS", {})
    launches = _counting_launch(monkeypatch)
    value, shapes, starts, loc, weights, grad = _decoder_like(rng)
    msda_backward(grad, value, shapes, starts, loc, weights, deterministic=False)
    assert len(launches) == 1
    strided = torch.cat([grad, grad], dim=-1)[..., : grad.shape[-1]]
    got = msda_backward(strided, value, shapes, starts, loc, weights, deterministic=False)
    assert len(launches) == 2  # the general path, which copies the gradient dense
    want = reference64(value, shapes, starts, loc, weights, grad)
    for g, w in zip(got, want[1:]):
        assert rel_err(g, w) <= 1e-5
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime.launch_enter_hook, "add"):
        return  # Triton without HookChain launch hooks
    seen = []
    hook = seen.append
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        msda_backward(grad, value, shapes, starts, loc, weights, deterministic=False)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(launches) == 3 and len(seen) == 1  # a profiler's hook sees the launch


@pytest.mark.gpu
def test_gpu_deterministic_backward_is_never_replayed(rng, monkeypatch):
    monkeypatch.setattr(msda_backward_module, "_REPLAYS", {})
    launches = _counting_launch(monkeypatch)
    value, shapes, starts, loc, weights, grad = _decoder_like(rng)
    for _ in range(2):
        msda_backward(grad, value, shapes, starts, loc, weights, deterministic=True)
    assert len(launches) == 4 and msda_backward_module._REPLAYS == {}
