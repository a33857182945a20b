"""A run's tables in BENCHMARKS.md's layout: one markdown section per operator, ready to paste.

Every section has a header line (device, versions, commit, ceilings, the floor, the command, the JSON), then one
row per cell: the floor, lik's time with its % of the floor, each peer's and reference's time, and how many times
faster lik is than the fastest peer. ``n/a``: the method cannot run on that machine (a peer not installed; the
reason is listed under the table); ``-``: the method does not apply to that cell; ``!``: the method's output
disagreed with the float64 reference (see the JSON). The text reads only the JSON, so ``lik bench --from-json``
prints it anywhere.
"""

from __future__ import annotations

from .ops import DISPLAY, OPS, Op, label, op_entries

__all__ = ["format_report", "format_section", "record_name", "ratio_text", "time_text"]


def record_name(results: dict) -> str:
    """The name the run's JSON is kept under in benchmarks/results: ``bench_<gpu>_<commit>``."""
    meta = results["meta"]
    device = str(meta.get("device") or "cpu").lower()
    gpu = next(
        (token for token in ("h200", "h100", "a100", "l40s", "l4", "b200") if token in device),
        device.replace(" ", "-")[:16],
    )
    commit = str(meta.get("git_commit") or "unknown")[:7]
    return f"bench_{gpu}_{commit}"


def time_text(ms: float | None, host: bool = False) -> str:
    """A time to three significant digits (milliseconds, or microseconds for host times)."""
    if ms is None:
        return "-"
    value = ms * 1e3 if host else ms
    return f"{value:,.0f}".replace(",", " ") if value >= 1000 else f"{value:.3g}"


def ratio_text(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _cell(entry: dict, column: str) -> dict | None:
    """The cell shown in ``column``: the method's own, or the best of the sweep ``column``."""
    if column in entry.get("sweeps", {}):
        return entry["cells"][entry["sweeps"][column]["best"]]
    return entry["cells"].get(column)


def _median(entry: dict, column: str) -> float | None:
    cell = _cell(entry, column)
    return None if cell is None else cell.get("median_ms")


def _text(entry: dict, column: str, op: Op, *, pct: bool = False, versus: float | None = None) -> str:
    cell = _cell(entry, column)
    if cell is None:
        return "-"
    if cell.get("median_ms") is None:
        return {"unavailable": "n/a"}.get(cell.get("status"), str(cell.get("status", "?")))
    notes = []
    if versus is not None:
        notes.append(f"{versus / cell['median_ms']:.2f}x")
    if pct and cell.get("pct_of_floor") is not None:
        notes.append(f"{cell['pct_of_floor']:.0f}%")
    mark = "!" if cell.get("status") == "mismatch" else ""
    text = time_text(cell["median_ms"], op.host) + mark
    return f"{text} ({', '.join(notes)})" if notes else text


def _faster_peer(entry: dict, op: Op, lik_column: str) -> str:
    peers = [t for t in (_median(entry, p) for p in op.peers) if t is not None]
    mine = _median(entry, lik_column)
    return "-" if not peers or mine is None else ratio_text(min(peers) / mine)


def _columns(op: Op, entries: list[dict]) -> list[str]:
    """The op's columns that at least one of its rows has (a method never applicable to any row is left out)."""
    wanted = [*op.lik, *op.peers, *op.others]
    return [c for c in wanted if any(_cell(e, c) is not None for e in entries) or c in op.lik]


def _floor_text(entry: dict) -> str:
    floor = entry.get("floor")
    return "-" if not floor else time_text(floor.get("floor_ms"))


def _rows(op: Op, entries: list[dict]) -> list[str]:
    unit = "us" if op.host else "ms"
    if op.name == "8bit":
        header = [
            "cell",
            "lik fp16 ms",
            "lik int8 ms (x fp16, % floor)",
            "lik fp8 ms (x fp16, % floor)",
            DISPLAY["flash-maxsim-int8x8"],
            DISPLAY["late-interaction-kernels-fp8"],
            "int8 vs flash-maxsim int8x8",
            "fp8 vs late-interaction-kernels fp8",
        ]
        rows = []
        for e in entries:
            fp16 = _median(e, "lik")
            int8, fp8 = _median(e, "lik-int8"), _median(e, "lik-fp8")
            fm, li = _median(e, "flash-maxsim-int8x8"), _median(e, "late-interaction-kernels-fp8")
            rows.append(
                [
                    label(e),
                    _text(e, "lik", op),
                    _text(e, "lik-int8", op, pct=True, versus=fp16),
                    _text(e, "lik-fp8", op, pct=True, versus=fp16),
                    _text(e, "flash-maxsim-int8x8", op),
                    _text(e, "late-interaction-kernels-fp8", op),
                    ratio_text(fm / int8 if fm and int8 else None),
                    ratio_text(li / fp8 if li and fp8 else None),
                ]
            )
        return _markdown(header, rows)
    columns = _columns(op, entries)
    header = ["cell" if not op.host else "call"] + ([] if op.host else ["floor ms"])
    for c in columns:
        name = DISPLAY.get(c, c)
        header.append(
            f"{name} {unit} (% floor)" if c in op.lik and not op.host else f"{name} {unit}" if c in op.lik else name
        )
    if op.peers:
        header.append(f"{DISPLAY.get(op.lik[0], op.lik[0])} vs faster peer")
    versus_other = bool(op.others) and op.others[0] in columns
    if versus_other:
        header.append(f"{DISPLAY.get(op.lik[0], op.lik[0])} vs {DISPLAY.get(op.others[0], op.others[0])}")
    if op.name == "train":
        header += ["deterministic / fast", "peak MB: lik fast / lower peer"]
    rows = []
    for e in entries:
        if "error" in e:
            rows.append([label(e), f"inputs: {e['error']['status']}"] + [""] * (len(header) - 2))
            continue
        row = [label(e)] + ([] if op.host else [_floor_text(e)])
        row += [_text(e, c, op, pct=c in op.lik) for c in columns]
        if op.peers:
            row.append(_faster_peer(e, op, op.lik[0]))
        if versus_other:
            other, mine = _median(e, op.others[0]), _median(e, op.lik[0])
            row.append(ratio_text(other / mine if other and mine else None))
        if op.name == "train":
            fast, det = _median(e, "lik-fast"), _median(e, "lik-deterministic")
            row.append("-" if not fast or not det else f"{det / fast:.2f}")
            peaks = [(_cell(e, p) or {}).get("peak_MB") for p in op.peers]
            peaks = [p for p in peaks if p is not None]
            mine = (_cell(e, "lik-fast") or {}).get("peak_MB")
            row.append("-" if mine is None else f"{mine:.0f} / {min(peaks):.0f}" if peaks else f"{mine:.0f} / -")
        rows.append(row)
    return _markdown(header, rows)


def _markdown(header: list[str], rows: list[list[str]]) -> list[str]:
    align = ["---"] + ["---:"] * (len(header) - 1)
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"] + [
        "| " + " | ".join(row) + " |" for row in rows
    ]


