"""Rescoring a compressed (PLAID) :class:`lik.Index`'s best documents from an exact copy of its tokens.

``lik.Index.build(docs, codec="plaid", rescore_dtype=torch.int8)`` (or ``torch.float16``) keeps, beside each
shard's residual codes, the shard's documents as an exact index of that dtype stores them (int8: quantized per
token with its fp32 scale): the shard's ``copy``, in host memory (placements ``"gpu"`` and ``"host"``; never on
the GPU) or memory-mapped from the shard file (``"disk"``). ``index.search(Q, k, rescore=R)`` then takes each
query's best ``R`` documents from the compressed search (exhaustive or candidate generation), gathers only
those documents' token rows from the copy (a ``"disk"`` index reads only their pages), scores them with packed
MaxSim on the search's device, and returns the top ``k`` of those exact scores.

``rescore=None`` (default): :data:`DEFAULT_RESCORE` documents (at least ``k``) when the index keeps a copy, off
otherwise; ``rescore=0``: off.
"""

from __future__ import annotations

import bisect
from dataclasses import replace

import torch

from ..ops.maxsim.packed_function import packed_query, score_packed
from ..retrieval.exact import merge_top_k
from .building import as_int
from .documents import _token_index
from .format import Shard, dtype_name

__all__ = ["RESCORE_DTYPES", "DEFAULT_RESCORE", "check_rescore_dtype", "rescore_count", "place_copy", "rescore_top"]

RESCORE_DTYPES = (torch.float16, torch.int8)
# Best documents rescored by default: exact scores of a few dozen documents cost a gather of ~ a few thousand
# token rows per query, and the compressed ranking rarely misplaces the true top 10 beyond its top 32.
DEFAULT_RESCORE = 32


def check_rescore_dtype(rescore_dtype) -> torch.dtype | None:
    """``rescore_dtype`` of :meth:`lik.Index.build` checked: ``None``, ``torch.float16`` or ``torch.int8``."""
    if rescore_dtype is not None and rescore_dtype not in RESCORE_DTYPES:
        raise ValueError(f"rescore_dtype must be None, torch.float16 or torch.int8, got {rescore_dtype!r}")
    return rescore_dtype


def rescore_count(rescore, k: int, rescore_dtype) -> int:
    """How many best documents a search rescores (0: none), checked: one-line errors naming ``rescore``."""
    if rescore is None:
        return 0 if rescore_dtype is None else max(k, DEFAULT_RESCORE)
    rescore = as_int(rescore, "rescore")
    if rescore == 0:
        return 0
    if rescore_dtype is None:
        raise ValueError(
            "rescore needs an exact copy of the tokens: build the index with codec='plaid' and "
            "rescore_dtype=torch.int8 or torch.float16 (or pass rescore=None / 0)"
        )
    if rescore < k:
        raise ValueError(f"rescore must be 0 or at least k ({k}), got {rescore}")
    return rescore


def place_copy(segment: Shard, placement: str) -> Shard:
    """``segment`` with its copy in host memory (``"disk"``: left memory-mapped where it is)."""
    if segment.copy is None or placement == "disk":
        return segment
    copy = segment.copy
    host = lambda t: None if t is None else (t.cpu() if t.is_cuda else t.clone())  # noqa: E731
    return replace(segment, copy=Shard(host(copy.tokens), copy.cu_seqlens.clone(), host(copy.scale)))


def _gather(segments, first: int, docs: torch.Tensor):
    """The copy's packed documents at sorted stored positions ``docs`` (CPU int64, from ``first``): tokens,
    scales (int8) or ``None``, int32 ``cu_seqlens``, on the host; only those documents' rows are read."""
    starts, position = [], first
    for segment in segments:
        starts.append(position)
        position += segment.num_docs
    values, tokens, scales, lengths = docs.tolist(), [], [], []
    for number, segment in enumerate(segments):
        lo = bisect.bisect_left(values, starts[number])
        hi = bisect.bisect_left(values, starts[number] + segment.num_docs)
        if hi == lo:
            continue
        rows, length = _token_index(segment.copy, docs[lo:hi] - starts[number])
        tokens.append(segment.copy.tokens.index_select(0, rows))
        scales.append(None if segment.copy.scale is None else segment.copy.scale.index_select(0, rows))
        lengths.append(length)
    cu = torch.zeros(docs.numel() + 1, dtype=torch.int64)
    cu[1:] = torch.cat(lengths).cumsum(0)
    return torch.cat(tokens), None if scales[0] is None else torch.cat(scales), cu.to(torch.int32)


@torch.no_grad()
def rescore_top(queries, n_queries: int, segments, first: int, positions: torch.Tensor, k: int, device):
    """Top-``k`` of the exact scores of each query's documents ``positions`` (int64 ``[Nq, R]`` stored positions
    from ``first``, ``-1`` where the compressed search found fewer) against the segments' copies:
    ``(scores fp32 [Nq, min(k, R)], positions int64)`` on ``device``, ties to the lower position, ``-1`` /
    ``-inf`` where no document is left. ``queries``: the search's checked dense buckets."""
    big = torch.iinfo(torch.int64).max
    held = positions.cpu()
    # Columns in increasing position (missing ones last), so that merge_top_k's rank breaks ties to the lower id.
    held = torch.where(held >= 0, held, big).sort(dim=1).values
    # A zero-length query is in no bucket: it scores 0 against every document, as the compressed search scored it.
    scores = torch.where(held != big, 0.0, float("-inf")).to(device)
    dtype = segments[0].copy.tokens.dtype if segments else torch.float16
    for bucket in queries:
        rows = torch.as_tensor(bucket.rows, dtype=torch.int64)
        mine = held[rows]
        valid = mine != big
        docs = torch.unique(mine[valid])
        if docs.numel() == 0:
            continue
        tokens, scale, cu = _gather(segments, first, docs)
        # A float16 copy scores fp16 queries; an int8 one quantizes them per token (lik.quantize), as exact indexes do.
        q = bucket.q.to(device) if dtype == torch.int8 else bucket.q.to(device, dtype)
        mask = None if bucket.mask is None else bucket.mask.to(device)
        scored = score_packed(
            packed_query(q, mask, dtype), tokens.to(device), cu.to(device), None if scale is None else scale.to(device)
        ).float()
        where = torch.searchsorted(docs, torch.where(valid, mine, docs[0])).to(device)
        own = torch.where(valid.to(device), scored.gather(1, where), float("-inf"))
        scores[rows.to(device)] = own
    ids = torch.where(held == big, -1, held).to(device)
    empty = torch.empty(n_queries, 0, device=device)
    scores, ids = merge_top_k(empty, empty.to(torch.int64), scores, ids, k)
    # A missing document ranks after every real one (score -inf, and ties to the lower position put real ones
    # first only when their positions are lower): put missing ones last explicitly.
    order = torch.argsort((ids < 0).to(torch.int8), dim=1, stable=True)
    return scores.gather(1, order), ids.gather(1, order)


def describe_copy(rescore_dtype) -> str:
    """The copy's dtype for ``repr`` (empty when none)."""
    return "" if rescore_dtype is None else f"rescore_dtype={dtype_name(rescore_dtype)}, "
