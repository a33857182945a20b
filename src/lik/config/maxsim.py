"""MaxSim's launch heuristics: the forward tiles (padded and packed layouts) and the backward tiles.

A configuration is a pure function of the architecture, the dtype, ``d``, the query length bucket and a few flags,
so the number of compiled variants is bounded and a call never pays for a benchmark sweep. Batch sizes and
sequence lengths are runtime arguments of the kernels: changing them never recompiles. Each heuristic returns the
config forced by :func:`lik.config.override` first, and reads the device through :mod:`lik._device`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from .. import _device
from .._device import cdiv, next_power_of_2
from ..core.budget import pipeline_stages, shared_memory_limit, warps_for_tile
from .forced import FORCED, register

__all__ = [
    "MaxSimForwardConfig", "MaxSimBackwardConfig", "maxsim_forward_config", "maxsim_forward_doc_programs",
    "maxsim_backward_config", "maxsim_varlen_config", "feature_chunks", "LONG_DOCUMENT", "MAX_RESIDENT_DIM",
    "EIGHT_BIT_DTYPES", "STREAMED_FIXED_BYTES", "MaxSimSoftConfig", "maxsim_soft_config",
]


def feature_chunks(dim: int, block_k: int) -> tuple[int, int]:
    """``(BLOCK_K, NUM_K)`` of the forward kernels for a config's ``block_k``.

    When ``block_k`` covers the padded width, one chunk holds every feature (the query block stays on chip:
    ``BLOCK_K`` is the power-of-two bucket of ``dim``); otherwise the features stream in ``cdiv(dim, block_k)``
    chunks of ``block_k`` (a ragged last chunk is masked; no power-of-two padding of ``dim``)."""
    block_d = max(16, next_power_of_2(dim))
    if block_k >= block_d:
        return block_d, 1
    return block_k, cdiv(dim, block_k)



@dataclass(frozen=True)
class MaxSimForwardConfig:
    """Tile shape of the forward kernel.

    A program owns ``groups`` query-row groups of ``group_rows`` rows each (``group_rows`` is the power-of-two
    bucket of ``Lq``, capped; a longer query is split into several groups whose partial sums are added) and one
    document, whose tokens it streams in tiles of ``block_n``. With ``programs_per_sm`` > 0 the launch is
    persistent: about that many programs per SM in all, each keeping its query rows and looping over documents.
    ``max_registers`` > 0 caps the registers per thread (``maxnreg``), e.g. to fit two programs per SM.
    """

    group_rows: int
    groups: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 0
    max_registers: int = 0
    # Streamed-k loop (d > MAX_RESIDENT_DIM): one flat (document, tile, chunk) loop, or chunks nested per tile.
    flat_k: bool = True

    @property
    def block_m(self) -> int:
        return self.group_rows * self.groups


@dataclass(frozen=True)
class MaxSimBackwardConfig:
    """Tiles of the backward kernels (every layout): query rows per program (dQ, atomic dD), and the dD routes
    with the sorted gather's tiles."""

    block_rows: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1
    # dQ: documents gathered per loop step (unrolled, all in flight).
    dq_docs: int = 2
    # dD kernels: "fast" takes ``fast_dd`` ("atomic" scatter or "sorted" gather), "deterministic" takes
    # ``deterministic_dd`` (only "sorted": no atomics). H200 (benchmarks/NOTES.md, "fast" dD): the atomic scatter
    # through a 16 MiB buffer beat the sorted gather at every training shape (ColBERT B 2048: 18.5 vs 20.9 ms).
    # The sorted gather: contributions per block, warps, winners per sort chunk (about 44 bytes of workspace
    # each at peak) and an optional cap on a chunk's document rows (32 767 or fewer: 16-bit sort keys).
    fast_dd: str = "atomic"
    deterministic_dd: str = "sorted"
    sort_entries: int = 8
    sort_warps: int = 1
    sort_chunk_rows: int = 0
    # The atomic scatter's fp32 buffer, in bytes (documents are scattered a chunk at a time through it).
    atomic_workspace_bytes: int = 16 << 20
    sort_workspace_entries: int = 1 << 20


