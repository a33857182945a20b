"""lik's compressed index (``codec="plaid"``) against fast-plaid on the same embeddings, recall against exact MaxSim.

    python3 benchmarks/plaid_bench.py --out $OUT/plaid                  # ~5M tokens, nbits 2 and 4 (< 150 s, H200)
    python3 benchmarks/plaid_bench.py --quick --out $OUT/plaid          # ~1M tokens
    python3 benchmarks/plaid_bench.py --tokens 20000000 --out ...       # any size that fits in memory
    python3 benchmarks/plaid_bench.py --scale [--tokens N] --out ...    # 1B tokens streamed: benchmarks/plaid_scale.py
    python3 benchmarks/plaid_bench.py --smoke --out ...                 # tiny, any device: the plumbing

Data: clustered synthetic tokens, d = 128, fp16: ``--centres`` random unit centres; each document (60-140 tokens)
draws its tokens around 4 of them (``normalise(centre + noise)``, noise of norm ``--noise``); each query copies 32
tokens of a random document with noise of norm ``--q-noise``. The corpus is made on the device in chunks from a
seed, so ``--scale`` regenerates it instead of holding it (256 GB of fp16 at 1B tokens).
Ground truth: exact MaxSim of every query against every document (``lik.maxsim_packed`` on the fp16 corpus);
a retrieved document counts if its exact score reaches the exact 10th score (ties cost nothing).
Systems: fast-plaid (``FastPlaid.create(kmeans_niters=4, nbits=...)``, ``search(top_k=10)`` with its defaults:
8 probes, 4 096 full scores; the queries already on the GPU), lik ``Index.build(codec="plaid", nbits=...)`` searched
exhaustively and with candidates (``--n-probe``, ``--candidates``: fast-plaid's defaults), and lik's exact fp16
index for reference. Bytes: the index folder (lik's shards + codec; ``--scale`` keeps the index on the GPU and
counts codes + residuals + centroids). Build: seconds to a searchable index, files written. Times: median of 3
warm calls, 256 queries at once and one query. Writes ``plaid_bench.json`` to ``--out``; prints a table last.
Without ``codec`` in ``lik.Index.build`` the lik rows say so and the run goes on.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # a checkout without installing lik

import lik  # noqa: E402

K, DIM, TOPICS_PER_DOC = 10, 128, 4


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="~1M tokens")
    size.add_argument("--scale", action="store_true", help="1B tokens (or --tokens), streamed; lik only")
    size.add_argument("--smoke", action="store_true", help="tiny sizes, any device")
    parser.add_argument("--tokens", type=int, default=None, help="corpus tokens (default 5M; --quick 1M)")
    parser.add_argument("--centres", type=int, default=4096)
    parser.add_argument("--min-len", type=int, default=60)
    parser.add_argument("--max-len", type=int, default=140)
    parser.add_argument("--noise", type=float, default=0.8)
    parser.add_argument("--q-noise", type=float, default=0.3)
    parser.add_argument("--queries", type=int, default=256)
    parser.add_argument("--q-len", type=int, default=32)
    parser.add_argument("--nbits", default=None, help="comma-separated, from 1 2 4 (default 2,4; --scale 2)")
    parser.add_argument("--n-probe", type=int, default=8)
    parser.add_argument("--candidates", type=int, default=4096)
    parser.add_argument("--skip", default="", help="comma-separated substrings of system names to leave out")
    parser.add_argument("--chunk-tokens", type=int, default=1 << 24, help="tokens generated per chunk")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-budget-s", type=float, default=140.0)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    scale = parser.add_argument_group("--scale only (benchmarks/plaid_scale.py)")
    scale.add_argument("--num-centroids", type=int, default=None, help="default 2**16 from 2**26 tokens up")
    scale.add_argument("--train-tokens", type=int, default=None, help="default 2**23 from 2**26 tokens up")
    scale.add_argument("--recall-queries", type=int, default=32, help="queries the scan and exact MaxSim score")
    scale.add_argument("--build-budget-s", type=float, default=None, help="default 0.6 of --time-budget-s")
    scale.add_argument("--no-exact", dest="exact", action="store_false", help="skip exact MaxSim")
    scale.add_argument("--sweep", default="4:1024,8:2048,16:4096,16:8192", help="n_probe:candidates,...")
    args = parser.parse_args(argv)
    if args.smoke:  # the smoke sizes are defaults: an explicit value still wins
        parser.set_defaults(centres=16, queries=8, min_len=6, max_len=14, chunk_tokens=1024, candidates=64, n_probe=4)
        args = parser.parse_args(argv)
    default_tokens = 1_000_000_000 if args.scale else 1_000_000 if args.quick else 3_000 if args.smoke else 5_000_000
    args.tokens = default_tokens if args.tokens is None else args.tokens
    try:
        args.nbits = [int(b) for b in (args.nbits or ("2" if args.scale else "2,4")).split(",")]
    except ValueError:
        parser.error(f"--nbits must be comma-separated integers, got {args.nbits!r}")
    checks = [
        (args.tokens >= 1, "--tokens must be positive"),
        (args.centres >= 1, "--centres must be positive"),
        (1 <= args.min_len <= args.max_len, "--min-len and --max-len must satisfy 1 <= min <= max"),
        (args.queries >= 1 and args.q_len >= 1, "--queries and --q-len must be positive"),
        (args.noise >= 0 and args.q_noise >= 0, "--noise and --q-noise must be non-negative"),
        (bool(args.nbits) and set(args.nbits) <= {1, 2, 4}, "--nbits must hold values from 1, 2, 4"),
        (args.n_probe >= 1, "--n-probe must be positive"),
        (args.candidates >= K, f"--candidates must be at least k = {K}"),
        (args.chunk_tokens >= args.max_len, "--chunk-tokens must hold one document (>= --max-len)"),
    ]
    for ok, message in checks:
        if not ok:
            parser.error(message)
    return args


# ---------------------------------------------------------------------------------------------- data
class Corpus:
    """The corpus as chunks of documents, each made on ``device`` from ``(seed, chunk)`` alone, so any pass can
    regenerate it. Documents per chunk are fixed, so a global document id names its chunk."""

    def __init__(self, args, device):
        self.args, self.device = args, torch.device(device)
        mean = (args.min_len + args.max_len) / 2
        self.num_docs = max(1, math.ceil(args.tokens / mean))
        self.docs_per_chunk = max(1, int(args.chunk_tokens // args.max_len))
        self.num_chunks = math.ceil(self.num_docs / self.docs_per_chunk)
        self.num_tokens = 0  # counted by the first pass
        g = torch.Generator().manual_seed(args.seed)
        self.centres = F.normalize(torch.randn(args.centres, DIM, generator=g), dim=-1).to(self.device)

    def _generator(self, salt: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(self.args.seed * 1_000_003 + salt)

    def chunk(self, number: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens fp16 [t, 128], cu_seqlens int64 [n + 1])`` of chunk ``number``, on the device."""
        a, g = self.args, self._generator(1 + number)
        n = min(self.docs_per_chunk, self.num_docs - number * self.docs_per_chunk)
        lengths = torch.randint(a.min_len, a.max_len + 1, (n,), generator=g, device=self.device)
        cu = F.pad(lengths.cumsum(0), (1, 0))
        topics = torch.randint(0, a.centres, (n, TOPICS_PER_DOC), generator=g, device=self.device)
        owner = torch.repeat_interleave(torch.arange(n, device=self.device), lengths)
        pick = torch.randint(0, TOPICS_PER_DOC, (owner.numel(),), generator=g, device=self.device)
        noise = torch.randn(owner.numel(), DIM, generator=g, device=self.device) * (a.noise / DIM**0.5)
        return F.normalize(self.centres[topics[owner, pick]] + noise, dim=-1).half(), cu

    def chunks(self):
        for number in range(self.num_chunks):
            yield number * self.docs_per_chunk, *self.chunk(number)

    def query_docs(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.args.seed + 7)
        return torch.randint(0, self.num_docs, (self.args.queries,), generator=g)

    def queries_from(self, first: int, tokens, cu, Q: torch.Tensor) -> None:
        """Fill the rows of ``Q [Nq, Lq, 128]`` whose source document lies in this chunk: ``q_len`` of its tokens
        (drawn with replacement) plus noise."""
        a = self.args
        for row, doc in enumerate(self.query_docs().tolist()):
            if first <= doc < first + cu.numel() - 1:
                g = self._generator(-1 - row)
                start, length = int(cu[doc - first]), int(cu[doc - first + 1] - cu[doc - first])
                picks = start + torch.randint(0, length, (a.q_len,), generator=g, device=self.device)
                noise = torch.randn(a.q_len, DIM, generator=g, device=self.device) * (a.q_noise / DIM**0.5)
                Q[row] = F.normalize(tokens[picks].float() + noise, dim=-1).half()


