"""PyLate's evaluation and rank helpers on what ``retrieve.ColBERT(index=lik.integrations.pylate.Index(...))``
returns: ``pylate.evaluation.evaluate`` (ranx's metrics) gives the values a hand-built collection fixes by
construction, and ``pylate.rank.rerank`` of the index's stored embeddings gives back exact MaxSim."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("pylate.indexes.base")
pytest.importorskip("ranx", reason="pylate.evaluation.evaluate needs ranx (the test extra installs it)")

from pylate import evaluation, rank, retrieve  # noqa: E402

import lik.integrations.pylate as lik_pylate  # noqa: E402

QUERY_DIM = 8  # the queries live in the first 8 coordinates; documents' filler tokens in the other 8
DIM = 2 * QUERY_DIM
METRICS = ["ndcg@10", "mrr@10", "hits@1", "hits@2", "recall@10"]


@pytest.fixture(autouse=True)
def pylate_scores_its_own_way():
    lik_pylate.disable()  # rank.rerank below runs PyLate's own colbert_scores


def unit(n, scale=1.0):
    token = torch.zeros(DIM)
    token[n] = scale
    return token


def hand_built():
    """For each topic ``i < 8``: ``d<i>`` (a token ``e_i``), ``x<i>`` (a token ``e_i / 2``), each with filler tokens
    orthogonal to every query, and query ``i`` (two tokens ``e_i``). So query ``i`` scores ``d<i>`` 2, ``x<i>`` 1
    and every other document 0: its ranking starts ``d<i>``, ``x<i>``."""
    ids, docs = [], []
    for topic in range(QUERY_DIM):
        for name, scale, fillers in (("d", 1.0, topic % 3), ("x", 0.5, 2 - topic % 3)):
            tokens = [unit(topic, scale)] + [unit(QUERY_DIM + (topic + f) % QUERY_DIM) for f in range(fillers)]
            ids.append(f"{name}{topic}")
            docs.append(torch.stack(tokens[::-1] if topic % 2 else tokens))  # the relevant token first or last
    queries = torch.stack([torch.stack([unit(topic), unit(topic)]) for topic in range(QUERY_DIM)])
    return ids, docs, queries


def make(tmp_path, **options):
    return lik_pylate.Index(index_folder=str(tmp_path), index_name="collection", show_progress=False, **options)


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8])
def test_evaluate_gives_the_metrics_fixed_by_construction(tmp_path, dtype):
    ids, docs, queries = hand_built()
    index = make(tmp_path, dtype=dtype).add_documents(ids, docs)
    index.remove_documents(["d3"])  # query 3's relevant document: never retrieved again
    scores = retrieve.ColBERT(index=index).retrieve(queries_embeddings=queries[:5], k=10)
    assert [[hit["id"] for hit in hits[:2]] for hits in scores] == [
        ["d0", "x0"],
        ["d1", "x1"],
        ["d2", "x2"],
        ["x3", "d0"],
        ["d4", "x4"],
    ]  # 0s: by id
    assert [len(hits) for hits in scores] == [10] * 5
    qrels = {
        "q0": {"d0": 1},  # first
        "q1": {"x1": 1},  # second
        "q2": {"d2": 1, "x2": 1},  # both, first and second
        "q3": {"d3": 1},  # removed
        "q4": {"d4": 1, "x4": 2},  # graded, in the wrong order
    }
    got = evaluation.evaluate(scores=scores, qrels=qrels, queries=list(qrels), metrics=METRICS)
    # ranx's "ndcg" is Jarvelin's: gain rel, discount log2(rank + 1) ("ndcg_burges": gain 2**rel - 1).
    ndcg_q4 = (1 + 2 / math.log2(3)) / (2 + 1 / math.log2(3))
    want = {
        "ndcg@10": (1 + 1 / math.log2(3) + 1 + 0 + ndcg_q4) / 5,
        "mrr@10": (1 + 1 / 2 + 1 + 0 + 1) / 5,
        "hits@1": (1 + 0 + 1 + 0 + 1) / 5,  # ranx's hits: relevant documents in the top k, not a rate
        "hits@2": (1 + 1 + 2 + 0 + 2) / 5,
        "recall@10": (1 + 1 + 1 + 0 + 1) / 5,
    }
    assert set(got) == set(want)
    for metric, value in want.items():
        assert float(got[metric]) == pytest.approx(value, rel=1e-12), metric


def test_perfect_retrieval_scores_one_in_every_placement(tmp_path, reference_path):
    ids, docs, queries = hand_built()
    make(tmp_path).add_documents(ids[:9], docs[:9]).add_documents(ids[9:], docs[9:])
    qrels = {f"q{topic}": {f"d{topic}": 1} for topic in range(QUERY_DIM)}
    reopened = make(tmp_path, placement="disk")
    for index in (reopened, make(tmp_path, placement="host")):
        scores = retrieve.ColBERT(index=index).retrieve(queries_embeddings=queries, k=10)
        got = evaluation.evaluate(scores=scores, qrels=qrels, queries=list(qrels), metrics=METRICS[:4])
        assert {metric: float(value) for metric, value in got.items()} == {
            "ndcg@10": 1.0,
            "mrr@10": 1.0,
            "hits@1": 1.0,
            "hits@2": 1.0,
        }
    # The same run, one document relevant that no query finds in its top 2: a computed miss, not a 1.
    missed = dict(qrels, q0={"d5": 1})
    scores = retrieve.ColBERT(index=reopened).retrieve(queries_embeddings=queries, k=2)
    got = evaluation.evaluate(scores=scores, qrels=missed, queries=list(missed), metrics=["ndcg@10", "hits@1"])
    assert float(got["ndcg@10"]) == pytest.approx(7 / 8) and float(got["hits@1"]) == pytest.approx(7 / 8)


def maxsim(query, doc):
    """Exact MaxSim in float64: each query token's best dot product with a token of ``doc``, summed."""
    return float((query.double() @ doc.double().T).max(dim=1).values.sum())


