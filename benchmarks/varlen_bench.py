"""Packed variable-length MaxSim against padded eager einsum and the two peers' packed paths.

Cells (d = 128, fp16, L2-normalised random data, lengths drawn once with a fixed seed):

* ``corpus/<dist>``: one query of Lq = 32 against a ragged corpus of B = 1 000 documents, Ld <= 512, for three
  length distributions (``uniform`` 256-512, ``hotpotqa`` lognormal mean ~120, ``ragged`` lognormal mean ~70).
  Methods: ``lik`` (lik.maxsim_packed), ``einsum-padded`` (fp16 eager einsum over zero-padded documents, the
  PyLate formula), ``flash-maxsim`` (flash_maxsim_packed), ``lik-kernels`` (late_interaction_kernels.maxsim_varlen
  with one packed query), ``lik-padded`` (lik.maxsim over the padded corpus with a mask) for context, and
  ``lik-triton-launch`` (the lik call with every kernel launched through Triton's own ``kernel[grid](...)``).
* ``pairs``: 5 000 ragged (query, document) pairs, Lq uniform 8-32, documents ``hotpotqa``. Methods: ``lik``
  (lik.maxsim_varlen), ``einsum-padded`` (batched over padded pairs), ``flash-maxsim`` (flash_maxsim_varlen),
  ``lik-kernels`` (late_interaction_kernels.score_pairs.score_pairs_packed).

Each cell's floor is computed from the real, unpadded tokens (docs/design.md: max(FLOPs / cuBLAS fp16 rate, bytes /
device-copy bandwidth), both measured in this run). Two timings per method: ``eager_ms``, the
``triton.testing.do_bench`` median of a plain call (L2 flushed; includes the host's launch cost whenever the
host is slower than the GPU), and ``graph_ms``, one call's share of a CUDA graph replaying many calls over
rotated input copies larger than the L2 cache (device time only). Bars are judged on ``eager_ms``.

Usage on the device: ``PYTHONPATH=src python3 benchmarks/varlen_bench.py --out $OUT`` (``--smoke``: tiny CPU run
of the plumbing under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import statistics
import time

import torch
import triton

import lik
from lik import _config, _launch

DIM = 128
LQ = 32
N_DOCS = 1000
MAX_LD = 512
N_PAIRS = 5000
GRAPH_CALLS = 20  # calls captured per graph
ROUNDS = 2  # interleaved timing rounds per cell
ROTATE_BYTES = 256 * 1024**2  # input copies per cell until their total passes this (several L2 caches)


# ---------------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------------


def doc_lengths(dist: str, n: int, gen: torch.Generator) -> list[int]:
    """Document lengths in [1, MAX_LD] for a named distribution."""
    if dist == "uniform":
        return torch.randint(256, MAX_LD + 1, (n,), generator=gen).tolist()
    # Lognormal: mean = exp(mu + sigma^2 / 2); sigma sets how ragged the corpus is.
    mean, sigma = {"hotpotqa": (120.0, 0.6), "ragged": (70.0, 1.0)}[dist]
    mu = math.log(mean) - sigma**2 / 2
    x = torch.exp(mu + sigma * torch.randn(n, generator=gen))
    return x.round().clamp(1, MAX_LD).long().tolist()


def normalised(n_rows: int, device, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n_rows, DIM, generator=gen)
    return torch.nn.functional.normalize(x, dim=-1).to(device=device, dtype=torch.float16)


def padded(packed: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-padded ``[n, max L, DIM]`` copy and its bool mask."""
    seqs = list(torch.split(packed, lengths))
    out = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
    lengths_t = torch.tensor(lengths, device=packed.device)
    return out, torch.arange(out.shape[1], device=packed.device)[None, :] < lengths_t[:, None]


def cu_of(lengths: list[int], device) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return cu.to(device)


# ---------------------------------------------------------------------------------------------------------------
# Methods: each builder takes one input set and returns a zero-argument call
# ---------------------------------------------------------------------------------------------------------------


def triton_launch(make):
    """The same lik call with lik's cached launch path off (every kernel through Triton's ``kernel[grid](...)``):
    the launch path's share of the call."""

    def method(s):
        call = make(s)

        def run():
            _launch.ENABLED = False
            try:
                return call()
            finally:
                _launch.ENABLED = True

        return run

    return method


