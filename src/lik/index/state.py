"""The pieces :class:`lik.Index` is made of besides its methods: a consistent view of its documents
(:class:`State`), where it runs (devices, placements, ranks), and writing a generation of shards (with a
compressed index's codec)."""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from pathlib import Path

import torch

from .building import as_int, progress_bar
from .documents import IdSpace, live_selection
from .plaid_codec import CODEC_FILE, write_codec
from .format import Shard
from .placement import place_together
from .rescore import place_copy
from .storage import IndexWriter

__all__ = ["State", "resolve_device", "check_shard", "auto_placement", "place_all", "place_segment", "write_index"]


def _free_host_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


class State:
    """One consistent view of an index's documents: its segments (never changed), their ids, and the chunk source
    and live-document selection built from them on first use. ``add`` / ``remove`` / ``compact`` make a new state
    and swap one reference, so a search holds the state it began with and a source is never paired with other
    segments. ``num_docs``: documents stored in the whole index (all ranks)."""

    def __init__(self, segments, num_docs: int | None, ids: IdSpace | None = None, source=None):
        self.segments = tuple(segments)
        self.num_docs = sum(s.num_docs for s in self.segments) if num_docs is None else num_docs
        self.ids = IdSpace(self.num_docs) if ids is None else ids
        self._source, self._live = source, None
        self._lock = threading.Lock()

    def source(self, build):
        with self._lock:
            if self._source is None:
                self._source = build(self.segments)
            return self._source

    def live_selection(self, source):
        """Every chunk of ``source`` with its live documents (cached: removed ones never change in a state)."""
        with self._lock:
            if self._live is None:
                self._live = live_selection(source.plans, self.ids.removed_positions(), source.device)
            return self._live


def resolve_device(device, placement: str) -> torch.device:
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if placement == "gpu" and device.type != "cuda":
        raise ValueError(f"placement='gpu' needs a CUDA device, got device={str(device)!r}")
    return device


def check_shard(shard, num_shards) -> tuple[int, int]:
    if (shard is None) != (num_shards is None):
        raise ValueError("shard and num_shards go together: pass both or neither")
    if shard is None:
        return 0, 1
    shard, num_shards = as_int(shard, "shard"), as_int(num_shards, "num_shards")
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise ValueError(f"need 0 <= shard < num_shards, got shard={shard}, num_shards={num_shards}")
    return shard, num_shards


def auto_placement(pieces, device) -> str:
    nbytes = sum(p.tokens.nbytes + (0 if p.scale is None else p.scale.nbytes) for p in pieces)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if nbytes < 0.7 * free:
            return "gpu"
    return "host" if nbytes < 0.5 * _free_host_bytes() else "disk"


def place_all(segments, placement: str, device: torch.device) -> list[Shard]:
    """``segments`` placed; on the GPU back to back in one buffer (what :func:`coalesce` joins for search)."""
    if placement == "gpu" and len(segments) > 1:
        return [place_copy(s, placement) for s in place_together(segments, device)]
    return [place_segment(s, placement, device) for s in segments]


def place_segment(segment: Shard, placement: str, device: torch.device) -> Shard:
    """``segment`` where ``placement`` keeps it (a ``"disk"`` one stays as it is: memory-mapped)."""
    if placement == "disk":
        return segment
    segment = place_copy(segment, placement)  # the copy for rescoring stays in host memory
    if placement == "gpu":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
    elif device.type != "cuda":
        move = lambda t: None if t is None else t.clone()  # noqa: E731 (into RAM, off the file map)
    else:
        move = lambda t: None if t is None else t.pin_memory()  # noqa: E731
    return Shard(move(segment.tokens), segment.cu_seqlens.clone(), move(segment.scale), copy=segment.copy)


def write_index(
    path: Path, shards, dtype, overwrite: bool, d: int | None, progress=None, ranges=None, codec=None, rescore=None
) -> None:
    """Write ``shards`` as a new generation of the index at ``path`` (see :class:`~lik.index.storage.IndexWriter`).
    ``codec``: a compressed index's :class:`lik.compression.ResidualCodec`, or a callable giving it once the
    shards are consumed (a build trains it on its first batches); its file is written beside the shards.
    ``rescore``: the dtype of the shards' exact copies (a compressed index's), recorded with the codec."""
    with IndexWriter(path, overwrite=overwrite) as writer:
        for number, shard in enumerate(progress_bar(shards, progress=progress, desc="write shards", unit="shard")):
            width = shard.tokens.shape[1]
            if codec is None and d is not None and width != d:
                raise ValueError(f"docs: shard {number} has d={width}, expected d={d}")
            d = width if codec is None else d
            writer.write_shard(shard)
        info = None
        if codec is not None:
            codec = codec() if callable(codec) else codec
            if codec is None:  # a build whose documents never came
                raise ValueError("docs is empty: pass at least one document (an index needs its width d)")
            d = codec.dim
            info = replace(writer.write_file(CODEC_FILE, lambda file: write_codec(file, codec)), rescore=rescore)
        if d is None:
            raise ValueError("docs is empty: pass at least one document (an index needs its width d)")
        writer.commit(d, dtype, **(ranges or {}), codec=info)
