"""Replays of recorded deformable-attention launches (lik._replay): on the CPU, with a stand-in launcher, that a
replay hands the kernels what the full path hands them for the new call's tensors, and which calls are never
replayed; on the GPU, that repeated forwards and backwards take them and give the full path's numbers."""

from __future__ import annotations

import pytest
import torch

from lik import _launch, _replay
from lik.ops.msda import backward as msda_backward_module
from lik.ops.msda import forward as msda_forward_module
from lik.ops.msda import function as msda_function_module
from lik.ops.msda import ms_deform_attn
from lik.ops.msda.backward import msda_backward
from lik.ops.msda.forward import msda_forward

from ...launch_hooks import recorded_launches

from .helpers import rand_problem, reference64, rel_err, with_grads

HW = [(5, 6), (3, 3)]


def _inputs(rng, dtype=torch.float32):
    value, shapes, starts, loc, weights, grad = rand_problem(rng, 2, 4, 3, 8, HW, 2, dtype=dtype)
    return value, shapes, starts, loc, weights, grad


@pytest.fixture
def stand_ins(monkeypatch):
    """Replays on the CPU: keys for CPU tensors, and a stand-in launcher per recorded launch that files
    ``(kernel, grid, arguments)`` (the full path still runs the kernels, interpreted)."""
    runs = []

    class StandIn:
        def __init__(self, kernel, grid):
            self.grid, self.device, self.function, self.packed, self.tail = (*grid, 1, 1)[:3], 0, kernel, None, ()
            self.run = lambda *a: runs.append((kernel, a[:3], a[9:]))

    def replay_key(value, shapes, starts, loc, attn, *more):
        return tuple(_replay.layout_key(t) for t in (value, shapes, starts, loc, attn)) + more

    monkeypatch.setattr(_launch, "replay_of", lambda kernel, grid, *args, **kwargs: StandIn(kernel, grid))
    monkeypatch.setattr(_launch, "_get_stream", lambda device: 0)
    monkeypatch.setattr(msda_forward_module, "replay_key", replay_key)
    monkeypatch.setattr(msda_backward_module, "replay_key", replay_key)
    monkeypatch.setattr(msda_forward_module, "_FORWARD_REPLAYS", {})
    monkeypatch.setattr(msda_backward_module, "_REPLAYS", {})
    monkeypatch.setattr(msda_function_module, "_CHECKED", {})
    return runs


def _full_launches(run) -> list[tuple]:
    with _replay.recording() as recorded:
        run()
    return [(kernel, (*grid, 1, 1)[:3], args) for kernel, grid, args, _ in recorded.launches]


def _assert_same_launches(replayed, full, sources):
    """Each replayed launch hands its kernel what the full path hands it for ``sources``: the same source at the same
    offset, a buffer of the call's own, the same values."""

    def label(address):
        for i, t in enumerate(sources):
            if t.data_ptr() <= address < t.data_ptr() + t.numel() * t.itemsize:
                return ("source", i, address - t.data_ptr())
        return ("made",)

    assert [(k, g) for k, g, _ in replayed] == [(k, g) for k, g, _ in full]
    for (_, _, got), (_, _, want) in zip(replayed, full):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert (label(a) == label(b.data_ptr())) if isinstance(b, torch.Tensor) else a == b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_replays_hand_the_kernels_what_the_full_path_would(rng, stand_ins, dtype):
    value, shapes, starts, loc, attn, grad = _inputs(rng, dtype)
    out = msda_forward(value, shapes, starts, loc, attn)
    grads = msda_backward(grad, value, shapes, starts, loc, attn, deterministic=False)
    assert len(msda_forward_module._FORWARD_REPLAYS) == len(msda_backward_module._REPLAYS) == 1 and not stand_ins
    value, shapes, starts, loc, attn, grad = _inputs(rng, dtype)  # new tensors, same key
    got = msda_forward(value, shapes, starts, loc, attn)
    assert got.shape == out.shape and got.dtype == out.dtype
    full = _full_launches(lambda: msda_forward_module._forward(value, shapes, starts, loc, attn))
    _assert_same_launches(stand_ins, full, (value, shapes, starts, loc, attn))
    stand_ins.clear()
    got = msda_backward(grad, value, shapes, starts, loc, attn, deterministic=False)
    # The stand-in wrote nothing: the value gradient is the zeroed fp32 buffer the atomics add into, in value's dtype.
    assert not got[0].any() and [(g.shape, g.dtype) for g in got] == [(g.shape, g.dtype) for g in grads]
    full = _full_launches(lambda: msda_backward_module._backward(grad, value, shapes, starts, loc, attn, False))
    _assert_same_launches(stand_ins, full, (value, shapes, starts, loc, attn, grad))


