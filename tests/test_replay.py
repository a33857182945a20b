"""``lik._replay``, the one replay mechanism: which argument of a recorded launch a replay reads from which source or
buffer (and at which offset), what is never replayable or not filed, when replays are off, and that a recording
sees exactly this thread's launches. On the CPU, with a stand-in for Triton's compiled launcher."""

from __future__ import annotations

import threading

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from lik import _launch, _replay
from lik.config import MaxSimBackwardConfig, override
from lik._launch import launch
from lik._replay import NEVER, allowed, made, note, plan_of, recording, tensor_key


def _copy_rows(x_ptr, out_ptr, n, stride, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs * stride, mask=offs < n) * factor, mask=offs < n)


@pytest.fixture
def cached_path(monkeypatch):
    """A JIT function whose compile step is a stand-in (its launcher files every call in ``calls``), with the
    launch cache on as on a GPU with a tested Triton: ``(kernel, calls)``."""
    calls = []

    class Metadata:
        num_warps, num_stages, maxnreg, num_ctas = 4, 2, None, 1

    class Compiled:
        function, packed_metadata, metadata = 11, (), Metadata()

        @staticmethod
        def run(*launch_args):
            calls.append(launch_args)

    class StandIn(JITFunction):
        def run(self, *args, grid, warmup, **kwargs):
            calls.append(("triton", grid, args))
            return Compiled()

    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(_launch, "_get_stream", lambda device: 99)
    monkeypatch.setattr(_launch, "_hooks_installed", lambda: False)
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    return StandIn(_copy_rows), calls


def test_a_replay_reads_each_argument_from_its_source_or_buffer_at_the_recorded_offset(cached_path):
    kernel, calls = cached_path
    x, out = torch.zeros(8, 4), torch.zeros(16)
    with recording() as recorded:
        buffer = made(torch.empty(6, 2))
        launch(kernel, (2,), x[1], buffer, 7, 1, 2.0, BLOCK=16)  # a view of x, one row in
        launch(kernel, (3,), x, out[4:], 5, 4, 0.5, BLOCK=32)  # out is the caller's too
        note("rows", 6)
    assert [c[0] for c in calls] == ["triton", "triton"] and len(recorded.launches) == 2
    plan = plan_of(recorded, (x, None, out))
    assert plan.buffers == (((6, 2), torch.float32),) and plan.notes == {"rows": 6}
    assert plan.steps[0].slots == (("source", 0, 16), ("buffer", 0, 0), ("value", 7), ("value", 1), ("value", 2.0))
    assert plan.steps[1].slots[:2] == (("source", 0, 0), ("source", 2, 16))
    x2, out2 = torch.zeros(8, 4), torch.zeros(16)
    buffers = plan.allocate()
    calls.clear()
    plan((x2, None, out2), buffers)
    # (grid x, y, z, stream, function, packed metadata, 3 hooks, arguments..., trailing constexprs)
    assert calls == [
        (2, 1, 1, 99, 11, (), None, None, None, x2.data_ptr() + 16, buffers[0].data_ptr(), 7, 1, 2.0, 16),
        (3, 1, 1, 99, 11, (), None, None, None, x2.data_ptr(), out2.data_ptr() + 16, 5, 4, 0.5, 32),
    ]


def test_a_launch_given_a_tensor_the_call_made_and_did_not_announce_is_never_replayable(cached_path):
    kernel, _ = cached_path
    x = torch.zeros(8)
    with recording() as recorded:
        copy = x.clone()  # e.g. a strided input made contiguous: its address changes with every call
        launch(kernel, (1,), copy, x, 8, 1, 1.0, BLOCK=16)
    assert plan_of(recorded, (x,)) is NEVER


