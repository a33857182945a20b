"""``lik._launch``: the cached launch path must pick exactly the kernel Triton's binder would, launch with the
same arguments, and step aside (Triton's own path) wherever it cannot be sure."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from lik import _launch
from lik._launch import (
    _record, _Uncached, argument_key, argument_keyer, cache_key, keyword_layout, launch, replay_allowed, replay_of,
    triton_version_tested,
)


def _scale_rows(x_ptr, out_ptr, n, stride, factor, BLOCK: tl.constexpr, NEGATE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs * stride, mask=offs < n, other=0.0)
    y = x * factor
    if NEGATE:
        y = -y
    tl.store(out_ptr + offs, y, mask=offs < n)


scale_rows = triton.jit(_scale_rows)


# --- argument keys (CPU) ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, code",
    [(0, 2), (1, 1), (2, 0), (16, 2), (17, 0), (-16, 2), (2**31 - 1, 0), (2**31, 6), (-(2**31), 2),
     (-(2**31) - 1, 4), (2**63, 14), (2**63 + 1, 12)],
)
def test_int_key_separates_what_triton_specialises(value, code):
    # bit 0: == 1, bit 1: % 16 == 0, bit 2: outside int32, bit 3: >= 2**63 (uint64)
    assert argument_key(value) == code


def test_tensor_key_is_dtype_alignment_and_device():
    x = torch.zeros(64, dtype=torch.float16)
    assert argument_key(x) == (torch.float16, True, False)
    assert argument_key(x[1:]) == (torch.float16, False, False)  # 2 bytes past a 16-byte boundary
    assert argument_key(x[8:]) == (torch.float16, True, False)
    assert argument_key(x.float()) == (torch.float32, x.float().data_ptr() % 16 == 0, False)


def test_keyer_of_a_type_layout_gives_every_arguments_key_and_the_launchers_arguments():
    """The generated keyer of a type layout equals argument_key argument by argument, for every kind of value,
    and passes every argument on as given except tensors, which become their addresses; a layout with a type
    argument_key refuses has no keyer."""
    x = torch.zeros(64, dtype=torch.float16)
    values = [x, x[1:], x[8:].float(), torch.nn.Parameter(torch.zeros(3)), 1, 0, -16, 32, 7, 2**31 - 1, 2**31,
              -(2**31), -(2**31) - 1, 2**63, 2**64 + 16, True, False, 0.5, None]
    keyer = argument_keyer(tuple(map(type, values)))
    keys, passed = keyer(tuple(values))
    assert keys == tuple(map(argument_key, values))
    expected = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values]
    assert list(passed) == expected and all(type(p) is type(e) for p, e in zip(passed, expected))
    assert passed[1] == x.data_ptr() + 2
    assert argument_keyer(())(()) == ((), ())
    assert argument_keyer((torch.Tensor, np.int64)) is None and argument_keyer((str,)) is None


def test_int_keys_are_remembered_within_a_bound(monkeypatch):
    """Int keys come from a memo of computed keys; it gives the computed key for remembered and new values alike
    and stops growing at its bound."""
    memo = _launch._INT_KEYS  # the generated keyers hold this very dict
    saved = dict(memo)
    memo.clear()
    monkeypatch.setattr(_launch, "_INT_KEYS_MAX", 8)
    try:
        keyer = argument_keyer((int,))
        for value in [*range(-3, 20), 2**31, 2**63, 1, 16, 2**31]:
            expected = ((value == 1) | ((value % 16) == 0) << 1 | (not -(2**31) <= value < 2**31) << 2
                        | (value >= 2**63) << 3)
            assert keyer((value,))[0] == (expected,)
            assert _launch._int_key(value) == expected
        assert list(memo) == list(range(-3, 5))
    finally:
        memo.clear()
        memo.update(saved)


def test_other_keys():
    assert argument_key(True) == ("bool", True) != argument_key(1)
    assert argument_key(False) == ("bool", False) != argument_key(0)
    assert argument_key(0.5) is float
    assert argument_key(None) is None
    with pytest.raises(_Uncached):
        argument_key(np.int64(3))  # a numpy int: Triton's path handles it, the cache does not key it
    with pytest.raises(_Uncached):
        argument_key("text")


class _Compiled:
    run, function, packed_metadata = print, 7, (1, 2)


def test_record_fills_trailing_constexprs_from_kwargs_and_defaults():
    kernel = JITFunction(_scale_rows)
    run, function, packed, tail = _record(kernel, _Compiled(), (1, 2, 3, 4, 5.0), {"BLOCK": 64, "num_warps": 4})
    assert (run, function, packed) == (print, 7, (1, 2))
    assert tail == (64, False)  # BLOCK from kwargs, NEGATE's default; num_warps is an option, not a parameter
    assert _record(kernel, _Compiled(), (1, 2, 3, 4, 5.0), {"BLOCK": 64, "NEGATE": True})[3] == (64, True)


def test_record_refuses_what_it_cannot_replay_by_position():
    kernel = JITFunction(_scale_rows)
    # a constexpr passed by position: its value would be keyed only by its int class
    assert _record(kernel, _Compiled(), (1, 2, 3, 4, 5.0, 64), {}) is None
    # a runtime argument passed by keyword: it would be frozen into the replayed tail
    assert _record(kernel, _Compiled(), (1, 2, 3, 4), {"factor": 5.0, "BLOCK": 64}) is None
    # a constexpr without a default left out
    assert _record(kernel, _Compiled(), (1, 2, 3, 4, 5.0), {}) is None
    # a compiled kernel without the launcher attributes
    assert _record(kernel, object(), (1, 2, 3, 4, 5.0), {"BLOCK": 64}) is None


def test_record_refuses_a_kernel_compiled_with_other_options():
    kernel = JITFunction(_scale_rows)

    class Compiled(_Compiled):
        metadata = type("Metadata", (), {"num_warps": 8, "num_stages": 3, "maxnreg": None})()

    args, kwargs = (1, 2, 3, 4, 5.0), {"BLOCK": 64, "num_warps": 8, "maxnreg": None}
    assert _record(kernel, Compiled(), args, kwargs, ("num_warps", "maxnreg")) is not None
    assert _record(kernel, Compiled(), args, {**kwargs, "num_warps": 4}, ("num_warps", "maxnreg")) is None
    assert _record(kernel, Compiled(), args, {**kwargs, "num_ctas": 2}, ("num_warps", "num_ctas")) is None


# --- the key names the launch configuration explicitly (CPU) ---------------------------------------------------


def test_keyword_layout_names_constexprs_in_order_then_every_key_option():
    kernel = JITFunction(_scale_rows)
    constexprs, options = keyword_layout(kernel, ("num_stages", "NEGATE", "num_warps", "BLOCK"))
    assert constexprs == ("BLOCK", "NEGATE")  # declaration order, whatever the call's order
    assert options == (("num_warps", True), ("num_stages", True), ("maxnreg", False), ("num_ctas", False))
    # Another Triton option is named after the four; a keyword that is neither makes the call uncached.
    assert keyword_layout(kernel, ("BLOCK", "enable_fp_fusion"))[1][-1] == ("enable_fp_fusion", True)
    assert keyword_layout(kernel, ("BLOCK", "factor")) is None  # a runtime parameter by keyword
    assert keyword_layout(kernel, ("BLOCK", "num_wraps")) is None  # a typo


def test_cache_key_separates_every_launch_option_and_ignores_keyword_order():
    kernel = JITFunction(_scale_rows)
    args = (torch.zeros(4), torch.zeros(4), 4, 1, 1.0)
    base = {"BLOCK": 64, "num_warps": 4, "num_stages": 2, "maxnreg": None}
    key = cache_key(kernel, 0, args, base)
    assert key == cache_key(kernel, 0, args, dict(reversed(base.items())))
    others = [{**base, "num_warps": 8}, {**base, "num_stages": 3}, {**base, "maxnreg": 128}, {**base, "BLOCK": 32},
              {**base, "NEGATE": True}, {"BLOCK": 64, "num_warps": 4, "num_stages": 2}]
    keys = [cache_key(kernel, 0, args, kw) for kw in others] + [cache_key(kernel, 1, args, base)]
    assert len({key, *keys}) == len(keys) + 1
    # An option left to Triton's default is not the same key as the same value passed (Triton's default may differ).
    assert cache_key(kernel, 0, args, {"BLOCK": 64}) != cache_key(kernel, 0, args, {"BLOCK": 64, "num_warps": 4})
    assert cache_key(kernel, 0, args, {"BLOCK": 64, "factor": 2.0}) is None


def _fake_cached_path(monkeypatch):
    """A JIT function whose compile step is a stand-in for Triton's (its compiled kernel's launcher records each
    call), with the cached path switched on as on a GPU: ``(kernel, runs, replays)``."""
    runs, replays = [], []

    class Metadata:
        num_warps, num_stages, maxnreg, num_ctas = 2, 1, None, 1

    class Compiled:
        function, packed_metadata, metadata = 11, (), Metadata()

        @staticmethod
        def run(*launch_args):
            replays.append(launch_args)

    class FakeJIT(JITFunction):
        def run(self, *args, grid, warmup, **kwargs):
            runs.append((grid, args, kwargs))
            return Compiled()

    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(_launch, "_get_stream", lambda device: 99)
    monkeypatch.setattr(_launch, "_hooks_installed", lambda: False)
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    return FakeJIT(_scale_rows), runs, replays


def test_cached_path_records_then_replays_with_the_callers_options(monkeypatch):
    """The whole cached path on CPU, with a stand-in for Triton's compiled kernel and launcher."""
    kernel, runs, replays = _fake_cached_path(monkeypatch)
    x, out = torch.zeros(32), torch.zeros(32)
    for _ in range(3):
        launch(kernel, (2,), x, out, 32, 1, 2.0, BLOCK=16, num_warps=2, num_stages=1)
    assert len(runs) == 1 and len(replays) == 2
    # Tensors reach the launcher as their addresses.
    assert replays[0] == (2, 1, 1, 99, 11, (), None, None, None, x.data_ptr(), out.data_ptr(), 32, 1, 2.0, 16, False)
    # Other options: a new key, so Triton's path runs (and here compiles with options the key does not match:
    # the record is refused and the kernel stays on Triton's path from then on).
    launch(kernel, (2,), x, out, 32, 1, 2.0, BLOCK=16, num_warps=4, num_stages=1)
    assert len(runs) == 2 and kernel._lik_launch_table.entries is None