def _strided(t):
    if t.dim() == 1 or t.shape[-1] == 1:
        return torch.stack([t, t], dim=-1)[..., 0]
    return torch.cat([t, t], dim=-1)[..., : t.shape[-1]]


def _misaligned(t):
    return torch.cat([t.new_zeros(1), t.flatten()])[1:].view(t.shape)


@pytest.mark.parametrize("which", [0, 3, 4, 5])
def test_a_strided_input_is_copied_and_never_replayed(rng, stand_ins, which):
    """The kernels read dense tensors: a strided input is copied per call, whose address no replay can know."""
    inputs = list(_inputs(rng))
    inputs[which] = _strided(inputs[which])
    value, shapes, starts, loc, attn, grad = inputs
    for _ in range(2):
        msda_backward(grad, value, shapes, starts, loc, attn, deterministic=False)
        msda_forward(value, shapes, starts, loc, attn)
    assert list(msda_backward_module._REPLAYS.values()) == [_replay.NEVER]
    (forward,) = msda_forward_module._FORWARD_REPLAYS.values()
    if which == 5:  # the output gradient is the backward's alone: the forward replays
        assert forward is not _replay.NEVER and [run[0] for run in stand_ins] == [msda_forward_module.msda_fwd_kernel]
    else:
        assert forward is _replay.NEVER and not stand_ins


def test_a_misaligned_input_is_a_call_of_its_own(rng, stand_ins):
    """Triton specialises on 16-byte alignment: a misaligned view is another key, recorded as such."""
    value, shapes, starts, loc, attn, _ = _inputs(rng)
    msda_forward(value, shapes, starts, loc, attn)
    msda_forward(_misaligned(value), shapes, starts, loc, attn)
    assert len(msda_forward_module._FORWARD_REPLAYS) == 2 and not stand_ins


def test_the_deterministic_backward_is_never_replayed(rng, stand_ins):
    value, shapes, starts, loc, attn, grad = _inputs(rng)
    for _ in range(2):
        msda_backward(grad, value, shapes, starts, loc, attn, deterministic=True)
    assert msda_backward_module._REPLAYS == {} and not stand_ins


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
    monkeypatch.setattr(msda_function_module, "_CHECKED", {})
    backward_launches = _counting_launch(monkeypatch)
    forward_launches = _counting_launch(monkeypatch, msda_forward_module)
    problem = _decoder_like(rng, dtype)
    first = with_grads(ms_deform_attn, *problem)
    assert len(forward_launches) == len(backward_launches) == 1
    assert len(msda_forward_module._FORWARD_REPLAYS) == len(msda_backward_module._REPLAYS) == 1
    assert len(msda_function_module._CHECKED) == 1  # ms_deform_attn's next call with this key skips its checks
    checks = []
    real_check = msda_function_module.check_inputs
    monkeypatch.setattr(msda_function_module, "check_inputs", lambda *a: checks.append(a) or real_check(*a))
    second = with_grads(ms_deform_attn, *problem)
    assert len(forward_launches) == len(backward_launches) == 1  # both replayed
    assert not checks
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
