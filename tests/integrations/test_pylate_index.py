"""lik.integrations.pylate.Index against the real PyLate: ``retrieve.ColBERT(index=...)`` returns the exact MaxSim
top-k (PyLate's own scores, document by document), in the shape PyLate's end-to-end indexes return; the collection
persists and reopens, removal holds through reopening and compaction, a write cut short leaves the collection as
before or after it, and bad input is refused with the argument named."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

indexes_base = pytest.importorskip("pylate.indexes.base")

from pylate import rank, retrieve  # noqa: E402
from pylate.scores import colbert_scores  # noqa: E402

import lik  # noqa: E402
import lik.integrations.pylate as lik_pylate  # noqa: E402
from lik.integrations import pylate_index  # noqa: E402

DIM = 8


@pytest.fixture(autouse=True)
def pylate_scores_its_own_way():
    lik_pylate.disable()  # the references below are PyLate's own scoring


def grid(rng, *shape):
    """Multiples of 1/4: every score is exact in fp16 storage and fp32 sums, so ranks and ties are deterministic."""
    return torch.randint(-4, 5, shape, generator=rng).float() / 4


@pytest.fixture
def corpus():
    rng = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 12, (40,), generator=rng).tolist()
    docs = [grid(rng, n, DIM) for n in lengths]
    docs[7] = docs[30].clone()  # equal documents: the one added first ranks first
    ids = [f"doc-{n}" for n in range(len(docs))]
    return ids, docs, grid(rng, 5, 6, DIM)


def exact_top_k(queries, ids, docs, k, keep=None):
    """PyLate's colbert_scores of each query against each document on its own (no padding), ranked by descending
    score, ties to the earlier document."""
    chosen = [n for n, name in enumerate(ids) if keep is None or name in keep]
    results = []
    for query in queries:
        scores = [float(colbert_scores(query[None], docs[n][None])[0, 0]) for n in chosen]
        order = sorted(range(len(chosen)), key=lambda j: (-scores[j], j))[:k]
        results.append([{"id": ids[chosen[j]], "score": scores[j]} for j in order])
    return results


def make(tmp_path, **options):
    return lik_pylate.Index(index_folder=str(tmp_path), index_name="collection", show_progress=False, **options)


def test_it_is_an_end_to_end_pylate_index():
    assert issubclass(lik_pylate.Index, indexes_base.Base) and lik_pylate.Index.is_end_to_end_index is True


def test_retrieve_colbert_returns_the_exact_top_k(tmp_path, corpus):
    """The interpreted kernels where TRITON_INTERPRET=1: the scores are PyLate's exactly."""
    ids, docs, queries = corpus
    index = make(tmp_path, override=True).add_documents(ids, docs)
    got = retrieve.ColBERT(index=index).retrieve(queries_embeddings=queries, k=6)
    assert got == exact_top_k(queries, ids, docs, 6)
    assert all(type(hit["score"]) is float for hits in got for hit in hits)
    subset = ids[::3] + ["not-an-id"]  # ids not in the collection are ignored, as PLAID's fast-plaid ignores them
    got = retrieve.ColBERT(index=index).retrieve(queries_embeddings=queries, k=4, subset=subset)
    assert got == exact_top_k(queries, ids, docs, 4, keep=set(subset))
    per_query = [ids[:5], [], ids[10:12], ids, ["doc-3"]]
    got = index(queries, k=3, subset=per_query)
    assert got == [exact_top_k(q[None], ids, docs, 3, keep=set(s))[0] for q, s in zip(queries, per_query)]
    assert [len(hits) for hits in got] == [3, 0, 2, 3, 1]


def test_inputs_in_pylates_forms(tmp_path, corpus, reference_path):
    ids, docs, queries = corpus
    numbered = list(range(100, 140))  # int ids stay ints through the id map
    index = make(tmp_path, dtype=torch.float32, batch_size=2).add_documents(
        np.array(numbered), [doc.numpy() for doc in docs])
    want = exact_top_k(queries, numbered, docs, 5)
    assert index(queries.numpy(), k=5) == want
    assert index([q.tolist() for q in queries], k=5) == want
    assert index(queries[0], k=5) == want[:1]  # one [tokens, dim] query
    # Queries of different lengths: each counts every one of its own tokens.
    ragged = [queries[0][:2], queries[1], queries[2][:5]]
    assert index(ragged, k=3) == [exact_top_k(q[None], numbered, docs, 3)[0] for q in ragged]
    assert index(queries, k=1000)[0] == exact_top_k(queries[:1], numbered, docs, 40)[0]  # k past the collection
    reopened = make(tmp_path)
    assert reopened(queries, k=5) == want and len(reopened) == 40
    assert json.loads((tmp_path / "collection" / "documents_ids.json").read_text())["ids"] == numbered


