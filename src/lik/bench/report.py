"""Human-readable views of a results JSON: the text table printed last, and the PNG plot.

Both read only the JSON (``lik bench --from-json results.json`` redraws them anywhere), so a device without
matplotlib still yields a plot later.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["format_table", "plot_results", "columns", "PEERS", "EIGHT_BIT_PEERS"]

PEERS = ("flash-maxsim", "late-interaction-kernels")
EIGHT_BIT_PEERS = ("flash-maxsim-int8x8", "late-interaction-kernels-fp8")
_SHORT = {
    "late-interaction-kernels": "li-kernels", "lik-deterministic": "lik-det", "eager-chunked": "chunked*",
    "flash-maxsim-int8x8": "fm-int8x8", "late-interaction-kernels-fp8": "li-fp8",
}


def columns(results: dict) -> list[str]:
    """Method columns in registry order, each sweep collapsed to one column (its best member)."""
    cols: list[str] = []
    for name, info in results["methods"].items():
        col = info.get("sweep") or name
        if col not in cols:
            cols.append(col)
    return cols


def _cell(entry: dict, col: str) -> dict | None:
    """The cell shown in column ``col``: the method's own, or the best of the sweep ``col``."""
    if col in entry.get("sweeps", {}):
        return entry["cells"][entry["sweeps"][col]["best"]]
    if col in entry["cells"]:
        return entry["cells"][col]
    members = [c for c in entry["cells"].values() if c.get("sweep") == col]
    return members[0] if members else None


def _fmt(cell: dict | None) -> str:
    if cell is None:
        return "-"
    if "median_ms" not in cell:
        return {"unavailable": "n/a"}.get(cell.get("status"), cell.get("status", "?"))
    mark = "!" if cell["status"] == "mismatch" else ""
    return f"{cell['median_ms']:.3g}/{cell['pct_of_floor']:.0f}%{mark}"


def _peak(cell: dict | None) -> str:
    return "-" if cell is None or cell.get("peak_MB") is None else f"{cell['peak_MB']:.0f}"


def _speedups(entry: dict) -> str:
    """Each lik method's speedup over the faster peer (``x`` > 1: lik is faster); an 8-bit lik method's over the
    faster 8-bit peer and over lik's own fp16 / bf16 / fp32 call."""
    cells = entry["cells"]

    def best(names):
        times = [cells[p]["median_ms"] for p in names if "median_ms" in cells.get(p, {})]
        return min(times) if times else None

    float_peer, eight_bit_peer = best(PEERS), best(EIGHT_BIT_PEERS)
    parts = []
    for name, cell in cells.items():
        if not name.startswith("lik") or "median_ms" not in cell:
            continue
        if cell.get("storage"):
            if eight_bit_peer:
                parts.append(f"{name} {eight_bit_peer / cell['median_ms']:.2f}x")
            if "median_ms" in cells.get("lik", {}):
                parts.append(f"{name} vs lik {cells['lik']['median_ms'] / cell['median_ms']:.2f}x")
        elif float_peer:
            parts.append(f"{_SHORT.get(name, name)} {float_peer / cell['median_ms']:.2f}x")
    return ", ".join(parts)


