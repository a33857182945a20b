"""Replays of recorded eager inference launches of ``lik.maxsim``: which arguments a recorded launch reads from
which tensor, which calls are declined, what is remembered; on the GPU, that repeated calls take the replay and
give the full path's scores bit for bit, and that every call a replay could get wrong keeps the full path."""

from __future__ import annotations

import pytest
import torch

import lik
from lik import _launch
from lik.ops.maxsim import replay as replay_module
from lik.ops.maxsim.replay import recorder, replay, replay_key

from ...launch_hooks import recorded_launches


@pytest.fixture
def fresh_replays(monkeypatch):
    table = {}
    monkeypatch.setattr(replay_module, "REPLAYS", table)
    # function.py imported the name: patch its reference too
    monkeypatch.setattr(lik.ops.maxsim.function, "REPLAYS", table)
    return table


def _stand_in_replay(monkeypatch, calls):
    launches = []

    def replay_of(kernel, grid, *args, **options):
        launches.append((grid, args, options))
        return lambda *addresses: calls.append(addresses)

    monkeypatch.setattr(replay_module, "replay_of", replay_of)
    return launches


def test_recorded_slots_name_the_callers_tensors_the_buffer_and_the_values(monkeypatch, fresh_replays):
    calls = []
    launches = _stand_in_replay(monkeypatch, calls)
    Q, D = torch.randn(4, 8), torch.randn(3, 5, 8)
    d_mask = torch.ones(3, 5, dtype=torch.bool)
    tensors = (Q, D, None, d_mask, None, None)
    partial = torch.empty(2, 1, 3)
    args = (Q.unsqueeze(0), D.unsqueeze(0), Q, d_mask.view(torch.uint8), partial, partial, 7, 0)
    recorder("key", tensors, True)((12,), args, {"DIM": 8}, partial)
    assert launches == [((12,), args, {"DIM": 8})]
    launch, slots, partial_shape, squeeze, query = fresh_replays["key"]
    assert slots == (0, 1, 0, 3, -1, -1, (7,), (0,)) and partial_shape == (2, 1, 3) and squeeze and query is None
    # A replay reads the new call's addresses in the recorded order, and a buffer of its own.
    Q2, D2, m2 = torch.randn(4, 8), torch.randn(3, 5, 8), torch.ones(3, 5, dtype=torch.bool)
    scores = replay("key", (Q2, D2, None, m2, None, None))
    (addresses,) = calls
    assert addresses[:4] == (Q2.data_ptr(), D2.data_ptr(), Q2.data_ptr(), m2.data_ptr())
    assert addresses[4] == addresses[5] and addresses[4] not in (Q2.data_ptr(), D2.data_ptr())
    assert addresses[6:] == (7, 0)
    assert scores.shape == (3,) and scores.dtype == torch.float32  # squeezed [1, B] -> [B], summed over 2 chunks


def test_a_launch_given_a_tensor_of_its_own_is_never_replayed(monkeypatch, fresh_replays):
    launches = _stand_in_replay(monkeypatch, [])
    Q, D = torch.randn(4, 8), torch.randn(3, 5, 8)
    partial = torch.empty(1, 1, 3)
    made = torch.randn(1, 4, 8)  # e.g. a copy of strided rows
    recorder("key", (Q, D, None, None, None, None), False)((3,), (made, D, partial), {}, partial)
    assert fresh_replays == {"key": None} and launches == []
    assert replay("key", (Q, D, None, None, None, None)) is None


def _stand_in_quantization(monkeypatch, calls, recorded=True):
    """quantize_rows_replay stand-in: what it was asked for, and a replay that files its addresses in ``calls``."""
    asked = []

    def quantize_rows_replay(rows, q, q_scale):
        asked.append((rows, q, q_scale))
        return (lambda *arguments: calls.append(("quantize", arguments)), (7, 8, 8, 8)) if recorded else None

    monkeypatch.setattr(replay_module, "quantize_rows_replay", quantize_rows_replay)
    return asked


