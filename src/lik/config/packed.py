"""The launch choice of packed-corpus inference: the document loop of the core kernel, or the token stream
(:mod:`lik.core.token_stream`), and the stream's tiles.

The stream walks a program's documents as one run of full tiles, so it wins where documents are short next to a
tile (a document loop then computes a ragged last tile per document and refills its pipeline per document), except
for one short int8 query, where the loop measured faster. What it reads: the mean document length (rows over
documents: shapes only, no host synchronisation), the query rows and the dtype.
``lik.config.override(packed_stream=PackedStreamConfig(...))`` forces a tile, and ``PackedStreamConfig(stream=False)``
forces the document loop (the A/B of the two paths).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import _device
from .forced import FORCED, register
from .maxsim import EIGHT_BIT_DTYPES, MAX_RESIDENT_DIM, _maxsim_forward_heuristic

__all__ = ["PackedStreamConfig", "packed_stream_config", "packed_stream_tiles", "STREAM_MAX_MEAN_TILES"]

# The stream's documents: up to this many tiles long on average. On the H200 (BENCHMARKS.md, "Packed corpora at
# search scale") the stream won on 100-token documents (1.6 tiles; Nq 1 and 32) and lost on 1 030-token ColPali
# pages (16 tiles of 64; Nq 32: 2.95 against the document loop's 2.50 ms), so pages keep the document loop.
STREAM_MAX_MEAN_TILES = 4


@dataclass(frozen=True)
class PackedStreamConfig:
    """Tiles of the token-stream kernel: ``groups`` query groups of ``group_rows`` rows (the padded heuristic's
    row blocks) against ``block_t`` packed rows per tile, ``programs_per_sm`` programs per SM in all (each owning a
    share of the rows), ``max_registers`` > 0 capping the registers per thread, and ``segments`` documents per tile
    folded in unrolled passes. ``stream=False``: take the
    document loop instead (only meaningful when forced).

    Example:
        >>> from lik.config import override
        >>> with override(packed_stream=PackedStreamConfig(stream=False)):
        ...     scores = lik.maxsim_packed(Q, d, cu)  # the document loop
    """

    group_rows: int = 32
    groups: int = 1
    block_t: int = 64
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 2
    max_registers: int = 0
    stream: bool = True
    # documents per tile folded in unrolled passes (more take a counted loop)
    segments: int = 3

    @property
    def block_m(self) -> int:
        return self.group_rows * self.groups


def packed_stream_config(
    *,
    q_len: int,
    n_queries: int,
    dim: int,
    dtype: torch.dtype,
    device: torch.device,
    n_rows: int,
    n_docs: int,
) -> PackedStreamConfig | None:
    """The stream's tiles for ``n_queries`` dense queries of ``q_len`` tokens against ``n_docs`` packed documents
    of ``n_rows`` rows in all, or None when the document loop takes the call (long documents, embeddings wider
    than :data:`~lik.config.maxsim.MAX_RESIDENT_DIM`). Inference only: the caller asks only without winners.
    A forced config (``packed_stream``) is returned as it is (``stream=False``: None); with none forced, a forced
    ``maxsim_varlen`` or ``maxsim_forward`` tile means the document loop (None)."""
    forced = FORCED.get("packed_stream")
    if forced is not None:
        return forced if forced.stream and dim <= MAX_RESIDENT_DIM else None
    if "maxsim_varlen" in FORCED or "maxsim_forward" in FORCED:
        return None  # a forced document-loop tile means the document loop
    if dim > MAX_RESIDENT_DIM or n_docs == 0:
        return None
    cfg = packed_stream_tiles(q_len=q_len, n_queries=n_queries, dim=dim, dtype=dtype, device=device)
    if n_rows > STREAM_MAX_MEAN_TILES * cfg.block_t * n_docs:
        return None
    if dtype == torch.int8 and cfg.block_m <= 32:
        # One short int8 query: the document loop read 71% of the floor on 100-token documents, the stream at its
        # best tiles 65% (H200; the stream's per-document masked maxima outweigh its full tiles at 32 rows).
        return None
    return cfg


def packed_stream_tiles(
    *, q_len: int, n_queries: int, dim: int, dtype: torch.dtype, device: torch.device
) -> PackedStreamConfig:
    """The stream's tiles whatever the documents' lengths (what :func:`packed_stream_config` returns where it
    takes the stream; a benchmark forces them to time the stream where the heuristic would not)."""
    return _stream_tiles(
        q_len, n_queries, dim, dtype, _device.arch(device), _device.interpreting(), _device.shared_memory(device)
    )


@functools.lru_cache(maxsize=1024)
def _stream_tiles(q_len, n_queries, dim, dtype, arch, interpreted, smem) -> PackedStreamConfig:
    # The padded heuristic's row blocks (stacked short queries, a long query split in groups): the stream's tile
    # is the padded loop's tile with the documents' boundaries removed.
    padded = _maxsim_forward_heuristic(q_len, n_queries, dim, dtype, False, arch, interpreted, False, False, smem)
    rows = padded.block_m
    if interpreted:
        return PackedStreamConfig(padded.group_rows, padded.groups, 16, 4, 1, 2)
    eight_bit = dtype in EIGHT_BIT_DTYPES
    # Programs per SM are what the registers and shared memory let reside at once (sm_90 ptxas of the kernel):
    # the programs share the rows equally, so one more than resides would run in a second wave.
    if dim > 128 or dtype == torch.float32:
        # Unmeasured: wider rows and fp32 tiles take the 64-row tile's shared memory of a 128-wide one.
        return PackedStreamConfig(padded.group_rows, padded.groups, 64, 4 if rows <= 128 else 8, 2, 1)
    if rows <= 64:
        # One short query streams the corpus (memory-bound): 128-token tiles, three stages (as the packed document
        # loop measured); int8 32 x 128: 128 registers, 37 KB, three programs per SM; float8 64 x 128: 180
        # registers, two resident, three planned (the third program's share overlaps the others' tails: 14% faster
        # on the H200); fp16 32 x 128: 127 registers, 74 KB, two (96 KB of tiles in flight each).
        return PackedStreamConfig(padded.group_rows, padded.groups, 128, 4, 3, 2 if dtype == torch.float16 else 3)
    if eight_bit:
        # Stacked 8-bit rows: the padded loop's 128 x 128 tiles of 4 warps (255 registers, 82 KB), two per SM.
        return PackedStreamConfig(padded.group_rows, padded.groups, 128, 4, 4, 2)
    if rows <= 128:
        # 128 x 64 on one warpgroup: 168 registers, two per SM.
        return PackedStreamConfig(padded.group_rows, padded.groups, 64, 4, 3, 2)
    # 256 stacked 16-bit rows: the padded persistent loop's 256 x 64 tiles, 8 warps capped at 128 registers so that
    # two programs share an SM (115 KB of shared memory each; 12 bytes spilled).
    return PackedStreamConfig(padded.group_rows, padded.groups, 64, 8, 3, 2, 128)


register("packed_stream", PackedStreamConfig)