def format_table(results: dict) -> str:
    """One block per suite: each method's median ms / % of floor and lik's speedup over the faster peer, then
    the peak memory in MB. ``!`` marks a method whose output disagreed with the float64 reference."""
    meta, ceil = results["meta"], results["ceilings"]
    lines = [
        f"lik bench | {meta.get('device')} | torch {meta.get('torch')} triton {meta.get('triton')} | "
        f"commit {str(meta.get('git_commit'))[:12]}{'+dirty' if meta.get('git_dirty') else ''} | "
        f"{meta['settings']['dtype']}",
        f"ceilings: copy {ceil['bandwidth_GBps']:.0f} GB/s (read+write), matmul {ceil['matmul_TFLOPps']:.4g} TFLOP/s; "
        "cells: median ms / % of floor ('!' = disagrees with reference, see JSON); 8-bit cells against their own "
        "floor (1-byte operands, the 8-bit matmul rate)",
    ]
    cols = columns(results)
    for suite in ("forward", "multi", "train"):
        entries = [e for e in results["shapes"] if e["shape"]["suite"] == suite]
        if not entries:
            continue
        used = [c for c in cols if any(_cell(e, c) is not None for e in entries)]
        head = f"{'shape':30s} {'floor ms':>9s} {'bound':>7s} " + " ".join(f"{_SHORT.get(c, c):>14s}" for c in used)
        lines += ["", f"[{suite}]", head + "  lik vs faster peer"]
        for e in entries:
            if "error" in e:
                lines.append(f"{e['name']:30s} inputs: {e['error']['status']}")
                continue
            fl = e["floor"]
            row = " ".join(f"{_fmt(_cell(e, c)):>14s}" for c in used)
            lines.append(f"{e['name']:30s} {fl['floor_ms']:9.4f} {fl['bound']:>7s} {row}  {_speedups(e)}".rstrip())
        lines.append("peak MB above the inputs:")
        for e in entries:
            peaks = " ".join(f"{_peak(_cell(e, c)):>14s}" for c in used)
            lines.append(f"{e['name']:30s} {'':9s} {'':7s} {peaks}")
    for record in results.get("quantize", []):
        lines.append(f"{record['what']}: {record['median_ms']:.3f} ms, {record['pct_of_floor']:.0f}% of its copy floor")
    if results.get("skipped_shapes"):
        lines += ["", "skipped (time budget): " + ", ".join(results["skipped_shapes"])]
    lines.append(f"wall {results.get('wall_s', 0):.0f} s")
    return "\n".join(lines)


def plot_results(results: dict, path: Path) -> str:
    """Save latency (log scale) and % of floor per shape, one row per suite, as a PNG; returns a status line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (redraw: lik bench --from-json results.json --out DIR)"
    suites = [s for s in ("forward", "multi", "train") if any(e["shape"]["suite"] == s for e in results["shapes"])]
    if not suites:
        return "plot skipped: no shapes"
    cols = columns(results)
    fig, axes = plt.subplots(len(suites), 2, figsize=(16, 4.2 * len(suites)), squeeze=False)
    for row, suite in enumerate(suites):
        entries = [e for e in results["shapes"] if e["shape"]["suite"] == suite and "error" not in e]
        used = [c for c in cols if any(_cell(e, c) and "median_ms" in _cell(e, c) for e in entries)]
        width = 0.8 / max(len(used), 1)
        labels = [e["name"].split("/", 1)[1] for e in entries]
        for k, col in enumerate(used):
            xs, ms, pct = [], [], []
            for i, e in enumerate(entries):
                cell = _cell(e, col)
                if cell and "median_ms" in cell:
                    xs.append(i + (k - (len(used) - 1) / 2) * width)
                    ms.append(cell["median_ms"])
                    pct.append(cell["pct_of_floor"])
            color = f"C{cols.index(col) % 10}"  # one colour per method across suites
            axes[row][0].bar(xs, ms, width, label=col, color=color)
            axes[row][1].bar(xs, pct, width, label=col, color=color)
        axes[row][0].plot(range(len(entries)), [e["floor"]["floor_ms"] for e in entries], "k_", ms=20,
                          label="floor")
        axes[row][0].legend(fontsize=7)
        axes[row][0].set_yscale("log")
        axes[row][0].set_ylabel("median ms (log)")
        axes[row][1].set_ylabel("% of floor")
        axes[row][1].axhline(100, color="k", lw=0.8)
        for ax in axes[row]:
            ax.set_title(suite)
            ax.set_xticks(range(len(entries)))
            ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
            ax.grid(axis="y", alpha=0.3)
        axes[row][1].legend(fontsize=7, ncol=2)
    meta = results["meta"]
    fig.suptitle(f"lik bench: {meta.get('device')}, {meta['settings']['dtype']}, "
                 f"commit {str(meta.get('git_commit'))[:12]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"
