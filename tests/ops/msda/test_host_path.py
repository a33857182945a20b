"""The host path of deformable attention, counted on the CPU so it cannot grow unnoticed: the PyTorch operators one
call issues besides its kernel launch (a forward: its output's allocation, nothing else; a replayed backward: its
three buffers, and one cast for a half-precision value), no device synchronisation
(``aten._local_scalar_dense``, a ``.item()`` / ``.tolist()`` / ``bool()`` of a CUDA tensor) once the level table has
been checked, and a repeated :func:`lik.ms_deform_attn` whose key passed the checks skipping them (no check, no
route: the recorded launch at once) while bad arguments are still refused.

The kernels are stubbed (``launch`` records and returns): what runs is the Python around them, as on a GPU host.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lik import _launch, _replay
from lik.ops.msda import backward as msda_backward_module
from lik.ops.msda import forward as msda_forward_module
from lik.ops.msda import function as msda_function_module
from lik.ops.msda import ms_deform_attn, ms_deform_attn_v2
from lik.ops.msda import validation
from lik.ops.msda.backward import msda_backward
from lik.ops.msda.validation import check_inputs_v2

from .helpers import rand_problem

HW = [(5, 6), (3, 3)]
ALLOCATION = "aten.empty.memory_format"
SYNC = "aten._local_scalar_dense.default"
DEVICE = "stand-in device"  # a key's first entry: the device current when it was made


class _Operators(TorchDispatchMode):
    """Every ATen operator dispatched inside the block, by name."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _operators(call) -> tuple[list[str], object]:
    with _Operators() as seen:
        out = call()
    return seen.names, out


@pytest.fixture
def stubbed(monkeypatch):
    """Kernels on the CPU (the interpreter's routing) with the forward's launch stubbed: each launch is recorded as
    ``(kernel, grid, args)`` and seen by a replay recording, and nothing runs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launches = []

    def launch(kernel, grid, *args, **kwargs):
        if _launch.WATCH is not None:
            _launch.WATCH(kernel, grid, args, kwargs)
        launches.append((kernel, grid, args))

    monkeypatch.setattr(msda_forward_module, "launch", launch)
    monkeypatch.setattr(msda_forward_module, "_FORWARD_REPLAYS", {})
    monkeypatch.setattr(msda_function_module, "_CHECKED", {})
    return launches


@pytest.fixture
def replays(stubbed, monkeypatch):
    """:func:`stubbed`, with replays on the CPU as on a GPU: keys for CPU tensors, and a stand-in compiled launcher
    that records the addresses a replay hands it."""
    runs = []

    class StandIn:
        def __init__(self, kernel, grid):
            self.grid, self.device, self.function, self.packed, self.tail = (*grid, 1, 1)[:3], 0, kernel, None, ()
            self.run = lambda *a: runs.append((kernel, a[9:]))

    def replay_key(value, shapes, starts, loc, attn, *more):
        return (DEVICE, *(_replay.layout_key(t) for t in (value, shapes, starts, loc, attn)), *more)

    monkeypatch.setattr(_launch, "replay_of", lambda kernel, grid, *args, **kwargs: StandIn(kernel, grid))
    monkeypatch.setattr(_launch, "_get_stream", lambda device: 0)
    monkeypatch.setattr(msda_forward_module, "replay_key", replay_key)
    return stubbed, runs


def _problem(rng, training: bool):
    value, shapes, starts, loc, attn, _ = rand_problem(rng, 2, 4, 3, 8, HW, 2)
    if training:
        value, loc, attn = (t.requires_grad_() for t in (value, loc, attn))
    return value, shapes, starts, loc, attn


@pytest.mark.parametrize("training", [False, True])
def test_a_forward_issues_one_allocation_and_no_synchronisation(rng, stubbed, training):
    """The full path (a CPU call: no replay): the output's allocation is the only operator, the first call included
    (reading a CPU level table dispatches nothing; a CUDA table is read once per table, a documented sync)."""
    problem = _problem(rng, training)
    for _ in range(2):
        names, out = _operators(lambda: ms_deform_attn(*problem))
        assert names == [ALLOCATION]
        assert out.shape == (2, 4, 24) and out.requires_grad == training
    assert len(stubbed) == 2


@pytest.mark.parametrize("training", [False, True])
def test_a_checked_key_replays_without_checking_again(rng, replays, monkeypatch, training):
    launches, runs = replays
    problem = _problem(rng, training)
    ms_deform_attn(*problem)  # the full path: checked, recorded, filed under the call's key
    assert len(launches) == 1 and not runs and len(msda_function_module._CHECKED) == 1
    checks = []
    real_check = msda_function_module.check_inputs
    monkeypatch.setattr(msda_function_module, "check_inputs", lambda *a: checks.append(a) or real_check(*a))
    again = _problem(rng, training)  # new tensors, the same key
    names, out = _operators(lambda: ms_deform_attn(*again))
    assert names == [ALLOCATION] and not checks and len(launches) == 1
    # The stand-in received what the full path's launch got, with this call's addresses and its own output.
    ((kernel, got),) = runs
    full_kernel, _, want = launches[0]
    assert kernel is full_kernel and len(got) == len(want)
    full_out = want[6]  # msda_fwd_kernel's out_ptr (kept alive by the record)
    for a, b in zip(got, want):
        if isinstance(b, torch.Tensor):
            assert _label(a, again, out) == _label(b.data_ptr(), problem, full_out)
        else:
            assert a == b
    assert out.requires_grad == training
    if training:
        assert type(out.grad_fn).__name__ == "_ReplayedFunctionBackward"


def _label(address: int, sources, out=None) -> int | str:
    """Which of a call's tensors ``address`` is: its output, or the index of the input."""
    if out is not None and address == out.data_ptr():
        return "out"
    return [t.data_ptr() for t in sources].index(address)


