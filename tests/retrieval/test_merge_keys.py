"""merge_keys / top_keys: a chunk's best keys cut per block in the key kernel, then merged by one program a row, equal
``torch.topk`` of every candidate's key (the search order: descending score, NaN last, ties and -0.0 to the lower id)
for any k up to FUSED_K, ragged last blocks, positions, the best so far, strided scores, rows wider than one program
(``torch.topk`` then), and the fallback past FUSED_K. Blocks are shrunk to 64 candidates so that the interpreter runs
several per row in a few seconds."""

from __future__ import annotations

import pytest
import torch

from lik._device import interpreting
from lik.retrieval import keys as K

VALUES = torch.tensor([0.0, -0.0, 1.5, -1.5, float("inf"), float("-inf"), float("nan"), 1.0, 1.0 + 2.0**-23])

pytestmark = pytest.mark.skipif(not interpreting(), reason="the kernels run on the CPU under TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(K, "_BLOCK", 64)


def _scores(rows, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ties = VALUES[torch.randint(0, VALUES.numel(), (rows, n), generator=gen)]
    return torch.where(torch.rand(rows, n, generator=gen) < 0.5, ties, torch.randn(rows, n, generator=gen))


def _expected(scores, first_id, ids, best, k):
    keys = K.candidate_keys(scores, first_id, ids)  # the elementwise kernel (its own tests pin its keys)
    keys = keys if best is None else torch.cat([best, keys], dim=1)
    return keys.topk(min(k, keys.shape[1]), dim=1).values


@pytest.mark.parametrize("k, n", [(1, 200), (3, 65), (10, 200), (16, 130), (64, 200)])
def test_fused_merge_equals_topk(k, n):
    scores = _scores(3, n, seed=k + n)
    assert torch.equal(K.merge_keys(scores, 7, None, None, k), _expected(scores, 7, None, None, k))


def test_positions_best_so_far_and_strided_scores():
    scores = _scores(2, 300, seed=1)
    ids = torch.sort(torch.randperm(1000, generator=torch.Generator().manual_seed(2))[:300]).values
    best = K.merge_keys(_scores(2, 90, seed=3), 2000, None, None, 5)
    got = K.merge_keys(scores, 2**31 + 5, ids, best, 5)
    assert torch.equal(got, _expected(scores, 2**31 + 5, ids, best, 5))
    wide = torch.zeros(2, 600)
    wide[:, ::2] = scores
    assert torch.equal(K.merge_keys(wide[:, ::2], 0, None, None, 9), _expected(scores, 0, None, None, 9))
    # fewer candidates than k in all: every one comes back, in order
    assert torch.equal(K.merge_keys(scores[:, :3], 0, None, best, 10), _expected(scores[:, :3], 0, None, best, 10))


def test_all_nan_rows_and_one_query():
    scores = torch.full((1, 150), float("nan"))
    got = K.merge_keys(scores, 0, None, None, 4)
    assert torch.equal(K.decode_keys(got)[1], torch.tensor([[0, 1, 2, 3]]))
    assert torch.equal(got, _expected(scores, 0, None, None, 4))


def test_fallbacks(monkeypatch):
    scores = _scores(2, 200, seed=4)
    # past FUSED_K: every key, one torch.topk
    assert torch.equal(K.merge_keys(scores, 0, None, None, 65), _expected(scores, 0, None, None, 65))
    # a row wider than one program: top_keys hands it to torch.topk
    monkeypatch.setattr(K, "ROW_WIDTH", 16)
    assert torch.equal(K.merge_keys(scores, 0, None, None, 3), _expected(scores, 0, None, None, 3))
    # no query, no candidate
    assert K.merge_keys(torch.zeros(0, 200), 0, None, None, 3).shape == (0, 3)
    assert K.merge_keys(torch.zeros(2, 0), 0, None, None, 0).shape == (2, 0)


def test_the_fused_path_launches_no_topk(monkeypatch):
    # The point of the two kernels: no torch.topk of the chunk's keys (a dozen launches on a GPU).
    calls = []
    original = torch.Tensor.topk
    monkeypatch.setattr(
        torch.Tensor, "topk", lambda self, *a, **kw: calls.append(self.shape) or original(self, *a, **kw)
    )
    K.merge_keys(_scores(2, 200), 0, None, None, 10)
    assert calls == []


def test_sort_fallback_of_older_triton(monkeypatch):
    # Triton without tl.topk: blocks sorted whole, their first K kept.
    monkeypatch.setattr(K, "_HAS_TOPK", False)
    scores = _scores(2, 130, seed=5)
    assert torch.equal(K.merge_keys(scores, 3, None, None, 6), _expected(scores, 3, None, None, 6))


@pytest.mark.parametrize("k", [3, 65])
@pytest.mark.parametrize("nan", [False, True])
def test_decode_in_the_merge(k, nan):
    # A search's last merge returns scores and ids (read from the keys in the same launch on the fused path).
    scores, earlier = _scores(2, 200, seed=6), _scores(2, 50, seed=7)
    if nan:  # NaN decoded as NaN, after every number, ties to the lower id
        scores, earlier = torch.full((2, 200), float("nan")), torch.full((2, 50), float("nan"))
        scores[:, 150] = -1.0
    best = K.merge_keys(earlier, 500, None, None, 4)
    got_scores, got_ids = K.merge_keys(scores, 3, None, best, k, decode=True)
    want_scores, want_ids = K.decode_keys(_expected(scores, 3, None, best, k))
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_scores.nan_to_num(7.0), want_scores.nan_to_num(7.0))
    assert got_scores.dtype == torch.float32 and got_ids.dtype == torch.int64
    if nan:
        assert got_scores[:, 0].tolist() == [-1.0, -1.0] and got_scores[:, 1:].isnan().all()
        assert got_ids[0, :3].tolist() == [153, 3, 4]
