"""The top-k merge's kernels compile for Hopper (sm_90) on a CPU-only machine, both variants (tl.topk and the
tl.sort fallback of a Triton without it), at the widths a search launches: tests/test_compile_sm90.py's recorder and
compiler (with a Triton 3.6 wheel on PYTHONPATH, the device's compiler)."""

from __future__ import annotations

import pytest
import torch

from lik.retrieval import keys as K

sm90 = pytest.importorskip("tests.test_compile_sm90")


def _merge_workload():
    gen = torch.Generator().manual_seed(0)
    for rows, n, k in ((1, 50_000, 10), (1, 500_000, 10), (32, 50_000, 1), (2, 5000, 64), (3, 3000, 16)):
        scores = torch.randn(rows, n, generator=gen)
        best = K.merge_keys(scores, 5, None, None, k)
        K.merge_keys(scores, 2**31, torch.arange(n), best, k)
        K.merge_keys(scores, 0, None, None, k, decode=True)  # a search's last merge, decoded in the launch


@pytest.mark.parametrize("has_topk", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_merge_kernels_compile_for_sm90(monkeypatch, has_topk):
    if not sm90._config.interpreting():
        pytest.skip("records launches through Triton's interpreter (TRITON_INTERPRET=1)")
    if has_topk and not K._HAS_TOPK:
        pytest.skip("this Triton has no tl.topk")
    monkeypatch.setattr(K, "_HAS_TOPK", has_topk)
    built = sm90.compile_for_sm90(sm90._record_launches(monkeypatch, _merge_workload))
    names = {job["name"] for job in built}
    assert any("block_top_keys" in name for name in names) and any("row_top_keys" in name for name in names)
