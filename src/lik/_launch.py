"""Launching a Triton kernel for a fraction of ``kernel[grid](...)``'s host time.

Triton's ``JITFunction.run`` binds the arguments, computes their specialisation, formats a cache key from the
options and looks the compiled kernel up on every call. On the lent H200's host that costs 18-41 us per launch of
lik's kernels, against 6-11 us for the compiled kernel's own launcher (``benchmarks/launch_profile.py``). For
small calls (a Deformable-DETR decoder layer, a short-document rerank, a ColBERT training step) the difference is
most of the call.

:func:`launch` keeps, per kernel, a table from a cheap key of the arguments to the kernel Triton compiled for
them. The key is at least as fine as Triton's own specialisation: a tensor's dtype and whether its address is
16-byte aligned; for an int, whether it equals 1, whether it is divisible by 16 and which integer width holds it;
a bool's or constexpr's exact value; the launch options. So a hit can only reuse the kernel that Triton's binder
would have chosen (``tests/test_launch.py`` checks that against the binder on the GPU). A miss launches through
``kernel[grid](...)``, compiling if needed, and records what it ran.

Triton's own path is taken under the interpreter (``TRITON_INTERPRET=1``), while a Triton launch hook is
installed (profilers such as proton install one), when ``LIK_TRITON_LAUNCH=jit`` is set at import (or
``lik._launch.ENABLED`` is False), and for a kernel called
in a form this module does not cache (a constexpr passed by position, an argument of another type, or a Triton
whose compiled kernels lack the launcher attributes used here).
"""

from __future__ import annotations

import inspect
import os

import torch
import triton
from triton.runtime.jit import JITFunction

__all__ = ["launch", "argument_key"]

_I32 = 2**31
_U64 = 2**63


class _Uncached(Exception):
    """An argument this module does not key; the call goes through Triton's own path."""


def argument_key(arg):
    """The part of one positional argument that can change which compiled kernel Triton picks.

    Ints map to a small code (bit 0: equals 1, bit 1: divisible by 16, bit 2: outside int32, bit 3: at least
    2**63), tensors to ``(dtype, 16-byte aligned)``, bools to ``("bool", value)``, floats to ``float``, ``None`` to
    itself. Anything else raises ``_Uncached``.

    Example:
        >>> argument_key(32), argument_key(1), argument_key(2**40 + 3)
        (2, 1, 4)
    """
    kind = arg.__class__
    if kind is int:
        return (arg == 1) | ((arg & 15) == 0) << 1 | (not -_I32 <= arg < _I32) << 2 | (arg >= _U64) << 3
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() & 15 == 0
    if kind is bool:
        return "bool", arg
    if kind is float:
        return float
    if arg is None:
        return None
    raise _Uncached(kind.__name__)


# Read once at import; tests switch it through this module's attribute.
ENABLED = os.environ.get("LIK_TRITON_LAUNCH", "fast") != "jit"
_KNOBS = getattr(triton, "knobs", None)


def _hooks_installed() -> bool:
    if _KNOBS is not None:
        hooks = (_KNOBS.runtime.launch_enter_hook, _KNOBS.runtime.launch_exit_hook)
    else:  # Triton before 3.4 keeps the hooks on CompiledKernel
        from triton.compiler import CompiledKernel

        hooks = (getattr(CompiledKernel, "launch_enter_hook", None), getattr(CompiledKernel, "launch_exit_hook", None))
    # Triton 3.6 holds hooks in a (possibly empty) HookChain, older versions a callable or None.
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


class _KernelTable:
    """Compiled kernels of one JIT function, by argument key; ``entries`` is None for a function launched through
    Triton only (interpreted, or found uncacheable). Kept on the function itself (``_lik_launch_table``), so it
    lives and dies with it."""

    __slots__ = ("entries",)

    def __init__(self, kernel):
        self.entries: dict | None = {} if isinstance(kernel, JITFunction) else None


_get_stream = torch._C._cuda_getCurrentRawStream if hasattr(torch._C, "_cuda_getCurrentRawStream") else None


def _record(kernel, compiled, args: tuple, kwargs: dict):
    """The launcher, function handle, packed metadata and trailing constexpr values of a kernel Triton just ran,
    or None when it cannot be replayed by position."""
    run = getattr(compiled, "run", None)
    function = getattr(compiled, "function", None)
    packed = getattr(compiled, "packed_metadata", None)
    params = getattr(kernel, "params", None)
    if run is None or function is None or packed is None or params is None:
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
    table = getattr(kernel, "_lik_launch_table", None)
    if table is None:
        table = kernel._lik_launch_table = _KernelTable(kernel)
    entries = table.entries
    if entries is None or not ENABLED or _get_stream is None or _hooks_installed():
        kernel[grid](*args, **kwargs)
        return
    device = torch.cuda.current_device()
    try:
        key = (device, tuple(map(argument_key, args)), tuple(kwargs.items()))
        entry = entries.get(key)
    except (_Uncached, TypeError):  # TypeError: an unhashable keyword value
        kernel[grid](*args, **kwargs)
        return
    if entry is None:
        compiled = kernel[grid](*args, **kwargs)
        entry = _record(kernel, compiled, args, kwargs)
        if entry is None:
            table.entries = None
        else:
            entries[key] = entry
        return
    run, function, packed, tail = entry
    n = len(grid)
    run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _get_stream(device), function, packed,
        None, None, None, *args, *tail)
