"""The launch choice of compressed-corpus inference (:func:`lik.ops.residual.score_residual_packed`): the token
stream with the residual loader (codes decoded on chip per tile), or the bounded-scratch fallback (a run of whole
documents decoded into a scratch buffer, then the exact packed scan), and the stream's tiles.

A row block decodes every tile it reads, so the decode is repeated once per row block: the stream takes the call
while the query rows fit in :data:`MAX_FUSED_ROW_BLOCKS` row blocks, the fallback beyond (where decoding once and
reading the decoded chunk once per row block, from L2, is cheaper). ``lik.config.override(residual_stream=
ResidualStreamConfig(...))`` forces tiles, ``ResidualStreamConfig(chunk_tokens=n)`` forces the fallback in runs of
about ``n`` tokens (the A/B of the two paths).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import _device
from .forced import FORCED, register
from .packed import packed_stream_tiles

__all__ = [
    "ResidualStreamConfig",
    "residual_stream_config",
    "MAX_FUSED_ROW_BLOCKS",
    "MAX_FUSED_DIM",
    "FALLBACK_CHUNK_TOKENS",
    "FUSED_NBITS",
]

# Row blocks of queries up to which the fused stream is chosen: one block (a query) decodes each tile once and beats
# the fallback's write and L2 read per token 2x; four blocks (32 queries of 32 tokens) decode each tile 4 times and
# lose to it (BENCHMARKS.md, compressed index); the crossover lies between.
MAX_FUSED_ROW_BLOCKS = 2
# Widest embedding the stream decodes on chip (a [64, d] fp32 tile a program; wider ones are unmeasured).
MAX_FUSED_DIM = 128
# Bit widths the stream decodes: 1 and 2 bits pick a dimension's weight by selects in registers; 4 bits gather it
# from the 16-entry table per dimension (a load per element, as the byte-table loader, 3.4x slower than the selects
# at 2 bits), which made one query 5.5x slower at 4 bits (11.1 vs 2.0 ms, 5M tokens, H200) than at 2, where the
# fallback's decode kernel (the same at both widths: 256 queries took 30.7 ms at each) took 4.6 ms at 2 bits.
FUSED_NBITS = (1, 2)
# The fallback's runs: 2**18 tokens of d 128 in fp16 are a 64 MiB scratch buffer.
FALLBACK_CHUNK_TOKENS = 1 << 18


@dataclass(frozen=True)
class ResidualStreamConfig:
    """Tiles of the token stream with the residual loader: ``groups`` query groups of ``group_rows`` rows against
    ``block_t`` tokens per tile, ``programs_per_sm`` programs per SM in all, ``max_registers`` > 0 capping the
    registers per thread, ``segments`` documents per tile folded in unrolled passes, ``byte_table`` the loader's way to
    a byte's bucket weights (see :mod:`lik.ops.residual.decode`). ``chunk_tokens`` > 0: the
    fallback instead (runs of whole documents of about that many tokens decoded, then ``maxsim_packed``'s scan).

    Example:
        >>> from lik.config import override
        >>> with override(residual_stream=ResidualStreamConfig(chunk_tokens=1 << 16)):
        ...     scores = lik.maxsim_residual(Q, codes, residuals, codec, cu)  # decode + packed scan
    """

    group_rows: int = 32
    groups: int = 1
    block_t: int = 64
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 2
    max_registers: int = 0
    segments: int = 3
    chunk_tokens: int = 0
    # a byte's weights from the 256-entry byte table (one vector load), else by selects on each dimension's bits
    # (sm_90 ptxas: about as many instructions either way; the table adds shared-memory traffic. Unmeasured.)
    byte_table: bool = False

    @property
    def block_m(self) -> int:
        return self.group_rows * self.groups


def residual_stream_config(
    *, q_len: int, n_queries: int, dim: int, dtype: torch.dtype, device: torch.device, nbits: int | None = None
) -> ResidualStreamConfig:
    """The path and tiles for ``n_queries`` queries of ``q_len`` tokens (``dtype`` fp16 / bf16 / fp32) against a
    compressed corpus of width ``dim`` and ``nbits`` bits a dimension (``None``: chosen as for 2 bits). A forced
    config (``residual_stream``) is returned as it is. Embeddings wider than :data:`MAX_FUSED_DIM` take the fallback
    (the stream decodes a token's whole row at once), and so do bit widths outside :data:`FUSED_NBITS` on a GPU.

    Example:
        >>> one = dict(q_len=32, n_queries=1, dim=128, dtype=torch.float16, device=torch.device("cuda"))
        >>> residual_stream_config(**one).chunk_tokens, residual_stream_config(**one, nbits=4).chunk_tokens
        (0, 262144)
    """
    forced = FORCED.get("residual_stream")
    if forced is not None:
        if dim > MAX_FUSED_DIM and not forced.chunk_tokens:
            return ResidualStreamConfig(chunk_tokens=FALLBACK_CHUNK_TOKENS)
        return forced
    if dim > MAX_FUSED_DIM:
        return ResidualStreamConfig(chunk_tokens=FALLBACK_CHUNK_TOKENS)
    # The packed stream's row blocks (stacked short queries, a long query split in groups); each decodes the tiles.
    packed = packed_stream_tiles(q_len=q_len, n_queries=n_queries, dim=dim, dtype=dtype, device=device)
    n_row_blocks = -(-n_queries * -(-q_len // packed.group_rows) // packed.groups)
    fused_bits = nbits is None or nbits in FUSED_NBITS
    return _tiles(packed.group_rows, packed.groups, n_row_blocks, dtype, _device.interpreting(), fused_bits)


@functools.lru_cache(maxsize=1024)
def _tiles(group_rows, groups, n_row_blocks, dtype, interpreted, fused_bits=True) -> ResidualStreamConfig:
    rows = group_rows * groups
    if interpreted:  # (the interpreter tests the stream at every bit width)
        return ResidualStreamConfig(group_rows, groups, 16, 4, 1, 2)
    if n_row_blocks > MAX_FUSED_ROW_BLOCKS or not fused_bits:
        return ResidualStreamConfig(group_rows, groups, chunk_tokens=FALLBACK_CHUNK_TOKENS)
    if dtype == torch.float32:
        # fp32 tiles: twice the shared memory of a 16-bit one (unmeasured).
        return ResidualStreamConfig(group_rows, groups, 32, 4 if rows <= 64 else 8, 2, 1)
    if rows <= 128:
        # One query, or a few stacked: 64-token tiles on one warpgroup (sm_90 ptxas: 162-168 registers, 43-68 KB of
        # shared memory), three programs per SM to hide the centroid gathers' latency.
        return ResidualStreamConfig(group_rows, groups, 64, 4, 2, 3)
    # 256 stacked rows: 8 warps capped at 128 registers so that two programs share an SM (100 KB of shared memory
    # each, 96 bytes spilled; uncapped: 188 registers, one program per SM), as the packed stream's 256-row tile.
    return ResidualStreamConfig(group_rows, groups, 64, 8, 2, 2, 128)


register("residual_stream", ResidualStreamConfig)
