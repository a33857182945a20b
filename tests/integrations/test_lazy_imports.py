"""Importing lik or lik.integrations imports no host library; nothing under lik.ops imports one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HOSTS = ("pylate", "colpali_engine", "sentence_transformers", "transformers", "flash_maxsim",
         "late_interaction_kernels")
SRC = Path(__file__).resolve().parents[2] / "src"


def test_importing_lik_and_its_integrations_loads_no_host():
    code = ("import sys, lik, lik.integrations\n"
            "import lik.integrations.pylate, lik.integrations.colpali, lik.integrations.sentence_transformers\n"
            "import lik.integrations.transformers, lik.integrations.flash_maxsim\n"
            "import lik.integrations.late_interaction_kernels\n"
            f"print(sorted(h for h in {HOSTS!r} if h in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(SRC), "PATH": ""})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_ops_source_names_no_host():
    for path in (SRC / "lik" / "ops").rglob("*.py"):
        text = path.read_text()
        for host in HOSTS:
            assert f"import {host}" not in text and f"from {host}" not in text, (path, host)


def test_integrations_package_is_lazy():
    import lik.integrations as integrations

    assert set(integrations.__all__) == {"pylate", "colpali", "sentence_transformers", "transformers",
                                         "hf_kernels", "flash_maxsim", "late_interaction_kernels"}
    assert integrations.flash_maxsim.__name__ == "lik.integrations.flash_maxsim"
