"""``lik bench``: the benchmark harness (one registry of shapes and methods, one process, methods interleaved).

Run ``python -m lik.bench --suite all --out DIR`` on a GPU (or ``lik bench ...``); ``--smoke`` checks the
plumbing on a CPU. Results go to ``DIR/results.json`` (device, versions, commit, ceilings, every cell),
``DIR/table.txt`` and ``DIR/bench.png``. See ``benchmarks/README.md``.
"""

from .methods import METHODS, Method, select_methods
from .roofline import Ceilings, Floor, floor, flop_count, min_bytes
from .runner import main, run
from .shapes import CANONICAL_SHAPES, SMOKE_SHAPES, Shape, select_shapes

__all__ = [
    "main",
    "run",
    "Shape",
    "CANONICAL_SHAPES",
    "SMOKE_SHAPES",
    "select_shapes",
    "Method",
    "METHODS",
    "select_methods",
    "Ceilings",
    "Floor",
    "floor",
    "flop_count",
    "min_bytes",
]
