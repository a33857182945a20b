"""merge_keys on the GPU at search sizes: equal to torch.topk of every key (5M tokens' 50 000 documents, 500 000 at
50M, 1 / 32 / 256 queries, k 1 / 10 / 64, NaN and ties), and the time of the fused merge against the key kernel +
torch.topk it replaces (printed: ``pytest -m gpu -s tests/retrieval/test_merge_keys_gpu.py``)."""

from __future__ import annotations

import pytest
import torch

from lik.retrieval import keys as K

pytestmark = pytest.mark.gpu


def _scores(rows, n):
    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    scores = torch.randn(rows, n, device="cuda", generator=gen)
    scores[:, ::97] = float("nan")
    scores[:, 1::89] = 2.5  # ties: the lower id first
    return scores


@pytest.mark.parametrize("rows, n", [(1, 50_000), (32, 50_000), (256, 50_000), (1, 500_000), (3, 1500)])
@pytest.mark.parametrize("k", [1, 10, 64])
def test_fused_merge_equals_topk(rows, n, k):
    scores = _scores(rows, n)
    want = K.candidate_keys(scores, 11).topk(k, dim=1).values
    assert torch.equal(K.merge_keys(scores, 11, None, None, k), want)
    best = want[:, : k // 2]
    positions = torch.arange(0, 2 * n, 2, device="cuda")
    want = torch.cat([best, K.candidate_keys(scores, 11, positions)], dim=1).topk(k, dim=1).values
    assert torch.equal(K.merge_keys(scores, 11, positions, best, k), want)


def test_print_merge_time():
    import triton

    for rows, n in ((1, 50_000), (32, 50_000), (256, 50_000), (1, 500_000)):
        scores = _scores(rows, n)
        fused = triton.testing.do_bench(lambda s=scores: K.merge_keys(s, 0, None, None, 10), return_mode="median")
        keys_topk = triton.testing.do_bench(
            lambda s=scores: K.candidate_keys(s, 0).topk(10, dim=1).values, return_mode="median"
        )
        print(
            f"merge Nq {rows} x {n} docs, k 10: fused {fused * 1e3:.1f} us, keys + torch.topk {keys_topk * 1e3:.1f} us"
        )
        assert fused < keys_topk
