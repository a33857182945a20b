"""Replays of ``lik.maxsim`` calls (eager inference, training forward and both backwards) and of ``lik.quantize``.

On the CPU, every recorded launch gets a stand-in launcher that files what it is given, and the test checks that a
replay with new tensors hands each kernel exactly what the full path hands it for those tensors (the same source
at the same offset, a buffer of the call's own, the same values). On the GPU, that repeated calls replay and give
the full path's bits, and that every call a replay could get wrong keeps the full path."""

from __future__ import annotations

import pytest
import torch

import lik
from lik import _launch, _replay
from lik.config import maxsim as maxsim_config
from lik.ops.maxsim import function
from lik.ops.maxsim import replay as replay_module
from lik.ops.maxsim.backward import maxsim_backward_dd, maxsim_backward_dq
from lik.ops.maxsim.forward import forward_problem
from lik.ops.maxsim.replay import Inference, Training
from lik.ops.maxsim.validation import MaxSimInputs
from lik.ops.quantization import function as quantization

from ...launch_hooks import recorded_launches


@pytest.fixture
def stand_ins(monkeypatch):
    """Replays on the CPU: keys for CPU tensors, and a stand-in launcher per recorded launch that files
    ``(kernel, grid, arguments)`` in the list returned (the full path still runs the kernels, interpreted)."""
    runs = []

    class StandIn:
        def __init__(self, kernel, grid):
            self.grid, self.device, self.function, self.packed, self.tail = (*grid, 1, 1)[:3], 0, kernel, None, ()
            self.run = lambda *a: runs.append((kernel, a[:3], a[9:]))

    monkeypatch.setattr(_launch, "replay_of", lambda kernel, grid, *args, **kwargs: StandIn(kernel, grid))
    monkeypatch.setattr(_launch, "replay_allowed", lambda: True)
    monkeypatch.setattr(_launch, "_get_stream", lambda device: 0)
    monkeypatch.setattr(replay_module, "current_device", lambda: 0)
    monkeypatch.setattr(function, "call_key", replay_module.key_of)  # past the CUDA gate
    monkeypatch.setattr(quantization, "_replay_key", lambda x, dtype: (0, _replay.tensor_key(x), dtype))
    calls = {}  # function.py looks the table up under the name it imported
    monkeypatch.setattr(replay_module, "CALLS", calls)
    monkeypatch.setattr(function, "CALLS", calls)
    monkeypatch.setattr(quantization, "QUANTIZATIONS", {})
    return runs


def _full_launches(run) -> list[tuple]:
    """The launches ``run()`` makes on the full path, as ``(kernel, grid, args)``."""
    with _replay.recording() as recorded:
        run()
    return [(kernel, (*grid, 1, 1)[:3], args) for kernel, grid, args, _ in recorded.launches]


def _label(address: int, sources) -> tuple:
    """Which source holds ``address`` and where; a source is a tensor or ``(address, bytes)``."""
    for i, t in enumerate(sources):
        if isinstance(t, torch.Tensor):
            t = (t.data_ptr(), max(1, t.numel()) * t.itemsize)
        if t is not None and t[0] <= address < t[0] + t[1]:
            return ("source", i, address - t[0])
    return ("made",)


def _assert_same_launches(replayed, full, sources, replayed_sources=None):
    """Each replayed launch hands its kernel what the full path hands it for ``sources`` (``replayed_sources``: the
    replay's, where one of them is a buffer of its own)."""
    assert [(k, g) for k, g, _ in replayed] == [(k, g) for k, g, _ in full]
    for (_, _, got), (_, _, want) in zip(replayed, full):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            if isinstance(b, torch.Tensor):
                assert _label(a, replayed_sources or sources) == _label(b.data_ptr(), sources)
            else:
                assert a == b


def _problem(rng, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=rng).to(dtype)


