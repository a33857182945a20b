"""Benchmark cases of the operators beyond dense MaxSim (packed corpora, lik.Index, deformable attention, Chamfer,
host time): one :class:`Case` is one row of an operator's table, timed the way :mod:`lik.bench.cells` times a
MaxSim shape (a checked first call, interleaved rounds, peak memory) and recorded in the same JSON form.

A case builds its inputs once; each :class:`CaseMethod` turns them into a zero-argument call. A method whose
package is missing (a peer) or that needs what this machine lacks is recorded as ``unavailable`` with the reason,
and the log says so; a call that fails is recorded as ``error`` / ``OOM``. Nothing a peer does stops the run.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .cells import failure, finish_cells, rel_error, round_order
from .measure import Timer, free_memory, peak_memory_bytes
from .roofline import Ceilings

__all__ = ["Case", "CaseMethod", "run_case", "host_ms", "host_us", "output_error", "floor_record"]

Inputs = dict
Call = Callable[[], object]


@dataclass(frozen=True)
class CaseMethod:
    """One implementation timed in a case.

    Attributes:
        build: ``build(inputs) -> call``; a zero-argument ``call`` whose output the case's reference checks.
        module: a package it needs (a peer); missing, the method is unavailable.
        needs_cuda: unavailable without a CUDA device.
        env: an environment variable it needs (a path to something built outside lik); unset, unavailable.
    """

    build: Callable[[Inputs], Call]
    module: str | None = None
    needs_cuda: bool = False
    env: str | None = None

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Why the method cannot run here, or ``None`` when it can."""
        if self.needs_cuda and device.type != "cuda":
            return "needs a CUDA device"
        if self.env is not None and not os.environ.get(self.env):
            return f"{self.env} is not set"
        if self.module is not None:
            try:
                importlib.import_module(self.module)
            except Exception as exc:  # an ImportError, or a peer failing at import time
                return f"import {self.module} failed: {type(exc).__name__}: {exc}"
        return None


@dataclass(frozen=True)
class Case:
    """One row of an operator's table.

    Attributes:
        op: the operator (table) it belongs to, e.g. ``"chamfer"``.
        name: stable identifier in the JSON, e.g. ``"chamfer/1x100000x3"``.
        label: the row label of the table.
        inputs: ``inputs(device, smoke) -> dict``, built once per case (``smoke``: CPU-sized).
        methods: name -> :class:`CaseMethod`, in column order.
        floor: ``floor(inputs, ceilings) -> dict`` with ``floor_ms`` (see :func:`floor_record`), or ``None``.
        reference: ``reference(inputs) -> expected output`` for the check, or ``None`` (no check).
        tolerance: relative error above which a method is marked ``mismatch``.
        host_time: time the host's cost per call (the GPU keeping up) instead of ``do_bench``.
        quick: part of the ``--quick`` subset.
    """

    op: str
    name: str
    label: str
    inputs: Callable[[torch.device, bool], Inputs]
    methods: dict[str, CaseMethod]
    floor: Callable[[Inputs, Ceilings], dict] | None = None
    reference: Callable[[Inputs], object] | None = None
    tolerance: float = 5e-3
    host_time: bool = False
    quick: bool = True
    params: dict = field(default_factory=dict)


def floor_record(flops: float, nbytes: float, ceilings: Ceilings, *, flops_per_s: float | None = None) -> dict:
    """The floor of a call as :class:`lik.bench.roofline.Floor` records it: max(FLOPs / matmul rate, bytes /
    copy bandwidth), ``flops_per_s`` replacing the run's matmul rate where another product sets it."""
    compute_ms = 1e3 * flops / (flops_per_s or ceilings.matmul_flops_per_s)
    memory_ms = 1e3 * nbytes / ceilings.bandwidth_bytes_per_s
    return {"flops": flops, "bytes": nbytes, "compute_ms": compute_ms, "memory_ms": memory_ms,
            "floor_ms": max(compute_ms, memory_ms), "bound": "compute" if compute_ms >= memory_ms else "memory"}


