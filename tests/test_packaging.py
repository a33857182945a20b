"""pyproject.toml and the Makefile agree with themselves: one version, one floor per dependency, a lint that runs."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import lik

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def test_version_has_one_place():
    """pyproject reads the version from lik.__version__ instead of writing it a second time."""
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lik.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", lik.__version__)


def test_each_dependency_has_one_requirement_across_extras():
    """Two extras that name the same package ask for the same versions (the demo and the tests share one env)."""
    specs = defaultdict(set)
    for requirements in PROJECT["optional-dependencies"].values():
        for text in [*PROJECT["dependencies"], *requirements]:
            requirement = Requirement(text)
            if canonicalize_name(requirement.name) != canonicalize_name(PROJECT["name"]):
                specs[canonicalize_name(requirement.name)].add((str(requirement.specifier), str(requirement.marker)))
    conflicting = {name: sorted(s) for name, s in specs.items() if len(s) > 1}
    assert not conflicting, f"one package, several requirements: {conflicting}"


def test_test_extra_includes_the_demo_and_the_lint():
    """`make test` runs the demo's real-text test and `make lint` from the same environment."""
    own = [Requirement(t) for t in PROJECT["optional-dependencies"]["test"]]
    included = set().union(*(r.extras for r in own if canonicalize_name(r.name) == canonicalize_name(PROJECT["name"])))
    assert {"demo", "lint"} <= included
    assert any(Requirement(t).name == "ruff" for t in PROJECT["optional-dependencies"]["lint"])


def test_make_targets_exist_and_ci_runs_lint_and_test():
    makefile = (ROOT / "Makefile").read_text()
    for target in ("lint", "quick", "test", "test-all", "test-gpu", "demo"):
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"Makefile has no {target} target"
    quick = re.search(r"^QUICK_TESTS \?= (.*?)(?<!\\)\n", makefile, re.M | re.S).group(1)
    for test in quick.replace("\\\n", " ").split():
        path, _, name = test.partition("::")
        assert (ROOT / path).exists(), f"QUICK_TESTS names {path}, which does not exist"
        assert not name or re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), f"no test {test}"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make lint" in ci and "make test" in ci


def test_default_run_deselects_gpu_and_slow():
    """The CPU default leaves out what needs a GPU and the slow interpreter cases; both markers are declared."""
    options = PYPROJECT["tool"]["pytest"]["ini_options"]
    assert "-m 'not gpu and not slow'" in options["addopts"]
    declared = {m.split(":")[0] for m in options["markers"]}
    assert {"gpu", "slow"} <= declared


def _run_pytest(directory: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=directory,
                          capture_output=True, text=True, timeout=120)


def test_slow_list_marks_its_cases_and_refuses_stale_patterns(tmp_path):
    """conftest.py's SLOW patterns mark exactly their cases (brackets literal), and a pattern left behind by a
    renamed test stops a run that collected its file."""
    source = (ROOT / "conftest.py").read_text()
    (tmp_path / "conftest.py").write_text(source + '\nSLOW = {"test_cases.py::test_a[*-2]": "covered by [x-1]"}\n')
    (tmp_path / "pyproject.toml").write_text(
        "[tool.pytest.ini_options]\nmarkers = ['slow: slow']\naddopts = \"-m 'not slow'\"\n")
    cases = "import pytest\n\n@pytest.mark.parametrize('n', [1, 2, 12])\n@pytest.mark.parametrize('s', ['x', 'y'])\n"
    (tmp_path / "test_cases.py").write_text(cases + "def test_a(s, n):\n    pass\n")
    default = _run_pytest(tmp_path)
    assert default.returncode == 0 and "4 passed, 2 deselected" in default.stdout, default.stdout
    slow = _run_pytest(tmp_path, "-m", "slow", "--collect-only")
    selected = sorted(line for line in slow.stdout.splitlines() if line.startswith("test_cases.py::"))
    assert selected == ["test_cases.py::test_a[x-2]", "test_cases.py::test_a[y-2]"], slow.stdout
    (tmp_path / "test_cases.py").write_text(cases + "def test_b(s, n):\n    pass\n")
    stale = _run_pytest(tmp_path)
    assert stale.returncode != 0 and "SLOW list names cases that do not exist" in stale.stdout + stale.stderr
