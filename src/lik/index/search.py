"""Exact top-k over a :class:`~lik.index.placement.ChunkSource`: score a chunk, merge, move on.

The working set is one chunk's ``[Nq, n_chunk]`` scores plus the running ``[Nq, k]``; the merge is
:func:`lik.retrieval.exact.merge_top_k`, the one :func:`lik.search` uses, so the order is the same: descending
score, ties to the lower document id, NaN last.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from ..ops.maxsim.packed_function import packed_query, score_packed
from ..retrieval.exact import BYTES_PER_CANDIDATE, DEFAULT_BUDGET_BYTES, merge_top_k
from ..retrieval.keys import MAX_ID, decode_keys, merge_keys
from ..retrieval.queries import QueryBucket, assemble, buckets, ragged_queries
from .format import EIGHT_BIT
from .placement import Chunk, ChunkPlan, ChunkSource

__all__ = ["select_chunks", "check_queries", "search_chunks", "search_buckets"]


def select_chunks(plans: Sequence[ChunkPlan], doc_ids: torch.Tensor | None) -> list[tuple[int, torch.Tensor | None]]:
    """Plans to score and, with a filter, the chunk-local positions of the selected documents (CPU int64).

    ``doc_ids`` is sorted, unique, CPU int64 (global ids). Chunks with no selected document are skipped, so they
    are never copied either.
    """
    if doc_ids is None:
        return [(number, None) for number in range(len(plans))]
    ids = doc_ids.tolist()
    selected = []
    for number, plan in enumerate(plans):
        lo = bisect.bisect_left(ids, plan.first_id)
        hi = bisect.bisect_left(ids, plan.first_id + plan.num_docs)
        if hi > lo:
            selected.append((number, doc_ids[lo:hi] - plan.first_id))
    return selected


def check_queries(Q, q_mask, cu_seqlens_q, d: int, dtype: torch.dtype
                  ) -> tuple[list[QueryBucket], bool, int, torch.device]:
    """:meth:`lik.Index.search`'s queries checked once, at its edge, for an index of width ``d`` and ``dtype``: in
    the dtype they are scored in, as dense buckets (one for a dense ``Q``); ``(buckets, squeeze, Nq, Q's device)``."""
    ragged = ragged_queries(Q, cu_seqlens_q)
    if ragged is not None:
        if q_mask is not None:
            raise ValueError("q_mask must be None for ragged queries (a list, or packed with cu_seqlens_q)")
        Q = ragged.tokens
    if not isinstance(Q, torch.Tensor):
        raise TypeError(f"Q must be a torch.Tensor or a list of them, got {type(Q).__name__}")
    if Q.dim() not in ((2,) if ragged is not None else (2, 3)) or Q.shape[-1] != d:
        raise ValueError(f"Q must be [Lq, d] or [Nq, Lq, d] with d={d}, got shape {list(Q.shape)}")
    if not Q.is_floating_point() or Q.dtype in EIGHT_BIT:
        raise TypeError(f"Q must be a float tensor, got {Q.dtype}")
    if dtype not in EIGHT_BIT:
        Q = Q if Q.dtype == dtype else Q.to(dtype)
    elif Q.dtype == torch.float64:
        Q = Q.float()  # 8-bit scoring quantizes fp16 / bf16 / fp32 queries
    if ragged is not None:
        ragged = ragged._replace(tokens=Q)
        return buckets(ragged), False, len(ragged.lengths), Q.device
    squeeze = Q.dim() == 2
    if q_mask is not None:
        if not isinstance(q_mask, torch.Tensor) or q_mask.dtype != torch.bool:
            raise TypeError("q_mask must be a bool tensor")
        if q_mask.shape != Q.shape[:-1]:
            raise ValueError(f"q_mask must have shape {list(Q.shape[:-1])}, got {list(q_mask.shape)}")
        q_mask = q_mask.unsqueeze(0) if squeeze else q_mask
    Q3 = Q.unsqueeze(0) if squeeze else Q
    return [QueryBucket(list(range(Q3.shape[0])), Q3, q_mask, None, None)], squeeze, Q3.shape[0], Q.device


@torch.no_grad()
def search_chunks(
    Q: torch.Tensor,
    q_mask: torch.Tensor | None,
    source: ChunkSource,
    selection: Sequence[tuple[int, torch.Tensor | None]],
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`search_buckets` of one dense batch of checked queries ``Q [Nq, Lq, d]`` with bool ``q_mask``."""
    return search_buckets([QueryBucket(list(range(Q.shape[0])), Q, q_mask, None, None)], Q.shape[0], source,
                          selection, k)


def search_buckets(
    queries: Sequence[QueryBucket],
    n_queries: int,
    source: ChunkSource,
    selection: Sequence[tuple[int, torch.Tensor | None]],
    k: int,
    scorer=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` of ``n_queries`` queries, given as dense buckets (:func:`lik.retrieval.queries.buckets`; one bucket
    ``[Nq, Lq, d]`` in order for a dense ``Q``), over the selected chunks: ``(scores fp32 [Nq, k'], ids int64
    [Nq, k'])`` on ``source.device``, with ``k' = min(k, selected documents)``.

    Each bucket's ``q`` (float, in the index's dtype for a float index) and bool ``mask`` were checked by the
    caller: a bucket is quantized once for an 8-bit index, and each chunk goes to packed MaxSim's internal scoring
    entry, with no check repeated and no host synchronisation. A chunk whose ``[Nq, documents]`` scores would pass
    :data:`~lik.retrieval.exact.DEFAULT_BUDGET_BYTES` is scored in runs of documents. ``scorer(bucket, tokens, cu,
    scale) -> fp32 [n, documents]`` replaces packed MaxSim (a compressed index's residual scorer). Inference only:
    :meth:`lik.Index.search` calls it under ``torch.no_grad``.

    A search of one query is host bound before its one scoring launch (a GPU-resident corpus is one chunk): nothing
    is allocated, moved or launched here that the search does not use (the host path's ops are pinned by
    tests/index/test_search_host_path.py)."""
    device = source.device
    if k == 0 or n_queries == 0:
        return _no_result(n_queries, device)
    queries = [bucket if _on(bucket, device) else _moved(bucket, device) for bucket in queries]
    # Every chunk's selected positions go to the device in one copy, not one per chunk. A chunk without positions
    # scores all its documents; positions already on the device (the live documents of an index with removed
    # ones, cached there) are used as they are: removed documents are never candidates, with no host sync.
    locals_ = [local for _, local in selection]
    to_move = [local is not None and local.device.type != device.type for local in locals_]
    if any(to_move):
        on_host = [local for local, move in zip(locals_, to_move) if move]
        moved = iter(torch.cat(on_host).to(device, non_blocking=True).split([t.numel() for t in on_host]))
        locals_ = [next(moved) if move else local for local, move in zip(locals_, to_move)]
    # The running top-k as one int64 key per candidate (lik.retrieval.keys): a chunk is merged by one topk. Ids past
    # 2**32 do not fit a key's low half: those searches merge scores and ids.
    numbers = [n for n, _ in selection]
    plans = [source.plans[n] for n in numbers]
    keyed = all(p.first_id + p.num_docs < MAX_ID for p in plans)
    step = max(1, DEFAULT_BUDGET_BYTES // (n_queries * BYTES_PER_CANDIDATE))
    last = len(plans) == 1 and plans[0].num_docs <= step  # the only merge is the last one
    packed, best, best_scores, best_ids = None, None, None, None
    for chunk, plan, local in zip(source.chunks(numbers), plans, locals_):
        if packed is None:
            packed = [(b, b if scorer else packed_query(b.q, b.mask, chunk.tokens.dtype)) for b in queries]
        # A chunk past the budget is scored in runs of documents; its selected positions (sorted) then go run by run
        # (read once on the host: only a large chunk with removed or filtered documents pays that sync).
        split = local is not None and chunk.num_docs > step
        host_local = local.cpu() if split else None
        for first_id, scores in _scored(packed, n_queries, chunk, plan, source, step, scorer or score_packed):
            if split:
                a = first_id - chunk.first_id
                lo, hi = torch.searchsorted(host_local, torch.tensor([a, a + scores.shape[1]])).tolist()
                if hi == lo:
                    continue
                local = (host_local[lo:hi] - a).to(device, non_blocking=True)
            if keyed:
                # One chunk scored in one run (a GPU-resident index): its merge also decodes, no launch after it.
                best = merge_keys(scores if local is None else scores[:, local], first_id, local, best, k, last)
                continue
            ids = torch.arange(first_id, first_id + scores.shape[1], device=device)
            if local is not None:
                scores, ids = scores[:, local], ids[local]
            if best_scores is None:
                best_scores, best_ids = _no_result(n_queries, device)
            best_scores, best_ids = merge_top_k(best_scores, best_ids, scores, ids.expand(n_queries, -1), k)
    if keyed and best is not None:
        return best if last else decode_keys(best)
    return _no_result(n_queries, device) if best_scores is None else (best_scores, best_ids)


def _no_result(n_queries: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(n_queries, 0, dtype=torch.float32, device=device),
            torch.empty(n_queries, 0, dtype=torch.int64, device=device))


def _on(bucket: QueryBucket, device: torch.device) -> bool:
    """Whether every tensor of ``bucket`` is on ``device`` already (the usual case: no ``.to`` call per search)."""
    return all(t is None or t.device == device for t in (bucket.q, bucket.mask, bucket.index))


def _moved(bucket: QueryBucket, device: torch.device) -> QueryBucket:
    move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
    return bucket._replace(q=move(bucket.q), mask=move(bucket.mask), index=move(bucket.index))


def _scored(packed, n_queries: int, chunk: Chunk, plan: ChunkPlan, source: ChunkSource, step: int, score):
    """``(first id, scores fp32 [Nq, n])`` of the chunk's documents, in runs of at most ``step`` documents."""
    runs = [(0, chunk.num_docs)]
    if chunk.num_docs > step:
        runs = [(a, min(a + step, chunk.num_docs)) for a in range(0, chunk.num_docs, step)]
    offsets = None
    for a, b in runs:
        tokens, cu, scale = chunk.tokens, chunk.cu_seqlens, chunk.scale
        if (a, b) != (0, chunk.num_docs):
            if offsets is None:  # host offsets of the chunk's documents (the plan's segment holds them)
                segment = source.segments[plan.segment]
                offsets = segment.cu_seqlens[plan.doc_start : plan.doc_stop + 1] - plan.token_start
            t0, t1 = int(offsets[a]), int(offsets[b])
            tokens, cu = tokens[t0:t1], cu[a : b + 1] - cu[a]
            scale = None if scale is None else scale[t0:t1]
        parts = [(bucket, score(query, tokens, cu, scale)) for bucket, query in packed]
        if len(parts) == 1 and parts[0][0].index is None:
            yield chunk.first_id + a, parts[0][1]
        else:
            yield chunk.first_id + a, assemble(parts, n_queries, b - a, torch.float32, tokens.device)
