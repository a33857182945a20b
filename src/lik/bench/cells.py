"""One MaxSim shape's cells: every applicable method checked, then timed in interleaved rounds, then its peak memory.

Per shape:

1. inputs (L2-normalised random, rotated through several sets when one set is small);
2. per method: a first call at the full shape (compilation, autotuning) whose output is checked against
   ``lik.maxsim_reference`` in float64 on a slice; the training step's gradients are checked on a sub-batch,
   and its repeatability (two runs, bitwise) recorded. A method that disagrees is marked ``mismatch``: still
   timed, never silently;
3. ``rounds`` timing rounds, each timing every method once in turn (methods interleaved, so drift in clocks
   or temperature hits all of them alike), in pairs of rounds rotated to start at the next method, the second
   of a pair reversed (:func:`round_order`); the cell's time is the median over rounds of do_bench medians;
4. peak memory per method in a fresh measurement.

Out-of-memory is caught and recorded as ``OOM``; any other failure as ``error`` with its message; a method that
cannot run here (a peer not installed) as ``unavailable`` with the reason.
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict

import torch
import torch.nn.functional as F

from .measure import InputSets, Timer, free_memory, is_oom, make_inputs, peak_memory_bytes
from .methods import QUANTIZED_TOLERANCE, Method
from .roofline import Ceilings, floor
from .shapes import Shape

__all__ = ["run_shape", "round_order", "finish_cells", "failure", "rel_error", "TOLERANCE"]

# ||out - ref|| / ||ref|| above which a method is marked "mismatch" (scores and gradients alike).
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 2e-3}

# Slice of the full-shape scores compared with the float64 reference, and the training sub-batch.
CHECK_QUERIES, CHECK_DOCS, CHECK_TRAIN_BATCH = 2, 32, 8

Call = Callable[[torch.Tensor, torch.Tensor], object]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (``inf`` on a shape mismatch, NaN when ``out`` has NaN)."""
    if tuple(out.shape) != tuple(ref.shape):
        return float("inf")
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _forward_call(score: Callable) -> Call:
    def call(*operands):  # (Q, D), or an 8-bit method's prepared operands
        with torch.no_grad():
            return score(*operands)

    return call


def _train_call(score: Callable, labels: torch.Tensor) -> Call:
    """One in-batch contrastive step: scores [B, B], cross-entropy on the diagonal, grads of Q and D."""

    def call(Q, D):
        scores = score(Q, D)
        loss = F.cross_entropy(scores, labels[: scores.shape[0]])
        dq, dd = torch.autograd.grad(loss, (Q, D))
        return scores.detach(), dq, dd

    return call


def _reference_train_step(Q: torch.Tensor, D: torch.Tensor) -> tuple[torch.Tensor, ...]:
    import lik

    q64 = Q.detach().double().requires_grad_()
    d64 = D.detach().double().requires_grad_()
    scores = lik.maxsim_reference(q64, d64)
    loss = F.cross_entropy(scores, torch.arange(scores.shape[0], device=scores.device))
    dq, dd = torch.autograd.grad(loss, (q64, d64))
    return scores.detach(), dq, dd


def _check_scores(shape: Shape, scores: torch.Tensor, Q: torch.Tensor, D: torch.Tensor) -> float:
    """Error of a slice of full-shape scores against the float64 reference."""
    import lik

    nq, nd = min(shape.nq, CHECK_QUERIES), min(shape.b, CHECK_DOCS)
    expected = (shape.b,) if shape.two_d_query else (shape.nq, shape.b)
    if tuple(scores.shape) != expected:
        return float("inf")
    q = Q if Q.dim() == 2 else Q[:nq]
    ref = lik.maxsim_reference(q.detach().double(), D[:nd].detach().double())
    got = scores[:nd] if scores.dim() == 1 else scores[:nq, :nd]
    return rel_error(got, ref)


