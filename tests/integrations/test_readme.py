"""Every line of the README's "Use it from ..." block runs and switches its host on (then off again)."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _lines():
    text = README.read_text()
    block = re.search(r"<!-- use-it-from: begin -->\n```python\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_block_names_every_host():
    hosts = [re.search(r"lik\.integrations\.(\w+)", line).group(1) for line in _lines()]
    assert hosts == ["pylate", "colpali", "sentence_transformers", "transformers"]


@pytest.mark.parametrize("line", _lines(), ids=lambda line: re.search(r"integrations\.(\w+)", line).group(1))
def test_line_enables_its_host(line, colpali_scoring_if_host):
    host = re.search(r"lik\.integrations\.(\w+)", line).group(1)
    package = {"colpali": "colpali_engine"}.get(host, host)
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (the test extra installs it)")
    if host == "colpali":
        colpali_scoring_if_host()
    module = importlib.import_module(f"lik.integrations.{host}")
    namespace = {}
    try:
        exec(line, namespace)
        assert namespace["m"] is module and module.is_enabled()
    finally:
        module.disable()
    assert not module.is_enabled()


@pytest.fixture
def colpali_scoring_if_host():
    from .conftest import import_colpali_scoring

    return import_colpali_scoring
