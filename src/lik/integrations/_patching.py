"""The one mechanism every ``enable()`` uses: rebind names in a host library's modules, remember what was
there, and put it back on ``disable()``.

A host function is reached through every module that imported it by name (``from ..scores import
colbert_scores``), so replacing it in its defining module alone misses call sites. :class:`Switch` scans the
host's loaded modules for each binding of the stock object and rebinds all of them; attributes held by
instances (a loss that stored the stock function at construction) are covered by :class:`MappedAttribute`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["Switch", "MappedAttribute"]

_MISSING = object()


class MappedAttribute:
    """A data descriptor placed on a host class while a switch is on: reading ``obj.<name>`` returns the lik
    replacement wherever the instance holds a stock object, anything else unchanged; writes go to the instance
    as before. Data descriptors take precedence over the instance ``__dict__``, so instances built before
    ``enable()`` are covered, and removing the descriptor restores the stock behaviour exactly."""

    def __init__(self, name: str, replacements: dict[int, Any], keep_alive: list[Any]):
        self.name = name
        self.replacements = replacements  # id(stock object) -> replacement
        self.keep_alive = keep_alive  # the stock objects, so their ids stay unique

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        try:
            value = obj.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None
        return self.replacements.get(id(value), value)

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.name] = value

    def __delete__(self, obj) -> None:
        del obj.__dict__[self.name]


class Switch:
    """Records every rebinding one ``enable()`` makes, so that ``disable()`` restores each of them."""

    def __init__(self, host: str):
        self.host = host
        self._undo: list[tuple[Any, str, Any]] = []

    @property
    def on(self) -> bool:
        return bool(self._undo)

    def set(self, owner: Any, name: str, value: Any) -> None:
        """``setattr(owner, name, value)``, remembering the previous value (or its absence) for ``restore``."""
        previous = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)
        self._undo.append((owner, name, previous))
        setattr(owner, name, value)

    def rebind_everywhere(self, stock: Any, replacement: Any) -> int:
        """Replace every module-level binding of ``stock`` in the host's loaded modules; returns how many."""
        count = 0
        for module_name, module in list(sys.modules.items()):
            if module is None or not (module_name == self.host or module_name.startswith(self.host + ".")):
                continue
            for name, value in list(vars(module).items()):
                if value is stock:
                    self.set(module, name, replacement)
                    count += 1
        return count

    def map_attribute(self, cls: type, name: str, replacements: Iterable[tuple[Any, Any]]) -> None:
        """Install a :class:`MappedAttribute` for ``cls.<name>`` (see its docstring)."""
        pairs = list(replacements)
        descriptor = MappedAttribute(name, {id(stock): new for stock, new in pairs}, [stock for stock, _ in pairs])
        self.set(cls, name, descriptor)

    def enabler(self, apply: Callable[[], None]) -> Callable[[], None]:
        """Decorator: ``enable()`` from a function that makes the changes. Idempotent, and all or nothing: if
        ``apply`` fails part way, every change it made is undone before the error propagates."""

        @functools.wraps(apply)
        def enable() -> None:
            if self.on:
                return
            try:
                apply()
            except BaseException:
                self.restore()
                raise

        return enable

    @contextlib.contextmanager
    def scoped(self, enable: Callable[[], None]) -> Iterator[None]:
        """``with enabled():`` -- switch on for the block, and back to the previous state after it."""
        was_on = self.on
        enable()
        try:
            yield
        finally:
            if not was_on:
                self.restore()

    def restore(self) -> None:
        """Undo every change, newest first (a name rebound twice returns to its first value)."""
        while self._undo:
            owner, name, previous = self._undo.pop()
            if previous is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)


def import_all(module_names: Iterable[str]) -> list[Any]:
    """Import the host modules that bind scoring functions, so that a rebinding scan sees every one of them."""
    return [importlib.import_module(name) for name in module_names]
