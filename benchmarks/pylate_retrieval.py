"""PyLate retrieval on the same embeddings: PyLate's Voyager and PLAID (fast-plaid) indexes against lik's exact
index (``lik.integrations.pylate.Index``), each driven the way a PyLate user drives it.

    python3 benchmarks/pylate_retrieval.py [--docs 4000] [--doc-len 64] [--queries 256] [--out $OUT]
    python3 benchmarks/pylate_retrieval.py --smoke      # tiny sizes, any device: a check that the script runs

The corpus is synthetic and clustered, like real ColBERT tokens: ``--topics`` unit centroids (d = 128), each
document drawn around 4 of them, lengths uniform in ``[doc_len / 4, 7 * doc_len / 4)``, every token L2-normalised
and rounded to fp16 (so the fp16 indexes store exactly what the reference scores); each query is drawn around the
topics of a random document, ``--q-len`` tokens. Every index gets the same embeddings and the same string ids.

For each method: build time (``add_documents``, files written), bytes on disk (the index folder), queries per
second of one ``retrieve.ColBERT(index=...).retrieve(queries, k=10)`` call over all queries (the median of three,
after warm-up calls of the same sizes), the median latency of a one-query call, and recall@10 against exact MaxSim
(every document scored in fp32 on the device; a retrieved document counts if its exact score reaches the exact 10th
score, so ties cannot cost recall).
Methods: lik fp16 and int8 (GPU-resident; the PyLate wrapper), ``lik.Index.search`` itself (the same fp16 index
without PyLate's result lists), PyLate's ``PLAID`` (fast-plaid backend, PyLate's defaults) and ``Voyager`` (HNSW
over every token, then PyLate's rerank of the candidates; PyLate's defaults, ``--voyager-queries`` queries, as it is
slow). A method whose package is missing is skipped with a note; a failure is recorded and the run goes on;
methods past ``--time-budget-s`` are skipped.

Prints a markdown table and writes ``pylate_retrieval.json`` to ``--out`` (default ``$OUT``, else the current
directory). PyLate's ``pylate.utils`` package imports transformers and datasets; where those are missing (a bare
GPU machine), the index classes are loaded with the two helpers they use from it (``iter_batch``,
``convert_to_tensor``) and nothing else.

On a machine without network (Python 3.12, torch 2.11), carry these wheels and install them with
``pip install --no-index --no-deps --target /tmp/site *.whl``, then run with ``PYTHONPATH=/tmp/site:src``:
``pylate==1.6.0``; ``fast-plaid==1.4.6.2110`` (built for torch 2.11.0 exactly; PyLate 1.6 accepts fast-plaid
1.4.6.x) with ``fastkmeans==0.5.0``, ``usearch`` and its ``numkong``, ``joblib``, ``filelock``; ``voyager==2.1.0``
(PyLate 1.6's ``Voyager`` passes lists to ``add_items``, which voyager 2.2 refuses). Fetch them elsewhere with
``pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 --platform
manylinux2014_x86_64 -d wheels <package>==<version>``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # a checkout without installing lik

import lik  # noqa: E402

K = 10


# ---------------------------------------------------------------------------------------------- data
def clustered_corpus(args, device):
    rng = torch.Generator(device="cpu").manual_seed(args.seed)
    dim = 128
    centroids = torch.nn.functional.normalize(torch.randn(args.topics, dim, generator=rng), dim=-1)
    lengths = torch.randint(max(1, args.doc_len // 4), max(2, 7 * args.doc_len // 4), (args.docs,), generator=rng)
    doc_topics = torch.randint(0, args.topics, (args.docs, 4), generator=rng)
    owner = torch.repeat_interleave(torch.arange(args.docs), lengths)
    topic = doc_topics[owner, torch.randint(0, 4, (owner.numel(),), generator=rng)]
    # Noise of norm ``--noise`` around a unit centroid: a token's cosine to its centroid is about 1 / sqrt(1 + n^2).
    tokens = centroids[topic] + args.noise * torch.randn(owner.numel(), dim, generator=rng) / dim**0.5
    tokens = torch.nn.functional.normalize(tokens, dim=-1).half().float()
    docs = list(tokens.split(lengths.tolist()))
    seeds = torch.randint(0, args.docs, (args.queries,), generator=rng)
    q_topic = doc_topics[seeds[:, None], torch.randint(0, 2, (args.queries, args.q_len), generator=rng)]
    queries = centroids[q_topic] + args.noise * torch.randn(args.queries, args.q_len, dim, generator=rng) / dim**0.5
    queries = torch.nn.functional.normalize(queries, dim=-1).half().float()
    return docs, queries


@torch.no_grad()
def exact_scores(queries, docs, device, chunk_docs=256):
    """fp32 MaxSim of every query against every document on ``device``: ``[Nq, N]`` (padding never counts)."""
    Q = queries.to(device)
    out = []
    for start in range(0, len(docs), chunk_docs):
        part = docs[start : start + chunk_docs]
        D = torch.nn.utils.rnn.pad_sequence(part, batch_first=True).to(device)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(d), dtype=torch.bool) for d in part],
                                               batch_first=True).to(device)
        sims = torch.einsum("qld,btd->qblt", Q, D).masked_fill(~mask[None, :, None, :], float("-inf"))
        out.append(sims.amax(-1).sum(-1))
    return torch.cat(out, dim=1).cpu()


def recall_at_k(hits, exact, names):
    """Mean fraction of each query's top-k whose exact score reaches the exact k-th score."""
    position = {name: n for n, name in enumerate(names)}
    values = []
    for row, query_hits in enumerate(hits):
        kth = exact[row].topk(K).values[-1]
        found = [position[h["id"]] for h in query_hits[:K]]
        values.append(sum(bool(exact[row, i] >= kth - 1e-4) for i in found) / K)
    return sum(values) / len(values)


