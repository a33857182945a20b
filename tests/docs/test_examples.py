"""The ```python blocks of README.md and docs/*.md run, in order, as a reader would paste them.

Each page runs in a fresh interpreter (its blocks share one namespace, so a block may use what an earlier one
defined; switches and monkeypatches stay in that process), in a temporary directory (an example that writes an
index writes it there), on CPU tensors through the PyTorch reference: the examples check the API a reader sees,
while the kernels' own tests cover the interpreted kernels. A block runs unless its first line says why not:

* ``# gpu-only: <why>``: needs a CUDA device (the block must name one); not run here.
* ``# requires: <module>[, <module>]``: runs when those host packages import, skipped otherwise.

The one-line switches between ``<!-- use-it-from: begin/end -->`` are run line by line, against each real host,
by ``tests/integrations/test_readme.py``; any copy of that block elsewhere must equal the README's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^( *)```python\n(.*?)^\1```", re.S | re.M)
SWITCHES = re.compile(r"<!-- use-it-from: begin -->\n```python\n(.*?)```\n<!-- use-it-from: end -->", re.S)
TAG = re.compile(r"#\s*(gpu-only|requires):\s*(.*)")
TIMEOUT_S = 300


@dataclass
class Block:
    page: str
    line: int
    code: str
    tag: str | None  # "gpu-only", "requires", "switches" or None
    argument: str


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    switches = [m.span(1) for m in SWITCHES.finditer(text)]
    found = []
    for match in FENCE.finditer(text):
        indent = len(match.group(1))
        code = "\n".join(line[indent:] for line in match.group(2).splitlines()) + "\n"
        line = text.count("\n", 0, match.start(2)) + 1
        tag, argument = None, ""
        first = code.lstrip().splitlines()[0] if code.strip() else ""
        if any(start <= match.start(2) < stop for start, stop in switches):
            tag = "switches"
        elif (m := TAG.fullmatch(first.strip())) is not None:
            tag, argument = m.group(1), m.group(2).strip()
        found.append(Block(page.relative_to(ROOT).as_posix(), line, code, tag, argument))
    return found


def _readme_switches() -> str:
    return SWITCHES.search((ROOT / "README.md").read_text()).group(1)


# Runs in the page's own interpreter: executes the blocks in order and reports each skip on stdout.
RUNNER = r"""
import importlib.util, json, sys, traceback
namespace = {"__name__": "__main__"}
for block in json.load(sys.stdin):
    where = f"{block['page']}:{block['line']}"
    if block["tag"] in ("gpu-only", "switches"):
        print(f"NOT RUN {where}: {block['tag']}")
        continue
    if block["tag"] == "requires":
        missing = [m for m in block["argument"].replace(",", " ").split() if importlib.util.find_spec(m) is None]
        if missing:
            print(f"NOT RUN {where}: {', '.join(missing)} not installed")
            continue
    try:
        exec(compile(block["code"], where, "exec"), namespace)
    except BaseException:
        print(f"FAILED {where}", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
"""


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_page_examples_run(page, tmp_path):
    found = blocks(page)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTEST_XDIST_WORKER")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU tensors everywhere, also on a GPU machine
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-c", RUNNER], input=json.dumps([vars(b) for b in found]), capture_output=True,
        text=True, cwd=tmp_path, env=env, timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, f"an example of {page.name} failed:\n{result.stderr[-6000:]}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_skip_tags_are_honest(page):
    """A block is kept from CPU CI only for a reason the block itself shows."""
    for block in blocks(page):
        where = f"{block.page}:{block.line}"
        body = block.code.split("\n", 1)[1] if block.tag in ("gpu-only", "requires") else block.code
        if block.tag == "gpu-only":
            assert block.argument, f"{where}: say why after '# gpu-only:'"
            assert re.search(r"cuda|nccl", body), f"{where}: tagged gpu-only but never asks for a CUDA device"
        elif block.tag == "requires":
            modules = block.argument.replace(",", " ").split()
            assert modules, f"{where}: name the modules after '# requires:'"
            for module in modules:
                assert re.search(rf"\bimport {module}\b|\bfrom {module}\b", body), (
                    f"{where}: requires {module} but does not import it")
        elif block.tag == "switches":
            assert block.code == _readme_switches(), f"{where}: differs from the README's one-line switches"
        else:
            assert "cuda" not in block.code, f"{where}: an untagged example must run on CPU tensors"


def test_pages_have_examples():
    """Every op page shows runnable code (a page whose fences lost their language would pass vacuously)."""
    for name in ("maxsim", "search", "msda", "chamfer", "integrations"):
        page = ROOT / "docs" / f"{name}.md"
        runnable = [b for b in blocks(page) if b.tag is None]
        assert runnable, f"docs/{name}.md has no example that CI runs"