def test_a_checked_key_still_refuses_bad_arguments(rng, replays):
    value, shapes, starts, loc, attn = _problem(rng, False)
    ms_deform_attn(value, shapes, starts, loc, attn)
    assert len(msda_function_module._CHECKED) == 1
    with pytest.raises(TypeError, match="im2col_step"):
        ms_deform_attn(value, shapes, starts, loc, attn, "64")
    with pytest.raises(TypeError, match="im2col_step"):
        ms_deform_attn(value, shapes, starts, loc, attn, True)
    with pytest.raises(TypeError, match="sampling_locations"):
        ms_deform_attn(value, shapes, starts, loc.numpy(), attn)
    with pytest.raises(ValueError, match="attention_weights"):
        ms_deform_attn(value, shapes, starts, loc, attn[..., :1])
    # The level table's values are not part of the key: changed in place, they are read and refused again.
    starts[1] += 1
    with pytest.raises(ValueError, match="value_level_start_index"):
        ms_deform_attn(value, shapes, starts, loc, attn)


def test_no_checked_key_off_the_gpu_or_while_replays_are_off(rng, stubbed):
    """Without the replay machinery (CPU tensors here; a forced config, a launch hook or an untested Triton on a
    GPU) every call is checked."""
    problem = _problem(rng, False)
    for _ in range(2):
        ms_deform_attn(*problem)
    assert msda_function_module._CHECKED == {}
    assert msda_function_module._checked_key(*problem, 64) is None