def exact_scores(Q: torch.Tensor, tokens: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """fp32 ``[Nq, n]`` exact MaxSim of ``Q`` against the packed documents (fp32 products on the CPU)."""
    if tokens.device.type == "cpu":
        Q, tokens = Q.float(), tokens.float()
    return lik.maxsim_packed(Q, tokens, cu.to(torch.int32)).float()


def recall_at_k(ids: torch.Tensor, exact: torch.Tensor, k: int = K) -> float:
    """Mean over queries of the share of ``ids [Nq, >= k]`` (``-1``: none) among the first ``k`` whose exact score
    reaches the query's exact ``k``-th score; a document retrieved twice counts once."""
    kth = exact.topk(min(k, exact.shape[1]), dim=1).values[:, -1:]
    ids = ids[:, :k].to(exact.device).sort(dim=1).values
    first = torch.ones_like(ids, dtype=torch.bool)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    hit = (exact.gather(1, ids.clamp_min(0)) >= kth - 1e-4) & (ids >= 0) & first
    return float(hit.sum(1).double().mean()) / k


# ---------------------------------------------------------------------------------------------- systems
def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, device, calls: int = 3) -> tuple[float, object]:
    """One warm-up call, then the median of ``calls`` timed calls; returns (ms, the last result)."""
    fn()
    synchronize(device)
    runs = []
    for _ in range(calls):
        start = time.perf_counter()
        result = fn()
        synchronize(device)
        runs.append((time.perf_counter() - start) * 1e3)
    return statistics.median(runs), result


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def measure(name, build, search, Q, exact, device, **extra) -> dict:
    """Build (timed), then the 256-query and one-query medians and recall@10; ``build`` returns (index, bytes)."""
    start = time.perf_counter()
    index, size = build()
    synchronize(device)
    row = {"system": name, "build_s": time.perf_counter() - start, "bytes": size, **extra}
    row["batch_ms"], ids = median_ms(lambda: search(index, Q), device)
    row["one_query_ms"], _ = median_ms(lambda: search(index, Q[:1]), device)
    row["recall_at_10"] = recall_at_k(ids, exact)
    return row


