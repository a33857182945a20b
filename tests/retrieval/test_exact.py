"""lik.search against brute force: score every document with the float64 reference, then rank in plain Python.

Inputs are multiples of 1/4 in [-1, 1] with small ``d`` and ``Lq``, so every product and sum is exact in fp32:
the kernels, the float32 reference and the float64 brute force give the identical scores whatever the chunking,
the expected order (descending score, ties by lower index, NaN last) is exact, and ties are frequent.
Random normalised inputs are checked against float64 with a tolerance separately.
"""

from __future__ import annotations

import math

import pytest
import torch

import lik
from lik.retrieval import exact

from ..ops.maxsim.helpers import rand_problem


@pytest.fixture(params=["kernel", "reference"])
def path(request, monkeypatch):
    """Run a test through the Triton kernels (interpreter on CPU) and through the CPU reference path."""
    if request.param == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    return request.param


@pytest.fixture
def reference_path(monkeypatch):
    """Tests of argument handling and shapes: the reference path keeps them fast under the interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def grid_problem(rng, n_q, l_q, n_docs, l_d, dim, *, masks=True, squeeze=False):
    shape_q = (l_q, dim) if squeeze else (n_q, l_q, dim)
    Q = torch.randint(-4, 5, shape_q, generator=rng).float() / 4
    D = torch.randint(-4, 5, (n_docs, l_d, dim), generator=rng).float() / 4
    if not masks:
        return Q, D, None, None
    return Q, D, torch.rand(shape_q[:-1], generator=rng) > 0.25, torch.rand((n_docs, l_d), generator=rng) > 0.25


def brute_force(Q, D, k, q_mask=None, d_mask=None, mask_mode="exclude"):
    """``(scores, indices)`` as lists of rows, from every document's float64 score and a Python sort."""
    full = lik.maxsim_reference(Q.double(), D.double(), q_mask, d_mask, mask_mode=mask_mode)
    rows = full.unsqueeze(0) if Q.dim() == 2 else full
    expected_scores, expected_indices = [], []
    for row in rows.tolist():
        order = sorted(range(len(row)), key=lambda j: (math.isnan(row[j]), 0 if math.isnan(row[j]) else -row[j], j))
        expected_indices.append(order[:k])
        expected_scores.append([row[j] for j in order[:k]])
    return expected_scores, expected_indices


def assert_same(result, expected):
    scores, indices = result
    expected_scores, expected_indices = expected
    rows = lambda t: (t.unsqueeze(0) if t.dim() == 1 else t).tolist()  # noqa: E731
    assert rows(indices) == expected_indices
    torch.testing.assert_close(
        torch.tensor(rows(scores), dtype=torch.float64), torch.tensor(expected_scores, dtype=torch.float64),
        rtol=0, atol=0, equal_nan=True,
    )


@pytest.mark.parametrize("chunk_size", [1, 3, 7, None])
def test_matches_brute_force_across_chunk_boundaries(rng, path, chunk_size):
    Q, D, q_mask, d_mask = grid_problem(rng, 2, 3, 7, 4, 4)
    scores, indices = lik.search(Q, D, 4, q_mask, d_mask, chunk_size=chunk_size)
    assert scores.shape == (2, 4) and scores.dtype == torch.float32
    assert indices.shape == (2, 4) and indices.dtype == torch.int64
    assert_same((scores, indices), brute_force(Q, D, 4, q_mask, d_mask))


def test_scores_match_float64_reference(rng, path):
    Q, D, q_mask, d_mask = rand_problem(rng, 2, 3, 6, 5, 16)
    scores, indices = lik.search(Q, D, 4, q_mask, d_mask, chunk_size=4)
    reference = lik.maxsim_reference(Q.double(), D.double(), q_mask, d_mask)
    torch.testing.assert_close(scores.double(), reference.gather(1, indices), rtol=1e-5, atol=1e-5)


def test_two_dimensional_query(rng, path):
    Q, D, q_mask, d_mask = grid_problem(rng, 1, 3, 6, 4, 4, squeeze=True)
    scores, indices = lik.search(Q, D, 3, q_mask, d_mask, chunk_size=4)
    assert scores.shape == (3,) and indices.shape == (3,)
    assert_same((scores, indices), brute_force(Q, D, 3, q_mask, d_mask))


@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
def test_masks_with_garbage_in_masked_positions(rng, path, mask_mode):
    Q, D, q_mask, d_mask = grid_problem(rng, 2, 3, 6, 4, 4)
    d_mask[4] = False  # a document with no valid token: scores 0 in exclude mode
    dirty_q = torch.where(q_mask[..., None], Q, float("nan"))
    dirty_d = torch.where(d_mask[..., None], D, float("inf"))
    result = lik.search(dirty_q, dirty_d, 6, q_mask, d_mask, mask_mode=mask_mode, chunk_size=4)
    assert_same(result, brute_force(Q, D, 6, q_mask, d_mask, mask_mode))