def test_the_v2_checks_make_no_tensors(rng):
    value, shapes, starts, loc, attn = _problem(rng, False)
    n, n_queries, heads = loc.shape[:3]
    loc5, attn4 = loc.reshape(n, n_queries, heads, 4, 2), attn.reshape(n, n_queries, heads, 4)
    names, counts = _operators(lambda: check_inputs_v2(value, shapes, starts, loc5, attn4, [1, 3], "discrete"))
    assert names == [] and counts == (1, 3)
    with pytest.raises(ValueError, match="num_points_list"):
        check_inputs_v2(value, shapes, starts, loc5, attn4, [1, 2, 1])
    with pytest.raises(ValueError, match="does not match N=1"):
        check_inputs_v2(value[:1], shapes, starts, loc5, attn4, [1, 3])
    with pytest.raises(ValueError, match="attention_weights"):
        check_inputs_v2(value, shapes, starts, loc5, attn4[..., :3], [1, 3])


@pytest.mark.parametrize("counts, method", [([2, 2], "default"), ([1, 3], "default"), ([2, 2], "discrete")])
def test_a_v2_forward_issues_no_synchronisation(rng, stubbed, monkeypatch, counts, method):
    """Equal counts run ms_deform_attn on views of the samples (two views and the output); other counts and the
    discrete method launch with the cached point table (the output only)."""
    from lik.ops.msda import v2

    monkeypatch.setattr(v2, "launch_forward", _stub_v2_launch)
    value, shapes, starts, loc, attn = _problem(rng, False)
    n, n_queries, heads = loc.shape[:3]
    loc5, attn4 = loc.reshape(n, n_queries, heads, 4, 2), attn.reshape(n, n_queries, heads, 4)
    for _ in range(2):
        names, _ = _operators(lambda: ms_deform_attn_v2(value, shapes, starts, loc5, attn4, counts, method))
    equal = method == "default" and counts[0] == counts[1]
    assert names == (["aten.view.default"] * 2 if equal else []) + [ALLOCATION]


def _stub_v2_launch(value, shapes, starts, loc, attn, points=None, max_points=0, discrete=False):
    return torch.empty((value.shape[0], loc.shape[1], value.shape[2] * value.shape[3]), dtype=value.dtype)


@pytest.mark.parametrize("method", ["default", "discrete"])
def test_a_v2_point_table_forward_replays_its_launch(rng, replays, monkeypatch, method):
    """Unequal counts (D-FINE's [3, 6, 3]) or the discrete method: the point table is one of the recorded launch's
    sources, and a call with the key replays it with its own addresses."""
    from lik.ops.msda import v2

    launches, runs = replays
    monkeypatch.setattr(v2, "_REPLAYS", {})

    def call():
        value, shapes, starts, loc, attn = _problem(rng, False)
        n, n_queries, heads = loc.shape[:3]
        loc5, attn4 = loc.reshape(n, n_queries, heads, 4, 2), attn.reshape(n, n_queries, heads, 4)
        return (value, shapes, starts, loc5, attn4), ms_deform_attn_v2(
            value, shapes, starts, loc5, attn4, [1, 3], method
        )

    first, _ = call()
    assert len(launches) == 1 and not runs and len(v2._REPLAYS) == 1
    table = launches[0][2][3]  # msda_fwd_kernel's points_ptr: the cached point table
    second, out = call()
    assert len(launches) == 1 and len(runs) == 1
    (_, got), (_, _, want) = runs[0], launches[0]
    for a, b in zip(got, want):
        if isinstance(b, torch.Tensor):
            assert _label(a, (*second, table), out) == _label(b.data_ptr(), (*first, table), want[6])
        else:
            assert a == b


@pytest.fixture
def backward_replays(replays, monkeypatch):
    """:func:`replays` for the atomic backward too: its launch stubbed, its keys made on the CPU, replays allowed,
    and the stand-in device current. Yields the launches, the stand-in's runs and the calls of the backward's own
    keying of the five tensors (:func:`lik.ops.msda.forward.replay_key`)."""
    launches, runs = replays
    keyed = []
    forward_key = msda_forward_module.replay_key
    monkeypatch.setattr(msda_backward_module, "launch", msda_forward_module.launch)
    monkeypatch.setattr(msda_backward_module, "replay_key", lambda *a: keyed.append(a) or forward_key(*a))
    monkeypatch.setattr(msda_backward_module, "allowed", lambda: True)
    monkeypatch.setattr(msda_backward_module, "current_device", lambda: DEVICE)
    monkeypatch.setattr(msda_backward_module, "_REPLAYS", {})
    return launches, runs, keyed


