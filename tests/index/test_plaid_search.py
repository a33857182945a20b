"""Candidate generation in a compressed lik.Index (each query keeps its own candidates, scored exactly), the automatic
choice of mode, and colbert-ai / fast-plaid directories loaded by lik.Index.load."""

from __future__ import annotations

import pytest
import torch

import lik
from lik.compression import candidates as plaid_candidates
from lik.index import plaid_search

from ..compression.test_colbert_format import _write as write_colbert
from ..compression.test_fast_plaid_format import _write as write_fast_plaid
from .test_plaid import assert_top_k, make_docs, queries, reference_scores, reference_scorer  # noqa: F401

LENGTHS = (5, 3, 7, 1, 4, 9, 2, 6, 3, 8, 1, 5, 4, 7, 2, 6, 3, 5, 2, 4)


@pytest.fixture
def index():
    return lik.Index.build(
        make_docs(2, LENGTHS), codec="plaid", nbits=2, dtype=torch.float32, shard_tokens=30, progress=False
    )


def candidate_lists(index, Q, q_mask, n_probe, n_candidates):
    """Each query's candidates (global ids) by lik.compression.candidates over each segment, as the index sees them."""
    found, first = [[] for _ in range(Q.shape[0])], 0
    for segment in index.segments:
        cu = segment.cu_seqlens.to(torch.int32)
        ids, offsets = plaid_candidates.build_ivf(segment.codes, cu, index.codec.num_centroids)
        got = plaid_candidates.generate_candidates(
            Q,
            q_mask,
            index.codec.centroids,
            ids,
            offsets,
            segment.codes,
            cu,
            n_probe=n_probe,
            n_candidates=n_candidates,
        )
        for row, values in enumerate(got.tolist()):
            found[row] += [first + v for v in values if v >= 0]
        first += segment.num_docs
    return found


def test_every_document_a_candidate_equals_the_exhaustive_scan(index):
    Q = queries(3)
    ref = reference_scores(index.codec, make_docs(2, LENGTHS), Q)
    exhaustive = index.search(Q, 6)
    assert_top_k(*exhaustive, ref, 6)
    every = index.search(Q, 6, n_probe=index.codec.num_centroids, candidates=len(LENGTHS))
    assert [torch.equal(a, b) for a, b in zip(every, exhaustive)] == [True, True]


@pytest.mark.parametrize("n_probe, n_candidates", [(1, 3), (2, 5), (3, 8)])
def test_each_query_keeps_its_own_candidates(index, n_probe, n_candidates):
    Q = queries(5, n=4, lq=3)
    q_mask = torch.ones(4, 3, dtype=torch.bool)
    q_mask[2, 1:] = False
    ref = reference_scores(index.codec, make_docs(2, LENGTHS), Q, q_mask)
    k = 3
    scores, ids = index.search(Q, k, q_mask, n_probe=n_probe, candidates=n_candidates)
    for row, own in enumerate(candidate_lists(index, Q, q_mask, n_probe, n_candidates)):
        masked = torch.full_like(ref[row], float("-inf"))
        masked[own] = ref[row, own]
        order = torch.sort(-masked, stable=True).indices[: min(k, len(own))]
        assert ids[row, : order.numel()].tolist() == order.tolist()
        torch.testing.assert_close(scores[row, : order.numel()].double(), ref[row, order], atol=1e-4, rtol=1e-5)
        assert ids[row, order.numel() :].eq(-1).all() and scores[row, order.numel() :].isneginf().all()


def test_filters_removed_documents_and_ragged_queries(index):
    docs = make_docs(2, LENGTHS)
    Q = queries(7)
    ref = reference_scores(index.codec, docs, Q)
    K = index.codec.num_centroids
    index.remove([0, 5, 11])
    live = [i for i in range(len(docs)) if i not in (0, 5, 11)]
    assert_top_k(*index.search(Q, 5, n_probe=K, candidates=20), ref, 5, live=live)
    wanted = [1, 2, 5, 9, 13, 17]  # 5 is removed
    assert_top_k(*index.search(Q, 4, doc_ids=wanted, n_probe=K, candidates=20), ref, 4, live=[1, 2, 9, 13, 17])
    index.compact()
    assert_top_k(*index.search(Q, 5, n_probe=K, candidates=20), ref, 5, live=live)
    s, i = index.search([Q[0], Q[1, :2]], 3, n_probe=K, candidates=20)
    ref2 = torch.cat([ref[:1], reference_scores(index.codec, docs, Q[1:2, :2])])
    assert_top_k(s, i, ref2, 3, live=live)


def test_fewer_candidates_than_k_pad_with_minus_one(index):
    Q = queries(9, n=2, lq=1)
    scores, ids = index.search(Q, 6, n_probe=1, candidates=6)
    own = candidate_lists(index, Q, None, 1, 6)
    for row in range(2):
        n = len(set(own[row]))
        assert sorted(ids[row, :n].tolist()) == sorted(set(own[row]))[:n] or n >= 6
        assert (ids[row, n:] == -1).all() and scores[row, n:].isneginf().all()
    assert any(len(set(o)) < 6 for o in own)  # the case under test happened