@pytest.mark.parametrize("version, tested", [
    ("3.6.0", True), ("3.6.1", True), ("3.6.0+git5b4a9c1", True), ("3.5.1", False), ("3.7.0", False),
    ("3.60.0", False), ("4.6.0", False),
])
def test_version_gate(version, tested):
    assert triton_version_tested(version) is tested


def test_untested_triton_takes_tritons_path_with_one_notice(monkeypatch):
    calls = []

    class FakeJIT(JITFunction):
        def run(self, *args, grid, warmup, **kwargs):
            calls.append(grid)

    kernel = FakeJIT(_scale_rows)
    monkeypatch.setattr(_launch, "ENABLED", False)
    monkeypatch.setattr(_launch, "_NOTICE", "lik: Triton 9.9 is not among the versions ...")
    x = torch.zeros(4)
    with pytest.warns(RuntimeWarning, match="Triton 9.9") as record:
        launch(kernel, (1,), x, x, 4, 1, 1.0, BLOCK=16)
        launch(kernel, (1,), x, x, 4, 1, 1.0, BLOCK=16)
    assert len(record) == 1 and len(calls) == 2
    assert kernel._lik_launch_table.entries == {}  # nothing recorded


def test_interpreted_kernels_take_tritons_path(monkeypatch):
    if isinstance(scale_rows, JITFunction):
        pytest.skip("only meaningful under TRITON_INTERPRET=1 (the CPU test run)")
    x = torch.arange(10, dtype=torch.float32)
    out = torch.empty_like(x)
    launch(scale_rows, (1,), x, out, 10, 1, 2.0, BLOCK=16)
    assert torch.equal(out, 2 * x)
    assert scale_rows._lik_launch_table.entries is None


