"""Document ids of a :class:`lik.Index`: removed documents (tombstones), compaction, and reading documents back.

A stored document has a *position*, its number among the documents the shards hold (shard order: what placements,
chunk plans and ranks count), and an *id*, the number it got when it was added (insertion order, never reused).
The two are equal until :meth:`lik.Index.compact` drops removed documents from the shards; ids then skip the
dropped ones. The map from positions to ids is strictly increasing, so ordering results by position orders them
by id, ties to the lower id included: searches run on positions and translate their final ids on the device.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import torch

from .format import Shard
from .manifest import IdRanges, Manifest
from .placement import ChunkPlan

__all__ = ["IdSpace", "check_ids", "live_selection", "rank_counts", "compact_segments", "read_documents"]


def check_ids(ids, num_ids: int, name: str, keep_order: bool = False) -> torch.Tensor | None:
    """``ids`` (a 1-D integer sequence or tensor) as sorted unique CPU int64 in ``[0, num_ids)`` (in the given
    order, repeats kept, with ``keep_order``; ``None`` stays ``None``); errors name ``name``."""
    if ids is None:
        return None
    if isinstance(ids, (str, bytes)):
        raise TypeError(f"{name} must be a 1-D integer sequence, got {type(ids).__name__}")
    if isinstance(ids, torch.Tensor):
        values = ids.detach().cpu()
    else:
        try:
            values = torch.as_tensor(ids)
        except (TypeError, ValueError, RuntimeError, OverflowError) as error:
            raise TypeError(f"{name} must be a 1-D integer sequence of ids in [0, {num_ids}) ({error})") from None
        if values.numel() == 0:
            values = values.to(torch.int64)  # an empty list has no integer type to infer
    if values.dtype == torch.bool or values.is_floating_point() or values.is_complex() or values.dim() != 1:
        raise TypeError(f"{name} must be a 1-D integer sequence, got {values.dtype} {list(values.shape)}")
    if values.numel() and values.dtype in (torch.uint32, torch.uint64):  # may not fit int64: compare before casting
        top = int(values.numpy().max())
        if top >= num_ids:
            raise ValueError(f"{name} must be in [0, {num_ids}), got an id of {top}")
    values = values.to(torch.int64)
    ordered = torch.unique(values)
    if ordered.numel() and (int(ordered[0]) < 0 or int(ordered[-1]) >= num_ids):
        raise ValueError(f"{name} must be in [0, {num_ids}), got values {int(ordered[0])}..{int(ordered[-1])}")
    return values if keep_order else ordered


def _as_ranges(ids: torch.Tensor) -> IdRanges:
    """Sorted unique ids as half-open ``(start, stop)`` runs."""
    if ids.numel() == 0:
        return ()
    values = ids.tolist()
    breaks = (torch.nonzero(ids.diff() != 1).flatten() + 1).tolist()
    starts = [0, *breaks]
    stops = [*breaks, len(values)]
    return tuple((values[a], values[b - 1] + 1) for a, b in zip(starts, stops))


def _from_ranges(ranges: IdRanges) -> torch.Tensor:
    if not ranges:
        return torch.empty(0, dtype=torch.int64)
    return torch.cat([torch.arange(start, stop, dtype=torch.int64) for start, stop in ranges])


def _union(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.unique(torch.cat([a, b])) if b.numel() else a


class IdSpace:
    """The ids of an index: ``num_ids`` given so far; ``removed``, ids removed but still stored; ``dropped``, ids
    removed and no longer stored (both sorted unique CPU int64). Immutable: each change returns a new one."""

    def __init__(self, num_ids: int, removed: torch.Tensor | None = None, dropped: torch.Tensor | None = None):
        self.num_ids = int(num_ids)
        self.removed = torch.empty(0, dtype=torch.int64) if removed is None else removed
        self.dropped = torch.empty(0, dtype=torch.int64) if dropped is None else dropped
        # dropped[i] - i: how many stored documents come before the i-th dropped id (see ids_of).
        self._stored_before_gap = self.dropped - torch.arange(self.dropped.numel())
        self._on_device: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> IdSpace:
        return cls(manifest.num_ids, _from_ranges(manifest.removed), _from_ranges(manifest.compacted))

    def ranges(self) -> dict:
        """The manifest's ``removed`` and ``compacted`` id ranges."""
        return {"removed": _as_ranges(self.removed), "compacted": _as_ranges(self.dropped)}

    @property
    def num_stored(self) -> int:
        return self.num_ids - self.dropped.numel()

    @property
    def num_live(self) -> int:
        return self.num_stored - self.removed.numel()

    def live_ids(self) -> torch.Tensor:
        keep = torch.ones(self.num_ids, dtype=torch.bool)
        keep[self.removed] = False
        keep[self.dropped] = False
        return torch.nonzero(keep).flatten()

    # ------------------------------------------------------------------ positions <-> ids
    def ids_of(self, positions: torch.Tensor) -> torch.Tensor:
        """Ids of stored positions (any shape, on any device; no host synchronisation)."""
        if self.dropped.numel() == 0:
            return positions
        device = positions.device
        if device not in self._on_device:
            self._on_device[device] = self._stored_before_gap.to(device)
        return positions + torch.searchsorted(self._on_device[device], positions, right=True)

    def positions_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Positions of stored ids (CPU int64; ids outside ``dropped``)."""
        return ids - torch.searchsorted(self.dropped, ids)

    def removed_positions(self) -> torch.Tensor:
        return self.positions_of(self.removed)

    def live_positions(self, ids: torch.Tensor) -> torch.Tensor:
        """Sorted positions of the live documents among sorted unique ``ids`` (removed ones are left out)."""
        live = ~torch.isin(ids, self.dropped) & ~torch.isin(ids, self.removed)
        return self.positions_of(ids[live])

    # ------------------------------------------------------------------ changes
    def with_added(self, count: int) -> IdSpace:
        return IdSpace(self.num_ids + count, self.removed, self.dropped)

    def with_removed(self, ids: torch.Tensor) -> IdSpace:
        """Mark checked ``ids`` removed (ids removed before stay removed)."""
        fresh = ids[~torch.isin(ids, self.dropped)]
        return IdSpace(self.num_ids, _union(self.removed, fresh), self.dropped)

    def compacted(self) -> IdSpace:
        """After the removed documents were dropped from the shards."""
        return IdSpace(self.num_ids, None, _union(self.dropped, self.removed))


# ---------------------------------------------------------------------------------------------- searching
def live_selection(plans: Sequence[ChunkPlan], removed: torch.Tensor, device) -> list[tuple[int, torch.Tensor | None]]:
    """The chunks a search without ``doc_ids`` scores, as :func:`lik.index.search.select_chunks` gives them: every
    plan, with the chunk-local positions of its live documents (on ``device``) where it holds removed ones; plans
    whose documents are all removed are left out (never scored, never copied). ``removed``: sorted positions."""
    values = removed.tolist()
    selection = []
    for number, plan in enumerate(plans):
        lo = bisect.bisect_left(values, plan.first_id)
        hi = bisect.bisect_left(values, plan.first_id + plan.num_docs)
        if hi == lo:
            selection.append((number, None))
        elif hi - lo < plan.num_docs:
            live = torch.ones(plan.num_docs, dtype=torch.bool)
            live[removed[lo:hi] - plan.first_id] = False
            selection.append((number, torch.nonzero(live).flatten().to(device)))
    return selection


def rank_counts(world: int, positions: torch.Tensor | None, removed: torch.Tensor, k: int, total: int) -> list[int]:
    """Each rank's result count in a distributed search: its live documents (among ``positions``, a filter's
    sorted positions, if given), at most ``k``. Rank ``r`` holds positions ``[total * r // world, ...)``."""
    counts = []
    for rank in range(world):
        lo, hi = total * rank // world, total * (rank + 1) // world
        if positions is None:
            n = hi - lo - int(((removed >= lo) & (removed < hi)).sum())
        else:
            n = int(((positions >= lo) & (positions < hi)).sum())
        counts.append(min(k, n))
    return counts


# ---------------------------------------------------------------------------------------------- segments
def _token_index(segment: Shard, docs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The token rows of documents ``docs`` (segment-local, CPU int64) and their lengths."""
    starts = segment.cu_seqlens[docs]
    lengths = segment.cu_seqlens[docs + 1] - starts
    # numpy, not torch.repeat_interleave: that one starts torch's thread pool even for a few rows, which hangs a
    # process forked after the pool ran (a write killed in a test, a worker of a forking server).
    offsets = np.repeat((starts - torch.cumsum(lengths, 0) + lengths).numpy(), lengths.numpy())
    return torch.from_numpy(offsets + np.arange(offsets.size, dtype=np.int64)), lengths


def _take(segment: Shard, docs: torch.Tensor) -> Shard:
    """A new segment of documents ``docs`` of ``segment``, its tensors where ``segment``'s are (a memory map is
    read into host memory)."""
    rows, lengths = _token_index(segment, docs)
    cu = torch.zeros(docs.numel() + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lengths, 0)
    tokens = segment.tokens.index_select(0, rows.to(segment.tokens.device))
    scale = None if segment.scale is None else segment.scale.index_select(0, rows.to(segment.scale.device))
    return Shard(tokens, cu, scale, copy=None if segment.copy is None else _take(segment.copy, docs))


def compact_segments(segments: Sequence[Shard], removed: torch.Tensor) -> list[Shard]:
    """``segments`` without the documents at sorted positions ``removed``: segments without any are kept as they
    are, emptied ones are left out."""
    values = removed.tolist()
    kept, first = [], 0
    for segment in segments:
        lo = bisect.bisect_left(values, first)
        hi = bisect.bisect_left(values, first + segment.num_docs)
        if hi == lo:
            kept.append(segment)
        elif hi - lo < segment.num_docs:
            live = torch.ones(segment.num_docs, dtype=torch.bool)
            live[removed[lo:hi] - first] = False
            kept.append(_take(segment, torch.nonzero(live).flatten()))
        first += segment.num_docs
    return kept


def read_documents(segments: Sequence[Shard], first_position: int, space: IdSpace,
                   ids: torch.Tensor, decode=None) -> list[torch.Tensor]:
    """The tokens of the documents ``ids`` (checked CPU int64, in that order) of ``segments`` (held from position
    ``first_position`` on), as CPU tensors: the stored dtype for a float index, fp32 (token times its scale) for
    an 8-bit one, ``decode(residuals, codes)`` for a compressed one. One gather and one copy per segment.
    ``KeyError`` for a removed id."""
    gone = torch.isin(ids, space.removed) | torch.isin(ids, space.dropped)
    if bool(gone.any()):
        raise KeyError(f"ids: document {int(ids[gone][0])} was removed")
    positions = space.positions_of(ids)
    held = sum(s.num_docs for s in segments)
    if bool(((positions < first_position) | (positions >= first_position + held)).any()):
        raise ValueError("ids: some documents are held by another rank of this distributed index")
    starts, first = [], first_position
    for segment in segments:
        starts.append(first)
        first += segment.num_docs
    found: list[torch.Tensor | None] = [None] * positions.numel()
    owner = torch.as_tensor([bisect.bisect_right(starts, p) - 1 for p in positions.tolist()], dtype=torch.int64)
    for number, segment in enumerate(segments):
        wanted = torch.nonzero(owner == number).flatten()
        if wanted.numel() == 0:
            continue
        part = _take(segment, positions[wanted] - starts[number])
        tokens = part.tokens.cpu()
        if decode is not None:
            tokens = decode(tokens, part.scale.cpu()).cpu()
        elif part.scale is not None:
            tokens = tokens.float() * part.scale.cpu()[:, None]
        for slot, piece in zip(wanted.tolist(), tokens.split(part.cu_seqlens.diff().tolist())):
            found[slot] = piece
    return found
