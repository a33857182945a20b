"""Launch heuristics: deterministic, bounded, per architecture, and forced by ``lik.config.override``."""

from __future__ import annotations

import pytest
import torch

import lik
from lik import _device
from lik import config as _config
from lik.config import maxsim as maxsim_config
from lik.core import budget
from lik.core.budget import SHARED_MEMORY_BY_ARCH

heuristic = maxsim_config._maxsim_forward_heuristic


def test_hopper_gets_256_row_tiles_older_gpus_128():
    assert heuristic(1024, 1, 128, torch.float16, False, (9, 0), False).block_m == 256
    assert heuristic(1024, 1, 128, torch.float16, False, (8, 0), False).block_m == 128
    fp32 = heuristic(1024, 1, 128, torch.float32, False, (9, 0), False)
    assert (fp32.block_m, fp32.num_stages, fp32.programs_per_sm) == (256, 3, 1)
    assert heuristic(32, 1, 128, torch.float32, False, (9, 0), False).num_stages == 2
    assert heuristic(1024, 1, 128, torch.float32, False, (8, 0), False).block_m == 64
    # wider than MAX_RESIDENT_DIM: the streamed-k tiles (a GEMM's 128 x 128 on Hopper, 64 rows before)
    assert heuristic(1024, 1, 512, torch.float16, False, (9, 0), False).block_m == 128
    assert heuristic(1024, 1, 512, torch.float16, False, (8, 0), False).block_m == 64


def test_short_queries_are_stacked_only_for_shared_documents():
    shared = heuristic(32, 32, 128, torch.float16, False, (9, 0), False)
    per_query = heuristic(32, 32, 128, torch.float16, True, (9, 0), False)
    assert (shared.group_rows, shared.groups, shared.num_warps) == (32, 8, 8)
    assert (per_query.group_rows, per_query.groups, per_query.num_warps) == (32, 1, 4)


def test_single_token_queries_stack_one_row_each():
    rows = heuristic(1, 2560, 128, torch.float16, False, (9, 0), False)
    assert (rows.group_rows, rows.block_m) == (1, 256)
    assert heuristic(1, 1, 128, torch.float16, False, (9, 0), False).group_rows == 16  # one query: a tile of 16
    assert heuristic(1, 8, 128, torch.float16, True, (9, 0), False).group_rows == 16  # per-query documents
    assert heuristic(1, 64, 512, torch.float16, False, (9, 0), False).block_m == 64  # streamed widths too
    assert heuristic(1, 64, 128, torch.int8, False, (9, 0), False).block_m == 64
    assert heuristic(1, 300, 128, torch.int8, False, (9, 0), False).block_m == 128


def test_one_short_8bit_query_streams_the_corpus_persistently():
    """A single short 8-bit query is memory-bound: persistent programs of 3 stages. float8 takes the 64-row
    warpgroup product (a narrower fp8 tile would be widened to fp16 products) against 128-token tiles, three
    programs per SM; int8 keeps its 32-row tile, against 128-token tiles of 4 warps (three programs per SM) for long
    documents and 64-token tiles of 2 warps (six per SM) for short ones."""
    int8 = heuristic(32, 1, 128, torch.int8, False, (9, 0), False, True)
    short_int8 = heuristic(32, 1, 128, torch.int8, False, (9, 0), False, False)
    fp8 = heuristic(32, 1, 128, torch.float8_e4m3fn, False, (9, 0), False)
    assert (int8.group_rows, int8.groups, int8.block_n, int8.programs_per_sm, int8.num_stages, int8.num_warps) == \
        (32, 1, 128, 3, 3, 4)
    assert (short_int8.group_rows, short_int8.groups, short_int8.block_n, short_int8.programs_per_sm,
            short_int8.num_stages, short_int8.num_warps) == (32, 1, 64, 6, 3, 2)
    assert (fp8.group_rows, fp8.groups, fp8.block_n, fp8.programs_per_sm, fp8.num_stages) == (64, 1, 128, 3, 3)
    assert heuristic(32, 1, 128, torch.float8_e4m3fn, False, (9, 0), False, True) == fp8  # one tile for any length
    assert heuristic(64, 1, 128, torch.float8_e4m3fn, False, (9, 0), False).group_rows == 64
    # per-query documents, long queries, before Hopper and stacked queries keep their own tiles
    assert heuristic(32, 1, 128, torch.int8, True, (9, 0), False).programs_per_sm == 0
    assert heuristic(32, 1, 128, torch.int8, False, (8, 0), False).programs_per_sm == 0
    assert heuristic(1024, 1, 128, torch.float8_e4m3fn, False, (9, 0), False).group_rows == 128
    assert heuristic(32, 32, 128, torch.int8, False, (9, 0), False).groups > 1


