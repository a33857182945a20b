"""Replays of ``lik.contrastive_loss`` training calls: MaxSim's recorded Training (shared with ``lik.maxsim``'s
table) and the cross-entropy kernel's step. On the CPU every recorded launch gets a stand-in launcher that files
what it is given (the pattern of tests/ops/maxsim/test_replay.py); the GPU tests check the bits."""

from __future__ import annotations

import pytest
import torch

import lik
from lik import _launch, _replay
from lik.core.forward_kernel import maxsim_fwd_kernel
from lik.ops.contrastive import function as contrastive
from lik.ops.contrastive.kernel import contrastive_ce_kernel, launch_cross_entropy
from lik.ops.maxsim import function as maxsim_function
from lik.ops.maxsim import replay as maxsim_replay
from lik.ops.maxsim.backward import maxsim_bwd_dd_atomic_kernel, maxsim_bwd_dq_kernel

pytestmark = pytest.mark.skipif(not lik._device.interpreting(), reason="the full path runs the interpreted kernels")


@pytest.fixture
def stand_ins(monkeypatch):
    """Keys for CPU tensors and a stand-in launcher per recorded launch, filing ``(kernel, grid, arguments)``."""
    runs = []

    class StandIn:
        def __init__(self, kernel, grid):
            self.grid, self.device, self.function, self.packed, self.tail = (*grid, 1, 1)[:3], 0, kernel, None, ()
            self.run = lambda *a: runs.append((kernel, a[:3], a[9:]))

    monkeypatch.setattr(_launch, "replay_of", lambda kernel, grid, *args, **kwargs: StandIn(kernel, grid))
    monkeypatch.setattr(_launch, "replay_allowed", lambda: True)
    monkeypatch.setattr(_launch, "_get_stream", lambda device: 0)
    monkeypatch.setattr(maxsim_replay, "current_device", lambda: 0)
    monkeypatch.setattr(maxsim_function, "call_key", maxsim_replay.key_of)  # past the CUDA gate
    monkeypatch.setattr(contrastive, "call_key", maxsim_replay.key_of)
    calls = {}  # one table under every name it is imported as
    for module in (maxsim_replay, maxsim_function):
        monkeypatch.setattr(module, "CALLS", calls)
    monkeypatch.setattr(contrastive, "MAXSIM_CALLS", calls)
    monkeypatch.setattr(contrastive, "CALLS", {})
    return runs


def _build(rng, labels=True):
    Q = torch.randn(3, 4, 16, generator=rng).requires_grad_()
    D = torch.randn(5, 6, 16, generator=rng).requires_grad_()
    return Q, D, (torch.randint(0, 5, (3,), generator=rng) if labels else None)


def _label(address, sources):
    for i, t in enumerate(sources):
        if t is not None and t.data_ptr() <= address < t.data_ptr() + max(1, t.numel()) * t.itemsize:
            return ("source", i, address - t.data_ptr())
    return ("made",)


@pytest.mark.parametrize("with_labels", [True, False])
def test_a_training_replay_runs_maxsims_launches_and_the_cross_entropy_step(stand_ins, rng, with_labels):
    Q, D, labels = _build(rng, with_labels)
    contrastive.contrastive_loss(Q, D, labels, temperature=0.25, backward="fast").backward()
    (recorded,) = contrastive.CALLS.values()
    assert type(recorded) is contrastive.Recorded and set(recorded.training.backward) == {(True, True)}
    assert list(maxsim_replay.CALLS.values()) == [recorded.training]  # lik.maxsim's table holds the same Training
    assert not stand_ins  # the first call ran the full path

    Q, D, labels = _build(rng, with_labels)
    loss = contrastive.contrastive_loss(Q, D, labels, temperature=0.25, backward="fast")
    assert type(loss.grad_fn).__name__ == "ContrastiveFunctionBackward" and loss.shape == ()
    assert [run[0] for run in stand_ins] == [maxsim_fwd_kernel, contrastive_ce_kernel]
    # The cross-entropy step gets what the full path's launch gets for these labels (the scores: a buffer).
    with _replay.recording() as full:
        launch_cross_entropy(torch.zeros(3, 5), labels, 0.25)
    ((_, grid, want, _),) = full.launches
    _, got_grid, got = stand_ins[1]
    assert got_grid == (*grid, 1, 1)[:3] and len(got) == len(want)
    for a, b in zip(got, want):
        if isinstance(b, torch.Tensor):
            assert _label(a, (labels,)) == _label(b.data_ptr(), (labels,))
        else:
            assert a == b
    stand_ins.clear()
    loss.backward()
    assert [run[0] for run in stand_ins] == [maxsim_bwd_dq_kernel, maxsim_bwd_dd_atomic_kernel]
    assert Q.grad.shape == Q.shape and D.grad.shape == D.shape


def test_a_recorded_lik_maxsim_forward_is_replayed_by_the_first_contrastive_call(stand_ins, rng):
    Q, D, labels = _build(rng)
    lik.maxsim(Q, D, backward="fast").sum().backward()
    assert len(maxsim_replay.CALLS) == 1 and not stand_ins
    Q, D, labels = _build(rng)
    loss = contrastive.contrastive_loss(Q, D, labels, backward="fast")
    assert [run[0] for run in stand_ins] == [maxsim_fwd_kernel]  # the cross-entropy step ran, recorded
    assert type(next(iter(contrastive.CALLS.values()))) is contrastive.Recorded
    assert loss.shape == ()


def test_other_labels_layouts_and_temperatures_are_other_keys(stand_ins, rng):
    Q, D, labels = _build(rng)
    for temperature, lab in ((1.0, labels), (0.5, labels), (0.5, None), (0.5, labels[:2])):
        try:
            contrastive.contrastive_loss(Q, D, lab, temperature=temperature).backward()
        except ValueError:
            assert lab is not None and lab.shape == (2,)  # refused by name, and filed nowhere
    assert len(contrastive.CALLS) == 3


def test_calls_that_copy_a_mask_are_never_replayed(stand_ins, rng):
    int_mask = (torch.rand(5, 6, generator=rng) > 0.3).to(torch.int64)  # turned bool by the checks, per call
    for _ in range(2):
        Q, D, labels = _build(rng)
        contrastive.contrastive_loss(Q, D, labels, d_mask=int_mask).backward()
    assert list(contrastive.CALLS.values()) == [_replay.NEVER] and not stand_ins
