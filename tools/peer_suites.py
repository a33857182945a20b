"""Run the peers' own test-suites against lik's compatibility modules in place of the peers.

    python tools/peer_suites.py --src .peer_src [--out DIR] [--suite NAME ...] [--workers N] [--baseline]
                                     [--timeout-s S] [--deadline-s S]

On the GPU machine (the sdists carried in the ignored folder ``.peer_src/``)::

    python3 tools/peer_suites.py --src .peer_src --out $OUT --workers 8 --deadline-s 540

``--src`` holds the peers' unpacked source distributions (``flash_maxsim-0.3.0/``, ``late_interaction_kernels-0.4.5/``;
``.tar.gz`` files are unpacked into the work folder), fetched with
``pip download --no-deps --no-binary=:all: flash-maxsim==0.3.0 late-interaction-kernels==0.4.5``. For each suite the
tool copies the sdist's ``tests/`` (and its pytest configuration) into a work folder and writes a shim package
named after the peer that re-exports lik's module (``lik.integrations.flash_maxsim`` /
``lik.integrations.late_interaction_kernels``); the shim folder leads ``PYTHONPATH``, so ``import flash_maxsim``,
its submodules and the tests' own subprocesses get lik. The peers' pure-PyTorch reference modules
(``flash_maxsim.naive``, ``late_interaction_kernels.reference``) load from the sdist: the suites compare lik with the
peers' own ground truth. Nothing of the peers is imported from site-packages.

pytest runs every test file with test functions; flash-maxsim's script-style files (module-level code, no test
functions) run as scripts, a pass being exit status 0 and no FAIL / BAD verdict printed (without CUDA they are not
run). Each failure is either one of the deliberate differences listed below (the reason is printed), a test known
to fail against the peer itself, or UNEXPECTED; failures of a test that needs CUDA on a machine without it, and of a
file that needs a package not installed, are counted apart. With ``--baseline`` the suite also runs against the peer
itself (its package from the sdist), and a failure it shares is marked as such. Files that test only the peer's own
reference or internal helpers are not run (listed with the reason). The exit status is 1 when anything is
UNEXPECTED. ``--out`` receives ``summary.md`` and ``peer_suites_logs.tar.gz`` (the JUnit XML and every log).
"""

from __future__ import annotations

import argparse
import fnmatch
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
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The peers' submodules each shim maps onto lik (peer name -> lik module), and their reference modules, which load
# from the sdist.
SUITES = {
    "flash_maxsim": {
        "sdist": "flash_maxsim-0.3.0",
        "lik": "lik.integrations.flash_maxsim",
        "aliases": {
            name: ""
            for name in (
                "flash_maxsim",
                "flash_maxsim_varlen",
                "flash_maxsim_batched_train",
                "flash_maxsim_quant",
                "flash_maxsim_rerank",
                "flash_maxsim_topk",
                "flash_maxsim_advanced",
                "flash_maxsim_pairs_dense",
                "warmup",
            )
        }
        | {"flash_maxsim_contrastive": ".contrastive"},
        "references": ("naive",),
        "version": "0.3.0",
    },
    "late_interaction_kernels": {
        "sdist": "late_interaction_kernels-0.4.5",
        "lik": "lik.integrations.late_interaction_kernels",
        "aliases": {
            "autograd": ".scoring",
            "varlen": ".scoring",
            "retrieve": ".scoring",
            "fp8": ".fp8",
            "padded": ".padded",
            "topk": ".topk",
            "score_pairs": ".score_pairs",
            "pylate_compat": ".pylate_compat",
            "colpali_compat": ".colpali_compat",
            "fused_head": ".fused_head",
            "plaid": ".plaid",
        },
        "references": ("reference",),
        "version": "0.4.5",
    },
}

# Test files that exercise only the peer's own code (its reference module or internal helpers): not run.
NOT_RUN = {
    "late_interaction_kernels": {
        "tests/test_reference_cpu.py": "tests the peer's reference module (loaded from the sdist), not lik",
        "tests/test_utils.py": "tests the peer's internal helpers (_utils)",
        "tests/test_autotune_kwargs.py": "tests the peer's autotuner configuration (_autotune)",
    },
}