# --- the real launch path (GPU) --------------------------------------------------------------------------------


def _table(kernel):
    return kernel._lik_launch_table.entries


@pytest.mark.gpu
def test_cached_kernel_is_the_one_tritons_binder_picks():
    base = torch.randn(4096, device="cuda")
    cases = [  # (input view, n, stride, constexprs): alignment, n == 1, n % 16, stride 1 / 16 / other
        (base, 1000, 1, {}), (base, 1024, 1, {}), (base, 1, 1, {}), (base[1:], 1000, 1, {}),
        (base, 256, 16, {}), (base, 200, 3, {}), (base, 1024, 1, {"NEGATE": True}), (base.half(), 1000, 1, {}),
    ]
    for x, n, stride, flags in cases:
        for _ in range(2):  # first call records through Triton, second replays
            out = torch.zeros(n, device="cuda", dtype=x.dtype)
            launch(scale_rows, (triton.cdiv(n, 128),), x, out, n, stride, 2.0, BLOCK=128, num_warps=4, **flags)
            expected = 2 * x[: (n - 1) * stride + 1 : stride] * (-1 if flags else 1)
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
        key = cache_key(scale_rows, torch.cuda.current_device(), (x, out, n, stride, 2.0),
                        {"BLOCK": 128, "num_warps": 4, **flags})
        cached = _table(scale_rows)[key]
        chosen = scale_rows.warmup(x, out, n, stride, 2.0, BLOCK=128, num_warps=4, grid=(1,), **flags)
        assert cached[1] == chosen.function, (n, stride, flags)


