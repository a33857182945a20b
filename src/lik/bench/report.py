"""A run's tables in BENCHMARKS.md's layout: one markdown section per operator, ready to paste.

Every section has a header line (device, versions, commit, ceilings, the floor, the command, the JSON), then one
row per cell: the floor, lik's time with its % of the floor, each peer's and reference's time, and how many times
faster lik is than the fastest peer. ``n/a``: the method cannot run on that machine (a peer not installed; the
reason is listed under the table); ``-``: the method does not apply to that cell; ``!``: the method's output
disagreed with the float64 reference (see the JSON). The text reads only the JSON, so ``lik bench --from-json``
prints it anywhere.

Several runs merge into one set of tables (:func:`load_results`, ``lik bench --from-json A.json B.json``): a cell
(a row, by its name) of a later file replaces the same cell of an earlier one, whole, so a row's ratios always
compare methods timed in the same run. A table whose rows come from more than one run lists every run's commit,
ceilings and command in its header, and each row measured before the table's newest run names its commit.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Sequence
from pathlib import Path

from .ops import DISPLAY, OPS, Op, label, op_entries

__all__ = [
    "SCHEMAS",
    "format_report",
    "format_section",
    "load_results",
    "merge_results",
    "section_rows",
    "record_name",
    "ratio_text",
    "time_text",
]

# The results layouts this module reads (``schema`` in the JSON ``lik bench`` writes; 1 had no row labels).
SCHEMAS = (1, 2)


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


def commit_text(meta: dict) -> str:
    """A run's commit as the tables print it: seven hex digits, ``+dirty`` when the tree had uncommitted changes."""
    return f"{str(meta.get('git_commit'))[:7]}{'+dirty' if meta.get('git_dirty') else ''}"


def _environment(meta: dict) -> str:
    peers = ", ".join(f"{name} {version}" for name, version in (meta.get("peers") or {}).items() if version)
    return f"{meta.get('device')}, torch {meta.get('torch')}, triton {meta.get('triton')}" + (
        f", {peers}" if peers else ""
    )


def _ceilings_text(ceil: dict) -> str:
    return f"{ceil['bandwidth_GBps']:.0f} GB/s copy (read + write), {ceil['matmul_TFLOPps']:.0f} TFLOP/s matmul"


def _header_line(op: Op, runs: list[dict]) -> str:
    """The header of a table whose rows come from ``runs`` (newest rank; each ``{"meta", "ceilings"}``)."""
    metas = [run["meta"] for run in runs]
    commits = [commit_text(meta) for meta in metas]
    dtype = f", {metas[0].get('settings', {}).get('dtype', 'fp16')}" if op.suites else ""
    if len(runs) == 1:
        parts = [f"{_environment(metas[0])}, lik commit `{commits[0]}`{dtype}"]
    else:
        environments = [_environment(meta) for meta in metas]
        where = (
            environments[0]
            if len(set(environments)) == 1
            else "; ".join(f"{env} (`{commit}`)" for env, commit in zip(environments, commits))
        )
        parts = [
            f"{where}, lik commits {', '.join(f'`{c}`' for c in commits)}{dtype}",
            f"Rows measured before `{commits[0]}` name their commit",
        ]
    if op.host:
        parts.append("Host microseconds per call (200 calls in a row, unsynchronised)")
    elif len(runs) == 1:
        parts.append(f"Ceilings measured in the run: {_ceilings_text(runs[0]['ceilings'])}")
    else:
        each = f"{_ceilings_text(runs[0]['ceilings'])} at `{commits[0]}`" + "".join(
            f"; {run['ceilings']['bandwidth_GBps']:.0f} GB/s, {run['ceilings']['matmul_TFLOPps']:.0f} TFLOP/s at `{c}`"
            for run, c in zip(runs[1:], commits[1:])
        )
        parts.append(f"Ceilings measured in each run: {each}")
    if op.floor:
        parts.append(f"Floor: {op.floor}")
    if len(runs) == 1:
        parts.append(f"Command: `{metas[0].get('command', 'lik bench')}`")
        parts.append(f"JSON: `benchmarks/results/{record_name(runs[0])}.json`")
    else:
        commands = "; ".join(f"`{meta.get('command', 'lik bench')}` (`{c}`)" for meta, c in zip(metas, commits))
        parts.append(f"Commands: {commands}")
        parts.append("JSON: " + ", ".join(f"`benchmarks/results/{record_name(run)}.json`" for run in runs))
    return ". ".join(parts) + "."


