"""A synthetic results JSON (what ``lik bench`` writes) for the tests of the tables and the plots: the numbers are
made up, chosen so that every ratio a table prints is known in advance."""

from __future__ import annotations

import copy

import pytest

PEERS_ABSENT = "import flash_maxsim failed: ModuleNotFoundError: No module named 'flash_maxsim'"


def _cell(ms, pct=None, status="ok", peak=None, **extra):
    return {"status": status, "round_ms": [ms], "median_ms": ms, "pct_of_floor": pct, "peak_MB": peak, **extra}


def _shape(suite, family, nq, lq, ld, b, d=128):
    return {"suite": suite, "family": family, "nq": nq, "lq": lq, "ld": ld, "b": b, "d": d, "quick": True}


SYNTHETIC = {
    "schema": 2,
    "meta": {
        "device": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0", "git_commit": "0123456789abcdef",
        "git_dirty": False, "peers": {"flash-maxsim": None, "late-interaction-kernels": "0.4.5"},
        "command": "lik bench --quick", "settings": {"dtype": "float16"},
    },
    "ceilings": {"bandwidth_GBps": 4250.0, "matmul_TFLOPps": 680.0},
    "quantize": [{"what": "lik.quantize fp16 [3000000, 128] -> int8", "median_ms": 0.296, "pct_of_floor": 93.4}],
    "shapes": [
        {   # schema 1 had no labels: the row label is made from the shape
            "name": "forward/colpali/B1000", "shape": _shape("forward", "colpali", 1, 1024, 1024, 1000),
            "floor": {"floor_ms": 0.392}, "sweeps": {},
            "cells": {
                "lik": _cell(0.453, 86.5, peak=0.0),
                "flash-maxsim": {"status": "unavailable", "error": PEERS_ABSENT},
                "late-interaction-kernels": _cell(0.677),
                "eager": _cell(1.96, 20.0),
                "lik-int8": _cell(0.30, 60.0, storage="int8"),
                "lik-fp8": _cell(0.2831, 70.0, storage="fp8"),
                "flash-maxsim-int8x8": {"status": "unavailable", "error": PEERS_ABSENT},
                "late-interaction-kernels-fp8": _cell(0.5309, 30.0, storage="fp8"),
            },
        },
        {
            "name": "train/colbert-train/B512", "label": "colbert-train 32x180, B 512",
            "shape": _shape("train", "colbert-train", 512, 32, 180, 512), "floor": {"floor_ms": 0.589},
            "cells": {
                "lik-fast": _cell(2.82, 20.9, peak=60.0),
                "lik-deterministic": _cell(2.85, 20.7, peak=84.0),
                "flash-maxsim": {"status": "unavailable", "error": PEERS_ABSENT},
                "late-interaction-kernels": _cell(4.55, peak=61.0),
                "eager": _cell(14.1, status="mismatch", peak=5761.0),
            },
        },
    ],
    "cases": [
        {
            "name": "chamfer/1x100000x3", "label": "N 1, P 100 000, D 3", "op": "chamfer",
            "floor": {"floor_ms": 0.128}, "cells": {
                "lik": _cell(6.40, 2.0),
                "flash-maxsim": _cell(14.7, 0.9, status="mismatch"),
                "chamferdist": _cell(46.7, 0.3),
                "keops": {"status": "error", "error": "RuntimeError: segmentation"},
            },
        },
        {
            "name": "host/maxsim-small", "label": "lik.maxsim, 32 x 128 query, 10 x 100 documents", "op": "host",
            "floor": None, "cells": {
                "lik": _cell(0.0221),
                "late-interaction-kernels": _cell(0.0513),
            },
        },
        {
            "name": "host/colbert-train-step", "label": "ColBERT training step, B 128 (32 x 180)", "op": "host",
            "floor": None, "cells": {"lik": _cell(1.2345), "late-interaction-kernels": _cell(2.469)},
        },
    ],
    "skipped": ["chamfer/1x1000000x3"],
    "wall_s": 412.0,
}


@pytest.fixture
def synthetic_results() -> dict:
    """A fresh copy of :data:`SYNTHETIC` (tests may change it)."""
    return copy.deepcopy(SYNTHETIC)
