"""One plot per operator: lik against the peers, the references and the floor, across the operator's cells.

Each PNG has one group of bars per row of the operator's table (time on a log scale, one colour per method, the
same colour for a method in every plot) and the floor of each cell as a black tick. They read only the JSON, so
``lik bench --from-json results.json --plots DIR`` redraws them anywhere; matplotlib (the ``bench`` extra) draws
with its Agg backend, no display needed. Without matplotlib nothing is drawn and the returned note says so. Merged
runs (``lik bench --from-json A.json B.json``) draw the merged rows: the title lists the commits, and a row measured
before the newest of them names its commit under its bar group, as in the table.
"""

from __future__ import annotations

from pathlib import Path

from .ops import DISPLAY, OPS, Op, label
from .report import commit_text, section_rows

__all__ = ["plot_op", "plot_all"]

_COLOURS: dict[str, str] = {}


def _colour(method: str) -> str:
    if method not in _COLOURS:
        _COLOURS[method] = f"C{len(_COLOURS) % 10}"
    return _COLOURS[method]


def _median(entry: dict, column: str) -> float | None:
    if column in entry.get("sweeps", {}):
        return entry["sweeps"][column]["median_ms"]
    cell = entry["cells"].get(column)
    return None if cell is None else cell.get("median_ms")


def _floor_ms(entry: dict, op: Op) -> float | None:
    """The floor drawn for a cell: that of lik's first method where it has its own (the 8-bit cells' 1-byte floor),
    else the cell's."""
    own = (entry["cells"].get(op.lik[0]) or {}).get("floor_ms")
    return own or (entry.get("floor") or {}).get("floor_ms")


def plot_op(results: dict, op: Op, path: Path) -> bool:
    """Draw ``op``'s plot into ``path``; ``False`` (nothing written) when the run has no timed cell for it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, runs = section_rows(results, op)
    entries = [e for e in rows if "error" not in e]
    columns = [c for c in (*op.lik, *op.peers, *op.others) if any(_median(e, c) is not None for e in entries)]
    if not entries or not columns:
        return False
    scale = 1e3 if op.host else 1.0
    width = 0.8 / len(columns)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(entries) + 2.0), 4.6))
    for k, column in enumerate(columns):
        xs, ys = [], []
        for i, entry in enumerate(entries):
            ms = _median(entry, column)
            if ms is not None:
                xs.append(i + (k - (len(columns) - 1) / 2) * width)
                ys.append(ms * scale)
        ax.bar(xs, ys, width, label=DISPLAY.get(column, column), color=_colour(column))
    floors = [(i, f * scale) for i, e in enumerate(entries) if (f := _floor_ms(e, op))]
    if floors:
        ax.hlines(
            [f for _, f in floors],
            [i - 0.45 for i, _ in floors],
            [i + 0.45 for i, _ in floors],
            colors="k",
            linewidth=1.5,
            label="floor",
            zorder=3,
        )
    ax.set_yscale("log")
    ax.set_ylabel("host us per call (log)" if op.host else "median ms (log)")
    ax.set_xticks(range(len(entries)))
    ax.set_xticklabels([label(e) for e in entries], rotation=25, ha="right", fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    devices = ", ".join(dict.fromkeys(str(run["meta"].get("device")) for run in runs))
    commits = ", ".join(commit_text(run["meta"]) for run in runs)
    ax.set_title(f"{op.title}\n{devices}, lik {commits}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_all(results: dict, directory: Path, ops: list[Op] | None = None) -> str:
    """Draw every operator's plot (or those of ``ops``) as ``directory/<op>.png``; returns a one-line note."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return (
            "plots skipped: matplotlib is not installed (pip install 'lik-kernels[bench]'; then redraw with "
            "lik bench --from-json results.json --plots DIR)"
        )
    drawn = [op.name for op in (ops or OPS) if plot_op(results, op, Path(directory) / f"{op.name}.png")]
    return f"plots: {', '.join(drawn) or 'none'} in {directory}"