def test_rerank_with_the_stored_embeddings(tmp_path, corpus, reference_path):
    ids, docs, queries = corpus
    index = make(tmp_path).add_documents(ids, docs)
    candidates = [ids[:9], ids[20:25]]
    stored = index.get_documents_embeddings(candidates)
    assert [[t.tolist() for t in group] for group in stored] == [[docs[ids.index(i)].tolist() for i in group]
                                                                for group in candidates]
    assert stored[0][0].dtype == torch.float32
    # rank.rerank (which pads documents with zeros, PyLate's own convention) takes them as it takes the originals.
    originals = [[docs[ids.index(i)] for i in group] for group in candidates]
    assert rank.rerank(documents_ids=candidates, queries_embeddings=queries[:2], documents_embeddings=stored) == (
        rank.rerank(documents_ids=candidates, queries_embeddings=queries[:2], documents_embeddings=originals))
    assert [t.tolist() for t in index.get_documents_embeddings(["doc-4"])] == [docs[4].tolist()]
    with pytest.raises(KeyError, match="nope"):
        index.get_documents_embeddings([["doc-1", "nope"]])


def test_remove_documents_persists_through_reopening_and_compaction(tmp_path, corpus, reference_path):
    ids, docs, queries = corpus
    index = make(tmp_path).add_documents(ids[:30], docs[:30])
    removed = ["doc-0", "doc-7", "doc-12", "doc-29"]
    index.remove_documents(removed)
    index.add_documents(ids[30:], docs[30:])  # added after a removal: new ids continue
    alive = [name for name in ids if name not in removed]
    want = exact_top_k(queries, ids, docs, len(alive), keep=set(alive))
    assert index(queries, k=len(alive)) == want and len(index) == len(alive)
    reopened = make(tmp_path)
    assert reopened(queries, k=len(alive)) == want
    reopened.compact()
    assert reopened(queries, k=len(alive)) == want
    assert make(tmp_path, placement="disk")(queries, k=len(alive)) == want
    with pytest.raises(KeyError, match="doc-7"):
        reopened.get_documents_embeddings(["doc-7"])
    with pytest.raises(KeyError, match="doc-7"):
        reopened.remove_documents(["doc-3", "doc-7"])
    assert len(reopened) == len(alive)  # a refused removal removes nothing
    reopened.add_documents(["doc-7"], [docs[0]])  # a removed id may be added again, as a new document
    assert reopened(queries[:1], k=1, subset=["doc-7"]) == exact_top_k(queries[:1], ["doc-7"], [docs[0]], 1)


def test_override_starts_empty_and_replaces_only_its_own_collection(tmp_path, corpus):
    ids, docs, queries = corpus
    make(tmp_path).add_documents(ids[:3], docs[:3])
    fresh = make(tmp_path, override=True)
    with pytest.raises(ValueError, match="index is empty"):
        fresh(queries, k=1)
    with pytest.raises(ValueError, match="index is empty"):
        make(tmp_path)(queries, k=1)  # reopened before anything was added: still empty
    fresh.add_documents(ids[5:7], docs[5:7])
    assert {hit["id"] for hit in make(tmp_path)(queries[0], k=5)[0]} == {"doc-5", "doc-6"}
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    for override in (False, True):
        with pytest.raises(FileExistsError, match="not a lik PyLate index"):
            lik_pylate.Index(index_folder=str(tmp_path), index_name="mine", override=override)
    assert os.listdir(mine) == ["notes.txt"]