def test_stacked_tiles_halve_where_that_cuts_a_quarter_of_the_padded_rows():
    def rows(q_len, n_queries, dtype=torch.float16):
        return heuristic(q_len, n_queries, 128, dtype, False, (9, 0), False).block_m

    assert rows(1, 320) == 128  # 384 rows computed instead of 512
    assert rows(32, 10) == 128  # ten stacked 32-token queries: the same 320 rows
    assert rows(1, 257) == rows(1, 384) == 128
    assert rows(1, 256) == rows(1, 385) == rows(1, 2560) == 256  # no padding, or 640 against 768 rows
    assert rows(32, 32) == rows(1, 200) == 256
    assert rows(1, 320, torch.float32) == 128
    assert heuristic(32, 10, 128, torch.float16, True, (9, 0), False).block_m == 32  # per-query: never stacked


def test_persistent_launch_for_stacked_short_queries_and_fp32_long_queries():
    stacked = heuristic(32, 32, 128, torch.float16, False, (9, 0), False)
    single = heuristic(32, 1, 128, torch.float16, False, (9, 0), False)
    single_long_docs = heuristic(32, 1, 128, torch.float16, False, (9, 0), False, True)
    long_query = heuristic(1024, 1, 128, torch.float16, False, (9, 0), False)
    assert stacked.programs_per_sm == 2
    assert single.programs_per_sm == long_query.programs_per_sm == 0
    assert (single.block_n, single.num_stages) == (64, 3)
    assert (single_long_docs.block_n, single_long_docs.num_stages) == (128, 4)
    cuda_like = dict(q_len=32, n_queries=1, dim=128, dtype=torch.float16, per_query=False, device=torch.device("cpu"))
    assert _config.maxsim_forward_config(**cuda_like, doc_len=_config.LONG_DOCUMENT - 1) == \
        _config.maxsim_forward_config(**cuda_like, doc_len=1)
    assert heuristic(32, 32, 128, torch.float32, False, (9, 0), False).programs_per_sm == 2
    assert heuristic(32, 32, 128, torch.float32, False, (8, 0), False).programs_per_sm == 0  # unmeasured
    assert heuristic(32, 32, 128, torch.float16, False, (8, 0), False).programs_per_sm == 0
    assert heuristic(32, 1, 128, torch.float32, False, (9, 0), False, True).block_n == 64  # fp32 tiles: 2x smem
    assert heuristic(32, 32, 128, torch.float16, False, (9, 0), True).programs_per_sm == 0
    # fp32 long queries: one persistent program per SM, only where measured (shared documents, inference, Hopper)
    assert heuristic(512, 1, 128, torch.float32, False, (9, 0), False).programs_per_sm == 1
    assert heuristic(1024, 32, 128, torch.float32, False, (9, 0), False).programs_per_sm == 1
    assert heuristic(128, 1, 128, torch.float32, False, (9, 0), False).programs_per_sm == 0
    assert heuristic(1024, 1, 128, torch.float32, True, (9, 0), False).programs_per_sm == 0
    assert heuristic(1024, 1, 128, torch.float32, False, (9, 0), False, False, True).programs_per_sm == 0
    assert heuristic(1024, 1, 128, torch.float32, False, (8, 0), False).programs_per_sm == 0