# ---------------------------------------------------------------------------------------------- PyLate
def import_pylate():
    """PyLate's index, retrieval and rank modules, as installed. Where ``pylate.utils``' own imports are missing,
    a ``pylate.utils`` holding only ``iter_batch`` and ``convert_to_tensor`` (their real files) stands in."""
    try:
        importlib.import_module("pylate.utils")
    except ModuleNotFoundError as error:
        if error.name == "pylate" or importlib.util.find_spec("pylate") is None:
            raise
        for name in [n for n in sys.modules if n.startswith("pylate.")]:
            del sys.modules[name]
        root = Path(importlib.util.find_spec("pylate").submodule_search_locations[0]) / "utils"
        utils = types.ModuleType("pylate.utils")
        utils.__path__ = [str(root)]
        sys.modules["pylate.utils"] = utils
        for helper in ("iter_batch", "tensor"):
            module = importlib.import_module(f"pylate.utils.{helper}")
            setattr(utils, helper, module)
        utils.iter_batch = sys.modules["pylate.utils.iter_batch"].iter_batch
        utils.convert_to_tensor = sys.modules["pylate.utils.tensor"].convert_to_tensor
        print(f"pylate.utils needs {error.name}: loaded its iter_batch and convert_to_tensor only")
    return tuple(importlib.import_module(name) for name in ("pylate.indexes", "pylate.retrieve"))


