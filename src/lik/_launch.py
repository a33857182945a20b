"""Launching a Triton kernel for a fraction of ``kernel[grid](...)``'s host time.

Triton's ``JITFunction.run`` binds the arguments, computes their specialisation, formats a cache key from the
options and looks the compiled kernel up on every call. On the lent H200's host that costs 18-41 us per launch of
lik's kernels, against 6-11 us for the compiled kernel's own launcher (``benchmarks/host_path.py`` measures the
host path today). For small calls (a Deformable-DETR decoder layer, a short-document rerank, a ColBERT training
step) the difference is most of the call.

:func:`launch` keeps, per kernel, a table from a cheap key of the arguments to the kernel Triton compiled for
them. The key is at least as fine as Triton's own specialisation: a tensor's dtype, whether its address is
16-byte aligned and whether it is on a CUDA device; for an int, whether it equals 1, whether it is divisible by
16 and which integer width holds it; a bool's or constexpr's exact value; the launch options. So a hit can only
reuse the kernel that Triton's binder would have chosen (``tests/test_launch.py`` checks that against the binder
on the GPU). A miss launches through ``kernel[grid](...)``, compiling if needed, and records what it ran.

The key names the launch configuration explicitly: besides the device and the argument keys it holds every
keyword of the call in a fixed order, the kernel's constexpr parameters in declaration order, then the launch
options ``num_warps``, ``num_stages``, ``maxnreg``, ``num_ctas`` and any other Triton option (one the caller leaves
out takes Triton's default, and is named as left out). A keyword that is neither a constexpr nor a Triton option
makes the call uncached. When a kernel is first recorded, the options Triton compiled it with (its own metadata)
must equal the ones the caller passed, or the kernel stays on Triton's path.

A hit calls Triton's compiled launcher by position, each tensor given as its address: the key has read it
already, and given the tensor the launcher would read it again and ask the driver about it (a check that only
rejects host memory, which the key sends to Triton's path). That launcher is private API: the cached path runs
only on the Triton versions in :data:`TESTED_TRITON` (those the GPU equivalence tests in ``tests/test_launch.py``
passed on). On any other version every launch takes Triton's own path and the first one says so once
(``warnings.warn``); set ``lik._launch.ENABLED = True`` to try the cached path there anyway.

Triton's own path is also taken under the interpreter (``TRITON_INTERPRET=1``), while a Triton launch hook is
installed (profilers such as proton install one), when ``LIK_TRITON_LAUNCH=jit`` is set at import (or
``lik._launch.ENABLED`` is False), and for a kernel called in a form this module does not cache (a constexpr
passed by position, an argument of another type, an unknown keyword, or a Triton whose compiled kernels lack the
launcher attributes used here).

:mod:`lik._replay` builds on this table: while it records a call, :data:`WATCH` sees every launch, and
:func:`replay_of` hands it the compiled launcher of a launch, bound to its grid (a :class:`Replay`).
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from operator import itemgetter

import torch
import triton
from triton.runtime.jit import JITFunction

from ._device import current_device as _current_device

__all__ = [
    "launch", "Replay", "replay_of", "replay_allowed", "WATCH", "argument_key",
    "argument_keyer", "argument_keys", "cache_key", "keyword_layout", "triton_version_tested", "TESTED_TRITON",
]

_I32 = 2**31
_U64 = 2**63


class _Uncached(Exception):
    """An argument this module does not key; the call goes through Triton's own path."""


def argument_key(arg):
    """The part of one positional argument that can change which compiled kernel Triton picks.

    Ints map to a small code (bit 0: equals 1, bit 1: divisible by 16, bit 2: outside int32, bit 3: at least
    2**63), tensors to ``(dtype, 16-byte aligned, on a CUDA device)``, bools to ``("bool", value)``, floats to
    ``float``, ``None`` to itself. Anything else raises ``_Uncached``. (:func:`argument_keyer` holds the rules,
    :func:`_int_key` the ints'.)

    Example:
        >>> argument_key(32), argument_key(1), argument_key(2**40 + 3)
        (2, 1, 4)
    """
    keyer = argument_keyer((arg.__class__,))
    if keyer is None:
        raise _Uncached(arg.__class__.__name__)
    return keyer((arg,))[0][0]