def test_128_stacked_rows_run_one_uncapped_warpgroup():
    """128 stacked rows (ragged queries scored as rows, a few short queries) take 4 warps with no register cap in
    inference; 256-row tiles, training (winners), fp32 and 64 stacked rows keep their settings."""
    rows = heuristic(1, 325, 128, torch.bfloat16, False, (9, 0), False)  # 325 rows: 128-row tiles
    few = heuristic(32, 4, 128, torch.float16, False, (9, 0), False)
    for cfg in (rows, few):
        assert (cfg.group_rows * cfg.groups, cfg.num_warps, cfg.max_registers, cfg.programs_per_sm) == (128, 4, 0, 2)
    tall = heuristic(32, 32, 128, torch.float16, False, (9, 0), False)
    assert (tall.group_rows * tall.groups, tall.num_warps, tall.max_registers) == (256, 8, 128)
    training = heuristic(32, 4, 128, torch.float16, False, (9, 0), False, False, True)
    assert (training.num_warps, training.max_registers) == (8, 128)
    fp32 = heuristic(32, 4, 128, torch.float32, False, (9, 0), False)
    assert (fp32.num_warps, fp32.max_registers) == (8, 0)
    two = heuristic(32, 2, 128, torch.float16, False, (9, 0), False)
    assert (two.group_rows * two.groups, two.num_warps, two.max_registers) == (64, 4, 128)


def test_packed_corpora_of_up_to_128_stacked_rows_are_persistent(monkeypatch):
    """The packed launch keeps the padded heuristic's persistent programs for 128 stacked fp16 / bf16 rows; 256-row
    tiles, single short queries, pairs and fp32 get a program per document."""
    monkeypatch.setattr(_device, "interpreting", lambda: False)
    monkeypatch.setattr(_device, "arch", lambda device: (9, 0))
    cpu = torch.device("cpu")

    def varlen(q_len, n_queries, dtype=torch.bfloat16, pairs=False):
        return _config.maxsim_varlen_config(q_len=q_len, n_queries=n_queries, dim=128, dtype=dtype, pairs=pairs,
                                            device=cpu)

    rows, few = varlen(1, 325), varlen(32, 4, torch.float16)
    assert (rows.block_m, rows.programs_per_sm) == (128, 2) and (few.block_m, few.programs_per_sm) == (128, 2)
    for cfg in (varlen(1, 2554), varlen(32, 32, torch.float16), varlen(32, 1), varlen(32, 4, pairs=True),
                varlen(32, 4, torch.float32)):
        assert cfg.programs_per_sm == 0


def test_training_forward_of_stacked_short_queries_runs_two_capped_programs_per_sm():
    inference = heuristic(32, 512, 128, torch.float16, False, (9, 0), False)
    training = heuristic(32, 512, 128, torch.bfloat16, False, (9, 0), False, False, True)
    assert (inference.block_m, inference.programs_per_sm, inference.max_registers) == (256, 2, 128)
    # fp32 stacked tiles fill the shared memory of an SM alone: no register cap
    assert heuristic(32, 512, 128, torch.float32, False, (9, 0), False).max_registers == 0
    assert (training.block_m, training.num_warps, training.programs_per_sm, training.max_registers) == (128, 8, 2, 128)
    # one query, long queries, fp32, per-query documents and the interpreter keep the inference tiles
    for args in (
        (32, 1, 128, torch.float16, False, (9, 0), False), (1024, 64, 128, torch.float16, False, (9, 0), False),
        (32, 512, 128, torch.float32, False, (9, 0), False), (32, 512, 128, torch.float16, True, (9, 0), False),
        (32, 512, 128, torch.float16, False, (9, 0), True),
    ):
        assert heuristic(*args, False, True) == heuristic(*args)