_NO_NORM_WARNING = "lik prints no warning for unnormalised inputs (the peer's autograd._maybe_warn_unnormalized)"
_PEER_INTERNALS = "tests the peer's kernels or internals (not part of the API lik replaces)"
_PATCH_INTERNALS = (
    "patch_pylate / patch_colpali_engine are lik's switches: no names rebound, no _ORIGINAL, "
    "patched_* or package_at_least; they act on every device and host version"
)
# Deliberate differences: (suite, node id pattern, reason). Listed in the compatibility modules' docstrings.
DIFFERENCES = [
    (
        "flash_maxsim",
        "tests/test_flash_maxsim.py::test_chamfer_backward",
        "flash_chamfer is not covered (lik.chamfer_distance has PyTorch3D's contract)",
    ),
    ("flash_maxsim", "tests/test_flash_maxsim.py::test_sparse_maxsim*", "flash_maxsim_sparse is not covered"),
    ("flash_maxsim", "tests/test_sparse_dd.py*", "flash-maxsim's sparse_dd backward is not covered"),
    (
        "flash_maxsim",
        "tests/test_splitd_int8_warmup.py::test_int8_train_gradient_quality",
        "flash_maxsim_int8_batched_train is not covered (lik's 8-bit scoring is inference only)",
    ),
    ("flash_maxsim", "tests/test_invgrid_correctness.py", "flash-maxsim's invgrid backward proposal is not covered"),
    (
        "late_interaction_kernels",
        "tests/test_retrieve_cpu.py::test_suppress_norm_warn_env_var_silences_warning",
        _NO_NORM_WARNING,
    ),
    (
        "late_interaction_kernels",
        "tests/test_retrieve_cpu.py::test_unnormalized_warn_fires_once_direct",
        _NO_NORM_WARNING,
    ),
    (
        "late_interaction_kernels",
        "tests/test_retrieve_cpu.py::test_norm_check_runs_once_even_when_normalized",
        _NO_NORM_WARNING,
    ),
    ("late_interaction_kernels", "tests/test_retrieve.py::test_unnormalized_input_warns_once", _NO_NORM_WARNING),
    ("late_interaction_kernels", "tests/test_forward.py::test_chunked_backward_matches_unchunked*", _PEER_INTERNALS),
    ("late_interaction_kernels", "tests/test_forward.py::test_kd_over_ceil_still_warns", _PEER_INTERNALS),
    ("late_interaction_kernels", "tests/test_backward_lowmem.py*", _PEER_INTERNALS),
    ("late_interaction_kernels", "tests/test_backward_unified.py*", _PEER_INTERNALS),
    ("late_interaction_kernels", "tests/test_compile_cache.py*", _PEER_INTERNALS),
    ("late_interaction_kernels", "tests/test_public_api.py*", "the mps backend is not covered"),
    (
        "late_interaction_kernels",
        "tests/test_robustness.py::test_no_grad_does_not_save_argmax_buffer",
        "lik keeps the winners as int16 when Ld < 32 768 (half the peer's int32 buffer): no_grad does skip the save, "
        "but the saving is below the test's int32-sized threshold",
    ),
    (
        "late_interaction_kernels",
        "tests/test_plaid.py::test_residual_backward_rejects_empty_docs",
        "plaid.maxsim_residual gives an empty document a zero gradient (the peer raises ValueError in training)",
    ),
    ("late_interaction_kernels", "tests/test_pylate_compat_fallback.py*", _PATCH_INTERNALS),
    ("late_interaction_kernels", "tests/test_pylate_compat_warnings.py*", _PATCH_INTERNALS),
    ("late_interaction_kernels", "tests/test_pylate_compat.py::test_*_uses_patched_scores", _PATCH_INTERNALS),
    ("late_interaction_kernels", "tests/test_pylate_compat.py::test_unpatch_restores_original", _PATCH_INTERNALS),
    (
        "late_interaction_kernels",
        "tests/test_pylate_compat.py::test_patch_pylate_is_noop_on_native_pylate",
        _PATCH_INTERNALS,
    ),
    ("late_interaction_kernels", "tests/test_colpali_compat.py::test_patch_and_unpatch_round_trip", _PATCH_INTERNALS),
    ("late_interaction_kernels", "tests/test_colpali_compat.py::test_double_patch_is_idempotent", _PATCH_INTERNALS),
    ("late_interaction_kernels", "tests/test_colpali_compat.py::test_lik_disable_falls_through", _PATCH_INTERNALS),
    (
        "late_interaction_kernels",
        "tests/test_colpali_compat.py::test_patched_score_multi_vector_matches_original_cuda",
        _PATCH_INTERNALS,
    ),
    (
        "late_interaction_kernels",
        "tests/test_colpali_compat.py::test_patch_colpali_engine_is_noop_on_native_colpali",
        _PATCH_INTERNALS,
    ),
    (
        "late_interaction_kernels",
        "tests/test_padded.py::test_pack_padded_async_assert_*",
        "pack_padded refuses a length past the padding with ValueError on the host, not a device-side assert",
    ),
    (
        "late_interaction_kernels",
        "tests/test_varlen.py::test_varlen_too_small_max_seqlen_asserts",
        "max_seqlen_* are hints in lik: a small one costs speed, never tokens (no device-side assert)",
    ),
]

