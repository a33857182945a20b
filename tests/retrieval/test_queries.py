"""Queries of different lengths in one search (lik.search and lik.Index.search): a list of ``[Lq_i, d]`` tensors or
packed queries with ``cu_seqlens_q`` give the results of one call per query and of a float64 brute force.

Inputs are multiples of 1/4 with small ``d``, so every score is exact in fp32 and the expected order (descending
score, ties to the lower id) is exact too; ties are frequent."""

from __future__ import annotations

import pytest
import torch

import lik
from lik.index import search as index_search
from lik.retrieval import queries

from ..index.helpers import grid_docs, padded

LENGTHS = (3, 0, 5, 1, 9, 2)  # a zero-length query, a one-token one, 9 > 8 (its own bucket), odd sizes


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(4321)


@pytest.fixture(params=["kernel", "reference"])
def path(request, monkeypatch):
    """The Triton kernels (interpreter on CPU when TRITON_INTERPRET=1) and the CPU reference path."""
    if request.param == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    return request.param


def grid_queries(rng, lengths=LENGTHS, dim=6) -> list[torch.Tensor]:
    return [torch.randint(-4, 5, (n, dim), generator=rng).float() / 4 for n in lengths]


def brute_force(qs, docs, k):
    """float64 scores of every (query, document), ranked in plain Python: descending, ties to the lower id."""
    scores, ids = [], []
    for q in qs:
        row = []
        for doc in docs:
            sim = q.double() @ doc.double().T
            row.append(float(sim.max(dim=1).values.sum()) if sim.numel() else 0.0)
        order = sorted(range(len(docs)), key=lambda j: (-row[j], j))[:k]
        scores.append([row[j] for j in order])
        ids.append(order)
    return torch.tensor(scores, dtype=torch.float64), torch.tensor(ids, dtype=torch.int64)


def assert_exact(result, expected):
    assert result[1].tolist() == expected[1].tolist()
    assert result[0].double().tolist() == expected[0].tolist()


def test_lik_search_ragged_equals_one_call_per_query_and_float64(rng, path):
    docs = grid_docs(rng)
    D, d_mask = padded(docs)
    qs = grid_queries(rng)
    k = len(docs)
    want = brute_force(qs, docs, k)
    got = lik.search(qs, D, k, d_mask=d_mask, chunk_size=3)
    assert got[0].shape == (len(qs), k) and got[0].dtype == torch.float32
    assert_exact(got, want)
    for number, q in enumerate(qs):
        if q.shape[0]:
            one = lik.search(q, D, k, d_mask=d_mask)
            assert torch.equal(one[1], got[1][number]) and torch.equal(one[0], got[0][number])
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    assert_exact(lik.search(torch.cat(qs), D, k, d_mask=d_mask, cu_seqlens_q=cu), want)
    assert_exact(lik.search(torch.cat(qs).double(), D.double(), k, d_mask=d_mask, cu_seqlens_q=cu.long()), want)


def test_one_query_empty_queries_and_no_query(rng):
    docs = grid_docs(rng)
    D, d_mask = padded(docs)
    q = grid_queries(rng, (4,))
    assert_exact(lik.search(q, D, 3, d_mask=d_mask), brute_force(q, docs, 3))
    empty = [torch.zeros(0, 6), torch.zeros(0, 6)]
    scores, ids = lik.search(empty, D, 4, d_mask=d_mask)
    assert scores.tolist() == [[0.0] * 4] * 2 and ids.tolist() == [[0, 1, 2, 3]] * 2
    scores, ids = lik.search(torch.zeros(0, 6), D, 2, d_mask=d_mask, cu_seqlens_q=torch.tensor([0]))
    assert scores.shape == ids.shape == (0, 2)


def test_int8_corpus_ragged_equals_one_call_per_query(rng, path):
    docs = [torch.randn(n, 16, generator=rng) for n in (5, 0, 9, 3, 1, 7)]
    D, d_mask = padded(docs, fill=0.0)
    D_q, d_scale = lik.quantize(D, torch.int8)
    qs = [torch.randn(n, 16, generator=rng) for n in (3, 1, 0, 6)]
    scores, ids = lik.search(qs, D_q, 6, d_mask=d_mask, d_scale=d_scale)
    for number, q in enumerate(qs):
        if q.shape[0]:
            one = lik.search(q, D_q, 6, d_mask=d_mask, d_scale=d_scale)
            assert torch.equal(one[1], ids[number])
            torch.testing.assert_close(one[0], scores[number], rtol=1e-6, atol=1e-6)
    q_q = [lik.quantize(q, torch.int8) for q in qs]  # queries already 8-bit, with their scales
    again = lik.search([q for q, _ in q_q], D_q, 6, d_mask=d_mask, q_scale=[s for _, s in q_q], d_scale=d_scale)
    assert torch.equal(again[1], ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8, torch.float8_e4m3fn])
