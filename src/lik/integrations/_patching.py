"""The one mechanism every ``enable()`` uses: a host library's own functions are switched to lik in place, and
switched back by ``disable()``.

Rebinding the host's names to lik's functions would miss the stock function wherever it was already taken (a
model's stored similarity function, a default argument), would leave lik's function in every object configured
while the switch was on, and breaks pickling (pickle finds a function under its module and name, and that name
would no longer lead to it). So :meth:`Switch.route` binds nothing: it gives the host's function object the code
of a trampoline to lik, and :meth:`Switch.restore` gives it its own code back. Every reference to the function,
taken before, during or after the switch, follows the switch; a pickle names the host's function only, so it loads
where lik is absent or off and behaves as the host's, and where lik is on behaves as lik's.

Example:
    >>> switch = Switch("lik.integrations.pylate", "PyLate", "pylate")
    >>> (scores,) = switch.import_host("pylate.scores.colbert")   # ImportError naming the extra if absent
    >>> switch.route(scores.colbert_scores, colbert_scores)       # until switch.restore()
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Switch", "original", "is_routed"]

_MISSING = object()
_ROUTE_KEYWORD = "_lik_route_"


def _trampoline(*args, _lik_route_=None, **kwargs):
    # The code a routed host function runs. Its route is a keyword-only default stored on that function, so the
    # code needs no global or closure of its own and fits any host function without a closure.
    return _lik_route_(*args, **kwargs)


class _Route:
    """What a routed host function calls: lik's ``replacement``, or the host's ``stock`` code where
    ``keep_stock(args, kwargs)`` says the call asks for the host's own path (an explicit backend)."""

    __slots__ = ("stock", "replacement", "keep_stock")

    def __init__(self, stock: Callable, replacement: Callable, keep_stock: Callable[[tuple, dict], bool] | None):
        self.stock = stock
        self.replacement = replacement
        self.keep_stock = keep_stock

    def __call__(self, *args, **kwargs):
        if self.keep_stock is not None and self.keep_stock(args, kwargs):
            return self.stock(*args, **kwargs)
        return self.replacement(*args, **kwargs)


def _route_of(fn: Any) -> _Route | None:
    route = (getattr(fn, "__kwdefaults__", None) or {}).get(_ROUTE_KEYWORD)
    return route if isinstance(route, _Route) else None


def is_routed(fn: Any) -> bool:
    """Whether a switch has routed the host function ``fn`` to lik."""
    return _route_of(fn) is not None


def original(fn: Callable) -> Callable:
    """The host's own behaviour of ``fn``: a copy of its original code while a switch routes it, else ``fn``."""
    route = _route_of(fn)
    return fn if route is None else route.stock


def _copy(fn: types.FunctionType) -> types.FunctionType:
    """A new function object running ``fn``'s current code with its globals, defaults and attributes."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = dict(fn.__kwdefaults__) if fn.__kwdefaults__ else None
    copy.__qualname__, copy.__module__, copy.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    copy.__dict__.update(fn.__dict__)
    return copy


class Switch:
    """The changes of one integration's ``enable()``, so that ``disable()`` undoes each of them.

    Args:
        integration: the lik module, named in errors (``"lik.integrations.pylate"``).
        host: the host library's name for people (``"PyLate"``).
        extra: the ``lik-kernels`` extra that installs the host (``"pylate"``).
    """

    def __init__(self, integration: str, host: str, extra: str):
        self.integration, self.host, self.extra = integration, host, extra
        self._undo: list[Callable[[], None]] = []
        self._on = False

    @property
    def on(self) -> bool:
        return self._on

    def missing_host(self, reason: str) -> ImportError:
        """The error ``enable()`` raises when the host cannot be used: what failed, and the install command."""
        return ImportError(f"{self.integration}.enable() needs {self.host}: {reason}. Install it with: "
                           f'pip install "lik-kernels[{self.extra}]"')

    def import_host(self, *module_names: str) -> list[types.ModuleType]:
        """Import the host modules ``enable()`` changes; a module that cannot be found (the host, or one of its
        own dependencies) becomes :meth:`missing_host`'s error."""
        try:
            return [importlib.import_module(name) for name in module_names]
        except ModuleNotFoundError as error:
            raise self.missing_host(str(error)) from error

    def route(self, fn: Any, replacement: Callable, keep_stock: Callable[[tuple, dict], bool] | None = None) -> None:
        """Make the host function ``fn`` (a plain Python function, module-level or in a class body) call
        ``replacement`` with the same arguments until :meth:`restore`, or its own code for the calls where
        ``keep_stock(args, kwargs)`` is true. ``fn`` keeps its identity, name and signature, so every binding of
        it and every pickle of it stay valid."""
        if not isinstance(fn, types.FunctionType):
            raise TypeError(f"{self.integration}: cannot route {fn!r}, which is not a Python function")
        if fn.__closure__:
            raise TypeError(f"{self.integration}: cannot route {fn.__module__}.{fn.__qualname__}, a closure "
                            f"(this version of {self.host} is not supported)")
        if is_routed(fn):
            return
        code, kwdefaults = fn.__code__, fn.__kwdefaults__
        signature = fn.__dict__.get("__signature__", _MISSING)
        fn.__signature__ = inspect.signature(fn)  # what inspect and help() show stays the host's
        route = _Route(_copy(fn), replacement, keep_stock)
        names = {"co_name": code.co_name}
        if hasattr(code, "co_qualname"):  # Python 3.11 and newer
            names["co_qualname"] = code.co_qualname
        # Either code runs with these defaults (each ignores what it does not name), so a call made meanwhile on
        # another thread never sees a half-switched function.
        fn.__kwdefaults__ = {**(kwdefaults or {}), _ROUTE_KEYWORD: route}
        fn.__code__ = _trampoline.__code__.replace(**names)

        def undo() -> None:
            fn.__code__ = code
            fn.__kwdefaults__ = kwdefaults
            if signature is _MISSING:
                fn.__dict__.pop("__signature__", None)
            else:
                fn.__signature__ = signature

        self._undo.append(undo)

    def enabler(self, apply: Callable[[], None]) -> Callable[[], None]:
        """Decorator: ``enable()`` from a function that makes the changes. Idempotent, and all or nothing: if
        ``apply`` fails part way, every change it made is undone before the error propagates."""

        @functools.wraps(apply)
        def enable() -> None:
            if self._on:
                return
            try:
                apply()
            except BaseException:
                self.restore()
                raise
            self._on = True

        return enable

    @contextlib.contextmanager
    def scoped(self, enable: Callable[[], None]) -> Iterator[None]:
        """``with enabled():`` -- switch on for the block, and back to the previous state after it."""
        was_on = self._on
        enable()
        try:
            yield
        finally:
            if not was_on:
                self.restore()

    def restore(self) -> None:
        """Undo every change, newest first."""
        while self._undo:
            self._undo.pop()()
        self._on = False