def test_overlapping_sources_a_strided_buffer_or_triton_s_path_leave_nothing_to_file(cached_path, monkeypatch):
    kernel, _ = cached_path
    x = torch.zeros(4, 8)
    with recording() as recorded:
        launch(kernel, (1,), x[0], x[1], 8, 1, 1.0, BLOCK=16)
    assert plan_of(recorded, (x, x[1])) is None  # x[1] lies in both sources: which one is ambiguous
    assert plan_of(recorded, (x,)).steps[0].slots[:2] == (("source", 0, 0), ("source", 0, 32))
    assert plan_of(recorded, (x[0], x[1])) is not None
    strided = torch.zeros(4, 8)[:, :2]
    with recording() as recorded:
        made(strided)
        launch(kernel, (1,), x, strided, 2, 1, 1.0, BLOCK=16)
    assert plan_of(recorded, (x,)) is None
    monkeypatch.setattr(_launch, "replay_of", lambda *args, **kwargs: None)
    with recording() as recorded:
        launch(kernel, (1,), x, x, 8, 1, 1.0, BLOCK=16)
    assert plan_of(recorded, (x,)) is None
    assert plan_of(None, (x,)) is None
    with recording() as recorded:
        pass
    assert plan_of(recorded, (x,)) is None


def test_a_recording_sees_only_its_own_thread_and_does_not_nest(cached_path):
    kernel, _ = cached_path
    x = torch.zeros(8)
    with recording() as recorded:
        with recording() as inner:
            assert inner is None  # one recording at a time: the inner call runs unrecorded
        other = threading.Thread(target=lambda: (made(torch.zeros(2)), note("other", 1),
                                                 launch(kernel, (1,), x, x, 8, 1, 1.0, BLOCK=16)))
        other.start()
        other.join()
        launch(kernel, (1,), x, x, 8, 1, 1.0, BLOCK=64)
    assert len(recorded.launches) == 1 and recorded.launches[0][3] == {"BLOCK": 64}
    assert recorded.made == [] and recorded.notes == {}
    assert _launch.WATCH is None
    with recording() as again:  # released: the next call may record
        assert again is not None


def test_made_and_note_do_nothing_outside_a_recording():
    x = torch.zeros(3)
    assert made(x) is x
    note("unused", 1)
    with recording() as recorded:
        pass
    assert recorded.made == [] and recorded.notes == {}


def test_replays_are_off_for_an_untested_triton_a_hook_a_forced_config_and_inside_a_recording(cached_path,
                                                                                              monkeypatch):
    assert allowed()
    with override(maxsim_backward=MaxSimBackwardConfig(block_rows=16, block_k=32)):
        assert not allowed()
    with recording():
        assert not allowed()  # an op called inside another's full path launches where the recording sees it
    assert allowed()
    monkeypatch.setattr(_launch, "_hooks_installed", lambda: True)
    assert not allowed()
    monkeypatch.setattr(_launch, "_hooks_installed", lambda: False)
    monkeypatch.setattr(_launch, "ENABLED", False)  # what a Triton outside TESTED_TRITON gets at import
    assert not allowed()


def test_the_installed_triton_decides_whether_replays_run():
    """With the Triton this run installed (CI's, or the device's), replays are on exactly when its launcher is one the
    launch cache replays; otherwise every call takes the full path, through Triton's own launch."""
    tested = _launch.triton_version_tested(__import__("triton").__version__)
    on_gpu = torch.cuda.is_available() and not _launch._hooks_installed()
    assert allowed() == (tested and on_gpu and _launch._REQUESTED)


def test_tensor_keys_separate_shape_strides_dtype_grad_and_the_address_modulo_16():
    x = torch.zeros(64)
    keys = {tensor_key(t) for t in (x[:8], x[8:16], x[1:9], x[:8].view(2, 4), x[:16:2], x[:8].double(),
                                    x[:8].requires_grad_(False).clone().requires_grad_())}
    assert len(keys) == 6  # x[:8] and x[8:16] differ only by 32 bytes: the same key
    assert tensor_key(x[:8]) == tensor_key(x[8:16]) != tensor_key(x[1:9])


def test_tables_are_bounded(monkeypatch):
    monkeypatch.setattr(_replay, "LIMIT", 3)
    table = {}
    for i in range(4):
        _replay.file(table, i, i)
    assert table == {3: 3}