@pytest.mark.gpu
def test_a_host_tensor_gets_tritons_error_not_a_launch():
    """The cached path hands addresses to the launcher without the driver query that rejects host memory, so a
    CPU tensor must never match a recorded key: it takes Triton's path, which refuses it."""
    x = torch.randn(256, device="cuda")
    out = torch.empty_like(x)
    launch(scale_rows, (2,), x, out, 256, 1, 1.0, BLOCK=128)
    launch(scale_rows, (2,), x, out, 256, 1, 1.0, BLOCK=128)  # replayed
    with pytest.raises((ValueError, RuntimeError), match="(?i)cpu"):
        launch(scale_rows, (2,), x.cpu(), out, 256, 1, 1.0, BLOCK=128)
    torch.cuda.synchronize()  # the context is still usable


def test_replay_of_a_recorded_launch_calls_the_same_launcher(monkeypatch):
    """``replay_of`` finds what ``launch`` recorded for the same key (nothing before the first launch, nothing for
    another key) and its ``Replay`` calls the compiled launcher with the recorded grid, the current stream, the
    addresses given and the recorded trailing constexprs."""
    kernel, runs, replays = _fake_cached_path(monkeypatch)
    x, out = torch.zeros(32), torch.zeros(32)
    assert replay_of(kernel, (2,), x, out, 32, 1, 2.0, BLOCK=16, num_warps=2, num_stages=1) is None
    launch(kernel, (2,), x, out, 32, 1, 2.0, BLOCK=16, num_warps=2, num_stages=1)
    assert replay_allowed()
    replay = replay_of(kernel, (2,), x, out, 32, 1, 2.0, BLOCK=16, num_warps=2, num_stages=1)
    assert replay_of(kernel, (2,), x, out, 32, 1, 2.0, BLOCK=32, num_warps=2, num_stages=1) is None
    replay(123, 456, 32, 1, 2.0)
    assert len(runs) == 1  # compiled once, by the launch
    assert replays == [(2, 1, 1, 99, 11, (), None, None, None, 123, 456, 32, 1, 2.0, 16, False)]
    monkeypatch.setattr(_launch, "_hooks_installed", lambda: True)
    assert not replay_allowed()


