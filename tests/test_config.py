"""Launch heuristics: deterministic, bounded, and per architecture."""

from __future__ import annotations

import torch

from lik import _config

heuristic = _config._maxsim_forward_heuristic


def test_hopper_gets_256_row_tiles_older_gpus_128():
    assert heuristic(1024, 1, 128, torch.float16, False, (9, 0), False).block_m == 256
    assert heuristic(1024, 1, 128, torch.float16, False, (8, 0), False).block_m == 128
    fp32 = heuristic(1024, 1, 128, torch.float32, False, (9, 0), False)
    assert (fp32.block_m, fp32.num_stages) == (256, 3)
    assert heuristic(32, 1, 128, torch.float32, False, (9, 0), False).num_stages == 2
    assert heuristic(1024, 1, 128, torch.float32, False, (8, 0), False).block_m == 64
    assert heuristic(1024, 1, 512, torch.float16, False, (9, 0), False).block_m == 64


def test_short_queries_are_stacked_only_for_shared_documents():
    shared = heuristic(32, 32, 128, torch.float16, False, (9, 0), False)
    per_query = heuristic(32, 32, 128, torch.float16, True, (9, 0), False)
    assert (shared.group_rows, shared.groups, shared.num_warps) == (32, 8, 8)
    assert (per_query.group_rows, per_query.groups, per_query.num_warps) == (32, 1, 4)


def test_variants_do_not_depend_on_length_inside_a_bucket():
    configs = {heuristic(q_len, 4, 128, torch.float16, False, (9, 0), False) for q_len in range(17, 33)}
    assert len(configs) == 1