EIGHT_BIT_DTYPES = (torch.int8, torch.float8_e4m3fn)
LONG_DOCUMENT = 512  # tokens: from here one short query streams documents in 128-token tiles
# Widest embedding whose query block stays on chip for the whole document loop; wider ones stream the query and
# the document tile in feature chunks (the tuned d <= 128 tiles and the d <= 256 ones are left as they were).
MAX_RESIDENT_DIM = 256



def maxsim_forward_config(
    *, q_len: int, n_queries: int, dim: int, dtype: torch.dtype, per_query: bool, device: torch.device,
    doc_len: int = 0, argmax: bool = False,
) -> MaxSimForwardConfig:
    """Pick the forward tiles for ``n_queries`` queries of ``q_len`` tokens against documents of ``doc_len``
    tokens (only whether ``doc_len >= LONG_DOCUMENT`` matters: two variants at most per query bucket);
    ``argmax``: the training forward, which also records each row's winner."""
    forced = FORCED.get("maxsim_forward")
    if forced is not None:
        return replace(forced, groups=1) if per_query else forced
    return _maxsim_forward_heuristic(
        q_len, n_queries, dim, dtype, per_query, _device.arch(device), _device.interpreting(),
        doc_len >= LONG_DOCUMENT, argmax, _device.shared_memory(device),
    )