def fast_plaid_system(args, docs_cpu, root: Path, device, nbits: int):
    from fast_plaid.search import FastPlaid

    def build():
        index = FastPlaid(index=str(root / f"fast-plaid-{nbits}"), device=str(device))
        index.create(documents_embeddings=docs_cpu, kmeans_niters=4, nbits=nbits)
        return index, folder_bytes(root / f"fast-plaid-{nbits}")

    def search(index, Q):
        hits = index.search(queries_embeddings=Q, top_k=K, show_progress=False)
        ids = torch.full((len(hits), K), -1, dtype=torch.int64)
        for row, found in enumerate(hits):
            ids[row, : len(found[:K])] = torch.tensor([int(i) for i, _ in found[:K]], dtype=torch.int64)
        return ids

    return build, search


def lik_has_plaid() -> bool:
    return "codec" in inspect.signature(lik.Index.build).parameters


def lik_build(corpus: Corpus, root: Path | None, device, placement: str, **codec):
    """Build from the corpus's chunks (one packed batch each); saved under ``root`` when given."""
    batches = (lik.index.DocumentBatch.packed(t, c) for _, t, c in corpus.chunks())
    kw = dict(placement=placement, device=device, progress=False, **codec)
    if root is None:
        index = lik.Index.build(batches, **kw)
        per_token = 4 + DIM * codec["nbits"] // 8 if codec else 2 * DIM  # code + residual bytes, or fp16
        centroids = index.codec.centroids.numel() * index.codec.centroids.element_size() if codec else 0
        return index, corpus.num_tokens * per_token + centroids
    index = lik.Index.build(batches, out=root, overwrite=True, **kw)
    return index, folder_bytes(root)


