"""The dot route of lik.nearest_neighbors / lik.chamfer_distance compiles for Hopper (sm_90) without spilling,
checked on a CPU-only machine: its launches are recorded under the sm_90 heuristics (float32 at matmul precision
"high", float16, bfloat16; one direction and both) and each distinct variant is compiled to a cubin, whose stack
size Triton's ``cuobjdump`` reads (a spill would move the tile loop's state to local memory)."""

from __future__ import annotations

import pytest
import torch

from lik import _config
from lik.ops.chamfer.kernel import nearest_indices
from tests.test_compile_sm90 import _record_launches, compile_for_sm90


def _dot_workload():
    gen = torch.Generator().manual_seed(8)
    xl, yl = torch.tensor([70, 3]), torch.tensor([5, 90])
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        for dim, dtype in ((128, torch.float32), (16, torch.float32), (200, torch.float32), (128, torch.float16),
                           (128, torch.bfloat16), (64, torch.float16)):
            x = torch.randn(2, 70, dim, generator=gen).to(dtype)
            y = torch.randn(2, 90, dim, generator=gen).to(dtype)
            assert _config.nearest_config(dim=dim, norm=2, device=torch.device("cuda"), dtype=dtype).route == "dot"
            nearest_indices(x, y, xl, yl, 2)
            nearest_indices(x, y, xl, yl, 2, both_ways=True)
    finally:
        torch.set_float32_matmul_precision(saved)


def test_the_dot_route_compiles_for_sm90_without_spilling(monkeypatch):
    if not _config.interpreting():
        pytest.skip("records launches through Triton's interpreter (TRITON_INTERPRET=1)")
    launches = _record_launches(monkeypatch, _dot_workload)
    built = compile_for_sm90(launches)
    spilled = [(b["constants"]["DIM"], b["constants"]["BOTH_WAYS"], b["stack"]) for b in built if b["stack"]]
    assert not spilled, spilled