def test_rerank_of_the_stored_embeddings_is_exact_maxsim(tmp_path, reference_path):
    """A reranking of an exact index's candidates changes nothing: ``rank.rerank`` of the retrieved ids, with the
    embeddings ``get_documents_embeddings`` returns, gives back the retrieved scores, which are exact MaxSim."""
    rng = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 10, (30,), generator=rng).tolist()
    # Non-negative multiples of 1/4: exact in fp16 and in fp32 sums, and no similarity below the zeros rerank pads
    # documents with (PyLate's convention), so its padded scores are each document's own.
    docs = [torch.randint(0, 5, (n, DIM), generator=rng).float() / 4 for n in lengths]
    ids = [f"doc-{n}" for n in range(len(docs))]
    queries = [torch.randint(0, 5, (n, DIM), generator=rng).float() / 4 for n in (4, 7, 1)]
    index = make(tmp_path).add_documents(ids, docs)
    retrieved = retrieve.ColBERT(index=index).retrieve(queries_embeddings=queries, k=8)
    for query, hits in zip(queries, retrieved):
        assert [hit["score"] for hit in hits] == [maxsim(query, docs[ids.index(hit["id"])]) for hit in hits]
        others = [maxsim(query, doc) for name, doc in zip(ids, docs) if name not in {hit["id"] for hit in hits}]
        assert max(others) <= hits[-1]["score"]  # the top 8 of all 30
    candidates = [[hit["id"] for hit in hits] for hits in retrieved]
    stored = index.get_documents_embeddings(candidates)
    reranked = rank.rerank(documents_ids=candidates, queries_embeddings=queries, documents_embeddings=stored)
    # torch.sort in rerank does not keep ties in order: compare the scores by rank and the score of each id.
    assert [[hit["score"] for hit in hits] for hits in reranked] == [
        [hit["score"] for hit in hits] for hits in retrieved
    ]
    assert [{hit["id"]: hit["score"] for hit in hits} for hits in reranked] == [
        {hit["id"]: hit["score"] for hit in hits} for hits in retrieved
    ]
    # Candidates in another order, a query's list cut short, one query on its own: still exact MaxSim.
    shuffled = [group[::-1][:5] for group in candidates]
    again = rank.rerank(
        documents_ids=shuffled,
        queries_embeddings=queries,
        documents_embeddings=index.get_documents_embeddings(shuffled),
    )
    for query, group, hits in zip(queries, shuffled, again):
        assert sorted(hit["id"] for hit in hits) == sorted(group)
        assert [hit["score"] for hit in hits] == sorted(
            (maxsim(query, docs[ids.index(name)]) for name in group), reverse=True
        )


def test_rerank_of_signed_embeddings_is_maxsim_with_pylates_zero_padding(tmp_path, reference_path):
    """With similarities below zero, rerank's scores are MaxSim against each document zero-padded to its group's
    longest (PyLate's convention, whatever the index): the stored embeddings come back unpadded, at their own
    length, so the groups pad as the original embeddings do."""
    rng = torch.Generator().manual_seed(9)
    docs = [torch.randint(-4, 5, (n, DIM), generator=rng).float() / 4 for n in (3, 9, 1, 6, 2)]
    ids = ["a", "b", "c", "d", "e"]
    query = torch.randint(-4, 5, (5, DIM), generator=rng).float() / 4
    index = make(tmp_path).add_documents(ids, docs)
    stored = index.get_documents_embeddings([ids])
    assert [t.shape[0] for t in stored[0]] == [3, 9, 1, 6, 2]
    (reranked,) = rank.rerank(documents_ids=[ids], queries_embeddings=query[None], documents_embeddings=stored)
    padded = [torch.cat([doc, torch.zeros(9 - doc.shape[0], DIM)]) for doc in docs]
    assert any(maxsim(query, p) != maxsim(query, doc) for p, doc in zip(padded, docs))  # the padding shows
    assert {hit["id"]: hit["score"] for hit in reranked} == {name: maxsim(query, doc) for name, doc in zip(ids, padded)}
    (exact,) = index(query, k=5)  # the index's own scores: each document at its own length
    assert {hit["id"]: hit["score"] for hit in exact} == {name: maxsim(query, doc) for name, doc in zip(ids, docs)}