def _check(shape: Shape, call: Call, inputs: InputSets, operands: InputSets) -> dict:
    """First call at full shape (warm-up) and correctness; for training also gradients and repeatability.
    ``operands`` are what the method is called with (``inputs`` itself, or their 8-bit form); the reference
    always scores the float ``inputs``."""
    Q, D = inputs.sets[0]
    out = call(*operands.sets[0])
    if shape.suite != "train":
        return {"rel_err": _check_scores(shape, out, Q, D)}
    again = call(Q, D)
    repeatable = all(torch.equal(a, b) for a, b in zip(out[1:], again[1:]))
    errors = {"rel_err_scores": _check_scores(shape, out[0], Q, D)}
    del out, again
    n = min(shape.b, CHECK_TRAIN_BATCH)
    q_sub = Q[:n].detach().clone().requires_grad_()
    d_sub = D[:n].detach().clone().requires_grad_()
    got = call(q_sub, d_sub)
    ref = _reference_train_step(q_sub, d_sub)
    errors["rel_err_dq"] = rel_error(got[1], ref[1])
    errors["rel_err_dd"] = rel_error(got[2], ref[2])
    return {"rel_err": max(errors.values()), **errors, "repeatable": repeatable}


def failure(exc: BaseException) -> dict:
    """The cell record of a failed call (the caller frees memory once the exception, and the frames it
    keeps alive, are gone)."""
    status = "OOM" if is_oom(exc) else "error"
    text = str(exc).strip()
    if status == "error":
        traceback.print_exc()
    return {"status": status, "error": f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:500]}


def finish_cells(entry: dict, floor_ms: float | None) -> None:
    """Medians, % of floor (a cell's own ``floor_ms`` where it has one: 8-bit storage; none without a floor), best
    of each sweep and the ratio of every timed method to every other."""
    cells, timed = entry["cells"], {}
    for name, cell in cells.items():
        rounds = cell.get("round_ms")
        if not rounds or "error" in cell:
            continue
        cell["median_ms"] = statistics.median(rounds)
        cell["spread_pct"] = 100.0 * (max(rounds) - min(rounds)) / cell["median_ms"]
        own = cell.get("floor_ms", floor_ms)
        cell["pct_of_floor"] = None if own is None else 100.0 * own / cell["median_ms"]
        timed[name] = cell["median_ms"]
    sweeps: dict[str, dict] = {}
    for name, cell in cells.items():
        sweep = cell.get("sweep")
        if sweep and name in timed and (sweep not in sweeps or timed[name] < sweeps[sweep]["median_ms"]):
            sweeps[sweep] = {"best": name, "median_ms": timed[name], "pct_of_floor": cells[name]["pct_of_floor"]}
    entry["sweeps"] = sweeps
    timed.update({sweep: best["median_ms"] for sweep, best in sweeps.items()})
    # ratios[a][b] = time(b) / time(a): how many times faster a is than b.
    entry["ratios"] = {a: {b: tb / ta for b, tb in timed.items() if b != a} for a, ta in timed.items()}