def section_rows(results: dict, op: Op) -> tuple[list[dict], list[dict]]:
    """``op``'s rows and the runs they come from (newest rank, each ``{"meta", "ceilings"}``).

    For merged results a row from a run older than the newest of the table's runs gets its commit after its label,
    ``"visual 512x1024, B 1 000 (181de6b)"``; a single run's rows are returned as they are.
    """
    entries = op_entries(results, op)
    if "runs" not in results:
        return entries, [results]
    used = sorted({e["run"] for e in entries}, reverse=True)
    marked = [
        e if e["run"] == used[0] else {**e, "label": f"{label(e)} ({commit_text(results['runs'][e['run']]['meta'])})"}
        for e in entries
    ]
    return marked, [results["runs"][i] for i in used]


def load_results(paths: Sequence[str | Path]) -> dict:
    """Read one or more results JSON files and merge them in the order given (a later file's cells win).

    Args:
        paths: files that ``lik bench`` wrote (``results.json``), oldest rank.

    Returns:
        The run itself for one file, else :func:`merge_results` of them.

    Raises:
        ValueError: one line naming the file that cannot be read, is not JSON or has a schema not in
            :data:`SCHEMAS`.

    Example:
        >>> results = load_results(["bench_h200_181de6b.json", "bench_h200_b027828.json"])  # doctest: +SKIP
        >>> print(format_report(results))  # doctest: +SKIP
    """
    if isinstance(paths, (str, Path)) or not paths:
        raise ValueError(f"--from-json: expected a non-empty list of JSON files, got {paths!r}")
    runs = []
    for path in paths:
        try:
            run = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--from-json {path}: {exc}") from None
        schema = run.get("schema") if isinstance(run, dict) else None
        if schema not in SCHEMAS or not isinstance(run.get("meta"), dict):
            known = ", ".join(str(s) for s in SCHEMAS)
            raise ValueError(f"--from-json {path}: unknown results schema {schema!r} (lik bench reads {known})")
        runs.append(run)
    return merge_results(runs)


def _merged_order(sequences: list[list[str]]) -> list[str]:
    """Every name once, in an order that keeps each run's order of the names of one operator: a run's measured
    names, then those it skipped for time (a block's skipped names all come after its measured ones), chained per
    operator. Otherwise the newest run's order leads (a name only older runs have comes after), and where runs
    disagree the newer run wins."""
    rank: dict[str, tuple[int, int]] = {}
    after: dict[str, set[str]] = {}
    before_count: dict[str, int] = {}
    for run, names in enumerate(sequences):
        last: dict[str, str] = {}
        for position, name in enumerate(names):
            rank[name] = (-run, position)
            after.setdefault(name, set())
            before_count.setdefault(name, 0)
            previous = last.get(name.split("/")[0])
            if previous is not None and previous != name and name not in after[previous]:
                after[previous].add(name)
                before_count[name] += 1
            last[name.split("/")[0]] = name
    order: list[str] = []
    ready = [(rank[n], n) for n, count in before_count.items() if count == 0]
    waiting = set(rank) - {n for _, n in ready}
    heapq.heapify(ready)
    while ready or waiting:
        if not ready:  # runs that ordered an operator's names differently: the newest run's order
            name = min(waiting, key=rank.__getitem__)
            waiting.discard(name)
            heapq.heappush(ready, (rank[name], name))
        _, name = heapq.heappop(ready)
        order.append(name)
        for successor in after[name]:
            before_count[successor] -= 1
            if before_count[successor] == 0 and successor in waiting:
                waiting.discard(successor)
                heapq.heappush(ready, (rank[successor], successor))
    return order