def host_ms(call: Call, device: torch.device, calls: int | None = None) -> float:
    """Host milliseconds per call: ``calls`` calls in a row without synchronising (the GPU keeps up with small
    calls, so the wall time per call is what the host spends issuing it); 200 on a GPU, 3 on a CPU (plumbing)."""
    calls = calls or (200 if device.type == "cuda" else 3)
    for _ in range(5 if device.type == "cuda" else 1):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(calls):
        call()
    elapsed = time.perf_counter() - started
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 1e3 * elapsed / calls


def host_us(call: Call, calls: int = 200) -> float:
    """:func:`host_ms` in microseconds on the current CUDA device (the tools in benchmarks/ time host paths so)."""
    return 1e3 * host_ms(call, torch.device("cuda", torch.cuda.current_device()), calls)


def output_error(out, expected) -> float:
    """The largest :func:`~lik.bench.cells.rel_error` over a tensor or a tuple of tensors."""
    if isinstance(expected, torch.Tensor):
        out, expected = (out,), (expected,)
    if not isinstance(out, (tuple, list)) or len(out) != len(expected):
        return float("inf")
    return max((rel_error(o.reshape(e.shape) if o.numel() == e.numel() else o, e) for o, e in zip(out, expected)),
               default=0.0)


def run_case(case: Case, *, device: torch.device, timer: Timer, ceilings: Ceilings, rounds: int, smoke: bool,
             log: Callable[[str], None], noted: set[str] | None = None) -> dict:
    """Benchmark every method of ``case``; returns its JSON entry (the MaxSim entries' form: ``floor``, ``cells``
    with ``round_ms`` / ``median_ms`` / ``pct_of_floor`` / ``rel_err`` / ``peak_MB``, ``ratios``).

    ``noted``: ``op/method`` keys whose unavailability was already printed (a note per method, not per case)."""
    entry: dict = {"name": case.name, "label": case.label, "op": case.op, "params": dict(case.params), "cells": {}}
    noted = set() if noted is None else noted
    try:
        inputs = case.inputs(device, smoke)
        entry["floor"] = None if case.floor is None else case.floor(inputs, ceilings)
        expected = None if case.reference is None else case.reference(inputs)
    except Exception as exc:
        entry["error"] = failure(exc)
        free_memory(device)
        return entry
    calls: dict[str, Call] = {}
    for name, method in case.methods.items():
        cell = entry["cells"][name] = {}
        reason = method.unavailable_reason(device)
        if reason is not None:
            cell.update(status="unavailable", error=reason)
            if f"{case.op}/{name}" not in noted:
                noted.add(f"{case.op}/{name}")
                log(f"  {name}: skipped ({reason})")
            continue
        start = time.perf_counter()
        try:
            call = method.build(inputs)
            out = call()
            cell["rel_err"] = None if expected is None else output_error(out, expected)
            del out
        except Exception as exc:
            cell.update(failure(exc))
        free_memory(device)
        if "error" in cell:
            log(f"  {name:26s} {cell['status']}: {cell['error'][:120]}")
            continue
        err = cell["rel_err"]
        cell["status"] = "ok" if err is None or err <= case.tolerance else "mismatch"
        cell["check_s"] = time.perf_counter() - start
        calls[name] = call
    for round_index in range(rounds):
        for name, call in round_order(calls, round_index):
            cell = entry["cells"][name]
            if "error" in cell:
                continue
            try:
                ms = host_ms(call, device) if case.host_time else timer.median_ms(call)
                cell.setdefault("round_ms", []).append(ms)
            except Exception as exc:
                cell.update(failure(exc))
                free_memory(device)
    if not case.host_time:
        for name, call in calls.items():
            cell = entry["cells"][name]
            if "error" in cell:
                continue
            try:
                peak = peak_memory_bytes(call, device)
                cell["peak_MB"] = None if peak is None else peak / 2**20
            except Exception as exc:
                cell.update(failure(exc))
                free_memory(device)
    finish_cells(entry, None if entry["floor"] is None else entry["floor"]["floor_ms"])
    for name, cell in entry["cells"].items():
        if "median_ms" in cell:
            pct = "" if cell["pct_of_floor"] is None else f" {cell['pct_of_floor']:6.1f}% of floor"
            flag = "" if cell["status"] == "ok" else f"  MISMATCH rel_err={cell['rel_err']:.2e}"
            log(f"  {name:26s} {cell['median_ms']:10.4f} ms{pct}{flag}")
    del inputs, calls
    free_memory(device)
    return entry
