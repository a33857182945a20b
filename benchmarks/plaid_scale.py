"""``benchmarks/plaid_bench.py --scale``: a compressed index of up to a billion tokens built streamed on one GPU, then
searched by candidate generation and by the same codec's exhaustive scan.

    python3 benchmarks/plaid_bench.py --scale --tokens 1000000000 --nbits 2 --time-budget-s 540 --out $OUT/scale

One pass makes the corpus chunk by chunk on the device (plaid_bench's clustered tokens: lengths 60-140, d = 128,
unit fp16) and feeds it to ``lik.Index.build(codec="plaid", placement="gpu")`` as packed batches; the queries
(noisy copies of documents' tokens) are copied out on the way, so no fp16 corpus is ever held. Then, each stage
only while the time budget lasts, each writing ``plaid_scale.json`` as it ends:

1. the first candidate search (it builds the inverted file), one query (median of 5 warm calls), the whole batch
   (median of 3);
2. the exhaustive scan of the first ``--recall-queries`` queries: the reference. ``recall_vs_scan`` is the share
   of candidate generation's top 10 that the scan's top 10 holds (or that scores at least the scan's 10th);
3. exact MaxSim of those queries over the regenerated fp16 corpus: recall@10 of both against it, and their
   ratio (``candidates_over_scan``, the 5M comparison's "recall_vs_exhaustive");
4. ``--sweep`` settings (``n_probe:candidates``), their batch and one-query times and recall against the scan.

The build stops taking chunks past ``--build-budget-s`` (the index then holds fewer tokens, which the report
says). Centroids default to 2**16 (``--num-centroids``): the assignment of 1e9 tokens costs ``2 * 128 * K`` FLOP
a token, 1.7e16 at 2**16, about a minute of tensor-core time in the fused kernel; 2**18 (ColBERT's rule) would
take four. The codec trains on ``--train-tokens`` (default 2**23, about 128 tokens per centroid).
"""

from __future__ import annotations

import importlib
import json
import statistics
import time
from pathlib import Path

import torch

import lik

K = 10


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device, calls: int) -> tuple[float, object]:
    """Median ms of ``calls`` calls after one warm-up, and the last result."""
    fn()
    _sync(device)
    runs, result = [], None
    for _ in range(calls):
        start = time.perf_counter()
        result = fn()
        _sync(device)
        runs.append((time.perf_counter() - start) * 1e3)
    return statistics.median(runs), result


def fused_assignment(device, tokens: int = 1 << 16, centroids: int = 1 << 12) -> str:
    """Which assignment the build runs on CUDA, after a check of the fused kernel against its reference (64 Ki
    tokens, 4 Ki centroids). A failing kernel is switched off (k-means and compression then run their chunked
    products: slow at scale, which the build budget bounds). A codec module without the fused kernel would write
    a ``[K, 8192]`` fp32 block per 8192 tokens (262 TB at 1e9 tokens and 2**16 centroids): for this run its
    ``compress_into_codes`` is replaced by :func:`lik.compression.nearest.nearest_centroid` (inner product, fp16
    operands, fp32 accumulation: ColBERT's GPU assignment), and the report says so."""
    from lik.compression import codec as codec_module

    kmeans_module = importlib.import_module("lik.compression.kmeans")  # (the package's kmeans is the function)
    from lik.compression.nearest import nearest_centroid, nearest_centroid_reference

    g = torch.Generator(device=device).manual_seed(1)
    x = torch.nn.functional.normalize(torch.randn(tokens, 128, generator=g, device=device), dim=-1).half()
    c = torch.nn.functional.normalize(torch.randn(centroids, 128, generator=g, device=device), dim=-1).half()
    try:
        codes, scores = nearest_centroid(x, c, bias=None)
        ref_codes, ref_scores = nearest_centroid_reference(x, c, bias=None)
        agree = float((codes == ref_codes).float().mean())
        err = float((scores - ref_scores).abs().max())
        if agree < 0.99 or err > 1e-2:
            raise ValueError(f"fused kernel disagrees with its reference: codes agree {agree:.4f}, max diff {err}")
    except Exception as error:  # noqa: BLE001 (the run goes on with the unfused products)
        kmeans_module.FUSED = False
        return f"unfused (the fused kernel failed its check: {type(error).__name__}: {error})"[:400]
    if "nearest_centroid" in vars(codec_module):
        return f"lik (fused; check: codes agree {agree:.5f})"
    original = codec_module.ResidualCodec.compress_into_codes

    def compress_into_codes(self, embs):
        if not embs.is_cuda:
            return original(self, embs)
        embs = self._check_embs(embs)
        return nearest_centroid(embs, self.centroids, bias=None, product_dtype=torch.float16)[0]

    codec_module.ResidualCodec.compress_into_codes = compress_into_codes
    return f"fused nearest_centroid installed by the bench (codec.py's own is unfused); codes agree {agree:.5f}"