_HALF_VS_FLOAT = (
    "torch.allclose of flash-maxsim's float16 maxsim_naive and its float32 scores raises 'Half did not "
    "match Float', whatever the scores"
)
# Tests that fail against the peer itself whatever scores it computes (--baseline confirms them on a GPU).
FAILS_WITH_PEER = [
    ("flash_maxsim", "tests/test_flash_maxsim.py::test_correctness", _HALF_VS_FLOAT),
    ("flash_maxsim", "tests/test_flash_maxsim.py::test_variable_lengths", _HALF_VS_FLOAT),
    ("flash_maxsim", "tests/test_flash_maxsim.py::test_varlen_correctness", _HALF_VS_FLOAT),
    ("flash_maxsim", "tests/test_flash_maxsim.py::test_large_embedding_dim*", _HALF_VS_FLOAT),
]

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


def _run(cmd: list[str], cwd: Path, env: dict, timeout_s: int) -> tuple[int | None, str]:
    """``(exit status, output)``; at the time limit the command and its children (pytest-xdist's workers) are
    killed and the status is None."""
    process = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
        return process.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return None, f"stopped after {timeout_s} s\n{output}"


def _run_pytest(python, files, cwd, env, out, name, clock: Clock, workers) -> list[Outcome]:
    timeout_s = clock.limit()
    if timeout_s <= 0:
        return [Outcome(f, "not run", "--deadline-s reached") for f in files]
    junit = out / f"{name}.junit.xml"
    cmd = [
        python,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rs",
        "--continue-on-collection-errors",
        f"--junitxml={junit}",
        *(["-n", str(workers)] if workers > 1 else []),
        *files,
    ]
    code, log = _run(cmd, cwd, env, timeout_s)
    (out / f"{name}.pytest.log").write_text(log)
    if code is None:
        return [
            Outcome(f, "not run", f"pytest stopped at its {timeout_s} s limit (run this suite alone)") for f in files
        ]
    if not junit.is_file():
        return [Outcome(f, "failed", "pytest wrote no report (see the log)") for f in files]
    return _junit_outcomes(junit)


def _run_script(python, path, cwd, env, out, name, clock: Clock) -> Outcome:
    timeout_s = clock.limit()
    if timeout_s <= 0:
        return Outcome(path, "not run", "--deadline-s reached")
    code, log = _run([python, path], cwd, env, timeout_s)
    (out / f"{name}.{Path(path).stem}.log").write_text(log)
    if code is None:
        return Outcome(path, "not run", f"stopped at its {timeout_s} s limit")
    verdicts = [line for line in log.splitlines() if _VERDICT.search(line)]
    if code == 0 and not verdicts:
        return Outcome(path, "passed")
    last = log.strip().splitlines()[-1] if log.strip() else ""
    return Outcome(path, "failed", f"exit {code}; " + ("; ".join(verdicts[:3]) if verdicts else last) + "\n" + log)


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
    for name, pattern, reason in FAILS_WITH_PEER:
        if name == suite and fnmatch.fnmatch(outcome.test, pattern) and "did not match" in outcome.detail:
            return f"fails with the peer too: {reason}"
    return "UNEXPECTED"