def test_automatic_mode(index, monkeypatch):
    calls = []
    real = plaid_search.search_candidates

    def spy(*args):
        calls.append(args[-2:])
        return real(*args)

    monkeypatch.setattr("lik.index.index.search_candidates", spy)
    Q = queries(11)
    exhaustive = index.search(Q, 4)
    assert calls == []  # 88 tokens: a scan
    monkeypatch.setattr("lik.index.plaid_search.EXHAUSTIVE_TOKENS", 50)
    index.search(Q, 4)
    assert calls == [(min(plaid_search.DEFAULT_N_PROBE, index.codec.num_centroids), plaid_search.DEFAULT_CANDIDATES)]
    index.search(Q, 4, candidates=7)
    assert calls[-1] == (min(8, index.codec.num_centroids), 7)
    everything = index.search(Q, 4, n_probe=10**6)
    assert [torch.equal(a, b) for a, b in zip(everything, exhaustive)] == [True, True]


def test_placements_and_saved_index_search_the_same(index, tmp_path):
    Q = queries(13)
    K = index.codec.num_centroids
    want = index.search(Q, 5, n_probe=2, candidates=6)
    index.save(tmp_path / "ix")
    for placement in ("host", "disk"):
        loaded = lik.Index.load(tmp_path / "ix", placement=placement, chunk_tokens=17)
        got = loaded.search(Q, 5, n_probe=K, candidates=20)
        assert [torch.equal(a, b) for a, b in zip(got, index.search(Q, 5))] == [True, True]
        if placement == "host":  # chunks as the saved shards: the same candidates as in memory
            loaded = lik.Index.load(tmp_path / "ix", placement=placement)
            assert [torch.equal(a, b) for a, b in zip(loaded.search(Q, 5, n_probe=2, candidates=6), want)] == [
                True,
                True,
            ]


@pytest.mark.parametrize("writer", ["colbert", "fast-plaid"])
def test_colbert_and_fast_plaid_directories_load_and_convert(tmp_path, writer):
    directory = tmp_path / writer
    codec, codes = write_colbert(directory) if writer == "colbert" else write_fast_plaid(directory)[:2]
    plaid = lik.compression.load_plaid_index(directory)
    index = lik.Index.load(directory)
    assert len(index) == plaid.doclens.numel() and index.codec.nbits == codec.nbits and index.d == codec.dim
    assert torch.equal(torch.cat([s.codes for s in index.segments]), codes.to(torch.int32))
    docs = list(plaid.codec.decompress(plaid.codes, plaid.residuals).split(plaid.doclens.tolist()))
    Q = torch.randn(2, 3, codec.dim, generator=torch.Generator().manual_seed(1))
    ref = torch.zeros(2, len(docs), dtype=torch.float64)
    for j, doc in enumerate(docs):
        if doc.shape[0]:
            ref[:, j] = (Q.double() @ doc.double().T).amax(-1).sum(-1)
    k = len(docs)
    scores, ids = index.search(Q, k)
    order = torch.sort(-ref, dim=1, stable=True).indices
    assert torch.equal(ids, order)
    torch.testing.assert_close(scores.double(), ref.gather(1, order), atol=2e-3, rtol=1e-3)  # fp16 scoring
    both = index.search(Q, 2, n_probe=codec.num_centroids, candidates=k)
    assert torch.equal(both[1], ids[:, :2])
    # Save converts it to a lik index (the source directory is not written); add compresses with its codec.
    index.add([docs[0]], progress=False)
    index.save(tmp_path / "converted")
    loaded = lik.Index.load(tmp_path / "converted")
    assert torch.equal(torch.cat([s.codes for s in loaded.segments])[: codes.numel()], codes.to(torch.int32))
    assert torch.equal(loaded.codec.centroids, plaid.codec.centroids) and len(loaded) == k + 1
    part = lik.Index.load(directory, shard=1, num_shards=2)
    assert part.local_range == (k // 2, k) and sum(s.num_docs for s in part.segments) == k - k // 2


def _rank_main(rank: int, world: int, port: int, path: str, out: str) -> None:
    import os

    import torch.distributed as dist

    from lik.ops.residual import check_residual_inputs, maxsim_residual_reference

    def reference(Q, q_mask, codes, residuals, codec, cu_seqlens):
        inputs = check_residual_inputs(Q, codes, residuals, codec, cu_seqlens, q_mask)
        return inputs.finish(maxsim_residual_reference(inputs))

    plaid_search.score_residual_packed = reference  # a spawned process: the kernel is tested elsewhere
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        index = lik.Index.load(path, shard=rank, num_shards=world, placement="host", device="cpu", chunk_tokens=20)
        Q = queries(17)
        results = {"scan": index.search(Q, 7), "candidates": index.search(Q, 5, n_probe=1, candidates=5)}
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_match_one_process(index, tmp_path):
    import torch.multiprocessing as mp

    from .test_distributed import free_port

    index.remove([4])
    index.save(tmp_path / "ix")
    single = lik.Index.load(tmp_path / "ix", chunk_tokens=20)
    Q = queries(17)
    scan = single.search(Q, 7)
    assert_top_k(
        *scan,
        reference_scores(index.codec, make_docs(2, LENGTHS), Q),
        7,
        live=[i for i in range(len(LENGTHS)) if i != 4],
    )
    mp.spawn(_rank_main, args=(2, free_port(), str(tmp_path / "ix"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert [torch.equal(a, b) for a, b in zip(got["scan"], scan)] == [True, True]
        # Candidates: each rank's own, merged; the best of them are the single process's best over the union.
        scores, ids = got["candidates"]
        assert ids.shape == (3, 5) and (ids != 4).all()
        found = ids >= 0
        ref = reference_scores(index.codec, make_docs(2, LENGTHS), Q).gather(1, ids.clamp(min=0))
        torch.testing.assert_close(scores[found].double(), ref[found], atol=1e-4, rtol=1e-5)
        assert torch.equal(scores, torch.sort(scores, dim=1, descending=True).values)