@functools.cache
def argument_keyer(kinds: tuple[type, ...]):
    """A function of the positional arguments returning ``(keys, launch_args)``, for calls whose arguments have
    exactly the types ``kinds`` (None when one of them is not keyed): ``keys`` holds every argument's
    :func:`argument_key`, ``launch_args`` the arguments as Triton's compiled launcher takes them, each tensor
    replaced by its data address.

    ``launch`` runs on every call of every kernel; dispatching on each argument's type inside one Python call per
    argument cost a few microseconds per launch, so the dispatch is done once per type layout and its result is
    one generated expression (built from a fixed template: only argument positions are substituted).

    Example:
        >>> keyer = argument_keyer((torch.Tensor, int))
        >>> x = torch.zeros(4)
        >>> keyer((x, 32)) == ((argument_key(x), argument_key(32)), (x.data_ptr(), 32))
        True
    """
    keys, passed = [], []
    for i, kind in enumerate(kinds):
        arg = f"a[{i}]"
        passed.append(arg)
        if kind is int:
            keys.append(f"(K[{arg}] if {arg} in K else int_key({arg}))")
        elif issubclass(kind, torch.Tensor):
            keys.append(f"({arg}.dtype, (p{i} := {arg}.data_ptr()) & 15 == 0, {arg}.is_cuda)")
            passed[-1] = f"p{i}"  # bound by the key's expression, which is evaluated first
        elif kind is bool:
            keys.append(f"('bool', {arg})")
        elif kind is float:
            keys.append("float")
        elif kind is type(None):
            keys.append("None")
        else:
            return None
    listed = lambda parts: "(" + "".join(part + ", " for part in parts) + ")"  # noqa: E731
    return eval(f"lambda a: ({listed(keys)}, {listed(passed)})",  # noqa: S307
                {"float": float, "K": _INT_KEYS, "int_key": _int_key})


# An int's key, computed once per value: two dict operations cost less than the four tests (an int key is
# computed for every scalar argument of every launch). Bounded, so a stream of distinct values cannot grow it.
_INT_KEYS: dict[int, int] = {}
_INT_KEYS_MAX = 1 << 16


def _int_key(value: int) -> int:
    """bit 0: equals 1, bit 1: divisible by 16, bit 2: outside int32, bit 3: at least 2**63 (uint64)."""
    key = (value == 1) | ((value & 15) == 0) << 1 | (not -_I32 <= value < _I32) << 2 | (value >= _U64) << 3
    if len(_INT_KEYS) < _INT_KEYS_MAX:
        _INT_KEYS[value] = key
    return key


def argument_keys(args: tuple):
    """Every positional argument's :func:`argument_key`, or None when one is not keyed."""
    keyer = argument_keyer(tuple(map(type, args)))
    return None if keyer is None else keyer(args)[0]


# Triton releases (major.minor) whose launcher the cached path replays correctly: the GPU tests of
# tests/test_launch.py (same kernel as Triton's binder, same bits as Triton's launch) passed on them.
TESTED_TRITON = ("3.6",)


def triton_version_tested(version: str) -> bool:
    """True when ``version`` (e.g. ``"3.6.0"``, ``"3.6.0+git1234"``) is a release in :data:`TESTED_TRITON`."""
    return ".".join(version.split("+")[0].split(".")[:2]) in TESTED_TRITON


_REQUESTED = os.environ.get("LIK_TRITON_LAUNCH", "fast") != "jit"
_TRITON_TESTED = triton_version_tested(triton.__version__)
# Read once at import; tests switch it through this module's attribute.
ENABLED = _REQUESTED and _TRITON_TESTED
# Said once, at the first launch on a GPU, when the version gate (not the user) turned the cached path off.
_NOTICE = None if _TRITON_TESTED or not _REQUESTED else (
    f"lik: Triton {triton.__version__} is not among the versions lik's cached kernel launch was tested with "
    f"({', '.join(v + '.x' for v in TESTED_TRITON)}); kernels launch through Triton's own path (slower host side)"
)


def _say_untested_once() -> None:
    global _NOTICE
    notice, _NOTICE = _NOTICE, None
    if notice is not None:
        warnings.warn(notice, RuntimeWarning, stacklevel=3)


_KNOBS = getattr(triton, "knobs", None)

# The launch options every key names, passed or left to Triton's default, in this order.
_KEY_OPTIONS = ("num_warps", "num_stages", "maxnreg", "num_ctas")


def _triton_options() -> frozenset[str]:
    """Keyword names Triton's NVIDIA backend reads as compile / launch options (not kernel parameters)."""
    try:
        from dataclasses import fields

        from triton.backends.nvidia.compiler import CUDAOptions

        return frozenset(f.name for f in fields(CUDAOptions))
    except Exception:  # another backend layout: the options lik's launchers pass
        return frozenset(_KEY_OPTIONS + ("enable_fp_fusion", "launch_cooperative_grid", "launch_pdl"))


_OPTIONS = _triton_options() | frozenset(_KEY_OPTIONS)