def _run_tests(
    root: Path, env: dict, out: Path, tag: str, python: str, cuda: bool, skipped: dict, clock: Clock, workers: int
) -> list[Outcome]:
    files = sorted(p.relative_to(root).as_posix() for p in (root / "tests").glob("test_*.py"))
    outcomes = [Outcome(f, "not run", skipped[f]) for f in files if f in skipped]
    files = [f for f in files if f not in skipped]
    with_tests = [f for f in files if re.search(r"^\s*def test_", (root / f).read_text(), re.MULTILINE)]
    outcomes += _run_pytest(python, with_tests, root, env, out, tag, clock, workers)
    for script in (f for f in files if f not in with_tests):
        if cuda:
            outcomes.append(_run_script(python, script, root, env, out, tag, clock))
        else:
            outcomes.append(Outcome(script, "not run", "script-style file: needs CUDA"))
    return outcomes


def run_suite(
    suite: str, src: Path, work: Path, out: Path, python: str, clock: Clock, baseline: bool, workers: int = 0
) -> SuiteReport:
    """The suite against lik (the shim), and with ``baseline`` against the peer itself (the sdist's package)."""
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
    skipped = NOT_RUN.get(suite, {})
    report = SuiteReport(suite, _run_tests(root, env, out, suite, python, cuda, skipped, clock, workers))
    failed_with_peer = set()
    if baseline:
        report.peer = _run_tests(root, _env(sdist), out, f"{suite}.peer", python, cuda, skipped, clock, workers)
        failed_with_peer = {o.test for o in report.peer if o.status == "failed"}
    for outcome in report.outcomes:
        outcome.status = _classify(suite, outcome, cuda, failed_with_peer)
    return report


def summarize(reports: list[SuiteReport]) -> tuple[str, int]:
    lines, unexpected = [], 0
    for report in reports:
        counts: dict[str, int] = {}
        for outcome in report.outcomes:
            key = outcome.status.split(":")[0]
            counts[key] = counts.get(key, 0) + 1
        lines.append(f"## {report.name}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
        if report.peer is not None:
            peer_counts: dict[str, int] = {}
            for outcome in report.peer:
                peer_counts[outcome.status] = peer_counts.get(outcome.status, 0) + 1
            lines.append("the peer itself: " + ", ".join(f"{n} {k}" for k, n in sorted(peer_counts.items())))
        for outcome in report.outcomes:
            if outcome.status in ("passed", "skipped"):
                continue
            first = outcome.detail.strip().splitlines()[0][:160] if outcome.detail.strip() else ""
            note = "" if outcome.status.startswith(("listed", "fails with the peer too:")) else f"  ({first})"
            lines.append(f"- {outcome.test}: {outcome.status}{note}")
        unexpected += counts.get("UNEXPECTED", 0)
        skips: dict[str, int] = {}
        for outcome in report.outcomes:
            if outcome.status == "skipped":
                skips[outcome.detail[:120]] = skips.get(outcome.detail[:120], 0) + 1
        lines += [f"- skipped {n}: {reason}" for reason, n in sorted(skips.items())]
        lines.append("")
    return "\n".join(lines), unexpected


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, required=True, help="folder with the peers' unpacked sdists")
    parser.add_argument("--out", type=Path, help="folder for summary.md and peer_suites_logs.tar.gz")
    parser.add_argument("--suite", action="append", choices=sorted(SUITES), help="run only these suites")
    parser.add_argument("--python", default=sys.executable, help="interpreter that runs the tests")
    parser.add_argument("--timeout-s", type=int, default=480, help="limit for each pytest run and each script")
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="also run each suite against the peer itself (from the sdist): a failure it shares is "
        "marked 'fails with the peer too'",
    )
    parser.add_argument(
        "--deadline-s", type=int, help="time for the whole run: what would start after it is reported as not run"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        help="pytest-xdist workers for the pytest files (kernel compilation runs on the CPUs)",
    )
    args = parser.parse_args(argv)
    if not args.src.is_dir():
        parser.error(f"--src {args.src} is not a folder")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} exists and is not a folder")
    with tempfile.TemporaryDirectory(prefix="peer_suites_") as tmp:
        logs = Path(tmp) / "logs"
        logs.mkdir()
        clock = Clock(args.timeout_s, args.deadline_s)
        reports = [
            run_suite(s, args.src.resolve(), Path(tmp), logs, args.python, clock, args.baseline, args.workers)
            for s in (args.suite or sorted(SUITES))
        ]
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
