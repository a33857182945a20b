"""Where an index lives while it is searched, and how its chunks reach the device that scores them.

* ``"gpu"``: resident in device memory; chunks are views.
* ``"host"``: in pinned host RAM; each chunk is copied to one of two device buffers on a side stream, the copy of
  chunk ``i + 1`` overlapping the scoring of chunk ``i``.
* ``"disk"``: memory-mapped shard files; each chunk's rows are read from the file straight into one of two pinned
  staging buffers (large positional reads by several threads, not page faults on the mapping: one thread copies
  out of the page cache at about 5 GB/s) and copied on as for ``"host"``.

Device memory for ``"host"`` and ``"disk"`` is two chunk buffers whatever the corpus size. On a CPU-only machine
(or with ``device="cpu"``) every placement yields plain CPU views and the CPU reference scores them.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import Executor, ThreadPoolExecutor, wait
from dataclasses import dataclass
from collections.abc import Iterator, Sequence

import torch

from .format import Shard

__all__ = [
    "PLACEMENTS", "Chunk", "ChunkPlan", "plan_chunks", "coalesce", "place_together", "ChunkSource", "ResidentSource",
    "StreamedSource", "read_into", "read_pool", "READ_THREADS", "READ_PIECE_BYTES",
]

PLACEMENTS = ("auto", "gpu", "host", "disk")
# Threads reading a chunk of a "disk" index, and the least bytes each takes (smaller reads stay on one thread).
READ_THREADS = min(8, os.cpu_count() or 1)
READ_PIECE_BYTES = 8 << 20
_read_pool: ThreadPoolExecutor | None = None
_read_pool_lock = threading.Lock()


def read_pool() -> ThreadPoolExecutor:
    """The process's threads for :func:`read_into` (every ``"disk"`` index shares them), made on first use."""
    global _read_pool
    with _read_pool_lock:
        if _read_pool is None:
            _read_pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="lik-read")
        return _read_pool


def _forget_read_pool() -> None:
    # A forked child inherits the pool without its threads (work sent to it would never run): it makes its own.
    global _read_pool, _read_pool_lock
    _read_pool, _read_pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_read_pool)


@dataclass(frozen=True)
class ChunkPlan:
    """Documents ``[doc_start, doc_stop)`` of segment ``segment``: tokens ``[token_start, token_stop)``."""

    segment: int
    doc_start: int
    doc_stop: int
    token_start: int
    token_stop: int
    max_seqlen: int
    first_id: int

    @property
    def num_docs(self) -> int:
        return self.doc_stop - self.doc_start

    @property
    def num_tokens(self) -> int:
        return self.token_stop - self.token_start


@dataclass(frozen=True)
class Chunk:
    """A chunk ready to score on its device: packed ``tokens``, int32 ``cu_seqlens`` from 0, optional ``scale``."""

    tokens: torch.Tensor
    cu_seqlens: torch.Tensor
    scale: torch.Tensor | None
    max_seqlen: int
    first_id: int
    num_docs: int


def plan_chunks(segments: Sequence[Shard], first_ids: Sequence[int], chunk_tokens: int) -> list[ChunkPlan]:
    """Split each segment into runs of whole documents of at most ``chunk_tokens`` tokens (one longer document
    makes a chunk of its own). Host-side only: the plan needs no device synchronisation."""
    plans = []
    for number, (segment, first_id) in enumerate(zip(segments, first_ids)):
        if 0 < segment.num_docs and segment.num_tokens <= chunk_tokens:  # the whole segment: no walk over documents
            longest = int(segment.cu_seqlens.diff().max())
            plans.append(ChunkPlan(number, 0, segment.num_docs, 0, segment.num_tokens, longest, first_id))
            continue
        offsets = segment.cu_seqlens.tolist()
        start = 0
        while start < segment.num_docs:
            stop = start + 1
            while stop < segment.num_docs and offsets[stop + 1] - offsets[start] <= chunk_tokens:
                stop += 1
            lengths = [offsets[i + 1] - offsets[i] for i in range(start, stop)]
            plans.append(
                ChunkPlan(number, start, stop, offsets[start], offsets[stop], max(lengths), first_id + start)
            )
            start = stop
    return plans


