"""Run the peers' own test-suites against lik's compatibility modules in place of the peers.

    python3 tools/peer_suites.py --src .peer_src --out $OUT --workers 10 --deadline-s 150   # on a CUDA machine

``--src`` holds the peers' source distributions (``flash_maxsim-0.3.0/``, ``late_interaction_kernels-0.4.5/``, or
their ``.tar.gz``), from ``pip download --no-deps --no-binary=:all: flash-maxsim==0.3.0
late-interaction-kernels==0.4.5``. Each suite's ``tests/`` (and pytest configuration) is copied to a work folder
beside a shim package named after the peer that re-exports lik's module and maps the peer's API submodules onto
lik's (``src/lik/integrations/<peer>/_peer_suite.py`` holds the map, the files not run, the deliberate differences
and the tests that fail with the peer too); the shim leads ``PYTHONPATH`` (the tests' subprocesses get lik too). The
peers' pure-PyTorch references (``flash_maxsim.naive``, ``late_interaction_kernels.reference``) load from the sdist:
lik is compared with the peers' own ground truth (PyLate's scores: its auto backend, an installed flash-maxsim).

The suites run at once within ``--deadline-s``, sharing ``--workers`` pytest-xdist workers: test functions in one
pytest run, script-style files beside it as scripts (``--script-jobs`` at once, each with
``--script-memory-fraction`` of GPU memory, as the peers' benchmark scripts raise the batch until memory runs out; a
pass is exit status 0 and no FAIL / BAD verdict; not run without CUDA). At a limit a run gets SIGINT: what finished
counts, the rest is "not run". Each failure is a listed difference, a failure the peer shares, UNEXPECTED, or counted
apart (needs CUDA or a missing package). A file whose every test is listed is not run unless ``--run-listed``;
``--baseline`` also runs each suite against the peer, marking shared failures. Exit 1 when anything is UNEXPECTED;
``--out`` gets ``summary.md`` and ``peer_suites_logs.tar.gz``.
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _load_lists() -> tuple[dict, dict, list, list]:
    """Each suite's data from its compatibility package's ``_peer_suite.py`` (read as a file: no lik import):
    ``SUITES``, ``NOT_RUN``, ``DIFFERENCES`` ``(suite, pattern, reason)``, ``FAILS_WITH_PEER`` ``(suite, pattern,
    signature, reason)`` (a failure counts as the peer's when its text holds ``signature``)."""
    suites, not_run, differences, fails_with_peer = {}, {}, [], []
    for suite in ("flash_maxsim", "late_interaction_kernels"):
        path = REPO / "src" / "lik" / "integrations" / suite / "_peer_suite.py"
        spec = importlib.util.spec_from_file_location(f"_peer_suite_{suite}", path)
        data = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(data)
        suites[suite], not_run[suite] = data.SUITE, data.NOT_RUN
        differences += [(suite, pattern, reason) for pattern, reason in data.DIFFERENCES]
        fails_with_peer += [(suite, *entry) for entry in data.FAILS_WITH_PEER]
    return suites, not_run, differences, fails_with_peer


# Each suite's shim map, its files not run, deliberate differences (in the modules' docstrings), peer failures.
SUITES, NOT_RUN, DIFFERENCES, FAILS_WITH_PEER = _load_lists()

_NEEDS_CUDA = re.compile(
    r"Torch not compiled with CUDA|Found no NVIDIA driver|no CUDA GPUs are available|"
    r"CUDA driver initialization failed|cuda.*is not available",
    re.IGNORECASE,
)
_MISSING = re.compile(r"No module named '([\w.]+)'")
_VERDICT = re.compile(r"\b(FAIL|BAD)\b|✗")


@dataclass
class Outcome:
    test: str
    status: str  # passed | failed | skipped | not run
    detail: str = ""


@dataclass
class SuiteReport:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    peer: list[Outcome] | None = None  # the same suite against the peer itself (--baseline)
    seconds: float = 0.0


def _shim_source(suite: str, spec: dict, peer_dir: Path) -> str:
    return f'''"""{suite} shadowed by {spec["lik"]} (written by tools/peer_suites.py)."""
import importlib, importlib.abc, importlib.util, sys

_LIK = importlib.import_module({spec["lik"]!r})
_ALIASES = {spec["aliases"]!r}
_REFERENCES = {{name: {str(peer_dir)!r} + "/" + name + ".py" for name in {spec["references"]!r}}}


class _Loader(importlib.abc.Loader):
    def __init__(self, module):
        self.module = module
        self.spec = module.__spec__

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        # importlib stamps the alias's spec on the module it loads: lik's module keeps its own.
        module.__spec__ = self.spec


class _Finder(importlib.abc.MetaPathFinder):
    """{suite}.X -> lik's module for the peer's API submodules, the sdist's file for its references."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != __name__:
            return None
        if name in _REFERENCES:
            return importlib.util.spec_from_file_location(fullname, _REFERENCES[name])
        if name in _ALIASES:
            module = importlib.import_module(_LIK.__name__ + _ALIASES[name])
            return importlib.util.spec_from_loader(fullname, _Loader(module))
        return None


sys.meta_path.insert(0, _Finder())
# Every API submodule loads now, then the package's names are bound, as the peer's __init__ does: importing
# {suite}.X later binds nothing over the package's function X (the peer's X is its function, not its module).
for _name in _ALIASES:
    importlib.import_module(__name__ + "." + _name)
__all__ = list(_LIK.__all__)
globals().update({{name: getattr(_LIK, name) for name in __all__}})
__version__ = {spec["version"]!r}
for _name in _REFERENCES:
    _module = importlib.import_module(__name__ + "." + _name)
    globals()[_name] = _module
    globals().update({{k: v for k, v in vars(_module).items() if k.startswith("maxsim_naive") or k in (
        "maxsim_at_operator", "maxsim_bmm", "maxsim_chunked")}})
'''


def _sdist(src: Path, work: Path, name: str) -> Path:
    folder = src / name
    if folder.is_dir():
        return folder
    archive = src / f"{name}.tar.gz"
    if not archive.is_file():
        raise SystemExit(f"--src: {src} holds neither {name}/ nor {name}.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(work / "sdists", filter="data")
    return work / "sdists" / name


def _env(shim: Path) -> dict:
    env = dict(os.environ)
    paths = [str(shim), str(REPO / "src")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _has_cuda(python: str, env: dict) -> bool:
    probe = subprocess.run(
        [python, "-c", "import torch; print(torch.cuda.is_available())"], env=env, capture_output=True, text=True
    )
    return probe.stdout.strip() == "True"


def _junit_outcomes(path: Path) -> list[Outcome]:
    outcomes = []
    for case in ElementTree.parse(path).iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        if not classname and not name:  # the test a SIGINT interrupted
            continue
        if classname:
            module, _, klass = (
                classname.partition(".")[2].partition(".") if classname.startswith("tests.") else (classname, "", "")
            )
            test = f"tests/{module}.py::" + (f"{klass}::" if klass else "") + name
        else:  # a file that failed to import
            test = name.replace(".", "/") + ".py"
        status, detail = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                status, detail = "failed", (child.get("message") or "") + "\n" + (child.text or "")
            elif child.tag == "skipped":
                status, detail = "skipped", child.get("message") or ""
        outcomes.append(Outcome(test, status, detail))
    return outcomes


class Clock:
    """Each run's time limit: ``--timeout-s``, cut to what is left of ``--deadline-s`` (0: nothing left)."""

    def __init__(self, timeout_s: int, deadline_s: int | None):
        self.timeout_s = timeout_s
        self.end = None if deadline_s is None else time.monotonic() + deadline_s

    def limit(self) -> int:
        return self.timeout_s if self.end is None else max(0, min(self.timeout_s, int(self.end - time.monotonic())))


def _run(cmd: list[str], cwd: Path, env: dict, timeout_s: int, grace_s: int = 15) -> tuple[int | None, str]:
    """``(exit status, output)``; at the time limit the command and its children (pytest-xdist's workers) get
    SIGINT (pytest then writes its report of what ran), after ``grace_s`` more SIGKILL, and the status is None."""
    # A background job of a non-interactive shell inherits SIGINT ignored: its pytest would never stop and report.
    sigint = functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL)
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    process = subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True, preexec_fn=sigint, **pipes)
    try:
        output, _ = process.communicate(timeout=timeout_s)
        return process.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGINT)
        try:
            output, _ = process.communicate(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
        return None, f"stopped after {timeout_s} s\n{output}"


def _run_pytest(python, files, cwd, env, out, name, clock: Clock, workers) -> list[Outcome]:
    timeout_s = clock.limit()
    if timeout_s <= 0 or not files:
        return [Outcome(f, "not run", "--deadline-s reached") for f in files]
    junit = out / f"{name}.junit.xml"
    xdist = ["-n", str(workers)] if workers > 1 else []
    cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "--continue-on-collection-errors"]
    code, log = _run([*cmd, f"--junitxml={junit}", *xdist, *files], cwd, env, timeout_s)
    (out / f"{name}.pytest.log").write_text(log)
    outcomes = _junit_outcomes(junit) if junit.is_file() else []
    if code is None:  # what ran before the limit counts; the files with nothing reported did not run
        ran = {o.test.split("::")[0] for o in outcomes}
        stopped = f"pytest stopped at its {timeout_s} s limit before a test of this file finished"
        return outcomes + [Outcome(f, "not run", stopped) for f in files if f not in ran]
    return outcomes or [Outcome(f, "failed", "pytest wrote no report (see the log)") for f in files]