@functools.lru_cache(maxsize=4096)
def _maxsim_forward_heuristic(
    q_len, n_queries, dim, dtype, per_query, arch, interpreted, long_docs=False, argmax=False, smem=0,
) -> MaxSimForwardConfig:
    long_half_query = (
        dim > 128 and not interpreted and arch >= (9, 0) and dtype in (torch.float16, torch.bfloat16) and q_len >= 128
    )
    block_d = max(16, next_power_of_2(dim))
    # A long query at 128 < d <= 256 scored as a GEMM: 128 resident query rows against 64-token tiles of the
    # full depth, 8 warps, 3 stages (H100 sweeps, Lq = Ld = 1024, B = 256, d = 256: 0.290 ms against the
    # streamed 128 x 256 tiles' 0.307; BENCHMARKS.md "MaxSim at any embedding width"), where the shared memory
    # holds it.
    resident = MaxSimForwardConfig(128, 1, 64, block_d, 8, 3)
    resident_bytes = (resident.block_m + resident.num_stages * resident.block_n) * block_d * 2
    if long_half_query and dim <= MAX_RESIDENT_DIM and not argmax and resident_bytes <= smem:
        return resident
    if dim > MAX_RESIDENT_DIM or long_half_query:
        # A long query at d > 128 is a GEMM: the streamed loop's tall tiles beat the resident query block of the
        # smaller tiles below (H100, d = 256: 0.310 against 0.368 ms; BENCHMARKS.md "MaxSim at any embedding width").
        return _streamed_forward_tiles(q_len, n_queries, dim, dtype, per_query, arch, interpreted, smem)
    if interpreted:
        max_rows, block_n, warps, stages = 32, 16, 4, 1
    else:
        # From benchmarks/tune_maxsim.py on an H200 (benchmarks/NOTES.md): 256 query rows against 64-token
        # document tiles for long or stacked queries, 32 x 64 with 4 warps for a single short query.
        # 256-row tiles were measured on Hopper only; older GPUs get the 128-row tile (fewer registers per SM).
        # fp32 (TF32) at d <= 128 took the same 256 x 64 tiles in the H200 fp32 sweep (ColPali 1.28 -> 0.97 ms
        # against 64-row tiles; 3 stages for tiles of 128+ rows, 2 for one short query); before Hopper, and for
        # wider embeddings, fp32 keeps the small tiles (unmeasured, and their shared memory is smaller).
        hopper = arch >= (9, 0)
        wide = block_d > 128 or (dtype == torch.float32 and not hopper)
        max_rows = 64 if wide else (256 if hopper else 128)
        block_n, stages = (32 if block_d > 256 else 64), (2 if wide else 3)
    group_rows = _group_rows(q_len, n_queries, max_rows, per_query)
    groups = 1
    if not per_query:
        # Stack several short queries against one document tile: fuller tensor-core tiles, fewer doc re-reads.
        n_groups_total = n_queries * -(-q_len // group_rows)
        groups = _stacked_groups(q_len, n_queries, group_rows, max_rows, per_query)
    block_k = block_d if interpreted else min(block_d, 256)
    warps = 4 if interpreted or group_rows * groups < 128 else 8
    programs_per_sm = max_registers = 0
    if not interpreted and dtype == torch.float32 and group_rows * groups < 128:
        stages = 2
    elif not interpreted and hopper and not wide:
        # H200 sweeps (tune_maxsim.py --near-heuristic, benchmarks/NOTES.md): one short query streams long documents
        # best in 128-token tiles, 4 stages (long-doc 0.077 -> 0.074 ms); short documents keep 64-token tiles
        # (textual B = 10 000: 0.200 -> 0.218 ms with 128); stacked short queries gain from a persistent launch,
        # 2 programs per SM (fp16 multi textual 0.223 -> 0.191 ms, multi long-doc 0.52; fp32 / TF32 multi
        # textual 0.447 -> 0.314, multi long-doc 1.03 -> 0.95).
        if groups == 1 and group_rows <= 32 and not per_query and long_docs and dtype != torch.float32:
            block_n, stages = 128, 4
        if dtype == torch.float32 and groups == 1 and group_rows == 256 and not per_query and not argmax:
            # fp32 (TF32) long queries: the query block alone fills half of the shared memory, so one program per
            # SM; a persistent one keeps its query and streams documents back to back (H200, tune_maxsim.py
            # --dtype fp32, benchmarks/NOTES.md "fp32 (TF32)", A/B: visual 0.489 -> 0.447 ms, ColPali 0.966 -> 0.848,
            # multi ColPali 3.70 -> 3.47; fp16 gets slower with it, visual 0.238 -> 0.258).
            programs_per_sm = 1
        if groups > 1:
            programs_per_sm = 2
            if dtype != torch.float32 and group_rows * groups == 128 and not argmax:
                # 128 stacked rows fit one warpgroup's product (64 accumulator registers a thread): 4 warps with no
                # cap, still two programs per SM (H100 A/B, benchmarks/NOTES.md "128-row stacked tiles on one
                # warpgroup": colpali-engine's 325 rows x 1 000 pages 0.210 -> 0.183 ms, ten 32-token queries -6%).
                warps = 4
            elif dtype != torch.float32:
                # Two programs of 256 threads per SM need <= 128 registers; the flat (document, tile) loop takes
                # 130 at 256 stacked rows (offline ptxas for sm_90), 128 with the cap and no spills.
                max_registers = 128
        if argmax and groups > 1 and group_rows <= 32 and dtype != torch.float32:
            # The winner bookkeeping needs ~165 registers at 256 stacked rows; 128 rows capped at 128 registers
            # run two programs per SM (H200, a since-removed profile, benchmarks/NOTES.md:
            # ColBERT B 512 argmax forward 1.95 -> 1.29 ms, B 128 0.157 -> 0.091); the persistent launch and the
            # cap are the stacked branch's above.
            groups = max(1, min(128 // group_rows, next_power_of_2(n_groups_total)))
            warps = 8
    if not interpreted and hopper and not wide and dtype in EIGHT_BIT_DTYPES and groups == 1 and group_rows >= 128:
        # 8-bit long queries: half the bytes per tile, so 128 x 128 tiles of 4 warps (H100 sweep, benchmarks/NOTES.md
        # "8-bit corpora"); 3 stages let three programs share an SM (168 registers, 66 KB each), one's epilogue
        # under another's products (benchmarks/NOTES.md "8-bit epilogue": ColPali fp8 0.367 -> 0.311 ms).
        group_rows, block_n, warps, stages = 128, 128, 4, 3
    elif not interpreted and hopper and not wide and dtype in EIGHT_BIT_DTYPES and groups > 1:
        # 8-bit stacked short queries: 128 stacked rows against 128-token tiles, 4 warps, 2 persistent programs per
        # SM with no register cap (H100 sweep, benchmarks/NOTES.md "8-bit corpora": multi long-doc int8 0.741 ->
        # 0.415 ms, fp8 0.678 -> 0.364; the fp16 stacked tiles spill at 8 bits).
        groups = max(1, min(128 // group_rows, groups))
        block_n, warps, stages, programs_per_sm, max_registers = 128, 4, 4, 2, 0
    elif not interpreted and hopper and not wide and dtype in EIGHT_BIT_DTYPES and groups == 1 and not per_query \
            and q_len <= 64:
        # One short 8-bit query streams the corpus (memory-bound): persistent programs with 128-token tiles
        # (H100 sweep, benchmarks/NOTES.md "8-bit corpora"). int8 keeps its 32-row tile (its mma.sync is native);
        # float8 takes 64 rows, the smallest warpgroup product (a 32-row fp8 tile is widened to fp16 products):
        # textual B = 10 000 int8 0.157 -> 0.148 ms, fp8 0.202 -> 0.151. With the scales loaded a tile ahead,
        # int8 gains from three programs of 3 stages where it took four of 4 (0.148 -> 0.144 ms; benchmarks/NOTES.md
        # "scales one tile ahead"). Short int8 documents stream best in 64-token tiles of 2 warps, six programs per
        # SM (H200, CUDA graph replays: textual B = 10 000 0.1076 -> 0.1044 ms, B = 1 000 0.0212 -> 0.0209; long
        # documents lose with them, long-doc B = 1 000 0.0477 -> 0.0502; benchmarks/NOTES.md "Short int8 documents").
        if dtype == torch.int8 and group_rows <= 32:
            block_n, warps, stages, programs_per_sm = (128, 4, 3, 3) if long_docs else (64, 2, 3, 6)
        elif dtype == torch.float8_e4m3fn:
            group_rows, block_n, warps, stages, programs_per_sm = 64, 128, 4, 3, 3
    return MaxSimForwardConfig(group_rows, groups, block_n, block_k, warps, stages, programs_per_sm, max_registers)


def _group_rows(q_len: int, n_queries: int, max_rows: int, per_query: bool) -> int:
    """Rows per query group: the power-of-two bucket of ``Lq`` (at least 16, the smallest tensor-core tile),
    capped. Single-token queries against shared documents stack one row each instead (a group of 16 would
    compute 15 dead rows per query); this is how a ragged query set is scored row by row (per-row maxima,
    summed per query afterwards: ``lik.integrations.colpali``)."""
    if q_len == 1 and n_queries > 1 and not per_query:
        return 1
    return min(max(16, next_power_of_2(q_len)), max_rows)


def _stacked_groups(q_len: int, n_queries: int, group_rows: int, max_rows: int, per_query: bool) -> int:
    """Row groups per program: several short queries stacked against one document tile (shared documents).

    Tiles of 256 rows or more are halved where that cuts the padded rows by a quarter (320 rows: 384 in 128-row
    tiles instead of 512 in 256-row ones); row blocks of one document run side by side, so its tiles come from L2
    for all but the first."""
    if per_query:
        return 1
    n_groups_total = n_queries * -(-q_len // group_rows)
    groups = max(1, min(max_rows // group_rows, next_power_of_2(n_groups_total)))
    rows = n_groups_total * group_rows
    tile = groups * group_rows
    if tile >= 256 and groups > 1 and 4 * cdiv(rows, tile // 2) * (tile // 2) <= 3 * cdiv(rows, tile) * tile:
        groups //= 2
    return groups


# Shared memory the streamed loop uses outside its pipeline stages (the row-wise reductions' scratch and the
# compiler's own), kept free when stages are counted.
STREAMED_FIXED_BYTES = 16 << 10


def _streamed_forward_tiles(q_len, n_queries, dim, dtype, per_query, arch, interpreted, smem):
    """Tiles of the streamed-k loop (``dim > MAX_RESIDENT_DIM``): a GEMM's tiles, sized against the device.

    Tall row blocks (long or stacked queries) are compute-bound like a GEMM: 128 x 256 tiles of 64-byte-deep
    chunks (64 wide at 16 bits), each tile's chunks in a pipelined loop of its own (``flat_k=False``: the
    tensor-core products overlap, where the flat loop waits for each), 3 stages. One short query takes 64-token
    tiles of 128-wide chunks in the flat loop (memory-bound: fewer, longer copies, no pipeline refill per tile)
    and leaves room for two programs per SM. Stages: as many as the device's shared memory holds (at most 4, at
    least 2), and where even 2 do not fit the chunk is halved."""
    element = 4 if dtype == torch.float32 else 2
    if interpreted:
        group_rows = _group_rows(q_len, n_queries, 32, per_query)
        groups = _stacked_groups(q_len, n_queries, group_rows, 32, per_query)
        return MaxSimForwardConfig(group_rows, groups, 16, 64, 4, 1)
    hopper = arch >= (9, 0)
    max_rows = 128 if hopper else 64
    group_rows = _group_rows(q_len, n_queries, max_rows, per_query)
    groups = _stacked_groups(q_len, n_queries, group_rows, max_rows, per_query)
    block_m = group_rows * groups
    tall = block_m >= 128
    block_n = 256 if tall else 64
    block_k = (64 if tall else 128) * 2 // element
    programs = 1 if tall else 2
    max_stages = 3 if tall else 4
    limit = smem or shared_memory_limit(torch.device("cpu"), arch)
    while True:
        stage_bytes = (block_m + block_n) * block_k * element
        stages = pipeline_stages(stage_bytes, limit=limit, fixed_bytes=STREAMED_FIXED_BYTES, programs_per_sm=programs,
                                 max_stages=max_stages)
        if programs * (stages * stage_bytes + STREAMED_FIXED_BYTES) <= limit or block_k <= 16:
            break
        if programs > 1:
            programs = 1
        else:
            block_k //= 2
    warps = warps_for_tile(block_m, block_n)
    return MaxSimForwardConfig(group_rows, groups, block_n, block_k, warps, stages, flat_k=not tall)


def maxsim_forward_doc_programs(
    cfg: MaxSimForwardConfig, *, n_row_blocks: int, n_docs: int, device: torch.device
) -> int:
    """Programs per row block of the forward launch: one per document, or, for a persistent launch, as many as
    give every SM up to ``cfg.programs_per_sm`` programs in one wave (each then loops over ``n_docs / result``
    documents; rounding up would start a second, partial wave)."""
    if cfg.programs_per_sm <= 0:
        return n_docs
    return max(1, min(n_docs, cfg.programs_per_sm * _device.sm_count(device) // n_row_blocks))


def maxsim_backward_config(*, dim: int, dtype: torch.dtype, device: torch.device) -> MaxSimBackwardConfig:
    forced = FORCED.get("maxsim_backward")
    if forced is not None:
        return forced
    return _maxsim_backward_heuristic(max(16, next_power_of_2(dim)), _device.interpreting())


@functools.lru_cache(maxsize=64)
def _maxsim_backward_heuristic(block_d: int, interpreted: bool) -> MaxSimBackwardConfig:
    if interpreted:
        return MaxSimBackwardConfig(block_rows=16, block_k=block_d)
    return MaxSimBackwardConfig(block_rows=32, block_k=min(block_d, 128), num_warps=4, num_stages=1, dq_docs=2)



def maxsim_varlen_config(
    *, q_len: int, n_queries: int, dim: int, dtype: torch.dtype, pairs: bool, device: torch.device
) -> MaxSimForwardConfig:
    """Forward tiles of the packed kernels (``pairs``: one query per document, ``q_len`` its longest query).

    The padded heuristic's row groups, with other document tiles where the H200 sweep of
    the packed benchmark (``lik bench --ops packed``) measured them (fp16, d = 128, 32-row blocks): 128-token tiles
    for a corpus (fewer sequential steps on its longest documents), 32-token tiles for pairs (smaller CTAs, more of them
    resident), 4 warps for both.
    """
    forced = FORCED.get("maxsim_varlen")
    if forced is not None:
        return replace(forced, groups=1) if pairs else forced
    cfg = maxsim_forward_config(
        q_len=q_len, n_queries=n_queries, dim=dim, dtype=dtype, per_query=pairs, device=device
    )
    if _device.interpreting() or "maxsim_forward" in FORCED:
        return cfg
    return _varlen_tiles(cfg, dtype, dim, pairs)


@functools.lru_cache(maxsize=256)
def _varlen_tiles(cfg: MaxSimForwardConfig, dtype: torch.dtype, dim: int, pairs: bool) -> MaxSimForwardConfig:
    # Cached: a packed call is launch-bound, and building a dataclass per call is host time.
    # Up to 128 stacked fp16 / bf16 rows of a corpus keep the padded heuristic's tiles and persistent launch (the
    # packed launcher takes it in inference; H100: -12 to -22%, benchmarks/NOTES.md "A persistent launch for packed
    # corpora"). 256-row tiles have a program per document: under their 128-register cap the packed persistent loop
    # spills (offline ptxas for sm_90) and ran up to 22% slower. So do other packed launches.
    measured = dtype in (torch.float16, torch.bfloat16) and dim <= 128 and cfg.block_m <= 32
    if not measured:
        stacked = not pairs and 1 < cfg.groups and cfg.block_m <= 128 and dtype in (torch.float16, torch.bfloat16)
        return cfg if stacked else replace(cfg, programs_per_sm=0)
    return replace(cfg, block_n=32 if pairs else 128, num_warps=4, num_stages=3, programs_per_sm=0)



register("maxsim_forward", MaxSimForwardConfig)
register("maxsim_varlen", MaxSimForwardConfig)
register("maxsim_backward", MaxSimBackwardConfig)


@dataclass(frozen=True)
class MaxSimSoftConfig:
    """Tiles of the soft reductions' kernels (:mod:`lik.core.soft`): query rows per tile, document tokens per
    tile, the feature chunk (``block_k``; the backward's output is written in feature blocks of that width)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    dq_splits: int = 0  # document ranges per dQ row block (0: enough programs for the device)


register("maxsim_soft", MaxSimSoftConfig)


def maxsim_soft_config(*, dim: int, dtype: torch.dtype, device: torch.device, q_len: int = 64) -> MaxSimSoftConfig:
    """The soft reductions' tiles: query rows the power-of-two bucket of ``Lq`` up to 64 (ColBERT's 32-token queries
    waste no rows), 64-token tiles and the whole width up to 128 features (one chunk), 64-wide chunks beyond (a
    first choice, not tuned on a device yet); 16 x 16 under the interpreter."""
    forced = FORCED.get("maxsim_soft")
    if forced is not None:
        return forced
    return _soft_heuristic(max(16, next_power_of_2(dim)), dtype, min(64, max(16, next_power_of_2(q_len))),
                           _device.interpreting())


@functools.lru_cache(maxsize=256)
def _soft_heuristic(block_d: int, dtype: torch.dtype, block_m: int, interpreted: bool) -> MaxSimSoftConfig:
    if interpreted:
        return MaxSimSoftConfig(block_m=16, block_n=16, block_k=min(block_d, 64))
    block_k = block_d if block_d <= 128 else 64
    return MaxSimSoftConfig(block_m=block_m, block_n=64, block_k=block_k, num_warps=4,
                            num_stages=3 if dtype != torch.float32 else 2)