def test_a_float_query_quantized_for_an_8bit_corpus_is_recorded_and_quantized_again_on_replay(
        monkeypatch, fresh_replays):
    calls = []
    launches = _stand_in_replay(monkeypatch, calls)
    asked = _stand_in_quantization(monkeypatch, calls)
    Q = torch.randn(7, 8)  # float query of a 2-D call
    D, d_scale = lik.quantize(torch.randn(3, 5, 8), torch.int8)
    q, q_scale = lik.quantize(Q.unsqueeze(0), torch.int8)  # what MaxSimInputs.build made: [1, 7, 8], [1, 7]
    tensors = (Q, D, None, None, None, d_scale)
    partial = torch.empty(1, 1, 3)
    args = (q, D, q_scale, d_scale.unsqueeze(0), partial, 7)
    recorder("key", tensors, True, (q, q_scale))((3,), args, {}, partial)
    assert len(launches) == 1
    (rows, q_rows, scale_rows), = asked
    assert rows.data_ptr() == Q.data_ptr() and rows.shape == (7, 8)  # the caller's rows, not a copy
    assert q_rows.shape == (7, 8) and q_rows.data_ptr() == q.data_ptr() and scale_rows.shape == (7,)
    _, slots, _, squeeze, (quantize, ints, shape, dtype) = fresh_replays["key"]
    assert slots == (-2, 1, -3, 5, -1, (7,)) and squeeze
    assert ints == (7, 8, 8, 8) and shape == (1, 7, 8) and dtype == torch.int8
    # A replay quantizes the new query into buffers of its own, then scores with those buffers.
    Q2 = torch.randn(7, 8)
    D2, d_scale2 = lik.quantize(torch.randn(3, 5, 8), torch.int8)
    scores = replay("key", (Q2, D2, None, None, None, d_scale2))
    (kind, (x, q_new, scale_new, *rest)), scored = calls
    assert kind == "quantize" and x == Q2.data_ptr() and tuple(rest) == (7, 8, 8, 8)
    assert scored[0] == q_new and scored[2] == scale_new and q_new != scale_new
    assert scored[1] == D2.data_ptr() and scored[3] == d_scale2.data_ptr() and scored[5] == 7
    assert scored[4] not in (q_new, scale_new, Q2.data_ptr()) and scores.shape == (3,)


def test_a_float_query_whose_rows_are_copied_or_whose_quantization_was_not_recorded_is_not_replayed(
        monkeypatch, fresh_replays):
    launches = _stand_in_replay(monkeypatch, [])
    partial = torch.empty(1, 2, 3)
    D, d_scale = lik.quantize(torch.randn(3, 5, 8), torch.int8)
    # Two queries of 7 tokens cut from rows of 9: their 14 rows are no view of one matrix, so they are copied.
    Q = torch.randn(2, 9, 8)[:, :7]
    q, q_scale = lik.quantize(Q, torch.int8)
    asked = _stand_in_quantization(monkeypatch, [])
    args = (q, D, q_scale, d_scale.unsqueeze(0), partial)
    recorder("copied", (Q, D, None, None, None, d_scale), False, (q, q_scale))((3,), args, {}, partial)
    assert fresh_replays == {"copied": None} and asked == [] and launches == []
    # A view, but the quantization's launch went through Triton's own path: nothing to replay it with.
    Q = torch.randn(2, 7, 8)
    q, q_scale = lik.quantize(Q, torch.int8)
    asked = _stand_in_quantization(monkeypatch, [], recorded=False)
    args = (q, D, q_scale, d_scale.unsqueeze(0), partial)
    recorder("unrecorded", (Q, D, None, None, None, d_scale), False, (q, q_scale))((3,), args, {}, partial)
    assert fresh_replays["unrecorded"] is None and len(asked) == 1
    assert replay("unrecorded", (Q, D, None, None, None, d_scale)) is None


def test_arguments_sharing_an_address_are_not_recorded(monkeypatch, fresh_replays):
    launches = _stand_in_replay(monkeypatch, [])
    D = torch.randn(3, 5, 8)
    Q = D[0]  # a view of D's first document: one address, two arguments
    partial = torch.empty(1, 1, 3)
    recorder("key", (Q, D, None, None, None, None), False)((3,), (Q, D, partial), {}, partial)
    assert fresh_replays == {} and launches == []