@pytest.mark.gpu
def test_launch_hook_routes_through_triton():
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime.launch_enter_hook, "add"):
        pytest.skip("Triton without HookChain launch hooks")
    seen = []
    hook = seen.append
    x = torch.randn(256, device="cuda")
    out = torch.empty_like(x)
    launch(scale_rows, (2,), x, out, 256, 1, 1.0, BLOCK=128)  # recorded
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch(scale_rows, (2,), x, out, 256, 1, 1.0, BLOCK=128)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["maxsim", "msda"])
def test_fast_and_triton_launch_give_the_same_bits(op, monkeypatch):
    import lik

    gen = torch.Generator(device="cuda").manual_seed(0)
    if op == "maxsim":
        q = torch.randn(6, 19, 64, device="cuda", generator=gen, dtype=torch.float16, requires_grad=True)
        d = torch.randn(9, 37, 64, device="cuda", generator=gen, dtype=torch.float16, requires_grad=True)
        inputs = (q, d)
        run = lambda: lik.maxsim(q, d, backward="deterministic")  # noqa: E731
    else:
        shapes = torch.tensor([[7, 9], [3, 5]], device="cuda")
        starts = torch.tensor([0, 63], device="cuda")
        value = torch.randn(2, 78, 3, 32, device="cuda", generator=gen, requires_grad=True)
        loc = torch.rand(2, 11, 3, 2, 4, 2, device="cuda", generator=gen, requires_grad=True)
        attn = torch.rand(2, 11, 3, 2, 4, device="cuda", generator=gen, requires_grad=True)
        inputs = (value, loc, attn)
        run = lambda: lik.ms_deform_attn(value, shapes, starts, loc, attn)  # noqa: E731

    def forward_backward():
        out = run()
        grads = torch.autograd.grad(out, inputs, torch.ones_like(out))
        return [out.detach(), *grads]

    # Deterministic backwards, so that equal launches give equal bits (atomics would not).
    torch.use_deterministic_algorithms(True)
    try:
        monkeypatch.setattr(_launch, "ENABLED", False)
        slow = forward_backward()
        monkeypatch.setattr(_launch, "ENABLED", True)
        forward_backward()  # records
        fast = forward_backward()  # replays
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(slow, fast):
        assert torch.equal(a, b)
    from lik.ops.maxsim.forward_kernel import maxsim_fwd_kernel
    from lik.ops.msda.forward import msda_fwd_kernel

    kernel = maxsim_fwd_kernel if op == "maxsim" else msda_fwd_kernel
    assert _table(kernel), "the forward kernel did not go through the cached path"


@pytest.mark.gpu
def test_every_lik_kernel_stays_on_the_cached_path():
    """The record step refuses a kernel whose compiled options differ from the caller's: none of lik's may be."""
    import sys

    import lik

    assert _launch.ENABLED, f"Triton {triton.__version__}: the cached path is off (version gate or LIK_TRITON_LAUNCH)"
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(3, 21, 64, device="cuda", generator=gen, dtype=torch.float16, requires_grad=True)
    d = torch.randn(5, 33, 64, device="cuda", generator=gen, dtype=torch.float16, requires_grad=True)
    for backward in ("fast", "deterministic"):
        lik.maxsim(q, d, backward=backward).sum().backward()
    packed, cu, max_len = lik.pack([torch.randn(n, 64) for n in (7, 30, 1)])
    packed = packed.to("cuda", torch.float16).requires_grad_()
    lik.maxsim_packed(q, packed, cu.cuda(), max_seqlen_d=max_len).sum().backward()
    shapes = torch.tensor([[7, 9], [3, 5]], device="cuda")
    starts = torch.tensor([0, 63], device="cuda")
    value = torch.randn(2, 78, 3, 32, device="cuda", generator=gen, requires_grad=True)
    loc = torch.rand(2, 11, 3, 2, 4, 2, device="cuda", generator=gen, requires_grad=True)
    attn = torch.rand(2, 11, 3, 2, 4, device="cuda", generator=gen, requires_grad=True)
    lik.ms_deform_attn(value, shapes, starts, loc, attn).sum().backward()
    tables = {
        f"{module_name}.{name}": kernel._lik_launch_table
        # keyed by sys.modules' names: some packages put objects without __name__ in it
        for module_name, module in list(sys.modules.items()) if module_name.startswith("lik.")
        for name, kernel in vars(module).items() if isinstance(kernel, JITFunction) and hasattr(kernel,
                                                                                                "_lik_launch_table")
    }
    assert len(tables) >= 5, sorted(tables)
    assert not [name for name, table in tables.items() if table.entries is None]