@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
def test_empty_side_scores_zero_whatever_the_other_holds(rng, path, mask_mode):
    """Documents without tokens, or queries without tokens: every score is 0, garbage on the other side or not."""
    Q, _, q_mask, _ = grid_problem(rng, 2, 3, 1, 1, 4)
    q_mask[:, 0] = False
    masked_nan = torch.where(q_mask[..., None], Q, float("nan"))
    unmasked_nan = Q.clone()
    unmasked_nan[1, 1] = float("nan")
    tokenless = torch.randn(5, 0, 4, generator=rng)
    expected = brute_force(Q, tokenless, 5, q_mask, mask_mode=mask_mode)
    assert expected == ([[0.0] * 5] * 2, [list(range(5))] * 2)
    assert_same(lik.search(masked_nan, tokenless, 5, q_mask, mask_mode=mask_mode, chunk_size=2), expected)
    assert_same(lik.search(unmasked_nan, tokenless, 5, mask_mode=mask_mode, chunk_size=2), expected)

    _, D, _, d_mask = grid_problem(rng, 1, 1, 5, 4, 4)
    d_mask[:, 1] = False
    dirty_d = torch.where(d_mask[..., None], D, float("inf"))
    no_query_tokens = torch.zeros(2, 0, 4)
    result = lik.search(no_query_tokens, dirty_d, 5, None, d_mask, mask_mode=mask_mode, chunk_size=2)
    assert_same(result, expected)


def test_ties_break_by_lower_index_across_chunks(rng, path):
    Q, D, _, _ = grid_problem(rng, 2, 2, 3, 3, 4, masks=False)
    # Copies of three documents: exact ties that straddle every chunk boundary.
    corpus = D[[0, 1, 2, 0, 1, 0, 2, 1]]
    scores, indices = lik.search(Q, corpus, 8, chunk_size=3)
    for row_scores, row_indices in zip(scores.tolist(), indices.tolist()):
        for a, b, i, j in zip(row_scores, row_scores[1:], row_indices, row_indices[1:]):
            assert a > b or (a == b and i < j)
    assert_same((scores, indices), brute_force(Q, corpus, 8))


def test_nan_scores_rank_last(rng, path):
    Q, D, _, _ = grid_problem(rng, 2, 2, 6, 3, 4, masks=False)
    D[[1, 4], 1, 0] = float("nan")
    scores, indices = lik.search(Q, D, 6, chunk_size=4)
    assert indices[:, -2:].tolist() == [[1, 4], [1, 4]]
    assert scores[:, -2:].isnan().all() and not scores[:, :-2].isnan().any()
    assert_same((scores, indices), brute_force(Q, D, 6))


def test_nan_ranks_below_negative_infinity():
    # float64 runs the reference: -inf and NaN scores from infinite inputs, exactly as specified.
    Q = torch.ones(1, 2, 4, dtype=torch.float64)
    D = torch.ones(5, 3, 4, dtype=torch.float64)
    D[1] = float("-inf")  # every product -inf: score -inf
    D[3, :, 0] = float("nan")
    scores, indices = lik.search(Q, D, 5, chunk_size=2)
    assert indices.tolist() == [[0, 2, 4, 1, 3]]
    assert scores[0, 3] == float("-inf") and scores[0, 4].isnan()


def test_k_edges(rng, reference_path):
    Q, D, q_mask, d_mask = grid_problem(rng, 2, 3, 5, 4, 4)
    scores, indices = lik.search(Q, D, 5, q_mask, d_mask, chunk_size=2)
    assert_same((scores, indices), brute_force(Q, D, 5, q_mask, d_mask))
    scores, indices = lik.search(Q, D, 0, q_mask, d_mask)
    assert scores.shape == (2, 0) and indices.shape == (2, 0) and indices.dtype == torch.int64
    scores, indices = lik.search(Q[0], D, 0)
    assert scores.shape == (0,) and indices.shape == (0,)
    for bad_k in (6, -1):
        with pytest.raises(ValueError, match=r"\bk\b"):
            lik.search(Q, D, bad_k)
    for bad_k in (2.0, True, None):
        with pytest.raises(TypeError, match=r"\bk\b"):
            lik.search(Q, D, bad_k)
    assert lik.search(Q, D, torch.tensor(2))[1].shape == (2, 2)  # any integer-like k


def test_empty_inputs(reference_path):
    scores, indices = lik.search(torch.randn(2, 3, 8), torch.randn(0, 4, 8), 0)
    assert scores.shape == (2, 0) and indices.shape == (2, 0)
    scores, indices = lik.search(torch.randn(0, 3, 8), torch.randn(4, 2, 8), 3)
    assert scores.shape == (0, 3) and indices.shape == (0, 3)


def test_float64_inputs_give_float64_scores(rng):
    Q, D, q_mask, d_mask = rand_problem(rng, 2, 3, 6, 4, 8, dtype=torch.float64)
    scores, indices = lik.search(Q, D, 2, q_mask, d_mask)
    assert scores.dtype == torch.float64
    assert_same((scores, indices), brute_force(Q, D, 2, q_mask, d_mask))


