"""lik's host path on one GPU: the replays' bits, and the host time of the calls the design is judged by.

1. Checks (bitwise, replayed against the full path launched through Triton's own ``kernel[grid](...)``): eager
   inference of ``lik.maxsim`` (float, masked, per-query, 8-bit, a float query against an int8 corpus), the training
   forward and both backwards (fast: bitwise where each document row gets one contribution, else to 1e-3; and
   deterministic), ``lik.quantize``, packed chunks (``score_packed``, what ``Index.search`` runs), and deformable
   attention (forward, location and weight gradients bitwise; the atomic value gradient to 1e-5).
2. Host time per call: CPU wall time of calls issued back to back without synchronising (the GPU kept busy or
   ahead), next to the device time (CUDA events around the same calls queued behind a sleep kernel, so the device
   runs them without waiting for the host) and the synchronised wall time. Rows: the ColBERT training step (Nq = B =
   128, Lq 32, Ld 180, fp16, forward + cross-entropy + backward) with lik, a trivial differentiable scorer (the
   floor: a custom autograd Function of a few elementwise ops), late-interaction-kernels (when installed) and an
   einsum MaxSim; lik's B = 512 and ColPali B = 32 (1024 x 1024) steps; a small repeated inference call (32 query
   tokens, 100 documents of 64) against an empty Triton kernel with as many arguments; ``lik.Index.search`` of one
   32-token query over a GPU-resident corpus of 10M tokens against ``lik.maxsim_packed`` over the same tokens.
3. A markdown table, printed last, and everything as JSON (``--out``, default ``$OUT/host_path.json``).

``--dry-run`` runs every row once on tiny CPU shapes under Triton's interpreter (the plumbing, not the speed; the
replay checks need a GPU and are listed as skipped). Under 4 minutes on an H200.

Usage:
    python benchmarks/host_path.py [--out PATH] [--dry-run] [--index-tokens N] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

_DRY = "--dry-run" in sys.argv[1:]
if _DRY:  # before Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402, F401 (the interpreter looks for it beside a kernel)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import lik  # noqa: E402
from lik import _launch  # noqa: E402
from lik.bench.contrastive_cases import TrivialScorer  # noqa: E402  (the host floor: a few elementwise ops)


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file to write (default: $OUT/host_path.json, else ./host_path.json)")
    parser.add_argument("--dry-run", action="store_true", help="tiny CPU shapes under the interpreter")
    parser.add_argument("--index-tokens", type=int, default=10_000_000, help="tokens of the Index.search corpus")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds per row (the median is reported)")
    args = parser.parse_args(argv)
    if args.index_tokens < 1 or args.rounds < 1:
        parser.error("--index-tokens and --rounds must be positive")
    if args.out is None:
        args.out = Path(os.environ.get("OUT", ".")) / "host_path.json"
    return args


# ------------------------------------------------------------------------------------------------- timing


class Clock:
    """Host, device and wall time per call of ``fn`` on ``device`` (CUDA: events; CPU: host time only)."""

    def __init__(self, device: torch.device, rounds: int):
        self.device, self.rounds = device, rounds
        self.cuda = device.type == "cuda"
        self.cycles_per_us = self._calibrate() if self.cuda else 0.0

    def _calibrate(self) -> float:
        """Clock cycles per microsecond of ``torch.cuda._sleep`` (the sleep that holds the device back)."""
        torch.cuda._sleep(1000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(50_000_000)
        end.record()
        torch.cuda.synchronize()
        return 50_000_000 / (start.elapsed_time(end) * 1000)

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def measure(self, fn, calls: int) -> dict:
        for _ in range(1 if not self.cuda else 3):  # warm-up: compiles, records replays
            fn()
        self._sync()
        host, wall, device = [], [], []
        for _ in range(self.rounds):
            self._sync()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            host.append((time.perf_counter() - start) / calls * 1e6)
            self._sync()
            wall.append((time.perf_counter() - start) / calls * 1e6)
        result = {"host_us": statistics.median(host), "wall_us": statistics.median(wall), "calls": calls}
        if self.cuda:
            for _ in range(self.rounds):
                self._sync()
                # Hold the device back while the calls are queued: the events then time the device alone.
                torch.cuda._sleep(int(self.cycles_per_us * (2 * result["host_us"] * calls + 200)))
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                for _ in range(calls):
                    fn()
                end.record()
                torch.cuda.synchronize()
                device.append(begin.elapsed_time(end) * 1000 / calls)
            result["device_us"] = statistics.median(device)
        return result


# ------------------------------------------------------------------------------------------------- scorers


def einsum_maxsim(Q, D):
    return torch.einsum("qsd,btd->qbst", Q, D).amax(-1).float().sum(-1)


def _scorers(device) -> dict:
    scorers = {
        "lik": lambda Q, D: lik.maxsim(Q, D, backward="fast"),
        "trivial scorer": TrivialScorer.apply,
        "einsum": einsum_maxsim,
    }
    try:
        import late_interaction_kernels
    except ImportError:
        print("note: late_interaction_kernels is not installed: its row is skipped", file=sys.stderr)
    else:
        if device.type == "cuda":
            scorers["late-interaction-kernels"] = late_interaction_kernels.maxsim
    return scorers


def _unit(*shape, dtype, device, generator=None):
    x = torch.randn(*shape, device=device, generator=generator)
    return F.normalize(x, dim=-1).to(dtype)


def training_step(scorer, Q, D, labels):
    """One contrastive step: scores, cross-entropy over the in-batch documents, the gradients of Q and D."""
    loss = F.cross_entropy(scorer(Q, D), labels)
    return torch.autograd.grad(loss, (Q, D))


# ------------------------------------------------------------------------------------------------- checks


def _full_path(fn, *args, **kwargs):
    """``fn`` on the full path: Triton's own launch, no replay (lik._replay.allowed() is False)."""
    saved = _launch.ENABLED
    _launch.ENABLED = False
    try:
        return fn(*args, **kwargs)
    finally:
        _launch.ENABLED = saved