def corpus_methods(smoke: bool) -> dict:
    def lik_packed(s):
        return lambda: lik.maxsim_packed(s["Q"], s["d"], s["cu_d"], max_seqlen_d=s["max_d"])

    def lik_padded(s):
        return lambda: lik.maxsim(s["Q"], s["D_pad"], None, s["d_mask"])

    def einsum_padded(s):
        return lambda: torch.einsum("sk,btk->bst", s["Q"], s["D_pad"]).max(dim=-1).values.float().sum(dim=-1)

    methods = {"lik": lik_packed, "lik-triton-launch": triton_launch(lik_packed), "einsum-padded": einsum_padded,
               "lik-padded": lik_padded}
    if smoke:
        return methods

    def flash(s):
        from flash_maxsim import flash_maxsim_packed

        return lambda: flash_maxsim_packed(s["Q"], s["d"], s["cu_d"], s["max_d"])

    def lik_kernels(s):
        from late_interaction_kernels import maxsim_varlen

        cu_q = torch.tensor([0, LQ], dtype=torch.int32, device=s["Q"].device)
        return lambda: maxsim_varlen(s["Q"], s["d"], cu_q, s["cu_d"], LQ, s["max_d"])[0]

    return {**methods, "flash-maxsim": flash, "lik-kernels": lik_kernels}


def pair_methods(smoke: bool) -> dict:
    def lik_varlen(s):
        return lambda: lik.maxsim_varlen(s["q"], s["d"], s["cu_q"], s["cu_d"], s["max_q"], s["max_d"])

    def einsum_padded(s):
        return lambda: torch.einsum("nsk,ntk->nst", s["Q_pad"], s["D_pad"]).max(dim=-1).values.float().sum(dim=-1)

    methods = {"lik": lik_varlen, "lik-triton-launch": triton_launch(lik_varlen), "einsum-padded": einsum_padded}
    if smoke:
        return methods

    def flash(s):
        from flash_maxsim import flash_maxsim_varlen

        return lambda: flash_maxsim_varlen(s["q"], s["d"], s["cu_q"], s["cu_d"], s["max_q"], s["max_d"])

    def lik_kernels(s):
        from late_interaction_kernels.score_pairs import score_pairs_packed

        index = torch.arange(len(s["q_lens"]), dtype=torch.int32, device=s["q"].device)
        return lambda: score_pairs_packed(
            s["q"], s["d"], s["cu_q"], s["cu_d"], index, index, max_seqlen_q=s["max_q"], max_seqlen_d=s["max_d"]
        )

    return {**methods, "flash-maxsim": flash, "lik-kernels": lik_kernels}


def corpus_set(dist: str, device, gen) -> dict:
    lengths = doc_lengths(dist, N_DOCS, gen)
    d = normalised(sum(lengths), device, gen)
    D_pad, d_mask = padded(d, lengths)
    return dict(Q=normalised(LQ, device, gen), d=d, cu_d=cu_of(lengths, device), max_d=max(lengths),
                D_pad=D_pad, d_mask=d_mask, d_lens=lengths)


def pair_set(device, gen) -> dict:
    q_lens = torch.randint(8, LQ + 1, (N_PAIRS,), generator=gen).tolist()
    d_lens = doc_lengths("hotpotqa", N_PAIRS, gen)
    q, d = normalised(sum(q_lens), device, gen), normalised(sum(d_lens), device, gen)
    return dict(q=q, d=d, cu_q=cu_of(q_lens, device), cu_d=cu_of(d_lens, device), max_q=max(q_lens),
                max_d=max(d_lens), Q_pad=padded(q, q_lens)[0], D_pad=padded(d, d_lens)[0], q_lens=q_lens,
                d_lens=d_lens)


def floor_of(s: dict, ceilings: dict) -> dict:
    """Floor from the real tokens: every token read once, scores written once, FLOPs of the real products."""
    if "q_lens" in s:
        q_tokens, n_scores = sum(s["q_lens"]), len(s["q_lens"])
        products = sum(a * b for a, b in zip(s["q_lens"], s["d_lens"]))
        index_bytes = 2 * 4 * (n_scores + 1)
    else:
        q_tokens, n_scores = LQ, len(s["d_lens"])
        products = LQ * sum(s["d_lens"])
        index_bytes = 4 * (n_scores + 1)
    flops = 2.0 * products * DIM
    nbytes = 2.0 * DIM * (q_tokens + sum(s["d_lens"])) + 4.0 * n_scores + index_bytes
    compute_ms = 1e3 * flops / ceilings["matmul_flops_per_s"]
    memory_ms = 1e3 * nbytes / ceilings["bandwidth_bytes_per_s"]
    return dict(flops=flops, bytes=nbytes, compute_ms=compute_ms, memory_ms=memory_ms,
                floor_ms=max(compute_ms, memory_ms), bound="compute" if compute_ms > memory_ms else "memory")