def version_of(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(name, build, search, queries, names, exact, folder, device, n_queries=None):
    """Build once, warm up, then time three calls over the queries (the median) and a one-query call five times."""
    row = {"method": name}
    start = time.perf_counter()
    index = build()
    synchronize(device)
    row["build_s"] = time.perf_counter() - start
    row["bytes"] = folder_bytes(folder) if folder is not None else None
    chosen = queries if n_queries is None else queries[:n_queries]
    # Warm-up at both batch sizes timed below: a JIT-compiled method compiles per query-count bucket, so a
    # warm-up at another size would time a compilation.
    search(index, chosen)
    search(index, chosen[:1])
    synchronize(device)
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        hits = search(index, chosen)
        synchronize(device)
        runs.append(time.perf_counter() - start)
    seconds = statistics.median(runs)
    row.update(queries=len(chosen), search_s=seconds, qps=len(chosen) / seconds)
    latencies = []
    for number in range(5):
        start = time.perf_counter()
        search(index, chosen[number % len(chosen) :][:1])
        synchronize(device)
        latencies.append((time.perf_counter() - start) * 1e3)
    row["latency_ms"] = statistics.median(latencies)
    row["recall_at_10"] = recall_at_k(hits, exact[: len(chosen)], names)
    return row


def methods(args, docs, queries, names, root: Path, device):
    """``(name, build, search, folder, n_queries, missing)`` per method; ``missing``: why it cannot run."""
    try:
        indexes, retrieve = import_pylate()
        pylate_missing = None
    except ImportError as error:
        indexes = retrieve = None
        pylate_missing = f"PyLate is not installed ({error})"
    import lik.integrations.pylate as lik_pylate

    if pylate_missing is None:
        lik_pylate.disable()  # PyLate's Voyager reranks with its own scoring, as shipped
    placement = "gpu" if device.type == "cuda" else "auto"

    def retrieve_with(index, chosen, **options):
        return retrieve.ColBERT(index=index).retrieve(queries_embeddings=chosen, k=K, **options)

    def lik_wrapper(dtype):
        def build():
            index = lik_pylate.Index(index_folder=str(root), index_name=f"lik-{dtype}", override=True,
                                     placement=placement, dtype=getattr(torch, dtype), device=device,
                                     show_progress=False)
            return index.add_documents(names, docs)

        return build

    def lik_direct_build():
        lik.Index.build(docs, out=root / "lik-direct", overwrite=True, progress=False)
        return lik.Index.load(root / "lik-direct", placement=placement, device=device)

    def lik_direct_search(index, chosen):
        scores, ids = index.search(chosen.to(device), K)
        return [[{"id": names[i], "score": s} for i, s in zip(r_ids, r_scores)]
                for r_ids, r_scores in zip(ids.tolist(), scores.tolist())]

    def plaid_build():
        index = indexes.PLAID(index_folder=str(root), index_name="plaid", override=True, show_progress=False,
                              device=str(device))
        return index.add_documents(documents_ids=names, documents_embeddings=docs)

    def voyager_build():
        index = indexes.Voyager(index_folder=str(root), index_name="voyager", override=True, embedding_size=128)
        return index.add_documents(documents_ids=names, documents_embeddings=[d.numpy() for d in docs])

    missing_fast_plaid = None if importlib.util.find_spec("fast_plaid") else "fast-plaid is not installed"
    missing_voyager = None if importlib.util.find_spec("voyager") else "voyager is not installed"
    return [
        ("lik fp16 (PyLate wrapper)", lik_wrapper("float16"), retrieve_with, root / "lik-float16", None,
         pylate_missing),
        ("lik int8 (PyLate wrapper)", lik_wrapper("int8"), retrieve_with, root / "lik-int8", None, pylate_missing),
        ("lik.Index.search fp16", lik_direct_build, lik_direct_search, root / "lik-direct", None, None),
        ("PyLate PLAID (fast-plaid)", plaid_build, retrieve_with, root / "plaid", None,
         pylate_missing or missing_fast_plaid),
        ("PyLate Voyager", voyager_build, lambda index, chosen: retrieve_with(index, chosen, device=str(device)),
         root / "voyager", args.voyager_queries, pylate_missing or missing_voyager),
    ]


def markdown(rows, meta) -> str:
    lines = [f"PyLate retrieval, {meta['corpus']} ({meta['device']}; torch {meta['torch']}, PyLate "
             f"{meta['versions'].get('pylate')}, fast-plaid {meta['versions'].get('fast-plaid')}, voyager "
             f"{meta['versions'].get('voyager')}; commit {meta['commit']})", "",
             "| method | build s | MB on disk | queries | QPS | 1-query ms | recall@10 |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        if "qps" in row:
            megabytes = "n/a" if row["bytes"] is None else f"{row['bytes'] / 2**20:.1f}"
            lines.append(f"| {row['method']} | {row['build_s']:.2f} | {megabytes} | {row['queries']} | "
                         f"{row['qps']:.0f} | {row['latency_ms']:.1f} | {row['recall_at_10']:.3f} |")
        else:
            lines.append(f"| {row['method']} | skipped: {row['note']} | | | | | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=4000)
    parser.add_argument("--doc-len", type=int, default=64, help="mean tokens per document")
    parser.add_argument("--queries", type=int, default=256)
    parser.add_argument("--q-len", type=int, default=32)
    parser.add_argument("--topics", type=int, default=1024)
    parser.add_argument("--noise", type=float, default=0.8, help="norm of each token's noise around its centroid")
    parser.add_argument("--voyager-queries", type=int, default=32)
    parser.add_argument("--skip", default="", help="comma-separated substrings of method names to leave out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-budget-s", type=float, default=170.0)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: the plumbing, not the speed")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    if args.smoke:
        args.docs, args.doc_len, args.queries, args.topics, args.voyager_queries = 60, 12, 8, 16, 4
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    docs, queries = clustered_corpus(args, device)
    names = [f"doc-{n}" for n in range(len(docs))]
    exact = exact_scores(queries, docs, device)
    commit = os.environ.get("LIK_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    tokens = sum(len(d) for d in docs)
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "versions": {p: version_of(p) for p in ("pylate", "fast-plaid", "voyager", "lik-kernels")},
            "commit": commit, "args": vars(args), "command": " ".join(sys.argv),
            "corpus": f"{len(docs)} documents / {tokens} tokens, {len(queries)} queries of {args.q_len} tokens, "
                      "d = 128, clustered, fp16 values"}
    rows = []
    with tempfile.TemporaryDirectory(prefix="pylate-retrieval-") as tmp:
        for name, build, search, folder, n_queries, missing in methods(args, docs, queries, names, Path(tmp),
                                                                         device):
            if any(part and part.lower() in name.lower() for part in args.skip.split(",")):
                rows.append({"method": name, "note": "--skip"})
            elif missing is not None:
                rows.append({"method": name, "note": missing})
            elif time.perf_counter() - started > args.time_budget_s:
                rows.append({"method": name, "note": f"past the time budget ({args.time_budget_s:.0f} s)"})
            else:
                try:
                    rows.append(measure(name, build, search, queries, names, exact, folder, device, n_queries))
                except Exception as error:  # noqa: BLE001 (a peer's failure is a result; the run goes on)
                    rows.append({"method": name, "note": f"failed: {type(error).__name__}: {error}"[:300]})
            print(json.dumps(rows[-1]), flush=True)
    table = markdown(rows, meta)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pylate_retrieval.json").write_text(json.dumps({"meta": meta, "rows": rows, "markdown": table}, indent=1))
    print(f"wrote {out / 'pylate_retrieval.json'} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
