"""Merging per-rank top-k across a ``torch.distributed`` group (NCCL on GPUs, gloo on CPUs).

Each rank holds a contiguous, rank-ordered range of document ids (``shard=rank``), so concatenating the gathered
per-rank results in rank order and merging them with the same stable rank as a single process gives exactly the
single-process result, ties included. Every rank knows every rank's result count from the manifest (and the
filter), so one ``all_gather`` of fixed-size padded tensors suffices.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..retrieval.exact import merge_top_k

__all__ = ["gather_top_k"]


def gather_top_k(
    scores: torch.Tensor, ids: torch.Tensor, k: int, counts: Sequence[int], group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-``k`` from each rank's ``[Nq, counts[rank]]`` rank-ordered results; the same on every rank.

    Args:
        scores, ids: this rank's results, fp32 / int64 ``[Nq, counts[rank]]`` (``counts[rank] <= k``).
        k: results wanted overall, ``k <= sum(counts)``.
        counts: every rank's result count, in rank order (known on every rank without communication).
        group: the process group (default: the world).
    """
    world = dist.get_world_size(group)
    if len(counts) != world:
        raise ValueError(f"counts must have one entry per rank ({world}), got {len(counts)}")
    width = max(counts)
    n_queries = scores.shape[0]
    padded_scores = scores.new_zeros(n_queries, width)
    padded_ids = ids.new_zeros(n_queries, width)
    padded_scores[:, : scores.shape[1]] = scores
    padded_ids[:, : ids.shape[1]] = ids
    all_scores = [torch.empty_like(padded_scores) for _ in range(world)]
    all_ids = [torch.empty_like(padded_ids) for _ in range(world)]
    dist.all_gather(all_scores, padded_scores.contiguous(), group=group)
    dist.all_gather(all_ids, padded_ids.contiguous(), group=group)
    candidates = torch.cat([s[:, :c] for s, c in zip(all_scores, counts)], dim=1)
    candidate_ids = torch.cat([i[:, :c] for i, c in zip(all_ids, counts)], dim=1)
    # Each rank's block is in rank order and ids grow with rank: one stable merge gives the global order.
    empty_scores = candidates[:, :0]
    return merge_top_k(empty_scores, candidate_ids[:, :0], candidates, candidate_ids, k)
