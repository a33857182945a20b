"""The repository's scripts (``benchmarks/``, ``tools/``) are not modules of the package: tests load them by path."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

__all__ = ["REPO", "load_script"]

REPO = pathlib.Path(__file__).resolve().parents[1]


def load_script(relative_path: str, name: str) -> types.ModuleType:
    """The script at ``REPO / relative_path``, executed as a fresh module called ``name`` (in ``sys.modules``
    while it runs, for its dataclasses to find their module; never left there, so tests load their own copy).

    Example:
        >>> index_bench = load_script("benchmarks/index_bench.py", "index_bench")
    """
    spec = importlib.util.spec_from_file_location(name, REPO / relative_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module