@pytest.mark.parametrize("change", ["add", "remove"])
def test_a_write_cut_short_leaves_the_collection_before_or_after(tmp_path, corpus, monkeypatch, change,
                                                                reference_path):
    """The lik index is written first, then the id map: an add cut between them reopens as before the add (its
    documents are removed again), a removal as after it."""
    ids, docs, queries = corpus
    index = make(tmp_path).add_documents(ids[:20], docs[:20])

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(pylate_index.Index, "_write_map", interrupted)
    with pytest.raises(KeyboardInterrupt):
        if change == "add":
            index.add_documents(ids[20:], docs[20:])
        else:
            index.remove_documents(["doc-3", "doc-4"])
    monkeypatch.undo()
    alive = ids[:20] if change == "add" else [name for name in ids[:20] if name not in ("doc-3", "doc-4")]
    reopened = make(tmp_path)
    assert reopened(queries, k=len(alive)) == exact_top_k(queries, ids, docs, len(alive), keep=set(alive))
    reopened.add_documents(["late"], [docs[39]])  # and it goes on: ids continue after the orphans
    assert reopened(queries[:1], k=1, subset=["late"])[0][0]["id"] == "late"
    assert make(tmp_path)(queries[:1], k=1, subset=["late"])[0][0]["id"] == "late"


def test_int8_storage_scores_the_dequantized_operands(tmp_path, corpus, reference_path):
    """Tokens are stored int8 with a scale per token; queries are quantized per token as they are searched."""
    ids, docs, queries = corpus
    index = make(tmp_path, dtype=torch.int8).add_documents(ids, docs)
    stored = index.get_documents_embeddings(ids)
    q8, q_scale = lik.quantize(queries, torch.int8)
    got, want = index(queries, k=5), exact_top_k(q8.float() * q_scale[..., None], ids, stored, 5)
    assert [[h["id"] for h in hits] for hits in got] == [[h["id"] for h in hits] for hits in want]
    for hits, reference in zip(got, want):
        assert [h["score"] for h in hits] == pytest.approx([h["score"] for h in reference], rel=1e-5)


def test_bad_input_is_refused_with_the_argument_named(tmp_path, corpus):
    ids, docs, queries = corpus
    with pytest.raises(ValueError, match="codec .* compressed \\(PLAID\\) codec does not exist yet"):
        make(tmp_path, codec="plaid")
    with pytest.raises(ValueError, match="placement"):
        make(tmp_path, placement="ram")
    with pytest.raises(TypeError, match="dtype"):
        make(tmp_path, dtype=torch.int32)
    with pytest.raises(ValueError, match="batch_size"):
        make(tmp_path, batch_size=0)
    index = make(tmp_path).add_documents(ids[:4], docs[:4])
    cases = [
        (lambda: index.add_documents(["a", "b"], docs[:1]), ValueError, "documents_ids has 2 ids"),
        (lambda: index.add_documents(["a", "a"], docs[:2]), ValueError, "same id appears twice"),
        (lambda: index.add_documents(["doc-1"], docs[:1]), ValueError, "'doc-1' is already in the index"),
        (lambda: index.add_documents(["a"], [torch.ones(3, DIM + 1)]), ValueError,
         r"documents_embeddings\[0\] has dim 9"),
        (lambda: index.add_documents([1.5], docs[:1]), TypeError, r"documents_ids\[0\] must be a str or an int"),
        (lambda: index.add_documents(["a"], [torch.ones(3, DIM, dtype=torch.int64)]), TypeError,
         r"documents_embeddings\[0\] must hold floats"),
        (lambda: index.add_documents(["a"], [torch.ones(DIM)]), ValueError, r"documents_embeddings\[0\] must be 2-D"),
        (lambda: index.remove_documents(["nope"]), KeyError, "'nope' is not in the index"),
        (lambda: index(queries, k=0), ValueError, "k must be positive"),
        (lambda: index(queries, k=2.5), TypeError, "k must be an integer"),
        (lambda: index(torch.ones(2, 3, DIM + 1), k=1), ValueError, r"queries_embeddings\[0\] has dim 9"),
        (lambda: index(queries, k=1, subset=[["doc-1"]]), ValueError, "subset has 1 lists for 5 queries"),
        (lambda: index(queries, k=1, subset="doc-1"), TypeError, "subset must be a list"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
    assert len(make(tmp_path)) == 4  # nothing refused was written
    (tmp_path / "collection" / "documents_ids.json").write_text('{"format": "lik-pylate-ids", "version": 1, '
                                                                '"ids": ["a", "a"]}')
    with pytest.raises(ValueError, match=r"documents_ids\.json: ids\[1\] must be a str, an int or null"):
        make(tmp_path)
