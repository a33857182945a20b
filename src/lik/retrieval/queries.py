"""Queries of different lengths in one search: checked once, grouped into dense batches of similar length.

A search takes ``Q`` as one dense ``[Lq, d]`` / ``[Nq, Lq, d]`` tensor, a list of ``[Lq_i, d]`` tensors, or packed
query tokens ``[sum Lq_i, d]`` with ``cu_seqlens_q``. Ragged queries are put in *buckets*: the kernels give every
query a power-of-two block of rows (multiples of 256 rows past 256 tokens), so queries of one bucket scored together
as ``[n, P, d]`` with a mask cost what each costs alone, in one launch per bucket instead of one per query. Adjacent
buckets are merged where one launch is cheaper than two: a packed call streams the whole corpus, and under about
:data:`BALANCE_ROWS` query rows (d = 128, fp16 or 8-bit, on an H100 / H200: bytes / bandwidth ~ FLOPs / matmul rate)
its time is the stream's, so padded rows there are free, and above it every row costs. A zero-length query scores
0 against every document and is never launched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .._device import next_power_of_2

__all__ = ["RaggedQueries", "QueryBucket", "ragged_queries", "bucket_length", "buckets", "assemble", "BALANCE_ROWS"]

BALANCE_ROWS = 192
_WIDE_GROUP = 256  # the kernels' tallest row block: longer queries take whole multiples of it


class RaggedQueries(NamedTuple):
    """Checked ragged queries: packed ``tokens [Tq, d]``, host ``lengths`` (``Nq`` ints), optional fp32 ``scale [Tq]``
    (queries already 8-bit)."""

    tokens: torch.Tensor
    lengths: list[int]
    scale: torch.Tensor | None


class QueryBucket(NamedTuple):
    """Queries ``rows`` (their numbers in the call, host ints) as one dense batch ``q [n, P, d]``, bool ``mask
    [n, P]`` (None when every query fills ``P``), ``scale [n, P]`` for 8-bit queries; ``index``: ``rows`` as an
    int64 tensor on ``q``'s device (None when ``rows`` is every query in order)."""

    rows: list[int]
    q: torch.Tensor
    mask: torch.Tensor | None
    scale: torch.Tensor | None
    index: torch.Tensor | None


def _seqlens(cu_seqlens_q, n_rows: int) -> list[int]:
    if not isinstance(cu_seqlens_q, torch.Tensor):
        raise TypeError(f"cu_seqlens_q must be a torch.Tensor, got {type(cu_seqlens_q).__name__}")
    if cu_seqlens_q.dtype not in (torch.int32, torch.int64) or cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() == 0:
        raise ValueError(f"cu_seqlens_q must be 1-D int32 / int64 [Nq + 1], got {cu_seqlens_q.dtype} "
                         f"{list(cu_seqlens_q.shape)}")
    offsets = cu_seqlens_q.tolist()  # (one read of a device tensor: pass it on the CPU to avoid the sync)
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    if offsets[0] != 0 or offsets[-1] != n_rows or any(length < 0 for length in lengths):
        raise ValueError(f"cu_seqlens_q must start at 0, be non-decreasing and end at Q.shape[0] = {n_rows}, "
                         f"got {offsets[:4]}...{offsets[-1]}")
    return lengths


def ragged_queries(Q, cu_seqlens_q=None, q_scale=None) -> RaggedQueries | None:
    """Check ragged queries: ``Q`` a list / tuple of ``[Lq_i, d]`` tensors (one dtype, device and ``d``; ``q_scale``
    then a list of ``[Lq_i]``), or packed ``[Tq, d]`` with ``cu_seqlens_q`` (``q_scale [Tq]``). None for a dense
    ``Q`` (no ``cu_seqlens_q``): the caller checks it as before."""
    if isinstance(Q, (list, tuple)):
        if cu_seqlens_q is not None:
            raise ValueError("cu_seqlens_q goes with packed queries [Tq, d], not with a list of queries")
        for number, q in enumerate(Q):
            if not isinstance(q, torch.Tensor):
                raise TypeError(f"Q[{number}] must be a torch.Tensor [Lq, d], got {type(q).__name__}")
            if q.dim() != 2:
                raise ValueError(f"Q[{number}] must be 2-D [Lq, d], got shape {list(q.shape)}")
            first = Q[0]
            if (q.shape[1], q.dtype, q.device) != (first.shape[1], first.dtype, first.device):
                raise ValueError(f"Q[{number}] is {q.dtype} [{q.shape[1]} wide] on {q.device}, Q[0] is "
                                 f"{first.dtype} [{first.shape[1]} wide] on {first.device}: queries must match")
        if not Q:
            raise ValueError("Q is an empty list: pass at least one query (or a [0, Lq, d] tensor)")
        if q_scale is not None:
            if not isinstance(q_scale, (list, tuple)) or len(q_scale) != len(Q):
                raise ValueError(f"q_scale must be a list of {len(Q)} [Lq_i] tensors, as Q")
            if any(not isinstance(s, torch.Tensor) or s.shape != q.shape[:1] for s, q in zip(q_scale, Q)):
                raise ValueError("q_scale[i] must be a tensor of shape [Lq_i] for every query Q[i]")
            q_scale = torch.cat([s.detach().to(device=Q[0].device) for s in q_scale])
        tokens = torch.cat([q.detach() for q in Q]) if len(Q) > 1 else Q[0].detach()
        return RaggedQueries(tokens, [q.shape[0] for q in Q], q_scale)
    if cu_seqlens_q is None:
        return None
    if not isinstance(Q, torch.Tensor):
        raise TypeError(f"Q must be a torch.Tensor or a list of them, got {type(Q).__name__}")
    if Q.dim() != 2:
        raise ValueError(f"Q must be packed [Tq, d] with cu_seqlens_q, got shape {list(Q.shape)}")
    lengths = _seqlens(cu_seqlens_q, Q.shape[0])
    if q_scale is not None and (not isinstance(q_scale, torch.Tensor) or q_scale.shape != Q.shape[:1]):
        raise ValueError(f"q_scale must have shape [{Q.shape[0]}] for packed queries, got "
                         f"{list(getattr(q_scale, 'shape', []))}")
    return RaggedQueries(Q.detach(), lengths, None if q_scale is None else q_scale.detach())