def _inference_cases(rng):
    """``(name, build)``: build() gives ``(args, kwargs)`` of a new call with the same key each time."""

    def masked_2d():
        return (_problem(rng, 5, 16), _problem(rng, 3, 7, 16), None, torch.rand(3, 7, generator=rng) > 0.3), {}

    def stacked_zero_mode():
        return (_problem(rng, 2, 5, 16), _problem(rng, 3, 7, 16), torch.rand(2, 5, generator=rng) > 0.2), \
            {"mask_mode": "zero"}

    def per_query_documents():
        return (_problem(rng, 2, 5, 16), _problem(rng, 2, 3, 7, 16)), {}

    def long_query_in_chunks():  # two row chunks of the interpreter's 32-row tile: their sums are added
        return (_problem(rng, 40, 16), _problem(rng, 3, 7, 16)), {}

    def int8_with_scales():
        q, qs = lik.quantize(_problem(rng, 2, 5, 32), torch.int8)
        d, ds = lik.quantize(_problem(rng, 3, 7, 32), torch.int8)
        return (q, d), {"q_scale": qs, "d_scale": ds}

    def float_query_int8_corpus():  # the query is quantized per call: two launches
        d, ds = lik.quantize(_problem(rng, 3, 7, 32), torch.int8)
        return (_problem(rng, 5, 32), d), {"d_scale": ds}

    return [masked_2d, stacked_zero_mode, per_query_documents, long_query_in_chunks, int8_with_scales,
            float_query_int8_corpus]


@pytest.mark.parametrize("case", range(6))
def test_an_inference_replay_hands_the_kernels_what_the_full_path_would(stand_ins, rng, case):
    build = _inference_cases(rng)[case]
    args, kwargs = build()
    first = lik.maxsim(*args, **kwargs)
    (recorded,) = replay_module.CALLS.values()
    assert type(recorded) is Inference
    args, kwargs = build()
    stand_ins.clear()  # (building an 8-bit case replays lik.quantize)
    sources = (*args, *[None] * (4 - len(args)), kwargs.get("q_scale"), kwargs.get("d_scale"))
    got = lik.maxsim(*args, **kwargs)
    assert got.shape == first.shape and got.dtype == torch.float32 and len(replay_module.CALLS) == 1
    full = _full_launches(lambda: function._validated_inference(*sources[:4], kwargs.get("mask_mode", "exclude"),
                                                                "auto", *sources[4:]))
    _assert_same_launches(stand_ins, full, sources)


@pytest.mark.parametrize("backward, workspace, launches", [
    ("fast", 1 << 20, 2),  # dD through one fp32 buffer of the whole gradient, cast once
    ("fast", 2 * 7 * 16 * 4, 4),  # dD in chunks of two documents through the buffer
    ("deterministic", 1 << 20, 7),  # the winners sorted in passes of two documents (two launches each)
])
def test_a_training_replay_hands_the_kernels_what_the_full_path_would(stand_ins, rng, backward, workspace, launches,
                                                                      monkeypatch):
    # Small workspaces are the heuristic's here (a forced config would turn replays off).
    small = maxsim_config.MaxSimBackwardConfig(block_rows=16, block_k=16, atomic_workspace_bytes=workspace,
                                               sort_workspace_entries=2 * 2 * 5)
    monkeypatch.setattr(maxsim_config, "_maxsim_backward_heuristic", lambda block_d, interpreted: small)

    def build():
        Q = _problem(rng, 2, 5, 16, dtype=torch.float16).requires_grad_()
        D = _problem(rng, 5, 7, 16, dtype=torch.float16).requires_grad_()
        return Q, D, torch.rand(5, 7, generator=rng) > 0.3

    Q, D, d_mask = build()
    lik.maxsim(Q, D, d_mask=d_mask, backward=backward).float().square().sum().backward()
    (recorded,) = replay_module.CALLS.values()
    assert type(recorded) is Training and set(recorded.backward) == {(True, True)}
    Q, D, d_mask = build()
    scores = lik.maxsim(Q, D, d_mask=d_mask, backward=backward)
    assert type(scores.grad_fn).__name__ == "EagerMaxSimFunctionBackward" and scores.shape == (2, 5)
    forward_runs = list(stand_ins)
    stand_ins.clear()
    grad = torch.randn(2, 5, generator=rng)
    scores.backward(grad)
    assert Q.grad.shape == Q.shape and D.grad.shape == D.shape and Q.grad.dtype == torch.float16
    inputs = MaxSimInputs.build(Q, D, None, d_mask)
    full = _full_launches(lambda: function.launch_forward(forward_problem(inputs), True))
    _assert_same_launches(forward_runs, full, (Q, D, None, d_mask))
    # The backward's sources: (grad, Q, D, winners), the winners being the replayed forward's own buffer.
    argmax = torch.zeros((2, 5, 5), dtype=torch.int16)
    replayed_argmax = (forward_runs[0][2][7], argmax.numel() * argmax.itemsize)
    full = _full_launches(lambda: (
        maxsim_backward_dq(grad, inputs.d, argmax, inputs.q.shape, Q.dtype),
        maxsim_backward_dd(grad, inputs.q, argmax, inputs.d.shape, D.dtype, deterministic=backward != "fast",
                           per_query=False)))
    assert len(full) == launches  # dQ, then dD's
    _assert_same_launches(stand_ins, full, (grad, Q, D, argmax), (grad, Q, D, replayed_argmax))