def _equal(a, b) -> bool:
    if a.dtype in (torch.int8, torch.float8_e4m3fn):
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def run_checks(device) -> list[dict]:
    """Each replay path against the full path: ``{"check", "replayed", "equal"}`` rows."""
    if device.type != "cuda" or not _launch.replay_allowed():
        reason = "no GPU" if device.type != "cuda" else f"Triton {__import__('triton').__version__}: replays off"
        return [{"check": "replays", "replayed": False, "equal": None, "note": reason}]
    from lik.ops.maxsim import packed_function
    from lik.ops.maxsim import replay as maxsim_replay
    from lik.ops.msda import backward as msda_backward
    from lik.ops.msda import forward as msda_forward
    from lik.ops.quantization import function as quantization

    gen = torch.Generator(device=device).manual_seed(0)
    unit = lambda *shape, dtype=torch.float16: _unit(*shape, dtype=dtype, device=device, generator=gen)  # noqa: E731
    rows = []

    def check(name, tables, build, run, compare=lambda i, a, b: _equal(a, b)):
        """Record with one call, replay another of the same key, compare with the full path; ``replayed``: every
        table in ``tables`` filed a replayable entry."""
        before = [set(t) for t in tables]
        run(*build())  # records
        args = build()  # new tensors, the same key
        got, want = run(*args), _full_path(run, *args)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        filed = [[t[k] for k in set(t) - b] for t, b in zip(tables, before)]
        rows.append({"check": name, "replayed": all(len(f) == 1 and f[0] != "never" for f in filed),
                     "equal": all(compare(i, a, b) for i, (a, b) in enumerate(zip(got, want)))})

    def inference(*shapes, masks=False):
        def build():
            Q, D = unit(*shapes[0]), unit(*shapes[1])
            extra = ()
            if masks:
                extra = (torch.rand(Q.shape[:-1], device=device, generator=gen) > 0.2,
                         torch.rand(D.shape[:-1], device=device, generator=gen) > 0.2)
            return (Q, D, *extra)
        return build

    with torch.no_grad():
        check("inference fp16 [32 x 128] x [100, 64]", [maxsim_replay.CALLS], inference((32, 128), (100, 64, 128)),
              lik.maxsim)
        check("inference masked, zero mode", [maxsim_replay.CALLS], inference((3, 32, 128), (50, 70, 128), masks=True),
              lambda Q, D, qm, dm: lik.maxsim(Q, D, qm, dm, mask_mode="zero"))
        check("inference per-query documents", [maxsim_replay.CALLS], inference((4, 16, 64), (4, 9, 40, 64)),
              lik.maxsim)

        def int8_corpus():
            d, ds = lik.quantize(unit(30, 260, 128), torch.int8)
            return unit(32, 128), d, ds
        check("inference float query, int8 corpus", [maxsim_replay.CALLS], int8_corpus,
              lambda Q, D, ds: lik.maxsim(Q, D, d_scale=ds))
        check("quantize int8", [quantization.QUANTIZATIONS], lambda: (unit(7, 33, 96),),
              lambda x: lik.quantize(x, torch.int8))

        def chunk():
            d, cu, _ = lik.pack([unit(n, 128) for n in (300, 57, 512, 0, 130)])
            return packed_function.packed_query(unit(1, 32, 128), None, d.dtype), d, cu
        check("packed chunk (Index.search)", [packed_function.PACKED_CALLS], chunk, packed_function.score_packed)

    for backward, shapes in (("fast", ((64, 1, 128), (64, 20, 32, 128))), ("fast", ((16, 32, 128), (40, 64, 128))),
                             ("deterministic", ((16, 32, 128), (40, 64, 128)))):
        def step(Q, D, grad, backward=backward):
            Q, D = Q.clone().requires_grad_(), D.clone().requires_grad_()
            scores = lik.maxsim(Q, D, backward=backward)
            return (scores.detach(), *torch.autograd.grad(scores, (Q, D), grad))

        exact = backward == "deterministic" or shapes[0][1] == 1  # one contribution per document row

        def compare(i, a, b, exact=exact):  # scores and dQ (a gather) are bitwise whatever the dD route
            return _equal(a, b) if exact or i < 2 else torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-3)
        name = f"training {backward} {'one-token queries' if shapes[0][1] == 1 else 'ColBERT-like'}" + (
            "" if exact else " (dD atomic: 1e-3)")
        check(name, [maxsim_replay.CALLS],
              lambda shapes=shapes: (unit(*shapes[0]), unit(*shapes[1]),
                                     torch.randn(shapes[0][0], shapes[1][-3], device=device, generator=gen)),
              step, compare)

    shapes = torch.tensor([[20, 24], [10, 12], [5, 6], [3, 3]], device=device)
    starts = torch.cat([shapes.new_zeros(1), (shapes[:, 0] * shapes[:, 1]).cumsum(0)[:-1]])

    def msda_problem():
        value = torch.randn(2, 639, 8, 32, device=device, generator=gen)  # 639 = 20 * 24 + 10 * 12 + 5 * 6 + 3 * 3
        loc = torch.rand(2, 60, 8, 4, 4, 2, device=device, generator=gen)
        attn = torch.rand(2, 60, 8, 4, 4, device=device, generator=gen)
        return value, loc, attn, torch.randn(2, 60, 256, device=device, generator=gen)

    def msda_step(value, loc, attn, grad):
        value, loc, attn = (t.clone().requires_grad_() for t in (value, loc, attn))
        out = lik.ms_deform_attn(value, shapes, starts, loc, attn)
        return (out.detach(), *torch.autograd.grad(out, (value, loc, attn), grad))

    check("deformable attention (value grad atomic: 1e-5)", [msda_forward._FORWARD_REPLAYS, msda_backward._REPLAYS],
          msda_problem, msda_step,
          lambda i, a, b: _equal(a, b) if i != 1 else torch.allclose(a, b, rtol=1e-5, atol=1e-5))
    return rows