def _training_call(rng, dtype, wanted=(True, True, True)):
    value, shapes, starts, loc, attn = _problem(rng, False)
    value, loc, attn = (t.to(dtype).requires_grad_(w) for t, w in zip((value, loc, attn), wanted))
    out = ms_deform_attn(value, shapes, starts, loc, attn)
    grad = torch.randn(out.shape, generator=rng).to(dtype)
    return (value, shapes, starts, loc, attn, grad), out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_replayed_backward_makes_its_buffers_and_nothing_else(rng, backward_replays, dtype):
    """The backward of a replayed forward: the zeroed value-gradient buffer and the two point gradients (a half
    value adds its one cast from the fp32 buffer), no synchronisation, and no keying of the saved tensors (the
    forward's key is reused); the stand-in gets what the full path's launch got, with this call's addresses."""
    launches, runs, keyed = backward_replays
    first, out = _training_call(rng, dtype)
    leaves = [first[i] for i in (0, 3, 4)]
    full = torch.autograd.grad(out, leaves, first[5])  # full path: keyed, recorded, filed
    assert len(launches) == 2 and len(keyed) == 1 and len(msda_backward_module._REPLAYS) == 1
    again, out = _training_call(rng, dtype)
    assert type(out.grad_fn).__name__ == "_ReplayedFunctionBackward" and len(runs) == 1
    names, grads = _operators(lambda: torch.autograd.grad(out, [again[i] for i in (0, 3, 4)], again[5]))
    cast = ["aten._to_copy.default"] if dtype != torch.float32 else []
    assert names == ["aten.zeros.default", ALLOCATION, ALLOCATION, *cast] and SYNC not in names
    assert len(keyed) == 1 and len(launches) == 2 and len(runs) == 2
    assert [(g.shape, g.dtype) for g in grads] == [(g.shape, g.dtype) for g in full]
    (kernel, got), (full_kernel, _, want) = runs[1], launches[1]
    assert kernel is full_kernel and len(got) == len(want)
    if dtype == torch.float32:  # the returned value gradient is the buffer the kernel wrote
        for a, b in zip(got, want):
            if isinstance(b, torch.Tensor):
                assert _label(a, (*again, *grads)) == _label(b.data_ptr(), (*first, *full))
            else:
                assert a == b


def test_a_replayed_backward_keys_again_off_its_forwards_device_and_returns_only_wanted_gradients(
        rng, backward_replays, monkeypatch):
    launches, runs, keyed = backward_replays
    first, out = _training_call(rng, torch.float32, wanted=(False, True, True))
    torch.autograd.grad(out, [first[3], first[4]], first[5])
    again, out = _training_call(rng, torch.float32, wanted=(False, True, True))
    monkeypatch.setattr(msda_backward_module, "current_device", lambda: "another device")
    grad_loc, grad_attn = torch.autograd.grad(out, [again[3], again[4]], again[5])
    assert len(keyed) == 2 and len(runs) == 2 and len(launches) == 2  # keyed in full, then replayed
    assert grad_loc.shape == again[3].shape and grad_attn.shape == again[4].shape


def test_a_replayed_forwards_deterministic_backward_is_the_full_one(rng, backward_replays):
    launches, runs, keyed = backward_replays
    for _ in range(2):
        problem, out = _training_call(rng, torch.float32)
    torch.use_deterministic_algorithms(True)
    try:
        torch.autograd.grad(out, [problem[i] for i in (0, 3, 4)], problem[5])
    finally:
        torch.use_deterministic_algorithms(False)
    assert type(out.grad_fn).__name__ == "_ReplayedFunctionBackward"
    assert msda_backward_module._REPLAYS == {} and not keyed
    assert [k.fn.__name__ for k, _, _ in launches[1:]] == ["msda_bwd_kernel", "msda_bwd_value_kernel"]