# Runs a script as ``python path`` would, its process limited to a fraction of the GPU's memory: the peers'
# benchmark scripts raise the batch until they run out of memory, which would starve what runs beside them.
_SCRIPT_LAUNCHER = (
    "import os, runpy, sys\n"
    "fraction = float(sys.argv[1])\n"
    "sys.argv = sys.argv[2:]\n"
    "sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))\n"
    "if fraction < 1:\n"
    "    import torch\n"
    "    if torch.cuda.is_available():\n"
    "        torch.cuda.set_per_process_memory_fraction(fraction)\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def _run_script(python, path, cwd, env, out, name, clock: Clock, memory_fraction: float = 1.0) -> Outcome:
    timeout_s = clock.limit()
    if timeout_s <= 0:
        return Outcome(path, "not run", "--deadline-s reached")
    code, log = _run([python, "-c", _SCRIPT_LAUNCHER, str(memory_fraction), path], cwd, env, timeout_s)
    (out / f"{name}.{Path(path).stem}.log").write_text(log)
    verdicts = [line for line in log.splitlines() if _VERDICT.search(line)]
    if code is None and not verdicts:
        passed = sum(" OK" in line or "PASS" in line for line in log.splitlines())
        return Outcome(path, "not run", f"stopped at its {timeout_s} s limit ({passed} OK lines, no failure so far)")
    if code == 0 and not verdicts:
        return Outcome(path, "passed")
    last = log.strip().splitlines()[-1] if log.strip() else ""
    status = "stopped" if code is None else f"exit {code}"
    return Outcome(path, "failed", f"{status}; " + ("; ".join(verdicts[:3]) if verdicts else last) + "\n" + log)


def _classify(suite: str, outcome: Outcome, cuda: bool, failed_with_peer: set[str]) -> str:
    """``passed``, ``skipped``, ``not run``, ``listed: <reason>``, ``fails with the peer too``, ``needs CUDA``,
    ``needs <package>`` or ``UNEXPECTED``."""
    if outcome.status != "failed":
        return outcome.status
    for name, pattern, reason in DIFFERENCES:
        if name == suite and fnmatch.fnmatch(outcome.test, pattern):
            return f"listed: {reason}"
    if not cuda and _NEEDS_CUDA.search(outcome.detail):
        return "needs CUDA"
    missing = _MISSING.search(outcome.detail)
    if missing and not missing.group(1).startswith(suite):
        return f"needs {missing.group(1).split('.')[0]}"
    if outcome.test in failed_with_peer:
        return "fails with the peer too"
    for name, pattern, signature, reason in FAILS_WITH_PEER:
        if name == suite and fnmatch.fnmatch(outcome.test, pattern) and signature in outcome.detail:
            return f"fails with the peer too: {reason}"
    return "UNEXPECTED"


def _whole_file_difference(suite: str, path: str) -> str | None:
    """The reason when every test of ``path`` is a listed difference (a pattern without ``::`` matching it)."""
    for name, pattern, reason in DIFFERENCES:
        if name == suite and "::" not in pattern and fnmatch.fnmatch(path, pattern):
            return reason
    return None


def _test_files(root: Path) -> tuple[list[str], list[str]]:
    """``(pytest files, script-style files)`` of a suite's ``tests/``."""
    files = sorted(p.relative_to(root).as_posix() for p in (root / "tests").glob("test_*.py"))
    with_tests = [f for f in files if re.search(r"^\s*def test_", (root / f).read_text(), re.MULTILINE)]
    return with_tests, [f for f in files if f not in with_tests]


@dataclass
class Plan:
    """How a suite runs: pytest-xdist workers, scripts at once and each script's share of the GPU's memory; with
    ``run_listed`` the files whose every test is a listed difference run too."""

    workers: int = 0
    script_jobs: int = 1
    memory_fraction: float = 1.0
    run_listed: bool = False


def _run_tests(root, env, out, tag, python, cuda, suite, clock: Clock, plan: Plan) -> list[Outcome]:
    """The pytest files in one pytest run while the script-style files run beside it, ``plan.script_jobs`` at once."""
    skipped = NOT_RUN.get(suite, {})
    with_tests, scripts = _test_files(root)
    outcomes = [Outcome(f, "not run", skipped[f]) for f in with_tests + scripts if f in skipped]
    if not plan.run_listed:
        listed = {f: _whole_file_difference(suite, f) for f in with_tests + scripts if f not in skipped}
        outcomes += [Outcome(f, f"listed: {why} (every test listed: not run)") for f, why in listed.items() if why]
        skipped = {**skipped, **{f: why for f, why in listed.items() if why}}
    with_tests, scripts = ([f for f in group if f not in skipped] for group in (with_tests, scripts))
    if not cuda:
        outcomes += [Outcome(f, "not run", "script-style file: needs CUDA") for f in scripts]
        scripts = []
    with ThreadPoolExecutor(max_workers=1 + max(1, plan.script_jobs)) as pool:
        pytest_run = pool.submit(_run_pytest, python, with_tests, root, env, out, tag, clock, plan.workers)
        script_runs = [
            pool.submit(_run_script, python, f, root, env, out, tag, clock, plan.memory_fraction) for f in scripts
        ]
        outcomes += pytest_run.result() + [run.result() for run in script_runs]
    return outcomes


def run_suite(
    suite: str, src: Path, work: Path, out: Path, python: str, clock: Clock, baseline: bool, plan: Plan | None = None
) -> SuiteReport:
    """The suite against lik (the shim), and with ``baseline`` against the peer itself (the sdist's package)."""
    started = time.monotonic()
    plan = plan or Plan()
    spec = SUITES[suite]
    sdist = _sdist(src, work, spec["sdist"])
    shim = work / suite / "shim"
    (shim / suite).mkdir(parents=True)
    (shim / suite / "__init__.py").write_text(_shim_source(suite, spec, sdist / suite))
    root = work / suite / "run"
    shutil.copytree(sdist / "tests", root / "tests")
    for config in ("pyproject.toml", "setup.cfg", "pytest.ini"):
        if (sdist / config).is_file():
            shutil.copy(sdist / config, root / config)
    env = _env(shim)
    cuda = _has_cuda(python, env)
    report = SuiteReport(suite, _run_tests(root, env, out, suite, python, cuda, suite, clock, plan))
    failed_with_peer = set()
    if baseline:
        report.peer = _run_tests(root, _env(sdist), out, f"{suite}.peer", python, cuda, suite, clock, plan)
        failed_with_peer = {o.test for o in report.peer if o.status == "failed"}
    for outcome in report.outcomes:
        outcome.status = _classify(suite, outcome, cuda, failed_with_peer)
    report.seconds = time.monotonic() - started
    return report


def _plans(src: Path, suites: list[str], args) -> dict[str, Plan]:
    """The suites run at once: the pytest-xdist workers are shared in proportion to their pytest files."""
    sdists = {suite: src / SUITES[suite]["sdist"] for suite in suites}  # (a .tar.gz counts 1 file)
    counts = {suite: max(1, len(_test_files(d)[0])) if d.is_dir() else 1 for suite, d in sdists.items()}
    workers = {
        s: max(1, round(args.workers * n / sum(counts.values()))) if args.workers > 1 else 0 for s, n in counts.items()
    }
    return {s: Plan(workers[s], args.script_jobs, args.script_memory_fraction, args.run_listed) for s in suites}


def summarize(reports: list[SuiteReport]) -> tuple[str, int]:
    lines, unexpected = [], 0
    for report in reports:
        counts = Counter(outcome.status.split(":")[0] for outcome in report.outcomes)
        counted = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        lines.append(f"## {report.name}: {counted} ({report.seconds:.0f} s)")
        if report.peer is not None:
            peer_counts = Counter(outcome.status for outcome in report.peer)
            lines.append("the peer itself: " + ", ".join(f"{n} {k}" for k, n in sorted(peer_counts.items())))
        for outcome in report.outcomes:
            if outcome.status in ("passed", "skipped"):
                continue
            first = outcome.detail.strip().splitlines()[0][:160] if outcome.detail.strip() else ""
            note = "" if outcome.status.startswith(("listed", "fails with the peer too:")) else f"  ({first})"
            lines.append(f"- {outcome.test}: {outcome.status}{note}")
        unexpected += counts.get("UNEXPECTED", 0)
        skips = Counter(outcome.detail[:120] for outcome in report.outcomes if outcome.status == "skipped")
        lines += [f"- skipped {n}: {reason}" for reason, n in sorted(skips.items())]
        lines.append("")
    return "\n".join(lines), unexpected


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, required=True, help="folder with the peers' unpacked sdists")
    parser.add_argument("--out", type=Path, help="folder for summary.md and peer_suites_logs.tar.gz")
    parser.add_argument("--suite", action="append", choices=sorted(SUITES), help="run only these suites")
    parser.add_argument("--python", default=sys.executable, help="interpreter that runs the tests")
    for flag, kind, default, text in (
        ("--timeout-s", int, 480, "limit for each pytest run and each script"),
        ("--deadline-s", int, None, "time for the whole run (the suites run at once): what is left is not run"),
        ("--workers", int, 0, "pytest-xdist workers, shared by the suites in proportion to their pytest files"),
        ("--script-jobs", int, 2, "script-style files run at once per suite"),
        ("--script-memory-fraction", float, 0.25, "share of the GPU's memory a script-style file may allocate"),
    ):
        parser.add_argument(flag, type=kind, default=default, help=text)
    parser.add_argument("--baseline", action="store_true", help="also run each suite against the peer itself")
    parser.add_argument("--run-listed", action="store_true", help="also run files whose every test is listed")
    args = parser.parse_args(argv)
    if not args.src.is_dir():
        parser.error(f"--src {args.src} is not a folder")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} exists and is not a folder")
    with tempfile.TemporaryDirectory(prefix="peer_suites_") as tmp:
        logs = Path(tmp) / "logs"
        logs.mkdir()
        clock = Clock(args.timeout_s, args.deadline_s)
        suites = args.suite or sorted(SUITES)
        src = args.src.resolve()
        plans = _plans(src, suites, args)
        with ThreadPoolExecutor(max_workers=len(suites)) as pool:  # at once, each against the same deadline
            reports = list(
                pool.map(
                    lambda s: run_suite(s, src, Path(tmp), logs, args.python, clock, args.baseline, plans[s]), suites
                )
            )
        text, unexpected = summarize(reports)
        if args.out is not None:  # two files: a device run returns few
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "summary.md").write_text(text + "\n")
            with tarfile.open(args.out / "peer_suites_logs.tar.gz", "w:gz") as tar:
                tar.add(logs, arcname="peer_suites_logs")
    print(text)
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