def _merge_entries(runs: list[dict], key: str) -> list[dict]:
    """The ``key`` entries (``shapes`` or ``cases``) of every run by name, each from the last run that has it."""
    by_name: dict[str, dict] = {}
    sequences = []
    for index, run in enumerate(runs):
        names = [e["name"] for e in run.get(key, [])]
        by_name.update({e["name"]: {**e, "run": index} for e in run.get(key, [])})
        sequences.append(names + [n for n in run.get("skipped", run.get("skipped_shapes", [])) if n not in names])
    return [by_name[name] for name in _merged_order(sequences) if name in by_name]


def merge_results(runs: list[dict]) -> dict:
    """One results dict from several runs, oldest rank: the newest run's metadata, every run under ``"runs"``, and
    each entry (``shapes``, ``cases``) from the last run that has it, tagged with that run's index as ``"run"``.

    A name a run skipped for time stays listed as skipped only while no run has its row; the 8-bit table's
    ``lik.quantize`` lines come from the newest run that timed them.

    Example:
        >>> merged = merge_results([older, newer])  # doctest: +SKIP
        >>> [r["meta"]["git_commit"] for r in merged["runs"]]  # doctest: +SKIP
        ['181de6b', 'b027828']
    """
    if not runs:
        raise ValueError("runs: expected at least one results dict")
    if len(runs) == 1:
        return runs[0]
    merged = {k: v for k, v in runs[-1].items() if k not in ("shapes", "cases", "skipped", "skipped_shapes")}
    merged["runs"] = [{"meta": r["meta"], "ceilings": r.get("ceilings", {}), "wall_s": r.get("wall_s")} for r in runs]
    for key in ("shapes", "cases"):
        merged[key] = _merge_entries(runs, key)
    present = {e["name"] for key in ("shapes", "cases") for e in merged[key]}
    skipped: list[str] = []
    for r in runs:
        skipped += [n for n in r.get("skipped", r.get("skipped_shapes", [])) if n not in present and n not in skipped]
    merged["skipped"] = skipped
    quantized = [i for i, r in enumerate(runs) if r.get("quantize")]
    merged["quantize"] = [{**q, "run": quantized[-1]} for q in runs[quantized[-1]]["quantize"]] if quantized else []
    return merged


def _unavailable(op: Op, entries: list[dict]) -> list[str]:
    reasons: dict[str, str] = {}
    for e in entries:
        for name, cell in e["cells"].items():
            if cell.get("status") == "unavailable" and name in (*op.lik, *op.peers, *op.others):
                reasons.setdefault(name, cell.get("error", ""))
    return [f"Not run here: {', '.join(f'{DISPLAY.get(n, n)} ({r})' for n, r in reasons.items())}."] if reasons else []


def format_section(results: dict, op: Op) -> str | None:
    """The markdown section of ``op`` (``None`` when the run has no row for it)."""
    entries, runs = section_rows(results, op)
    if not entries:
        return None
    lines = [f"## {op.title}", "", _header_line(op, runs), "", *_rows(op, entries)]
    extra = _unavailable(op, entries)
    if op.name == "8bit":
        newest = max((e.get("run", 0) for e in entries), default=0)
        for r in results.get("quantize", []):
            older = f" (`{commit_text(results['runs'][r['run']]['meta'])}`)" if r.get("run", newest) != newest else ""
            extra.append(f"`{r['what']}`: {r['median_ms']:.3f} ms, {r['pct_of_floor']:.0f}% of its copy floor{older}.")
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
    if "runs" not in results:
        return "\n\n".join(sections + [f"Wall time of the run: {results.get('wall_s', 0):.0f} s."])
    walls = ", ".join(f"{run.get('wall_s') or 0:.0f} s at `{commit_text(run['meta'])}`" for run in results["runs"])
    return "\n\n".join(sections + [f"Wall time of the runs: {walls}."])