def recall_vs_scan(cand_ids, cand_scores, scan_ids, scan_scores, k: int = K) -> float:
    """Mean share of each query's candidate top ``k`` that the scan's top ``k`` holds or that scores (the same
    codec's score) at least the scan's ``k``-th, counted once per document; ``-1`` ids count nothing."""
    kth = scan_scores[:, k - 1 : k]
    in_scan = (cand_ids[:, :k, None] == scan_ids[:, None, :k]).any(-1)
    tie = cand_scores[:, :k] >= kth - 1e-4
    ordered = cand_ids[:, :k]
    earlier = torch.ones(ordered.shape[1], ordered.shape[1], dtype=torch.bool, device=ordered.device).tril(-1)
    # A repeated id counts once: its first place only.
    first = ~((ordered[:, :, None] == ordered[:, None, :]) & earlier).any(-1)
    ok = (in_scan | tie) & (ordered >= 0) & first
    return float(ok.sum(1).double().mean()) / k


def _save(path: Path, report: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(path)


def run(args, pb) -> int:
    """The ``--scale`` run; ``pb`` is the plaid_bench module (its corpus, exact scores and recall)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    started = time.perf_counter()
    deadline = started + args.time_budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "plaid_scale.json"
    nbits = args.nbits[0]
    settings = dict(n_probe=args.n_probe, candidates=args.candidates)
    num_centroids = args.num_centroids or (1 << 16 if args.tokens >= 1 << 26 else None)
    train_tokens = args.train_tokens or (1 << 23 if args.tokens >= 1 << 26 else None)
    report = {
        "meta": {
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__,
            "commit": pb.commit_of(),
            "args": vars(args),
            "nbits": nbits,
            "num_centroids": num_centroids,
            "train_tokens": train_tokens,
            "settings": settings,
        },
        "stages": {},
        "notes": [],
    }
    stages = report["stages"]

    def save():
        report["elapsed_s"] = time.perf_counter() - started
        if cuda:
            report["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        _save(path, report)

    def say(name, value):
        stages[name] = value
        print(json.dumps({name: value}, default=str), flush=True)
        save()

    if cuda:
        # fp32 products (k-means on the training sample) on TF32 tensor cores; queries and tokens are fp16.
        torch.set_float32_matmul_precision("high")
        torch.cuda.reset_peak_memory_stats()
        report["meta"]["assign"] = fused_assignment(device)
    save()

    # ------------------------------------------------------------------ build (one pass, queries copied out)
    corpus = pb.Corpus(args, device)
    Q = torch.zeros(args.queries, args.q_len, pb.DIM, dtype=torch.float16, device=device)
    filled = torch.zeros(args.queries, dtype=torch.bool)
    query_docs = corpus.query_docs()
    built = {"tokens": 0, "docs": 0, "chunks": 0, "truncated": False}
    build_budget = args.build_budget_s if args.build_budget_s else 0.6 * args.time_budget_s
    t0 = time.perf_counter()

    def batches():
        for first, tokens, cu in corpus.chunks():
            corpus.queries_from(first, tokens, cu, Q)
            filled[(query_docs >= first) & (query_docs < first + cu.numel() - 1)] = True
            built["tokens"] += tokens.shape[0]
            built["docs"] += cu.numel() - 1
            built["chunks"] += 1
            yield lik.index.DocumentBatch.packed(tokens, cu)
            del tokens, cu
            if time.perf_counter() - t0 > build_budget and built["chunks"] < corpus.num_chunks:
                built["truncated"] = True
                return

    placement = "gpu" if cuda else "auto"
    try:
        index = lik.Index.build(
            batches(),
            codec="plaid",
            nbits=nbits,
            num_centroids=num_centroids,
            train_tokens=train_tokens,
            placement=placement,
            device=device,
            progress=False,
        )
    except Exception as error:  # noqa: BLE001 (the report keeps what was reached, then the error propagates)
        say("build", {**built, "failed": f"{type(error).__name__}: {error}"[:400], "s": time.perf_counter() - t0})
        raise
    _sync(device)
    build_s = time.perf_counter() - t0
    codec = index.codec
    centroid_bytes = codec.centroids.numel() * codec.centroids.element_size()
    size = built["tokens"] * (4 + pb.DIM * nbits // 8) + centroid_bytes
    say(
        "build",
        {
            **built,
            "build_s": build_s,
            "tokens_per_s": built["tokens"] / build_s,
            "bytes": size,
            "num_centroids": codec.num_centroids,
            "peak_gib_after_build": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "allocated_gib": torch.cuda.memory_allocated() / 2**30 if cuda else None,
        },
    )
    if not bool(filled.all()):
        # A truncated build: queries copied from documents it never reached repeat ones it did.
        have = torch.nonzero(filled).flatten()
        missing = torch.nonzero(~filled).flatten()
        Q[missing.to(device)] = Q[have[torch.arange(missing.numel()) % have.numel()].to(device)]
        report["notes"].append(f"{missing.numel()} queries came from documents past the truncated build")

    def left() -> float:
        return deadline - time.perf_counter()

    def candidates(q, **kw):
        return index.search(q, K, **(kw or settings))

    # ------------------------------------------------------------------ candidate search
    R = min(args.recall_queries, args.queries)
    cand = None
    try:
        start = time.perf_counter()
        candidates(Q[:1])
        _sync(device)
        first_s = time.perf_counter() - start
        one_ms, _ = _timed(lambda: candidates(Q[:1]), device, 5)
        batch_ms, cand = _timed(lambda: candidates(Q), device, 3)
        say("candidates", {**settings, "first_search_s": first_s, "one_query_ms": one_ms, "batch_ms": batch_ms})
    except Exception as error:  # noqa: BLE001 (a stage's failure is a result; the run goes on)
        say("candidates", {"failed": f"{type(error).__name__}: {error}"[:400]})

    # ------------------------------------------------------------------ the reference: the same codec's scan
    scan = None
    if left() > 30:
        try:
            start = time.perf_counter()
            plaid_search = __import__("lik.index.plaid_search", fromlist=["EXHAUSTIVE_TOKENS"])
            saved, plaid_search.EXHAUSTIVE_TOKENS = plaid_search.EXHAUSTIVE_TOKENS, 1 << 62
            try:
                scan = index.search(Q[:R], K)
            finally:
                plaid_search.EXHAUSTIVE_TOKENS = saved
            _sync(device)
            row = {"queries": R, "scan_s": time.perf_counter() - start}
            if cand is not None:
                row["recall_vs_scan"] = recall_vs_scan(cand[1][:R], cand[0][:R], scan[1], scan[0])
            say("scan", row)
        except Exception as error:  # noqa: BLE001
            say("scan", {"failed": f"{type(error).__name__}: {error}"[:400]})
    else:
        say("scan", {"skipped": "past the time budget"})

    # ------------------------------------------------------------------ exact MaxSim over the regenerated corpus
    if args.exact and left() > 60 + build_s * 0.05:
        try:
            start = time.perf_counter()
            parts = []
            for number, (_, tokens, cu) in enumerate(corpus.chunks()):
                if number >= built["chunks"]:
                    break
                parts.append(pb.exact_scores(Q[:R], tokens, cu))
            exact = torch.cat(parts, dim=1)
            row = {"exact_s": time.perf_counter() - start}
            if scan is not None:
                row["scan_recall_at_10"] = pb.recall_at_k(scan[1], exact)
            if cand is not None:
                row["candidates_recall_at_10"] = pb.recall_at_k(cand[1][:R], exact)
            if scan is not None and cand is not None:  # the 5M bench's "recall_vs_exhaustive"
                row["candidates_over_scan"] = row["candidates_recall_at_10"] / max(row["scan_recall_at_10"], 1e-9)
            say("exact", row)
        except Exception as error:  # noqa: BLE001
            say("exact", {"failed": f"{type(error).__name__}: {error}"[:400]})

    # ------------------------------------------------------------------ other settings
    sweep = []
    for item in [s for s in args.sweep.split(",") if s]:
        if left() < 20:
            report["notes"].append(f"sweep stopped before {item}: past the time budget")
            break
        n_probe, n_cand = (int(v) for v in item.split(":"))
        kw = dict(n_probe=n_probe, candidates=max(n_cand, K))
        try:
            batch_ms, found = _timed(lambda kw=kw: candidates(Q, **kw), device, 1)
            one_ms, _ = _timed(lambda kw=kw: candidates(Q[:1], **kw), device, 3)
            row = {**kw, "batch_ms": batch_ms, "one_query_ms": one_ms}
            if scan is not None:
                row["recall_vs_scan"] = recall_vs_scan(found[1][:R], found[0][:R], scan[1], scan[0])
        except Exception as error:  # noqa: BLE001
            row = {**kw, "failed": f"{type(error).__name__}: {error}"[:400]}
        sweep.append(row)
        say("sweep", sweep)
    report["done"] = True
    save()
    print(f"wrote {path} in {time.perf_counter() - started:.0f} s")
    return 0
