"""``lik index build | info`` and ``lik search``: the command-line face of :class:`lik.Index`.

Embedding files (``.safetensors`` or ``.pt`` / ``.pth``) hold either a packed corpus (``tokens [T, d]`` and
``cu_seqlens [N + 1]``), one tensor per document (safetensors: in key order, numeric keys numerically), a list of
``[L_i, d]`` tensors, or one ``[N, L, d]`` tensor (with an optional bool ``mask [N, L]`` in a dict).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from .format import DTYPES, read_manifest
from .index import DEFAULT_SHARD_TOKENS, Index
from .placement import PLACEMENTS

__all__ = ["add_index_parser", "add_search_parser", "run_index", "run_search", "read_embeddings"]


def _key_order(key: str):
    return (0, int(key), "") if key.isdigit() else (1, 0, key)


def _split_packed(tokens: torch.Tensor, cu: torch.Tensor) -> Iterator[torch.Tensor]:
    offsets = cu.tolist()
    for start, stop in zip(offsets[:-1], offsets[1:]):
        yield tokens[start:stop]


def _split_padded(batch: torch.Tensor, mask: torch.Tensor | None) -> Iterator[torch.Tensor]:
    for i in range(batch.shape[0]):
        yield batch[i] if mask is None else batch[i][mask[i]]


def read_embeddings(path) -> Iterator[torch.Tensor]:
    """Yield the ``[L_i, d]`` documents of one embedding file (safetensors files are read one tensor at a time)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such embedding file")
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
            if {"tokens", "cu_seqlens"} <= set(keys):
                yield from _split_packed(f.get_tensor("tokens"), f.get_tensor("cu_seqlens"))
                return
            for key in sorted(keys, key=_key_order):
                yield f.get_tensor(key)
        return
    if path.suffix not in (".pt", ".pth"):
        raise ValueError(f"{path}: embedding files must be .safetensors, .pt or .pth")
    data = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(data, dict) and {"tokens", "cu_seqlens"} <= data.keys():
        yield from _split_packed(data["tokens"], data["cu_seqlens"])
    elif isinstance(data, dict) and "embeddings" in data:
        emb = data["embeddings"]
        yield from (_split_padded(emb, data.get("mask")) if isinstance(emb, torch.Tensor) else emb)
    elif isinstance(data, torch.Tensor) and data.dim() == 3:
        yield from _split_padded(data, None)
    elif isinstance(data, (list, tuple)):
        yield from data
    else:
        raise ValueError(f"{path}: expected a list of [L, d] tensors, an [N, L, d] tensor or a dict with "
                         "'tokens'/'cu_seqlens' or 'embeddings' (and optional 'mask')")