def test_nothing_is_recorded_when_the_launch_went_through_triton(monkeypatch, fresh_replays):
    monkeypatch.setattr(replay_module, "replay_of", lambda *a, **k: None)
    Q, D = torch.randn(4, 8), torch.randn(3, 5, 8)
    partial = torch.empty(1, 1, 3)
    recorder("key", (Q, D, None, None, None, None), False)((3,), (Q, D, partial), {}, partial)
    assert fresh_replays == {}


def test_replays_are_bounded(monkeypatch, fresh_replays):
    _stand_in_replay(monkeypatch, [])
    Q, D = torch.randn(4, 8), torch.randn(3, 5, 8)
    partial = torch.empty(1, 1, 3)
    for i in range(_launch.REPLAY_LIMIT + 1):
        recorder(i, (Q, D, None, None, None, None), False)((3,), (Q, D, partial), {}, partial)
    assert len(fresh_replays) == 1 and _launch.REPLAY_LIMIT in fresh_replays


def test_no_replay_key_off_the_gpu_or_for_what_is_not_a_tensor():
    Q, D = torch.randn(4, 8), torch.randn(3, 5, 8)
    assert replay_key(Q, D, None, None, "exclude", "auto", None, None) is None
    assert replay_key([[1.0]], D, None, None, "exclude", "auto", None, None) is None


def test_cpu_calls_record_nothing(fresh_replays):
    Q, D = torch.randn(4, 8), torch.randn(3, 5, 8)
    want = lik.maxsim_reference(Q.double(), D.double())
    torch.testing.assert_close(lik.maxsim(Q, D).double(), want, rtol=1e-5, atol=1e-5)
    assert fresh_replays == {}


# ---------------------------------------------------------------- GPU


def _counting_forward(monkeypatch):
    """Count the full path's forward launches (a replay does not go through maxsim_forward)."""
    from lik.ops.maxsim import function

    calls = []
    real = function.maxsim_forward

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(function, "maxsim_forward", counted)
    return calls


def _full_path(*args, **kwargs):
    """The same call through the full path (no replay key)."""
    with torch.no_grad():
        saved = _launch.ENABLED
        _launch.ENABLED = False  # replay_allowed() is False: no key, Triton's own launch path
        try:
            return lik.maxsim(*args, **kwargs)
        finally:
            _launch.ENABLED = saved


def _unit(*shape, dtype=torch.float16):
    return torch.nn.functional.normalize(torch.randn(*shape, device="cuda"), dim=-1).to(dtype)


def _cases():
    """(name, build) pairs; build() returns (args, kwargs) of a fresh call with the same shapes each time."""

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

    def float_query_int8_corpus():  # the query is quantized per call, in the replay too
        d, ds = lik.quantize(_unit(30, 260, 128), torch.int8)
        return (_unit(32, 128), d), {"d_scale": ds}

    def fp8_float_queries_with_masks():
        d, ds = lik.quantize(_unit(30, 100, 128), torch.float8_e4m3fn)
        q = _unit(3, 40, 256, dtype=torch.bfloat16)[..., :128]  # rows strided in memory, still one view
        return (q, d, torch.rand(3, 40, device="cuda") > 0.2), {"d_scale": ds}

    return [fp16_2d, masked_3d_zero, per_query_bf16, long_query_fp32, int8_with_scales, fp8_long_query,
            strided_documents, float_query_int8_corpus, fp8_float_queries_with_masks]


