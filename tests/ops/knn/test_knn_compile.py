"""Every launch of lik.knn_points compiles for Hopper (sm_90), checked on a CPU-only machine with the recording of
``tests/test_compile_sm90.py`` (the interpreter accepts code the real compiler rejects): launches are recorded
under the sm_90 heuristics and each distinct variant is compiled to a cubin. The running lists live in registers,
so the heuristic's tiles must also build without spilling (a spill moves the inner loop's state to local memory):
Triton's ``cuobjdump`` reads each cubin's stack size."""

from __future__ import annotations

import pytest
import torch

from lik import _config
from lik.config import override
from lik.ops.knn import KnnConfig
from lik.ops.knn.kernel import knn_forward
from tests.test_compile_sm90 import _record_launches, compile_for_sm90


def _knn_workload():
    """Both routes with 1, 8 and 32 slots over the dtypes, the direct route's coordinate loop (norm=1, D = 128),
    and every float32 product precision (the default "highest" takes TF32-split operands)."""
    gen = torch.Generator().manual_seed(6)
    l1, l2 = torch.tensor([70, 3]), torch.tensor([5, 90])

    def clouds(dim, dtype):
        return torch.randn(2, 70, dim, generator=gen).to(dtype), torch.randn(2, 90, dim, generator=gen).to(dtype)

    for dtype, K in ((torch.float32, 1), (torch.float16, 32), (torch.bfloat16, 8)):
        knn_forward(*clouds(3, dtype), l1, l2, K, 2)
    for dtype, K in ((torch.float32, 8), (torch.float32, 32), (torch.float16, 1), (torch.float16, 8),
                     (torch.bfloat16, 32)):
        knn_forward(*clouds(128, dtype), l1, l2, K, 2)
    knn_forward(*clouds(128, torch.float32), l1, l2, 8, 1)
    # The heuristic's other float32 products: one TF32 product ("high"), true float32 (before Ampere).
    for precision, block_m in (("tf32", 64), ("ieee", 32)):
        with override(knn=KnnConfig("products", precision, block_m=block_m, block_n=64, num_warps=8)):
            knn_forward(*clouds(128, torch.float32), l1, l2, 8, 2)


def test_every_knn_launch_compiles_for_sm90_without_spilling(monkeypatch):
    if not _config.interpreting():
        pytest.skip("records launches through Triton's interpreter (TRITON_INTERPRET=1)")
    # Recorded launches write nothing: the products route's re-sort would read garbage indices.
    monkeypatch.setattr("lik.ops.knn.kernel.exact_distances", lambda p1, p2, idx, valid, norm: idx.float() * 0)
    launches = _record_launches(monkeypatch, _knn_workload)
    built = compile_for_sm90(launches)
    spilled = [(b["constants"]["KP"], b["constants"]["WIDTH"], b["constants"]["DOT_PRECISION"], b["constants"]["NORM"],
                b["stack"]) for b in built if b["stack"]]
    assert not spilled, spilled