def keyword_layout(kernel, names: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[tuple[str, bool], ...]] | None:
    """The explicit, order-independent description of a call's keywords that goes into the cache key.

    Returns ``(constexprs, options)``: the constexpr parameters passed, in the kernel's declaration order, and
    ``(option, passed)`` for ``num_warps``, ``num_stages``, ``maxnreg``, ``num_ctas`` (always, in that order)
    followed by any other Triton option passed (by name). None when a keyword is neither (uncached).

    Example:
        >>> keyword_layout(kernel, ("num_warps", "BLOCK"))
        (('BLOCK',), (('num_warps', True), ('num_stages', False), ('maxnreg', False), ('num_ctas', False)))
    """
    constexprs = [p.name for p in kernel.params if p.is_constexpr]
    if any(n not in constexprs and n not in _OPTIONS for n in names):
        return None
    passed = set(names)
    options = tuple((n, n in passed) for n in _KEY_OPTIONS)
    options += tuple((n, True) for n in sorted(passed - set(constexprs) - set(_KEY_OPTIONS)))
    return tuple(n for n in constexprs if n in passed), options


class _Layout:
    """A call's keyword layout, interned per kernel: ``ident`` is the same for every call whose keywords describe
    the same layout (in any order), and ``values`` reads their values in the layout's order."""

    __slots__ = ("ident", "values", "options")

    def __init__(self, ident: int, layout, names: tuple[str, ...]):
        constexprs, options = layout
        ordered = constexprs + tuple(n for n, passed in options if passed)
        self.ident = ident
        self.options = ordered[len(constexprs):]
        if len(ordered) > 1:
            self.values = itemgetter(*ordered)
        elif ordered:
            name = ordered[0]
            self.values = lambda kwargs: (kwargs[name],)
        else:
            self.values = lambda kwargs: ()


def _hooks_installed() -> bool:
    if _KNOBS is not None:
        runtime = _KNOBS.runtime
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    else:  # Triton before 3.4 keeps the hooks on CompiledKernel
        from triton.compiler import CompiledKernel

        enter = getattr(CompiledKernel, "launch_enter_hook", None)
        leave = getattr(CompiledKernel, "launch_exit_hook", None)
    # Triton 3.6 holds hooks in a (possibly empty) HookChain, older versions a callable or None. Written out
    # rather than as a generator: this runs on every launch.
    return bool((enter is not None and getattr(enter, "calls", True))
                or (leave is not None and getattr(leave, "calls", True)))


_NEW = object()  # a keyword layout not seen yet for this kernel


class _KernelTable:
    """Compiled kernels of one JIT function, by argument key; ``entries`` is None for a function launched through
    Triton only (interpreted, or found uncacheable). Kept on the function itself (``_lik_launch_table``), so it
    lives and dies with it."""

    __slots__ = ("entries", "layouts", "layout_ids")

    def __init__(self, kernel):
        self.entries: dict | None = {} if isinstance(kernel, JITFunction) else None
        self.layouts: dict[tuple[str, ...], _Layout | None] = {}  # keyword names as passed -> their layout
        self.layout_ids: dict = {}  # explicit layout -> ident

    def layout(self, kernel, names: tuple[str, ...]) -> _Layout | None:
        if names not in self.layouts:
            layout = keyword_layout(kernel, names)
            self.layouts[names] = None if layout is None else _Layout(
                self.layout_ids.setdefault(layout, len(self.layout_ids)), layout, names)
        return self.layouts[names]


_get_stream = torch._C._cuda_getCurrentRawStream if hasattr(torch._C, "_cuda_getCurrentRawStream") else None


def _record(kernel, compiled, args: tuple, kwargs: dict, options: tuple[str, ...] = ()):
    """The launcher, function handle, packed metadata and trailing constexpr values of a kernel Triton just ran,
    or None when it cannot be replayed by position or was not compiled with the ``options`` the caller passed."""
    run = getattr(compiled, "run", None)
    function = getattr(compiled, "function", None)
    packed = getattr(compiled, "packed_metadata", None)
    params = getattr(kernel, "params", None)
    if run is None or function is None or packed is None or params is None:
        return None
    metadata = getattr(compiled, "metadata", None)
    missing = object()
    for name in options:
        if getattr(metadata, name, missing) != kwargs[name]:
            return None
    if any(p.is_constexpr for p in params[: len(args)]):
        return None
    tail = []
    for param in params[len(args):]:
        if not param.is_constexpr:
            return None
        name = param.name
        if name in kwargs:
            tail.append(kwargs[name])
        else:
            default = kernel.signature.parameters[name].default
            if default is inspect.Parameter.empty:
                return None
            tail.append(default)
    return run, function, packed, tuple(tail)


def cache_key(kernel, device: int, args: tuple, kwargs: dict):
    """The key :func:`launch` files a call under (the same computation, for tests and inspection):
    ``(device, argument keys, keyword layout id, keyword values in the layout's order)``, where the layout id
    stands for :func:`keyword_layout`'s explicit description. None for a call that is not cached."""
    table = getattr(kernel, "_lik_launch_table", None)
    if table is None:
        table = kernel._lik_launch_table = _KernelTable(kernel)
    layout = table.layout(kernel, tuple(kwargs))
    if layout is None:
        return None
    keys = argument_keys(args)
    if keys is None:
        return None
    return device, keys, layout.ident, layout.values(kwargs)