def test_persistent_launch_gives_every_sm_its_programs_and_never_more_than_the_documents():
    cfg = _config.MaxSimForwardConfig(32, 8, 64, 128, programs_per_sm=2)
    cpu = torch.device("cpu")  # one SM off CUDA
    assert _config.maxsim_forward_doc_programs(cfg, n_row_blocks=1, n_docs=5, device=cpu) == 2
    assert _config.maxsim_forward_doc_programs(cfg, n_row_blocks=4, n_docs=5, device=cpu) == 1
    assert _config.maxsim_forward_doc_programs(cfg, n_row_blocks=1, n_docs=1, device=cpu) == 1
    # never a second, partial wave: 3 slots on the one SM, 2 row blocks -> 1 program each (2 would need 4 slots)
    three = _config.MaxSimForwardConfig(32, 8, 64, 128, programs_per_sm=3)
    assert _config.maxsim_forward_doc_programs(three, n_row_blocks=2, n_docs=5, device=cpu) == 1
    if torch.cuda.is_available():
        sms = _device.sm_count(torch.device("cuda"))
        got = _config.maxsim_forward_doc_programs(cfg, n_row_blocks=3, n_docs=10**6, device=torch.device("cuda"))
        assert got == 2 * sms // 3
    one_per_doc = _config.MaxSimForwardConfig(32, 8, 64, 128)
    assert _config.maxsim_forward_doc_programs(one_per_doc, n_row_blocks=4, n_docs=7, device=cpu) == 7


def test_variants_do_not_depend_on_length_inside_a_bucket():
    configs = {heuristic(q_len, 4, 128, torch.float16, False, (9, 0), False) for q_len in range(17, 33)}
    assert len(configs) == 1


