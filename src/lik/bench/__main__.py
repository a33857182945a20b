"""``python -m lik.bench``: the same as ``lik bench``, with ``--from-json`` taking one or more results files.

``python -m lik.bench --from-json OLD.json NEW.json --out DIR --plots DIR`` merges the runs (a later file's cell
replaces an earlier file's, see :func:`lik.bench.report.load_results`), prints the tables, writes ``DIR/bench.md``
and redraws the plots from the merged rows; no GPU is needed. Without ``--from-json`` the arguments go to
:func:`lik.bench.runner.main` unchanged.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .ops import select_ops
from .plots import plot_all
from .report import format_report, load_results
from .runner import main as run_main
from .runner import parse_args

__all__ = ["main"]


def _from_json_paths(argv: list[str]) -> tuple[list[str] | None, list[str]]:
    """The files after ``--from-json`` (``None`` when absent) and the other arguments."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--from-json", nargs="+", default=None)
    known, rest = parser.parse_known_args(argv)
    return known.from_json, rest


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m lik.bench``; returns the process exit code.

    Example:
        >>> main(["--from-json", "bench_h200_181de6b.json", "bench_h200_b027828.json", "--no-plot"])  # doctest: +SKIP
        0
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        return run_main(argv)
    paths, rest = _from_json_paths(argv)
    if paths is None:
        return run_main(argv)
    # The other flags are the harness's own (--ops, --out, --plots, --no-plot): its parser checks them.
    args = parse_args([*rest, "--from-json", paths[-1]])
    try:
        ops = select_ops(args.ops)
        results = load_results(paths)
    except ValueError as exc:
        raise SystemExit(f"lik bench: {exc}") from None
    text = format_report(results, ops)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.md").write_text(text + "\n")
    if not args.no_plot:
        print(plot_all(results, Path(args.plots) if args.plots else out_dir / "plots", ops))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
