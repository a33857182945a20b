"""Exact top-k over a :class:`~lik.index.placement.ChunkSource`: score a chunk, merge, move on.

The working set is one chunk's ``[Nq, n_chunk]`` scores plus the running ``[Nq, k]``; the merge is
:func:`lik.retrieval.exact.merge_top_k`, the one :func:`lik.search` uses, so the order is the same: descending
score, ties to the lower document id, NaN last.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from ..core.precision import accumulation_dtype
from ..ops.maxsim.packed_function import packed_query, score_packed
from ..retrieval.exact import merge_top_k
from ..retrieval.keys import MAX_ID, candidate_keys, decode_keys, top_keys
from .placement import ChunkPlan, ChunkSource

__all__ = ["select_chunks", "search_chunks"]


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


@torch.no_grad()
def search_chunks(
    Q: torch.Tensor,
    q_mask: torch.Tensor | None,
    source: ChunkSource,
    selection: Sequence[tuple[int, torch.Tensor | None]],
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` of 3-D ``Q [Nq, Lq, d]`` over the selected chunks: ``(scores fp32 [Nq, k'], ids int64 [Nq, k'])``
    on ``source.device``, with ``k' = min(k, selected documents)``.

    ``Q`` (float, in the index's dtype for a float index) and the bool ``q_mask`` were checked by the caller: the
    query is quantized once for an 8-bit index, and each chunk goes to packed MaxSim's internal scoring entry, with
    no check repeated and no host synchronisation."""
    device = source.device
    n_queries = Q.shape[0]
    Q = Q.to(device, non_blocking=True)
    q_mask = None if q_mask is None else q_mask.to(device, non_blocking=True)
    score_dtype = accumulation_dtype(Q.dtype)
    best_scores = torch.empty(n_queries, 0, dtype=score_dtype, device=device)
    best_ids = torch.empty(n_queries, 0, dtype=torch.int64, device=device)
    if k == 0 or n_queries == 0:
        return best_scores, best_ids
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
    plans = [source.plans[n] for n, _ in selection]
    keyed = score_dtype == torch.float32 and all(p.first_id + p.num_docs < MAX_ID for p in plans)
    query, best = None, None
    for chunk, local in zip(source.chunks([n for n, _ in selection]), locals_):
        if query is None:
            query = packed_query(Q, q_mask, chunk.tokens.dtype)
        scores = score_packed(query, chunk.tokens, chunk.cu_seqlens, chunk.scale).to(score_dtype)
        if local is not None:
            scores = scores[:, local]
        if keyed:
            keys = candidate_keys(scores, chunk.first_id, local)
            keys = keys if best is None else torch.cat([best, keys], dim=1)
            best = top_keys(keys, min(k, keys.shape[1]))
            continue
        ids = torch.arange(chunk.first_id, chunk.first_id + chunk.num_docs, device=device)
        if local is not None:
            ids = ids[local]
        best_scores, best_ids = merge_top_k(best_scores, best_ids, scores, ids.expand(n_queries, -1), k)
    if keyed and best is not None:
        return decode_keys(best)
    return best_scores, best_ids