def round_order(calls: dict, round_index: int) -> list:
    """The ``(name, call)`` pairs of timing round ``round_index``: rounds come in pairs, the methods in their order
    rotated to start at the ``round_index // 2``-th, then that order reversed. On a power-capped GPU a method's time
    depends on what ran just before it (the first timing of a phase is the fast one, benchmarks/NOTES.md): a fixed order
    would favour the first method every round, and a rotation alone keeps every method behind the same neighbour
    (a heavy one slows it in every round); the reversed rounds put it behind its other neighbour.

    Example: methods ``a, b, c`` run ``a b c``, ``c b a``, ``b c a``, ``a c b``, ``c a b``, ``b a c``."""
    items = list(calls.items())
    start = (round_index // 2) % max(1, len(items))
    order = items[start:] + items[:start]
    return order[::-1] if round_index % 2 else order


def run_shape(
    shape: Shape,
    methods: list[Method],
    unavailable: dict[str, str],
    *,
    dtype: torch.dtype,
    device: torch.device,
    timer: Timer,
    ceilings: Ceilings,
    rounds: int,
    rotate_bytes: int,
    log: Callable[[str], None],
    storage_ceilings: dict[str, Ceilings] | None = None,
) -> dict:
    """Benchmark every applicable method at one shape; returns the shape's JSON entry.

    ``storage_ceilings``: the ceilings of 8-bit methods' floors by storage (matmul rate of that type)."""
    fl = floor(shape, torch.finfo(dtype).bits // 8, ceilings)
    entry = {"name": shape.name, "label": shape.label, "shape": asdict(shape), "floor": fl.as_dict(), "cells": {}}
    train = shape.suite == "train"
    try:
        inputs = make_inputs(shape, dtype, device, rotate_bytes=rotate_bytes, requires_grad=train)
    except Exception as exc:
        entry["error"] = failure(exc)
    if "error" in entry:
        free_memory(device)
        return entry
    entry["input_sets"] = len(inputs)
    labels = torch.arange(shape.b, device=device)
    calls: dict[str, Call] = {}
    operands: dict[str, InputSets] = {}
    for method in methods:
        if shape.suite not in method.suites or not method.applies(shape):
            continue
        cell = entry["cells"][method.name] = {"sweep": method.sweep} if method.sweep else {}
        if method.name in unavailable:
            cell.update(status="unavailable", error=unavailable[method.name])
            continue
        start = time.perf_counter()
        try:
            score = method.build(shape)
            call = _train_call(score, labels) if train else _forward_call(score)
            operands[method.name] = inputs
            if method.prepare is not None:  # quantized once per input set, outside the timing
                with torch.no_grad():
                    operands[method.name] = InputSets([method.prepare(shape, Q, D) for Q, D in inputs.sets])
            cell.update(_check(shape, call, inputs, operands[method.name]))
        except Exception as exc:
            cell.update(failure(exc))
        free_memory(device)
        if "error" in cell:
            operands.pop(method.name, None)
            log(f"  {method.name:26s} {cell['status']}: {cell['error'][:120]}")
            continue
        tolerance = QUANTIZED_TOLERANCE[method.storage] if method.storage else TOLERANCE[dtype]
        cell["status"] = "ok" if cell["rel_err"] <= tolerance else "mismatch"
        cell["check_s"] = time.perf_counter() - start
        if method.storage:
            cell["storage"] = method.storage
            own = (storage_ceilings or {}).get(method.storage, ceilings)
            cell["floor_ms"] = floor(shape, 1, own).ms
        calls[method.name] = call
        log(f"  {method.name:26s} {cell['status']} rel_err {cell['rel_err']:.1e}, first call and check "
            f"{cell['check_s']:.1f} s" + ("" if cell.get("repeatable", True) else ", not bitwise repeatable"))

    for round_index in range(rounds):
        for name, call in round_order(calls, round_index):
            cell = entry["cells"][name]
            if "error" in cell:
                continue
            try:
                cell.setdefault("round_ms", []).append(
                    timer.median_ms(lambda call=call, sets=operands[name]: call(*sets.next())))
            except Exception as exc:
                cell.update(failure(exc))
            if "error" in cell:
                free_memory(device)

    for name, call in calls.items():
        cell = entry["cells"][name]
        if "error" in cell:
            continue
        try:
            peak = peak_memory_bytes(lambda call=call, first=operands[name].sets[0]: call(*first), device)
            cell["peak_MB"] = None if peak is None else peak / 2**20
        except Exception as exc:
            cell.update(failure(exc))
        if "error" in cell:
            free_memory(device)
    finish_cells(entry, fl.ms)
    for name, cell in entry["cells"].items():
        if "median_ms" in cell:
            flag = "" if cell["status"] == "ok" else f"  MISMATCH rel_err={cell['rel_err']:.2e}"
            log(f"  {name:26s} {cell['median_ms']:10.4f} ms {cell['pct_of_floor']:6.1f}% of floor{flag}")
    del inputs, calls, operands
    free_memory(device)
    return entry