# ------------------------------------------------------------------------------------------------- timings


@triton.jit
def empty_kernel(
    p0, p1, p2, p3, p4, p5, p6, p7, p8, p9,
    n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14, n15, n16, n17, n18, n19, n20, n21, n22, n23,
    n24, n25, n26, n27, n28, n29, n30, n31, n32, n33, n34,
):
    """Does nothing, with as many arguments as lik's forward kernel: 10 pointers and 35 integers."""
    pass


def empty_launch():
    """A call of :func:`empty_kernel` through Triton's own launch."""
    x = torch.empty(16, device="cuda" if torch.cuda.is_available() and not _DRY else "cpu")
    args = [x] * 10 + [3 + i for i in range(35)]
    return lambda: empty_kernel[(1,)](*args)


INDEX = "Index.search, 1 query"


def run_timings(device, clock: Clock, dry: bool, index_tokens: int) -> list[dict]:
    rows = []

    def row(name, fn, calls, group):
        result = clock.measure(fn, calls)
        rows.append({"row": name, "group": group, **result})
        print(f"{group:>22} | {name:<28} host {result['host_us']:9.1f} us", file=sys.stderr)

    dtype = torch.float32 if dry else torch.float16
    gen = torch.Generator(device=device).manual_seed(1)

    def leaves(nq, lq, b, ld, d=128):
        Q = _unit(nq, lq, d, dtype=dtype, device=device, generator=gen).requires_grad_()
        D = _unit(b, ld, d, dtype=dtype, device=device, generator=gen).requires_grad_()
        return Q, D, torch.arange(min(nq, b), device=device)

    colbert = (2, 4, 2, 6, 16) if dry else (128, 32, 128, 180)
    Q, D, labels = leaves(*colbert)
    for name, scorer in _scorers(device).items():
        row(name, lambda scorer=scorer: training_step(scorer, Q, D, labels), 1 if dry else 20, "ColBERT B=128 step")
    for name, shape in (("lik ColBERT B=512", (2, 4, 3, 6, 16) if dry else (512, 32, 512, 180)),
                        ("lik ColPali B=32", (2, 8, 2, 8, 16) if dry else (32, 1024, 32, 1024))):
        Qb, Db, labels_b = leaves(*shape)
        row(name, lambda Qb=Qb, Db=Db, labels_b=labels_b: training_step(
            lambda q, d: lik.maxsim(q, d, backward="fast"), Qb, Db, labels_b), 1 if dry else 10, "other steps")


    Qs = _unit(*((4, 16) if dry else (32, 128)), dtype=dtype, device=device, generator=gen)
    Ds = _unit(*((3, 8, 16) if dry else (100, 64, 128)), dtype=dtype, device=device, generator=gen)
    with torch.no_grad():
        row("lik.maxsim", lambda: lik.maxsim(Qs, Ds), 1 if dry else 200, "small inference call")
    row("empty Triton kernel, 45 args", empty_launch(), 1 if dry else 200, "small inference call")

    # documents of 64-511 tokens (ColBERT passages to short pages), as many as the tokens fill
    n_tokens, (shortest, longest), dim = (40, (4, 16), 16) if dry else (index_tokens, (64, 512), 128)
    lengths = torch.randint(shortest, longest, (2 * n_tokens // (shortest + longest) + 1,),
                            generator=torch.Generator().manual_seed(2))
    lengths = lengths[: int((lengths.cumsum(0) <= n_tokens).sum())]
    tokens = _unit(int(lengths.sum()), dim, dtype=dtype, device=device, generator=gen)
    docs = list(tokens.cpu().split(lengths.tolist()))
    index = lik.Index.build(docs, dtype=dtype, placement="gpu" if device.type == "cuda" else "host", device=device)
    del docs
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32).to(device)
    query = _unit(8 if dry else 32, dim, dtype=dtype, device=device, generator=gen)
    longest = int(lengths.max())
    with torch.no_grad():
        k = min(10, len(index))
        row("lik.Index.search (gpu)", lambda: index.search(query, k=k), 1 if dry else 10, INDEX)
        row("lik.maxsim_packed", lambda: lik.maxsim_packed(query, tokens, cu, max_seqlen_d=longest), 1 if dry else 10,
            INDEX)
    rows[-1]["tokens"] = rows[-2]["tokens"] = int(lengths.sum())
    return rows