@pytest.mark.gpu
@pytest.mark.parametrize("build", _cases(), ids=lambda f: f.__name__)
def test_gpu_repeated_calls_replay_with_the_full_paths_scores(build, monkeypatch, fresh_replays):
    if "fp8" in build.__name__ and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs compute capability >= 8.9")
    full_launches = _counting_forward(monkeypatch)
    args, kwargs = build()
    first = lik.maxsim(*args, **kwargs)
    assert len(full_launches) == 1 and len(fresh_replays) == 1 and None not in fresh_replays.values()
    for _ in range(2):  # new tensors, same shapes: replayed
        args, kwargs = build()
        before = len(full_launches)
        got = lik.maxsim(*args, **kwargs)
        assert len(full_launches) == before
        want = _full_path(*args, **kwargs)
        assert got.shape == want.shape == first.shape and got.dtype == torch.float32
        assert torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_calls_that_make_a_tensor_of_their_own_keep_the_full_path(monkeypatch, fresh_replays):
    full_launches = _counting_forward(monkeypatch)
    d, ds = lik.quantize(_unit(30, 100, 128), torch.int8)
    Q = _unit(32, 128)
    cut = _unit(2, 40, 128)[:, :32]  # two queries' rows that no [64, 128] view holds: copied before quantizing
    int_mask = (torch.rand(30, 100, device="cuda") > 0.5).to(torch.int64)  # turned bool per call
    D = _unit(30, 100, 128)
    for args, kwargs in (((cut, d), {"d_scale": ds}), ((Q, D), {"d_mask": int_mask})):
        for _ in range(2):
            before = len(full_launches)
            got = lik.maxsim(*args, **kwargs)
            assert len(full_launches) == before + 1
            assert torch.equal(got, _full_path(*args, **kwargs))
    assert list(fresh_replays.values()) == [None, None]


@pytest.mark.gpu
def test_gpu_a_misaligned_view_or_new_matmul_precision_is_a_new_key(monkeypatch, fresh_replays):
    full_launches = _counting_forward(monkeypatch)
    Q, D = _unit(32, 128, dtype=torch.float32), _unit(20, 64, 128, dtype=torch.float32)
    lik.maxsim(Q, D)
    flat = torch.cat([D.new_zeros(1), D.flatten()])
    misaligned = flat[1:].view(D.shape)  # same shape and strides, address off by 4 bytes
    before = len(full_launches)
    got = lik.maxsim(Q, misaligned)
    assert len(full_launches) == before + 1 and torch.equal(got, _full_path(Q, misaligned))
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if saved == "highest" else "highest")
    try:
        before = len(full_launches)
        got = lik.maxsim(Q, D)
        assert len(full_launches) == before + 1
        want = _full_path(Q, D)
    finally:
        torch.set_float32_matmul_precision(saved)
    assert torch.equal(got, want)
    assert len(fresh_replays) == 3 and None not in fresh_replays.values()


@pytest.mark.gpu
def test_gpu_gradients_forced_configs_hooks_and_bad_input_skip_the_replay(monkeypatch, fresh_replays):
    import lik._config as config

    full_launches = _counting_forward(monkeypatch)
    Q, D = _unit(32, 128), _unit(50, 70, 128)
    lik.maxsim(Q, D)
    assert len(fresh_replays) == 1
    # A gradient: the autograd path (its forward stores winners), never a replay, nothing recorded.
    Qg = Q.clone().requires_grad_()
    assert replay_key(Qg, D, None, None, "exclude", "auto", None, None) is None
    with torch.no_grad():  # without grad the same tensor may replay: its key is an inference key
        assert replay_key(Qg, D, None, None, "exclude", "auto", None, None) is not None
    lik.maxsim(Qg, D).sum().backward()
    assert Qg.grad is not None and Qg.grad.abs().sum() > 0 and len(fresh_replays) == 1
    assert len(full_launches) == 2
    # A forced config: the full path, nothing recorded.
    forced = config.maxsim_forward_config(q_len=32, n_queries=1, dim=128, dtype=torch.float16, per_query=False,
                                          device=Q.device, doc_len=70)
    with config.override(maxsim_forward=forced):
        torch.testing.assert_close(lik.maxsim(Q, D), _full_path(Q, D), rtol=0, atol=0)
    assert len(full_launches) == 4 and len(fresh_replays) == 1
    # Bad input with a recorded shape is still refused by name.
    with pytest.raises(ValueError, match="d_mask"):
        lik.maxsim(Q, D, d_mask=torch.ones(50, 71, dtype=torch.bool, device="cuda"))
    with pytest.raises(ValueError, match="mask_mode"):
        lik.maxsim(Q, D, mask_mode="max")
    with recorded_launches() as seen:
        if seen is None:
            return  # Triton without HookChain launch hooks
        lik.maxsim(Q, D)
    assert len(seen) == 1  # a profiler's hook sees the launch: the full path took it