@pytest.mark.parametrize(
    "dim, points, expected",
    [
        (32, 4, (4, 4, 32, 1)),  # encoder / decoder shape: 4 rows x 4 points x 32 channels, one warp
        (32, 3, (4, 4, 32, 1)),  # P rounds up to a power of two (one masked point slot)
        (32, 8, (2, 8, 32, 1)),
        (256, 4, (1, 4, 128, 1)),  # wide heads: 128-channel blocks over a grid axis
        (128, 16, (1, 16, 128, 4)),  # many points: more warps, never a point loop
        (64, 64, (1, 64, 64, 8)),
    ],
)
def test_msda_tile_holds_every_point_of_a_level(dim, points, expected):
    cpu = torch.device("cpu")
    fwd = _config.msda_forward_config(n_rows=10**6, dim=dim, n_points=points, device=cpu)
    bwd = _config.msda_backward_config(n_rows=10**6, dim=dim, n_points=points, device=cpu)
    rows = expected[0]
    assert (fwd.block_rows, fwd.block_points, fwd.block_d, fwd.num_warps) == expected
    # The backward takes the forward's tile at half its rows (its atomics overlap better).
    assert (bwd.block_rows, bwd.block_points, bwd.block_d, bwd.num_warps) == (max(1, rows // 2), *expected[1:])
    for cfg in (fwd, bwd):
        assert cfg.block_points >= points and not cfg.transpose


@pytest.mark.parametrize("arch", sorted(SHARED_MEMORY_BY_ARCH))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_streamed_tiles_fit_the_shared_memory_of_every_architecture(arch, dtype):
    limit = SHARED_MEMORY_BY_ARCH[arch]
    for dim in (257, 384, 768, 1000, 1024, 2048, 4096, 8192):
        for q_len, n_queries, per_query in ((1024, 1, False), (32, 1, False), (32, 32, False), (32, 4, True)):
            cfg = heuristic(q_len, n_queries, dim, dtype, per_query, arch, False)
            block_k, num_k = _config.feature_chunks(dim, cfg.block_k)
            element = 4 if dtype == torch.float32 else 2
            stage = (cfg.block_m + cfg.block_n) * block_k * element
            assert num_k == -(-dim // block_k) > 1
            assert cfg.num_stages * stage + maxsim_config.STREAMED_FIXED_BYTES <= limit, (dim, q_len, cfg)
            assert cfg.num_stages >= 2 and cfg.num_warps in (4, 8)


def test_streamed_tiles_follow_the_device_limit_given():
    # A smaller device gets fewer stages (or a narrower chunk), never a launch that cannot start.
    big = heuristic(1024, 1, 768, torch.float16, False, (9, 0), False, False, False, 232_448)
    small = heuristic(1024, 1, 768, torch.float16, False, (9, 0), False, False, False, 99_000)
    assert big.num_stages == 3
    assert small.num_stages * (small.block_m + small.block_n) * small.block_k * 2 <= 99_000
    assert (small.num_stages, small.block_k) < (big.num_stages, big.block_k)


def test_long_queries_at_wide_d_take_the_nested_gemm_loop():
    # Compute-bound: 128 x 256 tiles, each tile's chunks pipelined on their own (flat_k False); past d = 256 on
    # Hopper in 16 bits, and at 128 < d <= 256 for the training forward (the resident query block below that,
    # and for short queries).
    for dim, argmax in ((256, True), (384, False), (768, False), (4096, False)):
        cfg = heuristic(1024, 1, dim, torch.float16, False, (9, 0), False, False, argmax, 232_448)
        assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.flat_k) == (128, 256, 64, False)
        assert cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k * 2 <= 232_448


def test_long_queries_at_d_up_to_256_keep_the_whole_depth_resident():
    # Scoring a long query at 128 < d <= 256: 128 resident rows against 64-token tiles of the full depth,
    # 3 stages; where the device's shared memory cannot hold them, the streamed tiles.
    for dim in (200, 256):
        cfg = heuristic(1024, 1, dim, torch.float16, False, (9, 0), False, False, False, 232_448)
        assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages) == (128, 64, 256, 8, 3)
        assert _config.feature_chunks(dim, cfg.block_k) == (256, 1)
    small = heuristic(1024, 1, 256, torch.float16, False, (9, 0), False, False, False, 99_000)
    assert _config.feature_chunks(256, small.block_k)[1] > 1 and not small.flat_k
    resident = heuristic(1024, 1, 128, torch.float16, False, (9, 0), False, False, False, 232_448)
    assert resident.block_k == 128
    short = heuristic(32, 1, 768, torch.float16, False, (9, 0), False, False, False, 232_448)
    assert short.flat_k and short.block_n == 64
    short_256 = heuristic(32, 1, 256, torch.float16, False, (9, 0), False, False, False, 232_448)
    assert short_256.block_k == 256  # resident


def test_budget_helpers():
    assert budget.pipeline_stages(32 << 10, limit=232_448, fixed_bytes=16 << 10) == 4
    assert budget.pipeline_stages(32 << 10, limit=101_376, fixed_bytes=16 << 10) == 2
    assert budget.pipeline_stages(32 << 10, limit=232_448, programs_per_sm=2, max_stages=8) == 3
    assert budget.warps_for_tile(128, 128) == 8 and budget.warps_for_tile(32, 64) == 4
    assert budget.shared_memory_limit(torch.device("cpu"), (9, 0)) == 232_448
    assert budget.shared_memory_limit(torch.device("cpu"), (8, 8)) == 101_376  # unknown minor: smallest of sm_8x
    assert budget.shared_memory_limit(torch.device("cpu"), (0, 0)) == budget.UNLIMITED_SHARED_MEMORY


def test_nearest_routes_by_width_and_norm():
    cpu = torch.device("cpu")
    assert _config.nearest_config(dim=3, norm=1, device=cpu).route == "direct"
    assert _config.nearest_config(dim=512, norm=1, device=cpu).route == "direct"
    assert _config.nearest_config(dim=3, norm=2, device=cpu).route == "direct"
    assert _config.nearest_config(dim=_config.NEAREST_POINT_MAX_DIM + 1, norm=2, device=cpu).route == "core"
    # No TF32 tensor cores (the CPU, the interpreter): true float32 products.
    assert _config.nearest_config(dim=128, norm=2, device=cpu).precision == "ieee"
    forced = _config.NearestConfig("direct", block_m=32)
    with _config.override(nearest=forced):
        assert _config.nearest_config(dim=128, norm=2, device=cpu) is forced


def test_override_forces_each_heuristic_inside_the_block_only_and_nests():
    cpu = torch.device("cpu")
    args = dict(q_len=32, n_queries=4, dim=64, dtype=torch.float16, per_query=False, device=cpu)
    chosen = _config.maxsim_forward_config(**args)
    outer = _config.MaxSimForwardConfig(16, 2, 16, 64)
    inner = _config.MaxSimForwardConfig(32, 1, 32, 64)
    backward = _config.MaxSimBackwardConfig(block_rows=16, block_k=64)
    with _config.override(maxsim_forward=outer):
        assert _config.maxsim_forward_config(**args) is outer
        # per-query documents are never stacked: the forced tile is taken one group at a time
        per_query = _config.maxsim_forward_config(**{**args, "per_query": True})
        assert per_query == _config.MaxSimForwardConfig(16, 1, 16, 64)
        with _config.override(maxsim_forward=inner, maxsim_backward=backward):
            assert _config.maxsim_forward_config(**args) is inner
            assert _config.maxsim_backward_config(dim=64, dtype=torch.float16, device=cpu) is backward
            assert _config.forced("maxsim_backward") is backward
        assert _config.maxsim_forward_config(**args) is outer and _config.forced("maxsim_backward") is None
    assert _config.maxsim_forward_config(**args) == chosen and _config.forced("maxsim_forward") is None


def test_override_refuses_unknown_keys_and_values_of_another_kind():
    forward = _config.MaxSimForwardConfig(16, 1, 16, 64)
    with pytest.raises(ValueError, match="maxsim_fwd"):
        with _config.override(maxsim_fwd=forward):
            pass
    with pytest.raises(TypeError, match="maxsim_backward must be a MaxSimBackwardConfig"):
        with _config.override(maxsim_backward=forward):
            pass
    assert _config.forced("maxsim_fwd") is None and _config.forced("maxsim_backward") is None


def test_override_is_restored_when_the_block_raises():
    forced = _config.NearestConfig("dot")
    with pytest.raises(RuntimeError):
        with _config.override(nearest=forced):
            raise RuntimeError("inside")
    assert _config.forced("nearest") is None


def test_the_former_module_path_forces_the_same_registry():
    """``lik._config.override`` (the path older code uses) is the same override as ``lik.config.override``."""
    from lik import _config as former

    forced = _config.NearestConfig("direct", block_m=32)
    with former.override(nearest=forced):
        assert _config.nearest_config(dim=128, norm=2, device=torch.device("cpu")) is forced
    assert former.MaxSimForwardConfig is _config.MaxSimForwardConfig and lik.config is _config


def test_device_queries_off_cuda():
    cpu = torch.device("cpu")
    assert _device.arch(cpu) == (0, 0) and _device.sm_count(cpu) == 1
    assert _device.shared_memory(cpu) == budget.UNLIMITED_SHARED_MEMORY
    assert [_device.next_power_of_2(n) for n in (0, 1, 2, 3, 17)] == [1, 1, 2, 4, 32]
    assert _device.cdiv(7, 2) == 4 and _device.cdiv(0, 3) == 0


def test_heuristics_read_the_device_through_the_device_module(monkeypatch):
    """Pretending to be an H100 (what ``test_compile_sm90`` and the warm-up tests do) changes the heuristic's
    answer: it reads the architecture and the interpreter flag through ``lik._device``."""
    cpu = torch.device("cpu")
    args = dict(q_len=1024, n_queries=1, dim=128, dtype=torch.float16, per_query=False, device=cpu)
    monkeypatch.setattr(_device, "interpreting", lambda: False)
    monkeypatch.setattr(_device, "arch", lambda device: (9, 0))
    assert _config.maxsim_forward_config(**args).block_m == 256
    monkeypatch.setattr(_device, "arch", lambda device: (8, 0))
    assert _config.maxsim_forward_config(**args).block_m == 128


def test_pretending_through_the_former_module_reaches_the_heuristics(monkeypatch):
    from lik import _config as former

    cpu = torch.device("cpu")
    args = dict(q_len=1024, n_queries=1, dim=128, dtype=torch.float16, per_query=False, device=cpu)
    monkeypatch.setattr(former, "interpreting", lambda: False)
    monkeypatch.setattr(former, "_arch", lambda device: (9, 0))
    assert _device.arch(cpu) == (9, 0) and _config.maxsim_forward_config(**args).block_m == 256
    monkeypatch.undo()
    assert _device.arch(cpu) == (0, 0) and _device.interpreting() == former.interpreting()