def test_index_search_ragged_equals_one_call_per_query(rng, monkeypatch, dtype):
    if dtype in (torch.float16, torch.float8_e4m3fn):  # the CPU reference (no fp16 / fp8 dot in the interpreter)
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    docs = [torch.randn(n, 8, generator=rng) for n in (4, 0, 6, 2, 9, 1, 3)]
    index = lik.Index.build(docs, dtype=dtype, chunk_tokens=7, progress=False)
    index.remove([3])
    qs = [torch.randn(n, 8, generator=rng) for n in (2, 0, 5, 1, 3)]
    k = len(index)
    scores, ids = index.search(qs, k)
    assert scores.shape == ids.shape == (len(qs), k) and 3 not in ids.tolist()[0]
    for number, q in enumerate(qs):
        if q.shape[0]:
            one = index.search(q, k)
            assert torch.equal(one[1], ids[number])
            torch.testing.assert_close(one[0], scores[number], rtol=1e-6, atol=1e-6)
        else:
            assert scores[number].tolist() == [0.0] * k and ids[number].tolist() == [0, 1, 2, 4, 5, 6]
    cu = torch.tensor([0, 2, 2, 7, 8, 11])
    packed = index.search(torch.cat(qs), 3, cu_seqlens_q=cu, doc_ids=[0, 2, 3, 5, 6])
    for number, q in enumerate(qs):
        if q.shape[0]:
            assert torch.equal(packed[1][number], index.search(q, 3, doc_ids=[0, 2, 3, 5, 6])[1])


def test_index_search_ragged_exact_against_float64(rng, path, monkeypatch):
    docs = grid_docs(rng)
    qs = grid_queries(rng)
    index = lik.Index.build(docs, dtype=torch.float32, chunk_tokens=1000, progress=False)
    want = brute_force(qs, docs, len(docs))
    assert_exact(index.search(qs, len(docs)), want)
    # A chunk whose [Nq, documents] scores pass the budget is scored in runs of documents.
    monkeypatch.setattr(index_search, "DEFAULT_BUDGET_BYTES", 2 * len(qs) * index_search.BYTES_PER_CANDIDATE)
    assert_exact(index.search(qs, len(docs)), want)
    # ... and its selected documents (removed ones left out, a filter) go run by run.
    index.remove([2, 3, 5])
    alive = [0, 1, 4, 6, 7, 8, 9]
    scores, positions = brute_force(qs, [docs[i] for i in alive], 5)
    assert_exact(index.search(qs, 5), (scores, torch.tensor(alive)[positions]))
    chosen = [1, 6, 7]
    scores, positions = brute_force(qs, [docs[i] for i in chosen], 3)
    assert_exact(index.search(qs, 3, doc_ids=chosen + [2]), (scores, torch.tensor(chosen)[positions]))


def test_bad_ragged_queries_are_named(rng):
    docs = grid_docs(rng)
    D, d_mask = padded(docs)
    index = lik.Index.build(docs, progress=False)
    qs = grid_queries(rng, (2, 3))
    for search in (lambda *a, **kw: lik.search(a[0], D, a[1], **kw), index.search):
        with pytest.raises(ValueError, match="k must be in"):
            search(qs, len(docs) + 1)  # k larger than the corpus
        with pytest.raises(ValueError, match="q_mask"):
            search(qs, 2, q_mask=torch.ones(2, 3, dtype=torch.bool))
        with pytest.raises(ValueError, match=r"Q\[1\]"):
            search([qs[0], torch.zeros(2, 5)], 2)
        with pytest.raises(TypeError, match=r"Q\[0\]"):
            search([[0.0] * 6], 2)
        with pytest.raises(ValueError, match="cu_seqlens_q"):
            search(torch.cat(qs), 2, cu_seqlens_q=torch.tensor([0, 2, 4]))
        with pytest.raises(ValueError, match="cu_seqlens_q"):
            search(torch.cat(qs), 2, cu_seqlens_q=torch.tensor([0, 3, 2, 5]))
        with pytest.raises(ValueError, match="cu_seqlens_q"):
            search(qs, 2, cu_seqlens_q=torch.tensor([0, 2, 5]))
        with pytest.raises(ValueError, match="empty list"):
            search([], 2)


def test_buckets_group_by_the_kernels_row_blocks():
    assert [queries.bucket_length(n) for n in (0, 1, 3, 8, 9, 256, 257, 600)] == [0, 1, 4, 8, 16, 256, 512, 768]
    # Few rows: one launch (the corpus is streamed once); many: one launch per bucket (no padded compute).
    assert queries._merge([1, 32], [1, 1]) == [1]
    assert queries._merge([16, 32], [64, 64]) == [0, 1]
    tokens = torch.arange(4 * 3 * 2, dtype=torch.float32).view(12, 2)
    dense = queries.buckets(queries.RaggedQueries(tokens, [4, 4, 4], None))
    assert len(dense) == 1 and dense[0].mask is None and dense[0].index is None
    assert dense[0].q.data_ptr() == tokens.data_ptr()  # already one dense block: a view
    ragged = queries.buckets(queries.RaggedQueries(tokens[:9], [3, 0, 6], None))
    assert [b.rows for b in ragged] == [[0, 2]] and ragged[0].q.shape == (2, 8, 2)
    assert ragged[0].mask.tolist() == [[True] * 3 + [False] * 5, [True] * 6 + [False] * 2]
    assert torch.equal(ragged[0].q[1, :6], tokens[3:9]) and not ragged[0].q[0, 3:].any()