def exhaustive_search(index, Q):
    """``index.search(Q, 10)`` with the automatic mode held at exhaustive whatever the corpus size."""
    plaid_search = sys.modules.get("lik.index.plaid_search")
    saved = getattr(plaid_search, "EXHAUSTIVE_TOKENS", None)
    if saved is not None:
        plaid_search.EXHAUSTIVE_TOKENS = 1 << 62
    try:
        return index.search(Q, K)[1]
    finally:
        if saved is not None:
            plaid_search.EXHAUSTIVE_TOKENS = saved


def systems(args, corpus, docs_cpu, Q, exact, root: Path, device):
    """``(name, runner or note)`` per system; a runner returns its rows (lik's build serves two rows)."""
    on_gpu = torch.device(device).type == "cuda"
    placement = "gpu" if on_gpu else "auto"
    out = []
    for nbits in args.nbits:
        fp_name = f"fast-plaid {nbits}-bit (8 probes, 4096 full scores)"
        if args.scale:
            out.append((fp_name, "skipped: it takes the corpus as in-memory tensors (256 GB of fp16 at 1B)"))
        elif importlib.util.find_spec("fast_plaid") is None:
            out.append((fp_name, "skipped: fast-plaid is not installed"))
        elif not on_gpu:
            out.append((fp_name, "skipped: needs CUDA (its CPU path is not what is compared)"))
        else:
            b, s = fast_plaid_system(args, docs_cpu, root, device, nbits)
            out.append((fp_name, lambda b=b, s=s, n=fp_name: [measure(n, b, s, Q, exact, device)]))
        name = f"lik plaid {nbits}-bit"
        if not lik_has_plaid():
            out.append((name, "skipped: lik.Index.build has no codec= (codec='plaid' is not in this lik)"))
            continue

        def lik_rows(nbits=nbits, name=name):
            start = time.perf_counter()
            folder = None if args.scale else root / f"lik-plaid-{nbits}"
            index, size = lik_build(corpus, folder, device, placement, codec="plaid", nbits=nbits)
            synchronize(device)
            built = {"build_s": time.perf_counter() - start, "bytes": size}
            ready = lambda: (index, size)  # noqa: E731
            probe = dict(n_probe=args.n_probe, candidates=args.candidates)
            rows = [
                measure(f"{name} exhaustive", ready, exhaustive_search, Q, exact, device),
                measure(
                    f"{name} candidates ({args.n_probe} probes, {args.candidates})",
                    ready,
                    lambda i, q: i.search(q, K, **probe)[1],
                    Q,
                    exact,
                    device,
                    **probe,
                ),
            ]
            for row in rows:
                row.update(built)
            rows[1]["recall_vs_exhaustive"] = rows[1]["recall_at_10"] / max(rows[0]["recall_at_10"], 1e-9)
            return rows

        out.append((name, lik_rows))
    if not args.scale:

        def exact_rows():
            build = lambda: lik_build(corpus, root / "lik-exact", device, placement)  # noqa: E731
            return [measure("lik exact fp16", build, lambda i, q: i.search(q, K)[1], Q, exact, device)]

        out.append(("lik exact fp16", exact_rows))
    return out