def _header_line(results: dict, op: Op) -> str:
    meta, ceil = results["meta"], results["ceilings"]
    peers = ", ".join(f"{name} {version}" for name, version in (meta.get("peers") or {}).items() if version)
    commit = f"{str(meta.get('git_commit'))[:7]}{'+dirty' if meta.get('git_dirty') else ''}"
    dtype = meta.get("settings", {}).get("dtype", "fp16")
    parts = [
        f"{meta.get('device')}, torch {meta.get('torch')}, triton {meta.get('triton')}"
        + (f", {peers}" if peers else "")
        + f", lik commit `{commit}`"
        + (f", {dtype}" if op.suites else "")
    ]
    if op.host:
        parts.append("Host microseconds per call (200 calls in a row, unsynchronised)")
    else:
        parts.append(
            f"Ceilings measured in the run: {ceil['bandwidth_GBps']:.0f} GB/s copy (read + write), "
            f"{ceil['matmul_TFLOPps']:.0f} TFLOP/s matmul"
        )
    if op.floor:
        parts.append(f"Floor: {op.floor}")
    parts.append(f"Command: `{meta.get('command', 'lik bench')}`")
    parts.append(f"JSON: `benchmarks/results/{record_name(results)}.json`")
    return ". ".join(parts) + "."


def _unavailable(op: Op, entries: list[dict]) -> list[str]:
    reasons: dict[str, str] = {}
    for e in entries:
        for name, cell in e["cells"].items():
            if cell.get("status") == "unavailable" and name in (*op.lik, *op.peers, *op.others):
                reasons.setdefault(name, cell.get("error", ""))
    return [f"Not run here: {', '.join(f'{DISPLAY.get(n, n)} ({r})' for n, r in reasons.items())}."] if reasons else []


def format_section(results: dict, op: Op) -> str | None:
    """The markdown section of ``op`` (``None`` when the run has no row for it)."""
    entries = op_entries(results, op)
    if not entries:
        return None
    lines = [f"## {op.title}", "", _header_line(results, op), "", *_rows(op, entries)]
    extra = _unavailable(op, entries)
    if op.name == "8bit":
        extra += [
            f"`{r['what']}`: {r['median_ms']:.3f} ms, {r['pct_of_floor']:.0f}% of its copy floor."
            for r in results.get("quantize", [])
        ]
    skipped = [
        name
        for name in results.get("skipped", results.get("skipped_shapes", []))
        if name.split("/")[0] in (op.name, *op.suites)
    ]
    if skipped:
        extra.append(f"Skipped (time budget): {', '.join(skipped)}.")
    if extra:
        lines += ["", *extra]
    lines += ["", f"![{op.name}](benchmarks/results/plots/{op.name}.png)"]
    return "\n".join(lines)


def format_report(results: dict, ops: list[Op] | None = None) -> str:
    """Every operator's section (or those of ``ops``), then the run's wall time."""
    sections = [s for op in (ops or OPS) if (s := format_section(results, op)) is not None]
    return "\n\n".join(sections + [f"Wall time of the run: {results.get('wall_s', 0):.0f} s."])
