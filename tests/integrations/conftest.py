"""Shared setup for the integration tests: they run the real host packages (installed by the test extra)."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types

import pytest


@pytest.fixture
def reference_path(monkeypatch):
    """CPU tensors run lik's PyTorch reference instead of the interpreted kernels: where the host computes in
    fp32 on the CPU, the drop-ins must then equal it bitwise."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def import_colpali_scoring():
    """colpali-engine's scoring modules (``utils.maxsim``, ``utils.processing_utils``,
    ``loss.late_interaction_losses``).

    colpali-engine 0.3.18's package ``__init__`` imports every model, and through transformers' Qwen2-VL image
    processor, torchvision, whose PyPI build does not load beside the CPU build of torch the tests use. Where
    that import fails, the packages are registered without running their ``__init__`` (their real directories as
    search path), so the real scoring modules load unchanged.
    """
    try:
        importlib.import_module("colpali_engine")
    except ModuleNotFoundError as error:
        if error.name != "torchvision":
            raise
        for name in [n for n in sys.modules if n == "colpali_engine" or n.startswith("colpali_engine.")]:
            del sys.modules[name]
        spec = importlib.util.find_spec("colpali_engine")
        root = spec.submodule_search_locations[0]
        for package in ("colpali_engine", "colpali_engine.utils", "colpali_engine.loss"):
            module = types.ModuleType(package)
            module.__path__ = [root + package[len("colpali_engine"):].replace(".", "/")]
            module.__spec__ = importlib.machinery.ModuleSpec(package, None, is_package=True)
            module.__spec__.submodule_search_locations = module.__path__
            sys.modules[package] = module
    return tuple(importlib.import_module(name) for name in (
        "colpali_engine.utils.maxsim", "colpali_engine.utils.processing_utils",
        "colpali_engine.loss.late_interaction_losses"))


@pytest.fixture(scope="session")
def colpali_scoring():
    if importlib.util.find_spec("colpali_engine") is None:
        pytest.skip("colpali-engine is not installed (the test extra installs it)")
    return import_colpali_scoring()