def _follows(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether ``b``'s rows start in memory where ``a``'s end (contiguous views of one buffer)."""
    if a is None or b is None:
        return a is None and b is None
    return (a.is_contiguous() and b.is_contiguous() and a.dtype == b.dtype and a.device == b.device
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.data_ptr() + a.nbytes == b.data_ptr())


def _joined(a: torch.Tensor, rows: int) -> torch.Tensor:
    return a.as_strided((rows, *a.shape[1:]), a.stride(), a.storage_offset())


def coalesce(segments: Sequence[Shard]) -> list[Shard]:
    """``segments`` with each run of segments that lie back to back in one device buffer (as :meth:`lik.Index.load`
    and ``build`` place a GPU-resident index) joined into one: views, no copy. A resident index is then scored by
    one packed call over all its documents instead of one per shard file."""
    joined: list[Shard] = []
    for segment in segments:
        last = joined[-1] if joined else None
        if (last is not None and last.tokens.is_cuda and segment.tokens.shape[1:] == last.tokens.shape[1:]
                and _follows(last.tokens, segment.tokens) and _follows(last.scale, segment.scale)):
            rows = last.num_tokens + segment.num_tokens
            cu = torch.cat([last.cu_seqlens, segment.cu_seqlens[1:] + last.cu_seqlens[-1]])
            scale = None if last.scale is None else _joined(last.scale, rows)
            joined[-1] = Shard(_joined(last.tokens, rows), cu, scale)
        else:
            joined.append(segment)
    return joined


def place_together(segments: Sequence[Shard], device: torch.device) -> list[Shard]:
    """``segments`` copied to ``device`` back to back in one buffer (one for their scales): views of it, which
    :func:`coalesce` joins again."""
    rows = sum(s.num_tokens for s in segments)
    first = segments[0]
    tokens = torch.empty(rows, *first.tokens.shape[1:], dtype=first.tokens.dtype, device=device)
    scale = None if first.scale is None else torch.empty(rows, dtype=first.scale.dtype, device=device)
    placed, start = [], 0
    for segment in segments:
        stop = start + segment.num_tokens
        tokens[start:stop].copy_(segment.tokens)
        if scale is not None:
            scale[start:stop].copy_(segment.scale)
        part = None if scale is None else scale[start:stop]
        placed.append(Shard(tokens[start:stop], segment.cu_seqlens.clone(), part, copy=segment.copy))
        start = stop
    return placed


def _chunk_offsets(segment: Shard, plan: ChunkPlan) -> torch.Tensor:
    return (segment.cu_seqlens[plan.doc_start : plan.doc_stop + 1] - plan.token_start).to(torch.int32)


def read_into(file, offset: int, out: torch.Tensor, pool: Executor | None = None, *,
              max_pieces: int | None = None, piece_bytes: int | None = None) -> None:
    """Fill the contiguous CPU tensor ``out`` with the bytes of ``file`` (an unbuffered binary file) at ``offset``.
    Positional reads where the OS has them, so sources sharing a file never move each other's position; with
    ``pool`` (and positional reads), up to ``max_pieces`` (default :data:`READ_THREADS`) pieces of at least
    ``piece_bytes`` (default :data:`READ_PIECE_BYTES`) are read at once.

    Example:
        >>> with open(path, "rb", buffering=0) as f:
        ...     read_into(f, 128, out, read_pool())  # out.nbytes bytes from byte 128 on
    """
    view = memoryview(out.view(-1).view(torch.uint8).numpy())
    max_pieces = READ_THREADS if max_pieces is None else max_pieces
    pieces = min(max_pieces, len(view) // max(1, READ_PIECE_BYTES if piece_bytes is None else piece_bytes))
    if pool is None or pieces < 2 or not hasattr(os, "preadv"):
        _read_range(file, offset, view)
        return
    bounds = [len(view) * i // pieces for i in range(pieces + 1)]
    reads = [pool.submit(_read_range, file, offset + a, view[a:b]) for a, b in zip(bounds, bounds[1:])]
    wait(reads)  # every piece done (or failed) before an error leaves: none writes into ``out`` afterwards
    for read in reads:
        read.result()


def _read_range(file, offset: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        if hasattr(os, "preadv"):
            got = os.preadv(file.fileno(), [view[done:]], offset + done)
        else:
            file.seek(offset + done)
            got = file.readinto(view[done:])
        if not got:
            raise ValueError(f"{file.name}: file ended before byte {offset + len(view)} (truncated shard?)")
        done += got


class ChunkSource:
    """Yields :class:`Chunk` s of chosen plans, in order, on ``device``. ``lock``: held by a search while it
    draws chunks (a source whose buffers one search at a time may use makes it a real lock)."""

    def __init__(self, segments: Sequence[Shard], plans: Sequence[ChunkPlan], device: torch.device):
        self.segments = list(segments)
        self.plans = list(plans)
        self.device = torch.device(device)
        self.lock = contextlib.nullcontext()

    def chunks(self, plan_numbers: Sequence[int]) -> Iterator[Chunk]:
        raise NotImplementedError


class ResidentSource(ChunkSource):
    """Segments already on ``device`` (``"gpu"`` placement, or any placement on CPU): chunks are views."""

    def __init__(self, segments, plans, device):
        super().__init__(segments, plans, device)
        # Offsets of every chunk, on the device once, so a search copies nothing per chunk; the chunks themselves
        # (views) made once too: a search of a resident index slices nothing.
        self.offsets = [_chunk_offsets(self.segments[p.segment], p).to(self.device) for p in self.plans]
        self._chunks = [self._chunk(number) for number in range(len(self.plans))]

    def _chunk(self, number: int) -> Chunk:
        plan = self.plans[number]
        segment = self.segments[plan.segment]
        scale = segment.scale
        return Chunk(
            segment.tokens[plan.token_start : plan.token_stop],
            self.offsets[number],
            None if scale is None else scale[plan.token_start : plan.token_stop],
            plan.max_seqlen,
            plan.first_id,
            plan.num_docs,
        )

    def chunks(self, plan_numbers):
        chunks = self._chunks
        return (chunks[number] for number in plan_numbers)


class StreamedSource(ChunkSource):
    """Host-resident (pinned) or memory-mapped segments streamed to a CUDA device through two buffers.

    The copy of the next chunk runs on a side stream while the current one is scored on the current stream;
    events order "copy into buffer b" after "scoring of the chunk that last used b" and "score" after "copy".
    The only host waits are on the staging buffers of memory-mapped segments (the CPU must not overwrite a
    pinned buffer whose copy is still running).
    """

    def __init__(self, segments, plans, device, *, staged: bool):
        super().__init__(segments, plans, device)
        self.lock = threading.Lock()  # the device and staging buffers serve one search at a time
        self.staged = staged
        capacity = max((p.num_tokens for p in self.plans), default=0)
        dim = self.segments[0].tokens.shape[1] if self.segments else 0
        dtype = self.segments[0].tokens.dtype if self.segments else torch.float16
        has_scale = bool(self.segments) and self.segments[0].scale is not None
        # fp32 scales of an 8-bit index, int32 codes of a compressed one: 4 bytes a token either way.
        side = self.segments[0].scale.dtype if has_scale else torch.float32
        self.buffers = [torch.empty(capacity, dim, dtype=dtype, device=self.device) for _ in range(2)]
        self.scale_buffers = [
            torch.empty(capacity if has_scale else 0, dtype=side, device=self.device) for _ in range(2)
        ]
        self.offsets_host = [_chunk_offsets(self.segments[p.segment], p).pin_memory() for p in self.plans]
        if staged:
            self.staging = [torch.empty(capacity, dim, dtype=dtype).pin_memory() for _ in range(2)]
            self.scale_staging = [
                torch.empty(capacity if has_scale else 0, dtype=side).pin_memory() for _ in range(2)
            ]
        self.copy_stream = torch.cuda.Stream(device=self.device)
        self.freed: list[torch.cuda.Event | None] = [None, None]
        self.copied_into: list[torch.cuda.Event | None] = [None, None]
        if hasattr(os, "posix_fadvise"):  # chunks are read front to back: ask for a large readahead
            for handle in {id(s.region.handle): s.region.handle for s in self.segments if s.region}.values():
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def _stage(self, segment: Shard, plan: ChunkPlan, slot: int, tokens, scale):
        """Bring a chunk of a memory-mapped (or host) segment into staging buffer ``slot``."""
        n = plan.num_tokens
        region = segment.region
        if region is not None:
            # The file opened at load time (unbuffered: reads go straight into the staging buffer), so a writer
            # replacing the index meanwhile changes nothing this index reads.
            handle = region.handle
            tokens_at = region.tokens_offset + plan.token_start * region.row_bytes
            read_into(handle, tokens_at, self.staging[slot][:n], read_pool())
            if scale is not None:
                scale_at = region.scale_offset + 4 * plan.token_start
                read_into(handle, scale_at, self.scale_staging[slot][:n], read_pool())
        else:
            self.staging[slot][:n].copy_(tokens)
            if scale is not None:
                self.scale_staging[slot][:n].copy_(scale)
        return self.staging[slot][:n], None if scale is None else self.scale_staging[slot][:n]

    def _copy(self, number: int, slot: int, free: torch.cuda.Event | None, staged_free: torch.cuda.Event | None):
        plan = self.plans[number]
        segment = self.segments[plan.segment]
        n = plan.num_tokens
        tokens = segment.tokens[plan.token_start : plan.token_stop]
        scale = None if segment.scale is None else segment.scale[plan.token_start : plan.token_stop]
        if self.staged:
            # The staging buffer's previous host-to-device copy must be done before the CPU refills it.
            if staged_free is not None:
                staged_free.synchronize()
            tokens, scale = self._stage(segment, plan, slot, tokens, scale)
        with torch.cuda.stream(self.copy_stream):
            if free is not None:
                self.copy_stream.wait_event(free)
            self.buffers[slot][:n].copy_(tokens, non_blocking=True)
            if scale is not None:
                self.scale_buffers[slot][:n].copy_(scale, non_blocking=True)
            offsets = self.offsets_host[number].to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        return done, offsets

    def chunks(self, plan_numbers):
        plan_numbers = list(plan_numbers)
        compute = torch.cuda.current_stream(self.device)
        # Kept from one search to the next (searches hold the lock, one at a time): the first copies of a search
        # wait for the previous search's scoring of the same slot, and the CPU waits for its last copy out of a
        # staging buffer before refilling it (no host sync between searches otherwise).
        freed = self.freed  # scoring of the slot's last chunk is done
        copied_into = self.copied_into  # the slot's last copy is done
        pending = self._copy(plan_numbers[0], 0, freed[0], copied_into[0]) if plan_numbers else None
        for position, number in enumerate(plan_numbers):
            slot = position % 2
            copied, offsets = pending
            copied_into[slot] = copied
            if position + 1 < len(plan_numbers):
                pending = self._copy(plan_numbers[position + 1], 1 - slot, freed[1 - slot], copied_into[1 - slot])
            compute.wait_event(copied)
            offsets.record_stream(compute)
            plan = self.plans[number]
            n = plan.num_tokens
            has_scale = self.scale_buffers[slot].numel() > 0
            yield Chunk(
                self.buffers[slot][:n],
                offsets,
                self.scale_buffers[slot][:n] if has_scale else None,
                plan.max_seqlen,
                plan.first_id,
                plan.num_docs,
            )
            # Recorded after the caller scored the chunk (the generator resumes only then).
            event = torch.cuda.Event()
            event.record(compute)
            freed[slot] = event