def test_a_deterministic_backward_reads_no_checked_level_table(rng, stubbed, monkeypatch):
    """Its corner-cell count comes from the forward's cached table check; a table never checked (or changed in
    place since) is read (one synchronisation, for a CUDA table) and counted."""
    monkeypatch.setattr(msda_backward_module, "launch", msda_forward_module.launch)
    monkeypatch.setattr(validation, "_FITTING_TABLES", {})
    value, shapes, starts, loc, attn = _problem(rng, True)
    out = ms_deform_attn(value, shapes, starts, loc, attn)
    grad = torch.randn(out.shape, generator=rng)
    torch.use_deterministic_algorithms(True)
    try:
        names, _ = _operators(lambda: torch.autograd.grad(out, [value, loc, attn], grad))
    finally:
        torch.use_deterministic_algorithms(False)
    assert SYNC not in names and _cells(stubbed) == sum((h + 1) * (w + 1) for h, w in HW)
    other = torch.tensor([[5, 6], [2, 3]])  # fits value too; never checked
    names, _ = _operators(lambda: msda_backward(grad, value.detach(), other, starts, loc.detach(), attn.detach(),
                                                deterministic=True))
    assert SYNC in names and _cells(stubbed) == 6 * 7 + 3 * 4


def _cells(launches) -> int:
    """``n_cells`` of the last sample-side backward launch (its ints end with n_cells, no_bucket, stride_gc)."""
    return [args for kernel, _, args in launches if kernel is msda_backward_module.msda_bwd_kernel][-1][-3]


# ------------------------------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["default", "discrete"])
def test_gpu_checked_and_replayed_calls_give_the_full_paths_bits(rng, monkeypatch, method):
    from lik.ops.msda import v2

    monkeypatch.setattr(msda_forward_module, "_FORWARD_REPLAYS", {})
    monkeypatch.setattr(msda_function_module, "_CHECKED", {})
    monkeypatch.setattr(v2, "_REPLAYS", {})
    hw = [(20, 24), (10, 12), (5, 6), (3, 3)]
    value, shapes, starts, loc, attn, grad = rand_problem(rng, 2, 60, 8, 32, hw, 4, device="cuda")
    # ms_deform_attn: the second training call takes the checked key's replay; same output and point gradients
    # (no atomics), the value gradient up to the atomics' order.
    runs = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in (value, loc, attn)]
        out = ms_deform_attn(leaves[0], shapes, starts, leaves[1], leaves[2])
        runs.append((type(out.grad_fn).__name__, out, torch.autograd.grad(out, leaves, grad)))
    assert runs[0][0] == "_CheckedInputsFunctionBackward" and runs[1][0] == "_ReplayedFunctionBackward"
    assert torch.equal(runs[0][1], runs[1][1])
    assert torch.equal(runs[0][2][1], runs[1][2][1]) and torch.equal(runs[0][2][2], runs[1][2][2])
    assert torch.allclose(runs[0][2][0], runs[1][2][0], rtol=1e-5, atol=1e-6)
    # ms_deform_attn_v2 with a point table: the replayed forward gives the full path's bits.
    n, n_queries, heads = loc.shape[:3]
    loc5, attn4 = loc.reshape(n, n_queries, heads, 16, 2), attn.reshape(n, n_queries, heads, 16)
    first = ms_deform_attn_v2(value, shapes, starts, loc5, attn4, [2, 6, 4, 4], method)
    assert len(v2._REPLAYS) == 1
    again = ms_deform_attn_v2(value.clone(), shapes, starts, loc5.clone(), attn4.clone(), [2, 6, 4, 4], method)
    assert torch.equal(first, again)
