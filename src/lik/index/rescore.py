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

from dataclasses import replace

import torch

from ..ops.maxsim.packed_function import packed_query, score_packed
from ..retrieval.exact import merge_top_k
from .building import as_int
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


def _rows(cu_seqlens: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """The token rows (CPU int64) of documents ``docs`` (CPU int64, positions in the packed ``cu_seqlens``), in order.

    The running sum of a step vector: 1 within a document, the jump from the previous document's last row (0 before
    the first) at a document's first row. Torch ops over the rows, no loop over documents (and no
    ``repeat_interleave``, which starts torch's thread pool even for a few rows)."""
    starts = cu_seqlens[docs]
    lengths = cu_seqlens[docs + 1] - starts
    full = lengths > 0  # an empty document has no first row to jump at
    starts, lengths = starts[full], lengths[full]
    offsets = torch.cumsum(lengths, 0) - lengths
    step = torch.ones(int(lengths.sum()), dtype=torch.int64)
    before = torch.zeros_like(starts)
    before[1:] = (starts + lengths - 1)[:-1]
    step[offsets] = starts - before
    return torch.cumsum(step, 0)


def _gather(segments, first: int, docs: torch.Tensor, device):
    """The copy's packed documents at sorted stored positions ``docs`` (CPU int64, from ``first``) on ``device``:
    tokens, scales (int8) or ``None``, int32 ``cu_seqlens``. Only those documents' rows are read, by one
    ``index_select`` per segment into one host buffer (pinned when ``device`` is a GPU), then copied to the device
    in one asynchronous copy per tensor."""
    bounds = torch.tensor([0] + [s.num_docs for s in segments], dtype=torch.int64).cumsum(0) + first
    cut = torch.searchsorted(docs, bounds).tolist()
    local = [docs[lo:hi] - bounds[n] for n, (lo, hi) in enumerate(zip(cut, cut[1:]))]
    rows = [_rows(s.copy.cu_seqlens, d) for s, d in zip(segments, local)]
    lengths = torch.cat([s.copy.cu_seqlens[d + 1] - s.copy.cu_seqlens[d] for s, d in zip(segments, local)])
    cu = torch.zeros(docs.numel() + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    copy, total = segments[0].copy, int(cu[-1])
    # Page-locked, the copy below is one DMA that does not wait on the host; torch's host allocator caches the buffer.
    pin = torch.device(device).type == "cuda"
    tokens = torch.empty(total, *copy.tokens.shape[1:], dtype=copy.tokens.dtype, pin_memory=pin)
    scale = None if copy.scale is None else torch.empty(total, dtype=copy.scale.dtype, pin_memory=pin)
    at = 0
    for segment, index in zip(segments, rows):
        # A slice of rows of the buffer is contiguous: index_select writes it in place, with no temporary.
        torch.index_select(segment.copy.tokens, 0, index, out=tokens[at : at + index.numel()])
        if scale is not None:
            torch.index_select(segment.copy.scale, 0, index, out=scale[at : at + index.numel()])
        at += index.numel()
    move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
    return move(tokens), move(scale), move(cu.to(torch.int32))


@torch.no_grad()
def rescore_top(queries, n_queries: int, segments, first: int, positions: torch.Tensor, k: int, device):
    """Top-``k`` of the exact scores of each query's documents ``positions`` (int64 ``[Nq, R]`` stored positions
    from ``first``, ``-1`` where the compressed search found fewer) against the segments' copies:
    ``(scores fp32 [Nq, min(k, R)], positions int64)`` on ``device``, ties to the lower position, ``-1`` /
    ``-inf`` where no document is left. ``queries``: the search's checked dense buckets.

    The union of all queries' documents is gathered once (a document several queries hold is read once) and each
    bucket is scored against all of it in one packed MaxSim call, each query keeping its own columns. At 64
    queries x 64 documents x ~100 tokens this scores ~4 x 10^5 tokens for each of 2048 query tokens (~10^11
    multiply-adds at d 128: well under a millisecond of int8 tensor-core time), where a call per query would
    repeat a launch and a gather 64 times for the same total rows."""
    big = torch.iinfo(torch.int64).max
    held = positions.cpu()
    # Columns in increasing position (missing ones last), so that merge_top_k's rank breaks ties to the lower id.
    held = torch.where(held >= 0, held, big).sort(dim=1).values
    valid = held != big
    # A zero-length query is in no bucket: it scores 0 against every document, as the compressed search scored it.
    scores = torch.where(valid, 0.0, float("-inf")).to(device)
    docs = torch.unique(held[valid])
    if docs.numel():
        tokens, scale, cu = _gather(segments, first, docs, device)
        where = torch.searchsorted(docs, torch.where(valid, held, docs[0])).to(device)
        valid_here = valid.to(device)
        dtype = tokens.dtype
        for bucket in queries:
            rows = torch.as_tensor(bucket.rows, dtype=torch.int64).to(device)
            # A float16 copy scores fp16 queries; an int8 one quantizes them per token (lik.quantize), as exact
            # indexes do.
            q = bucket.q.to(device) if dtype == torch.int8 else bucket.q.to(device, dtype)
            mask = None if bucket.mask is None else bucket.mask.to(device)
            scored = score_packed(packed_query(q, mask, dtype), tokens, cu, scale).float()
            scores[rows] = torch.where(valid_here[rows], scored.gather(1, where[rows]), float("-inf"))
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