# ------------------------------------------------------------------------------------------------- report


def _find(rows, group, name):
    return next((r for r in rows if r["group"] == group and r["row"] == name), None)


def summary(rows: list[dict]) -> dict:
    """The bars' ratios, where both rows ran."""
    out = {}
    lik_step = _find(rows, "ColBERT B=128 step", "lik")
    floor = _find(rows, "ColBERT B=128 step", "trivial scorer")
    peer = _find(rows, "ColBERT B=128 step", "late-interaction-kernels")
    if lik_step and floor:
        out["colbert_host_above_trivial_us"] = lik_step["host_us"] - floor["host_us"]
    if lik_step and peer:
        out["colbert_step_peer_over_lik"] = peer["wall_us"] / lik_step["wall_us"]
    small, empty = _find(rows, "small inference call", "lik.maxsim"), _find(rows, "small inference call",
                                                                              "empty Triton kernel, 45 args")
    if small and empty:
        out["small_call_host_over_empty_kernel"] = small["host_us"] / empty["host_us"]
    search = _find(rows, INDEX, "lik.Index.search (gpu)")
    packed = _find(rows, INDEX, "lik.maxsim_packed")
    if search and packed:
        out["index_search_over_maxsim_packed"] = search["wall_us"] / packed["wall_us"]
    return out


def table(checks, rows, bars) -> str:
    lines = ["| group | row | host us | device us | wall us |", "|---|---|---:|---:|---:|"]
    for r in rows:
        device = f"{r['device_us']:.1f}" if "device_us" in r else "n/a"
        lines.append(f"| {r['group']} | {r['row']} | {r['host_us']:.1f} | {device} | {r['wall_us']:.1f} |")
    lines += ["", "| bar | value |", "|---|---:|"] + [f"| {k} | {v:.3f} |" for k, v in bars.items()]
    lines += ["", "| replay check | replayed | bitwise (or as noted) |", "|---|---|---|"]
    lines += [f"| {c['check']} | {c['replayed']} | {c['equal'] if c['equal'] is not None else c.get('note', '')} |"
              for c in checks]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse(argv)
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.dry_run:
        print("host_path: no CUDA GPU here; use --dry-run for the CPU plumbing", file=sys.stderr)
        return 1
    started = time.perf_counter()
    checks = run_checks(device)
    rows = run_timings(device, Clock(device, 1 if args.dry_run else args.rounds), args.dry_run, args.index_tokens)
    bars = summary(rows)
    record = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "triton": __import__("triton").__version__, "lik": lik.__version__,
        "dry_run": args.dry_run, "seconds": time.perf_counter() - started,
        "checks": checks, "rows": rows, "bars": bars,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(table(checks, rows, bars))
    return 0 if all(c["equal"] is not False and c["replayed"] is not False for c in checks
                    if c["equal"] is not None) else 2


if __name__ == "__main__":
    sys.exit(main())
