"""tools/peer_suites.py: the shim puts lik in the peer's place (its API submodules lik's, its reference
modules the sdist's), failures are sorted into listed differences, peer failures, missing CUDA or packages and
UNEXPECTED, and a run reports per suite with an exit status that says whether anything is unexpected."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts import REPO, load_script


@pytest.fixture(scope="module")
def tool():
    return load_script("tools/peer_suites.py", "peer_suites")


def _fake_sdist(root: Path, suite: str, sdist: str, tests: dict[str, str], package: dict[str, str]) -> Path:
    for name, text in package.items():
        (root / sdist / suite).mkdir(parents=True, exist_ok=True)
        (root / sdist / suite / name).write_text(text)
    (root / sdist / "tests").mkdir(parents=True)
    for name, text in tests.items():
        (root / sdist / "tests" / name).write_text(text)
    return root


def test_classification(tool):
    Outcome = tool.Outcome
    suite = "late_interaction_kernels"

    def status(test, detail, cuda=True, peer=frozenset()):
        return tool._classify(suite, Outcome(test, "failed", detail), cuda, set(peer))

    assert status("tests/test_plaid.py::test_residual_backward_rejects_empty_docs", "DID NOT RAISE").startswith(
        "listed: "
    )
    assert status("tests/test_plaid.py::test_residual_matches_dense_maxsim", "assert 0.5 < 0.03") == "UNEXPECTED"
    assert status("tests/test_x.py::test_y", "No module named 'late_interaction_kernels.autograd'") == "UNEXPECTED"
    assert status("tests/test_x.py::test_y", "ModuleNotFoundError: No module named 'pylate.scores'") == "needs pylate"
    assert status("tests/test_x.py::test_y", "Torch not compiled with CUDA enabled", cuda=False) == "needs CUDA"
    assert status("tests/test_x.py::test_y", "Torch not compiled with CUDA enabled") == "UNEXPECTED"
    assert status("tests/test_x.py::test_y", "assert 1 < 0", peer={"tests/test_x.py::test_y"}) == (
        "fails with the peer too"
    )
    assert tool._classify(
        "flash_maxsim",
        Outcome("tests/test_flash_maxsim.py::test_correctness", "failed", "RuntimeError: Half did not match Float"),
        True,
        set(),
    ).startswith("fails with the peer too: ")
    assert (
        tool._classify(
            "flash_maxsim",
            Outcome("tests/test_flash_maxsim.py::test_correctness", "failed", "assert tensor(False)"),
            True,
            set(),
        )
        == "UNEXPECTED"
    )
    # A script failing with the peer too is known by its failure's signature; any other failure of it is not.
    script = "tests/test_batched_train.py"
    signature = "AttributeError: 'bool' object has no attribute 'requires_grad'"
    assert tool._classify("flash_maxsim", Outcome(script, "failed", f"exit 1; {signature}"), True, set()).startswith(
        "fails with the peer too: "
    )
    assert tool._classify("flash_maxsim", Outcome(script, "failed", "exit 0; score_err BAD"), True, set()) == (
        "UNEXPECTED"
    )
    for node in (
        "tests/test_pylate_compat.py::test_lik_disable_env_falls_back",
        "tests/test_pylate_compat.py::test_patched_with_both_masks_matches_pylate",
        "tests/test_pylate_compat.py::test_patched_kd_matches_pylate",
    ):
        assert status(node, "AssertionError: err=0.44").startswith("listed: ")
    assert status("tests/test_pylate_compat.py::test_patched_with_documents_mask", "err=0.4") == "UNEXPECTED"
    assert tool._classify(suite, Outcome("tests/test_x.py::test_y", "passed"), True, set()) == "passed"


def test_shim_maps_api_submodules_to_lik_and_references_to_the_sdist(tool, tmp_path):
    suite = "late_interaction_kernels"
    spec = tool.SUITES[suite]
    peer_dir = tmp_path / "sdist" / suite
    peer_dir.mkdir(parents=True)
    (peer_dir / "reference.py").write_text("SOURCE = 'the sdist'\n")
    shim = tmp_path / "shim" / suite
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(tool._shim_source(suite, spec, peer_dir))
    code = (
        "import sys, importlib\n"
        "import late_interaction_kernels as li, lik.integrations.late_interaction_kernels as ours\n"
        "from late_interaction_kernels import autograd, reference\n"
        "from late_interaction_kernels.fp8 import maxsim_inference_fp8\n"
        "assert li.maxsim is ours.maxsim and li.retrieve is ours.retrieve and autograd is ours.scoring\n"
        "assert maxsim_inference_fp8 is ours.fp8.maxsim_inference_fp8 and reference.SOURCE == 'the sdist'\n"
        "importlib.import_module('late_interaction_kernels.pylate_compat')\n"
        "sys.modules.pop('late_interaction_kernels.pylate_compat')  # a test re-importing it finds lik's again\n"
        "assert importlib.import_module('late_interaction_kernels.pylate_compat') is ours.pylate_compat\n"
        "from late_interaction_kernels.plaid import maxsim_residual\n"
        "assert maxsim_residual is ours.plaid.maxsim_residual\n"
        "from late_interaction_kernels.fused_head import maxsim_from_hidden\n"
        "assert maxsim_from_hidden is ours.fused_head.maxsim_from_hidden and li.plaid is ours.plaid\n"
        "print('lik plaid')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "shim"), str(REPO / "src")]))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "lik plaid", run.stderr


def test_flash_shim_keeps_the_packages_functions_over_its_submodules(tool, tmp_path):
    # PyLate's flash backend imports flash_maxsim_batched_train from the package after a test imported the
    # submodule of that name: the package's name must still be the function, as in the peer.
    suite = "flash_maxsim"
    peer_dir = tmp_path / "sdist" / suite
    peer_dir.mkdir(parents=True)
    (peer_dir / "naive.py").write_text("def maxsim_naive():\n    return 'the sdist'\n")
    shim = tmp_path / "shim" / suite
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(tool._shim_source(suite, tool.SUITES[suite], peer_dir))
    code = (
        "import flash_maxsim.flash_maxsim_batched_train, flash_maxsim.flash_maxsim, flash_maxsim.warmup\n"
        "import lik.integrations.flash_maxsim as ours\n"
        "from flash_maxsim import flash_maxsim, flash_maxsim_batched_train, warmup\n"
        "from flash_maxsim.flash_maxsim_contrastive import colbert_contrastive_step\n"
        "assert flash_maxsim_batched_train is ours.flash_maxsim_batched_train and flash_maxsim is ours.flash_maxsim\n"
        "assert warmup is ours.warmup and colbert_contrastive_step is ours.colbert_contrastive_step\n"
        "assert ours.__spec__.name == 'lik.integrations.flash_maxsim', ours.__spec__\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "shim"), str(REPO / "src")]))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr


def test_a_run_reports_each_outcome_and_fails_on_the_unexpected(tool, tmp_path, capsys):
    tests = {
        "test_flash_maxsim.py": (
            "import flash_maxsim, lik.integrations.flash_maxsim as ours\n"
            "def test_shadowed():\n    assert flash_maxsim.flash_maxsim_batched is ours.flash_maxsim_batched\n"
            "def test_reference_is_the_sdists():\n    assert flash_maxsim.maxsim_naive() == 'the sdist'\n"
            "def test_chamfer_backward():\n    from flash_maxsim.flash_chamfer import flash_chamfer_train\n"
            "def test_broken():\n    assert False, 'a real failure'\n"
        ),
        "test_sparse_dd.py": "def test_never_run():\n    assert False\n",  # every test listed: not run
    }
    src = _fake_sdist(
        tmp_path / "src",
        "flash_maxsim",
        "flash_maxsim-0.3.0",
        tests,
        {"__init__.py": "", "naive.py": "def maxsim_naive():\n    return 'the sdist'\n"},
    )
    out = tmp_path / "out"
    status = tool.main(["--src", str(src), "--out", str(out), "--suite", "flash_maxsim", "--timeout-s", "300"])
    printed = capsys.readouterr().out
    assert status == 1
    assert printed.startswith("## flash_maxsim: 1 UNEXPECTED, 2 listed, 2 passed (")
    assert "- tests/test_sparse_dd.py: listed: flash-maxsim's sparse_dd backward is not covered (every test" in printed
    assert "- tests/test_flash_maxsim.py::test_broken: UNEXPECTED  (AssertionError: a real failure" in printed
    assert "- tests/test_flash_maxsim.py::test_chamfer_backward: listed: flash_chamfer is not covered" in printed
    assert (out / "summary.md").read_text().strip() == printed.strip()
    assert (out / "peer_suites_logs.tar.gz").is_file()
    with pytest.raises(SystemExit):
        tool.main(["--src", str(tmp_path / "nowhere")])


def test_time_limits(tool, tmp_path):
    assert tool.Clock(100, None).limit() == 100 and tool.Clock(100, 3600).limit() == 100
    spent = tool.Clock(100, 0)
    assert spent.limit() == 0
    assert [
        o.status for o in tool._run_pytest(sys.executable, ["tests/test_a.py"], tmp_path, {}, tmp_path, "x", spent, 0)
    ] == ["not run"]
    code, output = tool._run(
        [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
        tmp_path,
        dict(os.environ),
        2,
    )
    assert code is None and "stopped after 2 s" in output and "started" in output
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(60)\n")
    outcome = tool._run_script(
        sys.executable, "slow.py", tmp_path, dict(os.environ), tmp_path, "x", tool.Clock(2, None)
    )
    assert outcome.status == "not run" and "2 s limit" in outcome.detail


def test_a_stopped_pytest_keeps_what_finished_and_scripts_run_as_themselves(tool, tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_quick():\n    pass\n")
    (tmp_path / "tests" / "test_b.py").write_text("import time\n\ndef test_slow():\n    time.sleep(120)\n")
    # No installed plugins, so the inner run starts fast on a loaded machine, and 30 s for test_a to finish in.
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    outcomes = tool._run_pytest(
        sys.executable, ["tests/test_a.py", "tests/test_b.py"], tmp_path, env, tmp_path, "x", tool.Clock(30, None), 0
    )
    assert [(o.test, o.status) for o in outcomes] == [
        ("tests/test_a.py::test_quick", "passed"),
        ("tests/test_b.py", "not run"),
    ]
    (tmp_path / "tests" / "script.py").write_text(
        "import os, sys\nprint(os.path.basename(__file__), sys.path[0] == os.path.dirname(os.path.abspath(__file__)))\n"
        "print('check 1 OK')\n"
    )
    outcome = tool._run_script(
        sys.executable, "tests/script.py", tmp_path, env, tmp_path, "x", tool.Clock(300, None), 1.0
    )
    assert outcome.status == "passed"
    assert (tmp_path / "x.script.log").read_text().splitlines()[0] == "script.py True"
    (tmp_path / "tests" / "bad.py").write_text("print('grad [FAIL]', flush=True)\nimport time\ntime.sleep(120)\n")
    outcome = tool._run_script(sys.executable, "tests/bad.py", tmp_path, env, tmp_path, "x", tool.Clock(5, None))
    assert outcome.status == "failed" and outcome.detail.startswith("stopped; grad [FAIL]")