def read_queries(path) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries of a file as ``(Q [Nq, Lq, d] float32, q_mask [Nq, Lq])``, ragged queries padded."""
    queries = [q.float() for q in read_embeddings(path)]
    if not queries:
        raise ValueError(f"{path}: holds no queries")
    longest = max(max(q.shape[0] for q in queries), 1)
    Q = torch.zeros(len(queries), longest, queries[0].shape[-1])
    mask = torch.zeros(len(queries), longest, dtype=torch.bool)
    for i, q in enumerate(queries):
        if q.dim() != 2 or q.shape[-1] != Q.shape[-1]:
            raise ValueError(f"{path}: query {i} has shape {list(q.shape)}, expected [L, {Q.shape[-1]}]")
        Q[i, : q.shape[0]] = q
        mask[i, : q.shape[0]] = True
    return Q, mask


def add_index_parser(commands) -> None:
    index = commands.add_parser("index", help="build or inspect a saved lik.Index",
                                description="Build a lik.Index from embedding files, or describe one.")
    actions = index.add_subparsers(dest="index_command", required=True, metavar="{build,info}")
    build = actions.add_parser("build", help="pack embedding files into an index directory")
    build.add_argument("embeddings", nargs="+", help=".safetensors / .pt files of document token embeddings")
    build.add_argument("--out", required=True, help="index directory to create")
    build.add_argument("--dtype", choices=sorted(DTYPES), default="float16", help="storage dtype (default float16)")
    build.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file")
    build.add_argument("--overwrite", action="store_true", help="replace an existing index at --out")
    info = actions.add_parser("info", help="describe a saved index")
    info.add_argument("path", help="index directory")


def add_search_parser(commands) -> None:
    search = commands.add_parser("search", help="exact top-k search of a saved index",
                                 description="Search a saved lik.Index with query embeddings from a file.")
    search.add_argument("index", help="index directory (from `lik index build`)")
    search.add_argument("--queries", required=True, help=".safetensors / .pt file of query token embeddings")
    search.add_argument("--k", type=int, default=10, help="results per query (default 10)")
    search.add_argument("--placement", choices=PLACEMENTS, default="auto", help="where the index lives")
    search.add_argument("--device", default=None, help="scoring device (default: cuda when available, else cpu)")
    search.add_argument("--batch-size", type=int, default=32, help="queries per search call (default 32)")
    search.add_argument("--output", help="save {'scores', 'ids'} to this .pt file instead of printing them")


def run_index(args, parser: argparse.ArgumentParser) -> int:
    if args.index_command == "info":
        manifest = read_manifest(args.path)
        print(json.dumps({"path": str(args.path), "documents": manifest.num_docs, "tokens": manifest.num_tokens,
                          "d": manifest.d, "dtype": str(manifest.dtype).removeprefix("torch."),
                          "shards": len(manifest.shards),
                          "bytes": sum(s.bytes for s in manifest.shards)}, indent=1))
        return 0
    if args.shard_tokens < 1:
        parser.error(f"--shard-tokens must be at least 1, got {args.shard_tokens}")
    missing = [p for p in args.embeddings if not Path(p).is_file()]
    if missing:
        parser.error(f"EMBEDDINGS: no such file: {missing[0]}")
    start = time.perf_counter()
    docs = (doc for path in args.embeddings for doc in read_embeddings(path))
    index = Index.build(docs, dtype=DTYPES[args.dtype], out=args.out, shard_tokens=args.shard_tokens,
                        overwrite=args.overwrite, placement="disk", device="cpu")
    seconds = time.perf_counter() - start
    tokens = sum(s.num_tokens for s in index.segments)
    print(f"built {args.out}: {len(index)} documents, {tokens} tokens, d={index.d}, {args.dtype} "
          f"in {seconds:.2f} s ({len(index) / max(seconds, 1e-9):.0f} documents/s)")
    return 0


def run_search(args, parser: argparse.ArgumentParser) -> int:
    if args.k < 0:
        parser.error(f"--k must be at least 0, got {args.k}")
    if args.batch_size < 1:
        parser.error(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.device is not None and args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    index = Index.load(args.index, placement=args.placement, device=args.device)
    Q, q_mask = read_queries(args.queries)
    if Q.shape[-1] != index.d:
        parser.error(f"--queries: queries have d={Q.shape[-1]}, the index has d={index.d}")
    if args.k > len(index):
        parser.error(f"--k {args.k} is larger than the index ({len(index)} documents)")
    device = index.device
    scores, ids = [], []
    start = time.perf_counter()
    for first in tqdm(range(0, Q.shape[0], args.batch_size), desc="search", unit="batch"):
        batch = slice(first, first + args.batch_size)
        s, i = index.search(Q[batch].to(device), args.k, q_mask[batch].to(device))
        scores.append(s.cpu())
        ids.append(i.cpu())
    seconds = time.perf_counter() - start
    scores, ids = torch.cat(scores), torch.cat(ids)
    if args.output:
        torch.save({"scores": scores, "ids": ids}, args.output)
    else:
        for number, (row_scores, row_ids) in enumerate(zip(scores.tolist(), ids.tolist())):
            hits = ", ".join(f"{i} ({s:.4f})" for s, i in zip(row_scores, row_ids))
            print(f"query {number}: {hits}")
    tokens = sum(s.num_tokens for s in index.segments)
    print(f"searched {Q.shape[0]} queries x {len(index)} documents ({tokens} tokens, placement "
          f"{index.placement}, {device}) in {seconds:.3f} s: {Q.shape[0] / max(seconds, 1e-9):.1f} queries/s, "
          f"{Q.shape[0] * tokens / max(seconds, 1e-9) / 1e6:.1f} M document tokens/s")
    return 0