def test_a_quantize_replay_hands_the_kernel_what_the_full_path_would(stand_ins, rng):
    x = _problem(rng, 3, 7, 32)
    x_q, scale = lik.quantize(x, torch.int8)
    x2 = _problem(rng, 3, 7, 32)
    got, got_scale = lik.quantize(x2, torch.int8)
    assert (got.shape, got.dtype, got_scale.shape) == (x_q.shape, torch.int8, scale.shape)
    full = _full_launches(lambda: quantization._quantize(x2, torch.int8))
    _assert_same_launches(stand_ins, full, (x2,))


@pytest.mark.parametrize("eight_bit", [False, True])
def test_a_packed_chunk_replay_hands_the_kernel_what_the_full_path_would(stand_ins, rng, monkeypatch, eight_bit):
    """lik.Index.search scores each chunk through score_packed: a chunk of a recorded shape is replayed."""
    from lik.ops.maxsim import packed_function

    monkeypatch.setattr(packed_function, "_replayable", lambda d: True)
    monkeypatch.setattr(packed_function, "current_device", lambda: 0)
    monkeypatch.setattr(packed_function, "PACKED_CALLS", {})

    def build():
        d, cu_d, _ = lik.pack([_problem(rng, n, 32) for n in (7, 0, 12)])
        d_scale = None
        if eight_bit:
            d, d_scale = lik.quantize(d, torch.int8)
        query = packed_function.packed_query(_problem(rng, 2, 5, 32), torch.rand(2, 5, generator=rng) > 0.2,
                                             d.dtype)
        return query, d, cu_d, d_scale

    first = packed_function.score_packed(*build())
    assert len(packed_function.PACKED_CALLS) == 1
    query, d, cu_d, d_scale = build()
    stand_ins.clear()
    got = packed_function.score_packed(query, d, cu_d, d_scale)
    assert got.shape == first.shape == (2, 3) and len(packed_function.PACKED_CALLS) == 1
    full = _full_launches(lambda: packed_function.packed_launch(packed_function.packed_forward_problem(
        packed_function.PackedInputs(query.q, d, None, cu_d, query.q_mask, 5, False, True, query.q_scale, d_scale)),
        False))
    _assert_same_launches(stand_ins, full, (query.q, query.q_mask, query.q_scale, d, cu_d, d_scale))


def test_calls_that_copy_an_argument_are_never_replayed(stand_ins, rng):
    Q, D = _problem(rng, 5, 16), _problem(rng, 3, 7, 16)
    int_mask = (torch.rand(3, 7, generator=rng) > 0.5).to(torch.int64)  # turned bool by the checks, per call
    for _ in range(2):
        lik.maxsim(Q, D, d_mask=int_mask)
    rows = _problem(rng, 2, 9, 32)[:, :7]  # rows no [14, 32] view holds: copied before they are quantized
    for _ in range(2):
        lik.quantize(rows, torch.int8)
    assert list(replay_module.CALLS.values()) == [_replay.NEVER] and not stand_ins
    assert list(quantization.QUANTIZATIONS.values()) == [_replay.NEVER]