def bucket_length(length: int) -> int:
    """The rows the kernels give a query of ``length`` tokens (its bucket)."""
    if length <= _WIDE_GROUP:
        return next_power_of_2(length) if length else 0
    return -(-length // _WIDE_GROUP) * _WIDE_GROUP


def _merge(sizes: list[int], counts: list[int]) -> list[int]:
    """The last bucket of each group of adjacent buckets (sorted ``sizes`` with ``counts`` queries) that minimises the
    sum over launches of ``max(BALANCE_ROWS, rows)``, ``rows`` = queries times the group's longest bucket."""
    best, cut = [0.0], [0]
    for j in range(1, len(sizes) + 1):
        options = [(best[i] + max(BALANCE_ROWS, sum(counts[i:j]) * sizes[j - 1]), i) for i in range(j)]
        cost, i = min(options)
        best.append(cost)
        cut.append(i)
    ends, j = [], len(sizes)
    while j:
        ends.append(j - 1)
        j = cut[j]
    return sorted(ends)


def buckets(queries: RaggedQueries) -> list[QueryBucket]:
    """Dense batches of ``queries`` (zero-length queries are in none): one gather copy of the tokens per bucket,
    none when the queries already are one dense block."""
    tokens, lengths = queries.tokens, queries.lengths
    device, width = tokens.device, tokens.shape[1]
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    by_size: dict[int, list[int]] = {}
    for number, length in enumerate(lengths):
        if length:
            by_size.setdefault(bucket_length(length), []).append(number)
    sizes = sorted(by_size)
    groups, first = [], 0
    for end in _merge(sizes, [len(by_size[s]) for s in sizes]):
        rows = sorted(r for s in sizes[first : end + 1] for r in by_size[s])
        groups.append((sizes[end], rows))
        first = end + 1
    if not groups:  # no query has a token: one launch-free batch of empty queries (all score 0)
        scale = None if queries.scale is None else queries.scale.new_zeros(len(lengths), 0)
        return [QueryBucket(list(range(len(lengths))), tokens.new_zeros(len(lengths), 0, width), None, scale, None)]
    out = []
    for size, rows in groups:
        n = len(rows)
        in_order = rows == list(range(n)) and n == len(lengths)
        if all(lengths[r] == size for r in rows) and rows == list(range(rows[0], rows[0] + n)):
            # one dense block already: views, no copy
            start = starts[rows[0]]
            q = tokens[start : start + n * size].view(n, size, width)
            scale = None if queries.scale is None else queries.scale[start : start + n * size].view(n, size)
            mask = None
        else:
            source = torch.cat([torch.arange(starts[r], starts[r] + lengths[r]) for r in rows])
            target = torch.cat([torch.arange(i * size, i * size + lengths[r]) for i, r in enumerate(rows)])
            source, target = source.to(device), target.to(device)
            q = tokens.new_zeros(n * size, width).index_copy_(0, target, tokens.index_select(0, source))
            q = q.view(n, size, width)
            scale = None
            if queries.scale is not None:
                scale = queries.scale.new_zeros(n * size).index_copy_(0, target, queries.scale.index_select(0, source))
                scale = scale.view(n, size)
            real = torch.arange(size) < torch.tensor([lengths[r] for r in rows])[:, None]
            mask = real.to(device)
        index = None if in_order else torch.tensor(rows, dtype=torch.int64).to(device)
        out.append(QueryBucket(rows, q, mask, scale, index))
    return out


def assemble(parts: Sequence[tuple[QueryBucket, torch.Tensor]], n_queries: int, n_docs: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """Scores ``[Nq, n_docs]`` from each bucket's scores ``[n, n_docs]`` (0 for zero-length queries)."""
    if len(parts) == 1 and parts[0][0].index is None:
        return parts[0][1]
    covered = sum(len(bucket.rows) for bucket, _ in parts)
    scores = (torch.empty if covered == n_queries else torch.zeros)(n_queries, n_docs, dtype=dtype, device=device)
    for bucket, part in parts:
        scores.index_copy_(0, bucket.index, part.to(dtype))
    return scores
