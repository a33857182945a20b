"""``lik bench``: the benchmark harness (one process, methods interleaved, against ceilings measured in the run).

Run ``python -m lik.bench --quick --out DIR`` on a GPU (or ``lik bench ...``, ``make bench``); ``--smoke`` checks
the plumbing on a CPU. One table and one plot per operator of BENCHMARKS.md (``--ops``): ``DIR/results.json``
(device, versions, commit, ceilings, every cell), ``DIR/bench.md`` (the tables in BENCHMARKS.md's layout) and
``DIR/plots/<op>.png``. Peers that are not installed are skipped with a note. See ``benchmarks/README.md``.
"""

from .cases import Case, CaseMethod, run_case
from .methods import METHODS, Method, select_methods
from .ops import OPS, Op, select_ops
from .plots import plot_all
from .report import format_report
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
    "Case",
    "CaseMethod",
    "run_case",
    "Op",
    "OPS",
    "select_ops",
    "format_report",
    "plot_all",
    "Ceilings",
    "Floor",
    "floor",
    "flop_count",
    "min_bytes",
]