# Called with ``(kernel, grid, args, kwargs)`` before every launch while a replay is being recorded (lik._replay).
WATCH = None


def launch(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` with Triton's per-call binding and cache lookup skipped after the first
    call with the same argument key.

    Args:
        kernel: a ``@triton.jit`` function whose non-constexpr parameters are all passed by position here and whose
            constexpr parameters are passed by keyword (or left at their defaults).
        grid: 1 to 3 program counts.
        args, kwargs: as for ``kernel[grid](...)``; ``num_warps`` / ``num_stages`` and other options go in kwargs.

    Example:
        >>> launch(add_kernel, (triton.cdiv(n, 1024),), x, y, out, n, BLOCK=1024, num_warps=4)
    """
    if WATCH is not None:
        WATCH(kernel, grid, args, kwargs)
    table = getattr(kernel, "_lik_launch_table", None)
    if table is None:
        table = kernel._lik_launch_table = _KernelTable(kernel)
    entries = table.entries
    if entries is None or not ENABLED or _get_stream is None or _hooks_installed():
        if _NOTICE is not None and entries is not None:
            _say_untested_once()
        kernel[grid](*args, **kwargs)
        return
    device = _current_device()
    names = tuple(kwargs)
    layout = table.layouts.get(names, _NEW)
    if layout is _NEW:
        layout = table.layout(kernel, names)
    keyer = None if layout is None else argument_keyer(tuple(map(type, args)))
    if keyer is None:
        kernel[grid](*args, **kwargs)
        return
    keys, launch_args = keyer(args)
    try:
        key = (device, keys, layout.ident, layout.values(kwargs))
        entry = entries.get(key)
    except TypeError:  # an unhashable keyword value
        kernel[grid](*args, **kwargs)
        return
    if entry is None:
        compiled = kernel[grid](*args, **kwargs)
        entry = _record(kernel, compiled, args, kwargs, layout.options)
        if entry is None:
            table.entries = None
        else:
            entries[key] = entry
        return
    run, function, packed, tail = entry
    n = len(grid)
    run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _get_stream(device), function, packed,
        None, None, None, *launch_args, *tail)


def replay_allowed() -> bool:
    """Whether a :class:`Replay` may launch now: the cached path is on and no Triton launch hook is installed (a
    profiler's hook must see every launch). Callers test this before each replay, as :func:`launch` does."""
    return ENABLED and _get_stream is not None and not _hooks_installed()


class Replay:
    """A launch that :func:`launch` recorded, bound to its grid: ``replay(*launch_args)`` launches the same compiled
    kernel again on the current stream of the device it was recorded on, with ``launch_args`` the kernel's
    positional arguments, each tensor given as its data address.

    For callers that launch one kernel with the same shapes many times (a decoder layer) and can tell from a key of
    their own that a call would have the recorded call's cache key (same dtypes, same 16-byte alignment, same
    integers and keywords): the replay skips computing that key. Test :func:`replay_allowed` before each one."""

    __slots__ = ("run", "function", "packed", "tail", "grid", "device")

    def __init__(self, entry: tuple, grid: tuple[int, ...], device: int):
        self.run, self.function, self.packed, self.tail = entry
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.device = device

    def __call__(self, *launch_args) -> None:
        grid = self.grid
        self.run(grid[0], grid[1], grid[2], _get_stream(self.device), self.function, self.packed, None, None, None,
                 *launch_args, *self.tail)


def replay_of(kernel, grid: tuple[int, ...], *args, **kwargs) -> Replay | None:
    """The :class:`Replay` of what :func:`launch` recorded for a call with these arguments (the same cache key), or
    None when nothing is recorded (no launch with this key yet, or the kernel runs through Triton's own path).

    Example:
        >>> launch(add_kernel, (4,), x, y, out, n, BLOCK=1024)
        >>> replay = replay_of(add_kernel, (4,), x, y, out, n, BLOCK=1024)
        >>> replay(x2.data_ptr(), y2.data_ptr(), out2.data_ptr(), n)   # same n, same alignment, same dtypes
    """
    table = getattr(kernel, "_lik_launch_table", None)
    if table is None or table.entries is None or _get_stream is None:
        return None
    device = _current_device()
    key = cache_key(kernel, device, args, kwargs)
    try:
        entry = None if key is None else table.entries.get(key)
    except TypeError:  # an unhashable keyword value: never recorded
        return None
    return None if entry is None else Replay(entry, grid, device)