def markdown(rows, meta) -> str:
    lines = [
        f"PLAID indexes, {meta['corpus']} ({meta['device']}; torch {meta['torch']}, fast-plaid "
        f"{meta['fast_plaid']}; commit {meta['commit']})",
        "",
        f"| system | bytes | build s | {meta['queries']} queries ms | one query ms | recall@10 |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        if "note" in row:
            lines.append(f"| {row['system']} | {row['note']} | | | | |")
            continue
        size = f"{row['bytes'] / 1e9:.3f} GB" if row["bytes"] >= 1e7 else f"{row['bytes'] / 1e6:.3f} MB"
        lines.append(
            f"| {row['system']} | {size} | {row['build_s']:.1f} | {row['batch_ms']:.1f} | "
            f"{row['one_query_ms']:.2f} | {row['recall_at_10']:.3f} |"
        )
    return "\n".join(lines)


def ground_truth(args, corpus: Corpus, device):
    """``(Q fp16 [Nq, Lq, 128], exact fp32 [Nq, N], tokens, cu)``: queries from one pass over the chunks, exact
    scores from the same pass (all in memory) or, with ``--scale``, a second pass (nothing kept)."""
    Q = torch.zeros(args.queries, args.q_len, DIM, dtype=torch.float16, device=device)
    if not args.scale:
        parts = list(corpus.chunks())
        tokens = torch.cat([t for _, t, _ in parts])
        lengths = torch.cat([c.diff() for _, _, c in parts])
        cu = F.pad(lengths.cumsum(0), (1, 0))
        corpus.queries_from(0, tokens, cu, Q)
        corpus.num_tokens = tokens.shape[0]
        return Q, exact_scores(Q, tokens, cu), tokens, cu
    for first, tokens, cu in corpus.chunks():
        corpus.queries_from(first, tokens, cu, Q)
        corpus.num_tokens += tokens.shape[0]
    exact = torch.cat([exact_scores(Q, t, c) for _, t, c in corpus.chunks()], dim=1)
    return Q, exact, None, None


def commit_of() -> str:
    here = Path(__file__).resolve().parent
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here)
    return os.environ.get("LIK_COMMIT") or git.stdout.strip() or "unknown"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.scale:  # benchmarks/plaid_scale.py, given this module's corpus, exact scores and recall
        spec = importlib.util.spec_from_file_location("plaid_scale", Path(__file__).resolve().parent / "plaid_scale.py")
        scale = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(scale)
        helpers = dict(Corpus=Corpus, DIM=DIM, exact_scores=exact_scores, recall_at_k=recall_at_k, commit_of=commit_of)
        return scale.run(args, argparse.Namespace(**helpers))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    corpus = Corpus(args, device)
    Q, exact, tokens, cu = ground_truth(args, corpus, device)
    truth_s = time.perf_counter() - started
    docs_cpu = None
    if tokens is not None and device.type == "cuda" and "fast-plaid" not in args.skip:
        docs_cpu = list(tokens.cpu().split(cu.diff().tolist()))
    meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__)
    fast_plaid = metadata.version("fast-plaid") if importlib.util.find_spec("fast_plaid") else None
    meta.update(fast_plaid=fast_plaid, commit=commit_of(), args=vars(args), command=" ".join(sys.argv))
    meta.update(ground_truth_s=truth_s, queries=args.queries, lik_has_plaid=lik_has_plaid())
    meta["corpus"] = (
        f"{corpus.num_docs} documents / {corpus.num_tokens} tokens, {args.queries} queries of "
        f"{args.q_len} tokens, d = 128, {args.centres} clusters, fp16"
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="plaid-bench-") as tmp:
        for name, runner in systems(args, corpus, docs_cpu, Q, exact, Path(tmp), device):
            done = len(rows)
            if any(part and part.lower() in name.lower() for part in args.skip.split(",")):
                rows.append({"system": name, "note": "--skip"})
            elif isinstance(runner, str):
                rows.append({"system": name, "note": runner})
            elif time.perf_counter() - started > args.time_budget_s:
                rows.append({"system": name, "note": f"past the time budget ({args.time_budget_s:.0f} s)"})
            else:
                try:
                    rows.extend(runner())
                except Exception as error:  # noqa: BLE001 (a system's failure is a result; the run goes on)
                    rows.append({"system": name, "note": f"failed: {type(error).__name__}: {error}"[:300]})
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            print("\n".join(json.dumps(row) for row in rows[done:]), flush=True)
    table = markdown(rows, meta)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plaid_bench.json").write_text(json.dumps({"meta": meta, "rows": rows, "markdown": table}, indent=1))
    print(f"wrote {out / 'plaid_bench.json'} in {time.perf_counter() - started:.0f} s")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