# ---------------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------------


def eager_ms(calls: list, cuda: bool) -> float:
    """Median ms of one call, rotating input sets; do_bench (L2 flushed) on CUDA, perf_counter on the CPU."""
    turn = iter(range(10**9))

    def step():
        return calls[next(turn) % len(calls)]()

    if cuda:
        return float(triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median"))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        step()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def graph_ms(calls: list) -> float:
    """One call's share of a CUDA graph replaying GRAPH_CALLS calls over the rotated input sets."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(GRAPH_CALLS):
            calls[i % len(calls)]()
    graph.replay()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / GRAPH_CALLS)
    return statistics.median(times)


def measure_ceilings() -> dict:
    """Device-copy bandwidth (read + write) and cuBLAS fp16 matmul rate of this GPU, in this process."""
    src = torch.empty(1024**3 // 2, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    copy = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    mm = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return dict(bandwidth_bytes_per_s=2 * 1024**3 / (copy * 1e-3), matmul_flops_per_s=2 * 8192**3 / (mm * 1e-3),
                copy_ms=copy, matmul_ms=mm)


def run_cell(name: str, sets: list[dict], methods: dict, ceilings: dict, cuda: bool) -> dict:
    floor = floor_of(sets[0], ceilings)
    cell = dict(floor=floor, methods={})
    reference = None
    # Two interleaved rounds, keeping each method's faster median: the first method timed after the inputs were
    # built would otherwise pay for the GPU's clocks ramping back up.
    for _ in range(ROUNDS if cuda else 1):
        for method, build in methods.items():
            entry = cell["methods"].setdefault(method, {})
            if "error" in entry:
                continue
            try:
                calls = [build(s) for s in sets]
                out = calls[0]().float().reshape(-1)
                if reference is None:
                    reference = out
                entry["max_abs_diff_vs_lik"] = float((out - reference).abs().max()) if out.numel() else 0.0
                entry["eager_ms"] = min(eager_ms(calls, cuda), entry.get("eager_ms", math.inf))
                entry["pct_of_floor"] = 100 * floor["floor_ms"] / entry["eager_ms"]
                if cuda:
                    entry["graph_ms"] = min(graph_ms(calls), entry.get("graph_ms", math.inf))
                    entry["graph_pct_of_floor"] = 100 * floor["floor_ms"] / entry["graph_ms"]
            except Exception as exc:  # a peer failing must not stop the run; the JSON records why
                entry["error"] = f"{type(exc).__name__}: {exc}"[:400]
    for method, entry in cell["methods"].items():
        print(f"{name:18s} {method:14s} {json.dumps(entry)}", flush=True)
    lik_ms = cell["methods"].get("lik", {}).get("eager_ms")
    for entry in cell["methods"].values():
        if lik_ms and "eager_ms" in entry:
            entry["speedup_of_lik"] = entry["eager_ms"] / lik_ms
    return cell


def sweep(cells_inputs: dict, deadline: float) -> dict:
    """lik with forced packed-kernel tiles on each cell (eager and graph ms), to inform the default heuristic; stops
    at ``deadline`` (a ``time.perf_counter`` value) so the main results always get written."""
    out = {}
    for group_rows, block_n, warps, stages in [(32, 32, 4, 3), (32, 64, 4, 2), (32, 64, 4, 4), (32, 128, 4, 3),
                                               (32, 64, 8, 3), (32, 128, 8, 3), (16, 64, 4, 3)]:
        if time.perf_counter() > deadline:
            break
        forced = _config.MaxSimForwardConfig(group_rows, 1, block_n, DIM, warps, stages)
        key = f"rows{group_rows}_n{block_n}_w{warps}_s{stages}"
        with _config.override(maxsim_varlen=forced):
            for name, (sets, build) in cells_inputs.items():
                calls = [build(s) for s in sets]
                try:
                    out.setdefault(key, {})[name] = dict(eager_ms=eager_ms(calls, True), graph_ms=graph_ms(calls))
                except Exception as exc:
                    out.setdefault(key, {})[name] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
        print(f"sweep {key} {json.dumps(out[key])}", flush=True)
    return out


def save(result: dict, out_dir: str) -> str:
    """Write the JSON (after every cell, so a run cut short still leaves its results)."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "varlen_bench.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__}
    for dist in ("flash-maxsim", "late-interaction-kernels"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run of the plumbing (interpreter)")
    parser.add_argument("--sweep-until-s", type=float, default=200.0,
                        help="seconds into the run after which the tile sweep stops (0: no sweep)")
    args = parser.parse_args()
    started = time.perf_counter()
    global N_DOCS, N_PAIRS
    cuda = not args.smoke
    if args.smoke:
        N_DOCS, N_PAIRS = 4, 4
    device = torch.device("cuda" if cuda else "cpu")
    gen = torch.Generator().manual_seed(0)

    ceilings = measure_ceilings() if cuda else dict(bandwidth_bytes_per_s=1e10, matmul_flops_per_s=1e11)
    result = dict(device=torch.cuda.get_device_name() if cuda else "cpu (smoke)", versions=versions(),
                  commit=os.environ.get("LIK_COMMIT"), ceilings=ceilings, cells={})
    print(f"device {result['device']}; ceilings {json.dumps(ceilings)}", flush=True)

    cells_inputs = {}
    for dist in ("uniform", "hotpotqa", "ragged"):
        first = corpus_set(dist, device, gen)
        per_set = 2 * DIM * (sum(first["d_lens"]) + LQ)
        # Copies with the same lengths and fresh values, so timing never re-reads a warm L2.
        copies = max(1, min(8, math.ceil(ROTATE_BYTES / per_set))) if cuda else 1
        sets = [first] + [dict(first, d=normalised(first["d"].shape[0], device, gen)) for _ in range(copies - 1)]
        for s in sets[1:]:
            s["D_pad"], s["d_mask"] = padded(s["d"], s["d_lens"])
        name = f"corpus/{dist}"
        result["cells"][name] = run_cell(name, sets, corpus_methods(args.smoke), ceilings, cuda)
        result["cells"][name]["mean_ld"] = sum(first["d_lens"]) / len(first["d_lens"])
        cells_inputs[name] = (sets, corpus_methods(True)["lik"])
        save(result, args.out)
    first = pair_set(device, gen)
    copies = max(1, min(4, math.ceil(ROTATE_BYTES / (2 * DIM * (first["q"].shape[0] + first["d"].shape[0])))))
    sets = [first] + [dict(first, q=normalised(first["q"].shape[0], device, gen),
                           d=normalised(first["d"].shape[0], device, gen)) for _ in range(copies - 1 if cuda else 0)]
    for s in sets[1:]:
        s["Q_pad"], s["D_pad"] = padded(s["q"], s["q_lens"])[0], padded(s["d"], s["d_lens"])[0]
    result["cells"]["pairs"] = run_cell("pairs", sets, pair_methods(args.smoke), ceilings, cuda)
    cells_inputs["pairs"] = (sets, pair_methods(True)["lik"])
    result["cells"]["pairs"]["mean_lq"] = sum(first["q_lens"]) / len(first["q_lens"])
    result["cells"]["pairs"]["mean_ld"] = sum(first["d_lens"]) / len(first["d_lens"])
    save(result, args.out)
    if cuda and args.sweep_until_s > 0:
        result["sweep"] = sweep(cells_inputs, started + args.sweep_until_s)
    path = save(result, args.out)
    print(f"\nwrote {path}\n")
    print(table(result))


def table(result: dict) -> str:
    """Markdown table: eager ms, % of floor and lik's speedup per method and cell (graph ms in brackets)."""
    methods = ["lik", "lik-triton-launch", "einsum-padded", "flash-maxsim", "lik-kernels", "lik-padded"]
    lines = ["| cell | floor us | " + " | ".join(methods) + " |", "|---" * (len(methods) + 2) + "|"]
    for name, cell in result["cells"].items():
        row = [name, f"{1e3 * cell['floor']['floor_ms']:.1f}"]
        for m in methods:
            e = cell["methods"].get(m)
            if not e or "eager_ms" not in e:
                row.append("-" if not e else "error")
                continue
            text = f"{1e3 * e['eager_ms']:.1f} us, {e['pct_of_floor']:.0f}%"
            if m != "lik":
                text += f", lik x{e['speedup_of_lik']:.2f}"
            if "graph_ms" in e:
                text += f" (graph {1e3 * e['graph_ms']:.1f} us, {e['graph_pct_of_floor']:.0f}%)"
            row.append(text)
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
