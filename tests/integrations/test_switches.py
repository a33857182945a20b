"""What every switch shares: a missing host names the extra to install, and the routing of a host's functions
keeps their identity, signature and pickles and is undone completely."""

from __future__ import annotations

import importlib
import inspect
import pickle
import re
import sys
import types
from pathlib import Path

import pytest

from lik.integrations import _patching

# lik.integrations module -> (host package, lik-kernels extra that installs it)
INTEGRATIONS = {
    "pylate": ("pylate", "pylate"),
    "colpali": ("colpali_engine", "colpali"),
    "sentence_transformers": ("sentence_transformers", "sentence-transformers"),
    "transformers": ("transformers", "transformers"),
}
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


@pytest.mark.parametrize("name", INTEGRATIONS)
def test_missing_host_names_the_extra_to_install(name, monkeypatch):
    host, extra = INTEGRATIONS[name]
    module = importlib.import_module(f"lik.integrations.{name}")
    # What an environment without the host looks like to an import, whatever this process has loaded.
    for loaded in [n for n in sys.modules if n == host or n.startswith(host + ".")]:
        monkeypatch.setitem(sys.modules, loaded, None)
    monkeypatch.setitem(sys.modules, host, None)
    with pytest.raises(ImportError, match=re.escape(f'pip install "lik-kernels[{extra}]"')) as error:
        module.enable()
    assert f"lik.integrations.{name}.enable() needs" in str(error.value) and host in str(error.value)
    assert not module.is_enabled()


def test_each_extra_installs_its_host():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    for host, extra in INTEGRATIONS.values():
        assert any(re.match(rf"{host}\b", requirement.replace("-", "_")) for requirement in extras[extra]), extra


@pytest.fixture
def host_module():
    """A stand-in host module holding a plain function, importable by name (so pickles can name it)."""
    module = types.ModuleType("lik_test_host")
    exec("def score(a, b=2, *, scale=1):\n    'The host docstring.'\n    return ('host', a, b, scale)\n",
         module.__dict__)
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def _switch():
    return _patching.Switch("lik.integrations.test", "the test host", "test")


def test_route_keeps_the_function_object_and_restore_gives_its_code_back(host_module):
    score = host_module.score
    code, signature = score.__code__, inspect.signature(score)
    switch = _switch()
    switch.route(score, lambda *args, **kwargs: ("lik", args, kwargs), keep_stock=lambda a, k: k.get("scale") == 0)
    assert host_module.score is score and inspect.signature(score) == signature and score.__name__ == "score"
    assert score(1) == ("lik", (1,), {})
    assert score(1, scale=0) == ("host", 1, 2, 0)  # the call asked for the host's own path
    assert _patching.original(score)(1) == ("host", 1, 2, 1) and _patching.is_routed(score)
    assert pickle.loads(pickle.dumps(score)) is score  # a pickle names the host's function
    switch.restore()
    assert score.__code__ is code and score.__defaults__ == (2,) and score.__kwdefaults__ == {"scale": 1}
    assert "__signature__" not in vars(score) and not _patching.is_routed(score)
    assert score(1) == ("host", 1, 2, 1) and _patching.original(score) is score


def test_route_refuses_what_it_cannot_switch_in_place(host_module):
    def closure_factory():
        captured = 1

        def inner():
            return captured

        return inner

    switch = _switch()
    with pytest.raises(TypeError, match="closure"):
        switch.route(closure_factory(), lambda: None)
    with pytest.raises(TypeError, match="not a Python function"):
        switch.route(len, lambda: None)


def test_enable_is_all_or_nothing_and_idempotent(host_module):
    switch = _switch()
    score = host_module.score

    @switch.enabler
    def failing_enable():
        switch.route(score, lambda *a, **k: "lik")
        raise switch.missing_host("a later step failed")

    with pytest.raises(ImportError, match=re.escape('pip install "lik-kernels[test]"')):
        failing_enable()
    assert not switch.on and score(1) == ("host", 1, 2, 1)

    @switch.enabler
    def enable():
        switch.route(score, lambda *a, **k: "lik")

    enable()
    enable()
    assert switch.on and score(1) == "lik"
    with switch.scoped(enable):  # already on: the block leaves it on
        pass
    assert switch.on
    switch.restore()
    assert not switch.on and score(1) == ("host", 1, 2, 1)