def test_bad_input_is_refused_and_not_recorded(stand_ins, rng):
    Q, D = _problem(rng, 5, 16), _problem(rng, 3, 7, 16)
    with pytest.raises(ValueError, match="d_mask"):
        lik.maxsim(Q, D, d_mask=torch.ones(3, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask_mode"):
        lik.maxsim(Q, D, mask_mode="max")
    with pytest.raises(ValueError, match="backward"):
        lik.maxsim(Q, D, backward="slow")
    assert replay_module.CALLS == {} and _launch.WATCH is None


def test_no_replay_key_off_the_gpu_or_for_what_is_not_a_tensor():
    Q, D = torch.randn(4, 8), torch.randn(3, 5, 8)
    assert replay_module.call_key(Q, D, None, None, "exclude", "auto", None, None) is None
    assert replay_module.key_of(Q, [[1.0]], None, None, "exclude", "auto", None, None) is None
    assert replay_module.key_of(Q, D, [True], None, "exclude", "auto", None, None) is None


def test_the_key_gate_follows_what_the_launch_cache_replays(monkeypatch):
    """A CUDA call has a key only where the launch cache replays Triton's launcher: a Triton outside
    ``TESTED_TRITON`` (as CI installs), a launch hook or a forced config give every call the full path."""
    from lik.config import MaxSimBackwardConfig, override

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # no GPU needed to ask the gate
    monkeypatch.setattr(replay_module, "current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_get_stream", lambda device: 0)
    monkeypatch.setattr(_launch, "_hooks_installed", lambda: False)
    monkeypatch.setattr(_launch, "ENABLED", True)
    args = (torch.randn(4, 8), torch.randn(3, 5, 8), None, None, "exclude", "auto", None, None)
    assert replay_module.call_key(*args) == replay_module.key_of(*args) is not None
    with override(maxsim_backward=MaxSimBackwardConfig(block_rows=16, block_k=32)):
        assert replay_module.call_key(*args) is None
    monkeypatch.setattr(_launch, "_hooks_installed", lambda: True)
    assert replay_module.call_key(*args) is None
    monkeypatch.setattr(_launch, "_hooks_installed", lambda: False)
    monkeypatch.setattr(_launch, "ENABLED", _launch.triton_version_tested("3.7.0"))  # an untested release
    assert replay_module.call_key(*args) is None


def test_the_key_separates_what_changes_a_call(stand_ins):
    Q, D = torch.randn(4, 8), torch.randn(3, 5, 8)
    key = replay_module.key_of(Q, D, None, None, "exclude", "auto", None, None)
    assert key != replay_module.key_of(Q, D, None, None, "zero", "auto", None, None)
    assert key != replay_module.key_of(Q, D, None, None, "exclude", "fast", None, None)
    assert key != replay_module.key_of(Q.requires_grad_(), D, None, None, "exclude", "auto", None, None)
    with torch.no_grad():  # without grad the same tensor has an inference key: only requires_grad differs
        assert replay_module.key_of(Q, D, None, None, "exclude", "auto", None, None)[3] is False
    torch.use_deterministic_algorithms(True)
    try:  # a training call's "auto" backward resolves to the flag, so the flag is in its key
        assert replay_module.key_of(Q, D, None, None, "exclude", "auto", None, None) != \
            replay_module.key_of(Q, D, None, None, "exclude", "deterministic", None, None)
    finally:
        torch.use_deterministic_algorithms(False)


def test_cpu_calls_record_nothing():
    Q, D = torch.randn(4, 8), torch.randn(3, 5, 8)
    before = dict(replay_module.CALLS)
    torch.testing.assert_close(lik.maxsim(Q, D).double(), lik.maxsim_reference(Q.double(), D.double()),
                               rtol=1e-5, atol=1e-5)
    assert replay_module.CALLS == before


# ---------------------------------------------------------------- GPU


@pytest.fixture
def fresh_tables(monkeypatch):
    table = {}
    monkeypatch.setattr(replay_module, "CALLS", table)
    monkeypatch.setattr(function, "CALLS", table)
    monkeypatch.setattr(quantization, "QUANTIZATIONS", {})
    return table


def _counting_full_path(monkeypatch):
    """Count the full path's forward launches (a replay does not go through launch_forward)."""
    calls = []
    real = function.launch_forward

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(function, "launch_forward", counted)
    return calls


def _without_replays(run, *args, **kwargs):
    """``run(*args, **kwargs)`` on the full path, launched through Triton's own ``kernel[grid](...)``."""
    saved = _launch.ENABLED
    _launch.ENABLED = False  # lik._replay.allowed() is False: no key
    try:
        return run(*args, **kwargs)
    finally:
        _launch.ENABLED = saved


def _unit(*shape, dtype=torch.float16):
    return torch.nn.functional.normalize(torch.randn(*shape, device="cuda"), dim=-1).to(dtype)


def _gpu_cases():
    def fp16_2d():
        return (_unit(32, 128), _unit(50, 70, 128)), {}

    def masked_3d_zero():
        d_mask = torch.rand(50, 70, device="cuda") > 0.3
        q_mask = torch.rand(3, 32, device="cuda") > 0.2
        return (_unit(3, 32, 128), _unit(50, 70, 128), q_mask, d_mask), {"mask_mode": "zero"}

    def per_query_bf16():
        return (_unit(2, 16, 64, dtype=torch.bfloat16), _unit(2, 9, 40, 64, dtype=torch.bfloat16)), {}

    def long_query_fp32():
        return (_unit(300, 96, dtype=torch.float32), _unit(20, 130, 96, dtype=torch.float32)), {}

    def int8_with_scales():
        q, qs = lik.quantize(_unit(2, 40, 128), torch.int8)
        d, ds = lik.quantize(_unit(30, 260, 128), torch.int8)
        return (q, d), {"q_scale": qs, "d_scale": ds}

    def fp8_long_query():
        q, qs = lik.quantize(_unit(1024, 128), torch.float8_e4m3fn)
        d, ds = lik.quantize(_unit(8, 1024, 128), torch.float8_e4m3fn)
        return (q, d), {"q_scale": qs, "d_scale": ds}

    def strided_documents():
        return (_unit(32, 64), _unit(40, 50, 128)[..., :64]), {}

    def float_query_int8_corpus():
        d, ds = lik.quantize(_unit(30, 260, 128), torch.int8)
        return (_unit(32, 128), d), {"d_scale": ds}

    def fp8_float_queries_with_masks():
        d, ds = lik.quantize(_unit(30, 100, 128), torch.float8_e4m3fn)
        q = _unit(3, 40, 256, dtype=torch.bfloat16)[..., :128]  # rows strided in memory, still one view
        return (q, d, torch.rand(3, 40, device="cuda") > 0.2), {"d_scale": ds}

    return [fp16_2d, masked_3d_zero, per_query_bf16, long_query_fp32, int8_with_scales, fp8_long_query,
            strided_documents, float_query_int8_corpus, fp8_float_queries_with_masks]


@pytest.mark.gpu
@pytest.mark.parametrize("build", _gpu_cases(), ids=lambda f: f.__name__)
def test_gpu_repeated_inference_replays_with_the_full_paths_bits(build, monkeypatch, fresh_tables):
    if "fp8" in build.__name__ and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs compute capability >= 8.9")
    full_launches = _counting_full_path(monkeypatch)
    args, kwargs = build()
    first = lik.maxsim(*args, **kwargs)
    assert len(full_launches) == 1 and len(fresh_tables) == 1 and _replay.NEVER not in fresh_tables.values()
    for _ in range(2):  # new tensors, same shapes: replayed
        args, kwargs = build()
        before = len(full_launches)
        with torch.no_grad():
            got = lik.maxsim(*args, **kwargs)
        assert len(full_launches) == before
        want = _without_replays(lik.maxsim, *args, **kwargs)
        assert got.shape == want.shape == first.shape and got.dtype == torch.float32
        assert torch.equal(got, want)


def _training_step(Q, D, d_mask, backward, grad):
    Q, D = Q.clone().requires_grad_(), D.clone().requires_grad_()
    scores = lik.maxsim(Q, D, d_mask=d_mask, backward=backward)
    scores.backward(grad)
    return scores.detach(), Q.grad, D.grad


@pytest.mark.gpu
@pytest.mark.parametrize("backward", ["fast", "deterministic"])
@pytest.mark.parametrize("shape", ["colbert", "chunked"])
def test_gpu_repeated_training_replays_forward_and_backward_with_the_full_paths_bits(backward, shape, monkeypatch,
                                                                                     fresh_tables):
    """The forward's scores, dQ and the deterministic dD are bitwise the full path's. The fast dD adds by atomics,
    in an order that changes between runs: it is compared bitwise where each document row gets one contribution
    (one-token queries against per-query documents), else to a tight tolerance."""
    full_launches = _counting_full_path(monkeypatch)
    if shape == "colbert":
        dims = (16, 32, 128), (40, 64, 128)
    else:  # the fast dD through its buffer in chunks; one-token queries: one contribution per document row
        dims = (64, 1, 128), (64, 20, 32, 128)
        monkeypatch.setattr(maxsim_config, "_maxsim_backward_heuristic", lambda block_d, interpreted: (
            maxsim_config.MaxSimBackwardConfig(block_rows=32, block_k=128, atomic_workspace_bytes=1 << 20,
                                               sort_workspace_entries=64 * 5)))
    for step in range(3):
        Q, D = _unit(*dims[0]), _unit(*dims[1])
        grad = torch.randn(dims[0][0], dims[1][-3], device="cuda")
        before = len(full_launches)
        got = _training_step(Q, D, None, backward, grad)
        assert len(full_launches) == before + (step == 0)  # a replay does not take the full path
        want = _without_replays(_training_step, Q, D, None, backward, grad)
        exact = backward == "deterministic" or shape == "chunked"
        for i, (a, b) in enumerate(zip(got, want)):
            assert a.shape == b.shape and a.dtype == b.dtype
            if exact or i < 2:  # scores and dQ (a gather) are always bitwise
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    (recorded,) = fresh_tables.values()
    assert type(recorded) is Training and set(recorded.backward) == {(True, True)}


@pytest.mark.gpu
def test_gpu_repeated_quantize_replays_with_the_full_paths_bits(fresh_tables):
    for dtype in (torch.int8, torch.float8_e4m3fn):
        if dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
            continue
        for _ in range(3):
            x = torch.randn(7, 33, 96, device="cuda", dtype=torch.bfloat16)
            got = lik.quantize(x, dtype)
            want = _without_replays(lik.quantize, x, dtype)
            assert all(torch.equal(a.view(torch.uint8) if a.dtype == dtype else a,
                                   b.view(torch.uint8) if b.dtype == dtype else b) for a, b in zip(got, want))
    assert len(quantization.QUANTIZATIONS) == 2 and _replay.NEVER not in quantization.QUANTIZATIONS.values()


@pytest.mark.gpu
def test_gpu_a_misaligned_view_or_new_matmul_precision_is_a_new_key(monkeypatch, fresh_tables):
    full_launches = _counting_full_path(monkeypatch)
    Q, D = _unit(32, 128, dtype=torch.float32), _unit(20, 64, 128, dtype=torch.float32)
    lik.maxsim(Q, D)
    flat = torch.cat([D.new_zeros(1), D.flatten()])
    misaligned = flat[1:].view(D.shape)  # same shape and strides, address off by 4 bytes
    before = len(full_launches)
    got = lik.maxsim(Q, misaligned)
    assert len(full_launches) == before + 1 and torch.equal(got, _without_replays(lik.maxsim, Q, misaligned))
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if saved == "highest" else "highest")
    try:
        before = len(full_launches)
        got = lik.maxsim(Q, D)
        assert len(full_launches) == before + 1
        want = _without_replays(lik.maxsim, Q, D)
    finally:
        torch.set_float32_matmul_precision(saved)
    assert torch.equal(got, want)
    assert len(fresh_tables) == 3 and _replay.NEVER not in fresh_tables.values()


@pytest.mark.gpu
def test_gpu_forced_configs_hooks_and_bad_input_skip_the_replay(monkeypatch, fresh_tables):
    from lik import config

    full_launches = _counting_full_path(monkeypatch)
    Q, D = _unit(32, 128), _unit(50, 70, 128)
    lik.maxsim(Q, D)
    assert len(fresh_tables) == 1
    forced = config.maxsim_forward_config(q_len=32, n_queries=1, dim=128, dtype=torch.float16, per_query=False,
                                          device=Q.device, doc_len=70)
    with config.override(maxsim_forward=forced):
        assert torch.equal(lik.maxsim(Q, D), _without_replays(lik.maxsim, Q, D))
    assert len(full_launches) == 3 and len(fresh_tables) == 1
    with pytest.raises(ValueError, match="d_mask"):  # a recorded shape does not settle another argument's checks
        lik.maxsim(Q, D, d_mask=torch.ones(50, 71, dtype=torch.bool, device="cuda"))
    with pytest.raises(ValueError, match="mask_mode"):
        lik.maxsim(Q, D, mask_mode="max")
    with recorded_launches() as seen:
        if seen is None:
            return  # Triton without HookChain launch hooks
        lik.maxsim(Q, D)
    assert len(seen) == 1  # a profiler's hook sees the launch: the full path took it


@pytest.mark.gpu
def test_gpu_packed_chunks_replay_with_the_full_paths_bits(monkeypatch):
    from lik.ops.maxsim import packed_function

    monkeypatch.setattr(packed_function, "PACKED_CALLS", {})
    for eight_bit in (False, True):
        for _ in range(3):
            d, cu_d, _ = lik.pack([_unit(n, 128) for n in (300, 57, 512, 0, 130)])
            d_scale = None
            if eight_bit:
                d, d_scale = lik.quantize(d, torch.int8)
            query = packed_function.packed_query(_unit(2, 32, 128), torch.rand(2, 32, device="cuda") > 0.1, d.dtype)
            got = packed_function.score_packed(query, d, cu_d.cuda(), d_scale)
            want = _without_replays(packed_function.score_packed, query, d, cu_d.cuda(), d_scale)
            assert got.shape == want.shape == (2, 5) and torch.equal(got, want)
    assert len(packed_function.PACKED_CALLS) == 2 and _replay.NEVER not in packed_function.PACKED_CALLS.values()
