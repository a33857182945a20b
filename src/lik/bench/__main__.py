"""``python -m lik.bench``: the same as ``lik bench`` (:func:`lik.bench.runner.main`).

``python -m lik.bench --from-json OLD.json NEW.json --out DIR --plots DIR`` merges the runs (a later file's cell
replaces an earlier file's, see :func:`lik.bench.report.load_results`), prints the tables, writes ``DIR/bench.md``
and redraws the plots from the merged rows; no GPU is needed.
"""

from __future__ import annotations

import sys

from .runner import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