def test_validation_names_the_argument(rng, reference_path):
    Q, D, q_mask, d_mask = grid_problem(rng, 2, 3, 5, 4, 4)
    with pytest.raises(ValueError, match="D"):
        lik.search(Q, torch.randn(5, 4, 7), 1)
    with pytest.raises(ValueError, match="d_mask"):
        lik.search(Q, D, 1, q_mask, d_mask[:, :2])
    with pytest.raises(TypeError, match="D"):
        lik.search(Q, D.double(), 1)
    with pytest.raises(ValueError, match=r"\[B, Ld, d\]"):
        lik.search(Q, torch.randn(2, 5, 4, 4), 1)
    with pytest.raises(ValueError, match="chunk_size"):
        lik.search(Q, D, 1, chunk_size=0)
    with pytest.raises(TypeError, match="chunk_size"):
        lik.search(Q, D, 1, chunk_size=2.5)


def test_scores_chunk_by_chunk(rng, reference_path, monkeypatch):
    """Each chunk scored holds at most chunk_size documents, views of the inputs validated once; the default chunk
    follows the memory budget."""
    seen = []
    real_score = exact.score_canonical

    def recording_score(inputs, **kwargs):
        seen.append(inputs.d.shape[1])
        return real_score(inputs, **kwargs)

    monkeypatch.setattr(exact, "score_canonical", recording_score)
    Q, D, _, _ = grid_problem(rng, 2, 3, 10, 4, 4, masks=False)
    lik.search(Q, D, 3, chunk_size=4)
    assert seen == [4, 4, 2]

    seen.clear()
    lik.search(Q, D, 3)
    assert seen == [10]  # the default budget holds millions of documents' scores
    seen.clear()
    monkeypatch.setattr(exact, "DEFAULT_BUDGET_BYTES", 4 * 2 * exact.BYTES_PER_CANDIDATE)  # 4 documents x 2 queries
    lik.search(Q, D, 3)
    assert seen == [4, 4, 2]


def test_no_gradient(rng, reference_path):
    Q, D, _, _ = grid_problem(rng, 1, 3, 4, 4, 4, masks=False)
    scores, _ = lik.search(Q.requires_grad_(), D, 2)
    assert not scores.requires_grad


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_matches_float64_reference(dtype):
    generator = torch.Generator().manual_seed(0)
    Q = torch.nn.functional.normalize(torch.randn(4, 32, 128, generator=generator), dim=-1).to(dtype)
    D = torch.nn.functional.normalize(torch.randn(3000, 64, 128, generator=generator), dim=-1).to(dtype)
    d_mask = torch.rand(3000, 64, generator=generator) > 0.2
    scores, indices = lik.search(Q.cuda(), D.cuda(), 10, d_mask=d_mask.cuda(), chunk_size=700)
    reference = lik.maxsim_reference(Q.double(), D.double(), d_mask=d_mask)
    torch.testing.assert_close(scores.cpu().double(), reference.gather(1, indices.cpu()), rtol=1e-3, atol=1e-3)
    expected_scores, _ = lik.search(Q.double(), D.double(), 10, d_mask=d_mask)
    torch.testing.assert_close(scores.cpu().double(), expected_scores, rtol=1e-3, atol=1e-3)


def test_validated_once_scored_without_the_public_entry(rng, reference_path, monkeypatch):
    """The arguments are checked once, then every chunk goes to the internal scoring entry: never to the public
    lik.maxsim, which would validate them again per chunk."""
    from lik.ops.maxsim import function, validation

    builds = []
    real_build = validation.MaxSimInputs.build.__func__
    monkeypatch.setattr(validation.MaxSimInputs, "build",
                        classmethod(lambda cls, *a, **kw: builds.append(1) or real_build(cls, *a, **kw)))
    monkeypatch.setattr(function, "maxsim", lambda *a, **kw: pytest.fail("lik.maxsim called per chunk"))
    Q, D, q_mask, d_mask = grid_problem(rng, 2, 3, 10, 4, 4)
    scores, indices = lik.search(Q, D, 3, q_mask, d_mask, chunk_size=3)
    assert builds == [1]
    assert_same((scores, indices), brute_force(Q, D, 3, q_mask, d_mask))


def _rank_by_sorting(scores, k):
    """The order rank() must give, by two stable sorts (descending score with NaN as -inf, then NaN last)."""
    is_nan = scores.isnan()
    by_score = torch.where(is_nan, float("-inf"), scores).sort(dim=-1, descending=True, stable=True).indices
    return by_score.gather(-1, is_nan.gather(-1, by_score).to(torch.uint8).sort(dim=-1, stable=True).indices)[:, :k]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rank_orders_by_score_then_position_with_nan_last(rng, dtype):
    values = torch.tensor([0.0, -0.0, 1.5, -1.5, float("inf"), float("-inf"), float("nan"), 2.0**-140, -(2.0**-140),
                           3.0e38, -3.0e38])
    scores = values[torch.randint(0, values.numel(), (5, 300), generator=rng)].to(dtype)
    for k in (0, 1, 7, 300):
        assert torch.equal(exact.rank(scores, k), _rank_by_sorting(scores, k))
    scores = torch.randn(3, 1000, generator=rng).to(dtype).round(decimals=1)  # frequent ties
    assert torch.equal(exact.rank(scores, 50), _rank_by_sorting(scores, 50))
