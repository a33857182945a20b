"""lik.Index(codec="plaid", rescore_dtype=...): the exact copy kept for rescoring (built, added, removed,
compacted, saved, loaded, sharded with the codes) and ``search(..., rescore=)`` against float64 MaxSim of the
copy's stored values and against an exact index of the copy's dtype."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import lik
from lik.index import rescore

from .helpers import read_json, score_with_reference, shard_paths, unit_docs

D = 16
EXACT_DTYPE = {torch.int8: torch.int8, torch.float16: torch.float16}


@pytest.fixture(autouse=True)
def reference_scorer(monkeypatch):
    score_with_reference(monkeypatch)


def queries(seed: int = 1, n: int = 3, lq: int = 5) -> torch.Tensor:
    return torch.randn(n, lq, D, generator=torch.Generator().manual_seed(seed))


def stored(doc: torch.Tensor, dtype) -> torch.Tensor:
    """What the copy holds of ``doc``, in float64."""
    if dtype == torch.int8:
        q, scale = lik.quantize(doc, torch.int8)
        return q.double() * scale.double()[:, None]
    return doc.to(dtype).double()


def reference_scores(Q, docs, dtype) -> torch.Tensor:
    """float64 MaxSim ``[Nq, N]`` of ``Q`` (as the copy's dtype scores it: fp16-rounded, or quantized per token for
    an int8 copy) against the copy's values."""
    q = torch.stack([stored(query, dtype) for query in Q]) if dtype == torch.int8 else Q.half().double()
    cols = []
    for doc in docs:
        d = stored(doc, dtype)
        cols.append(
            torch.zeros(Q.shape[0], dtype=torch.float64)
            if d.shape[0] == 0
            else torch.einsum("qld,td->qlt", q, d).amax(-1).sum(-1)
        )
    return torch.stack(cols, dim=1)


def build(docs, dtype, **kwargs):
    return lik.Index.build(docs, codec="plaid", nbits=2, dtype=torch.float32, rescore_dtype=dtype, **kwargs)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float16])
def test_rescoring_everything_is_exact_search(dtype):
    """rescore = every document: the result is the exact top-k of the copy (the exact index of its dtype, and
    float64 MaxSim of its values)."""
    docs, Q = unit_docs(), queries()
    index = build(docs, dtype, shard_tokens=20)
    assert len(index.segments) > 1 and all(s.copy.tokens.dtype == dtype for s in index.segments)
    scores, ids = index.search(Q, 6, rescore=len(docs))
    exact_scores, exact_ids = lik.Index.build(docs, dtype=EXACT_DTYPE[dtype]).search(Q, 6)
    assert torch.equal(ids, exact_ids)
    torch.testing.assert_close(scores, exact_scores)
    ref = reference_scores(Q, docs, dtype)
    top = ref.topk(6, dim=1)
    assert torch.equal(ids, top.indices)
    torch.testing.assert_close(scores.double(), top.values, atol=2e-3, rtol=0)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float16])
def test_rescores_only_the_compressed_top(dtype):
    """rescore = r: the top k of the exact scores of the compressed search's best r documents (per query)."""
    docs, Q = unit_docs(seed=3), queries(seed=4, n=4)
    index = build(docs, dtype)
    k, r = 3, 5
    _, candidates = index.search(Q, r, rescore=0)
    scores, ids = index.search(Q, k, rescore=r)
    ref = reference_scores(Q, docs, dtype)
    for row in range(Q.shape[0]):
        own = ref[row, candidates[row]]
        best = own.topk(k)
        assert torch.equal(ids[row], candidates[row][best.indices])
        torch.testing.assert_close(
            scores[row].double(), best.values, atol=3e-2 if dtype == torch.int8 else 2e-3, rtol=0
        )


def test_default_rescore():
    docs, Q = unit_docs(), queries()
    with_copy = build(docs, torch.float16)
    many = unit_docs(seed=5, lengths=(2,) * 40)
    big = build(many, torch.float16)
    # max(k, 32) documents by default with a copy; none without.
    assert torch.equal(big.search(Q, 3)[1], big.search(Q, 3, rescore=32)[1])
    assert torch.equal(with_copy.search(Q, 4)[1], with_copy.search(Q, 4, rescore=len(docs))[1])
    plain = lik.Index.build(docs, codec="plaid", nbits=2, dtype=torch.float32)
    assert torch.equal(plain.search(Q, 4)[1], plain.search(Q, 4, rescore=0)[1])


def test_candidate_generation_then_rescoring():
    docs, Q = unit_docs(seed=6), queries(seed=7)
    index = build(docs, torch.float16)
    _, candidates = index.search(Q, 4, n_probe=1, candidates=4, rescore=0)
    scores, ids = index.search(Q, 2, n_probe=1, candidates=4, rescore=4)
    ref = reference_scores(Q, docs, torch.float16)
    for row in range(Q.shape[0]):
        found = candidates[row][candidates[row] >= 0]
        best = ref[row, found].topk(min(2, found.numel()))
        assert torch.equal(ids[row, : best.indices.numel()], found[best.indices])
        assert bool((ids[row, best.indices.numel() :] == -1).all())


def test_ragged_queries_with_an_empty_one():
    """A zero-length query scores 0 against every document (ties to the lower id), as an exact index scores it."""
    docs = unit_docs()
    Q = [queries(seed=8, n=1, lq=3)[0], torch.zeros(0, D), queries(seed=9, n=1, lq=6)[0]]
    index = build(docs, torch.int8)
    scores, ids = index.search(Q, 5, rescore=len(docs))
    exact_scores, exact_ids = lik.Index.build(docs, dtype=torch.int8).search(Q, 5)
    assert torch.equal(ids, exact_ids) and torch.equal(ids[1], torch.arange(5))
    torch.testing.assert_close(scores, exact_scores)


def test_k_zero_and_all():
    docs, Q = unit_docs(), queries()
    index = build(docs, torch.float16)
    assert index.search(Q, 0)[1].shape == (3, 0)
    _, ids = index.search(Q, len(docs))
    assert torch.equal(ids.sort(dim=1).values, torch.arange(len(docs)).expand(3, -1))


@pytest.mark.parametrize(("placement", "dtype"), [("host", torch.float16), ("disk", torch.int8)])
def test_save_load_keeps_the_copy(tmp_path, placement, dtype):
    docs, Q = unit_docs(), queries()
    index = build(docs, dtype, shard_tokens=30)
    index.save(tmp_path / "ix")
    manifest = read_json(tmp_path / "ix" / "manifest.json")
    assert manifest["codec"]["rescore_dtype"] == str(dtype).removeprefix("torch.")
    loaded = lik.Index.load(tmp_path / "ix", placement=placement)
    assert loaded.rescore_dtype == dtype
    for a, b in zip(index.segments, loaded.segments, strict=True):
        assert torch.equal(a.copy.tokens, b.copy.tokens)
        assert (a.copy.scale is None) == (dtype != torch.int8) and (b.copy.scale is None) == (dtype != torch.int8)
        assert a.copy.scale is None or torch.equal(a.copy.scale, b.copy.scale)
    for r in (0, 7):
        expected = index.search(Q, 4, rescore=r)
        got = loaded.search(Q, 4, rescore=r)
        assert torch.equal(expected[1], got[1]) and torch.equal(expected[0], got[0])


def test_streamed_build_and_shards(tmp_path):
    """Build with out= (copies written as the shards fill), then a rank's half of the documents."""
    docs = unit_docs()
    build(docs, torch.float16, out=tmp_path / "ix", shard_tokens=25)
    whole = lik.Index.load(tmp_path / "ix")
    half = lik.Index.load(tmp_path / "ix", shard=1, num_shards=2)
    assert half.rescore_dtype == torch.float16
    expected = torch.cat([d.half() for d in docs[10:]])
    assert torch.equal(torch.cat([s.copy.tokens for s in half.segments]), expected)
    assert torch.equal(torch.cat([s.copy.tokens for s in whole.segments]), torch.cat([d.half() for d in docs]))
    for segment in half.segments:
        assert torch.equal(segment.copy.cu_seqlens, segment.cu_seqlens)


def test_add_remove_compact_keep_the_copy(tmp_path):
    docs, more, Q = unit_docs(), unit_docs(seed=11, lengths=(3, 0, 6, 2)), queries()
    index = build(docs, torch.float16).add(more)
    everything = docs + more
    exact = lik.Index.build(everything, dtype=torch.float16)
    assert torch.equal(index.search(Q, 5, rescore=len(everything))[1], exact.search(Q, 5)[1])
    gone = [1, 3, 6, 21]
    index.remove(gone)
    exact.remove(gone)
    for step in ("removed", "compacted", "saved"):
        if step == "compacted":
            index.compact()
            assert sum(s.copy.num_tokens for s in index.segments) == sum(s.num_tokens for s in index.segments)
        if step == "saved":
            index.save(tmp_path / "ix")
            index = lik.Index.load(tmp_path / "ix", placement="disk")
        scores, ids = index.search(Q, 6, rescore=len(index))
        exact_scores, exact_ids = exact.search(Q, 6)
        assert torch.equal(ids, exact_ids), step
        torch.testing.assert_close(scores, exact_scores)
        assert not bool(torch.isin(ids, torch.tensor(gone)).any())


def test_damaged_copy_is_refused(tmp_path):
    build(unit_docs(), torch.int8).save(tmp_path / "ix")
    manifest_path = tmp_path / "ix" / "manifest.json"
    manifest = read_json(manifest_path)
    manifest["codec"]["rescore_dtype"] = "float16"  # the shards hold int8
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="exact_tokens"):
        lik.Index.load(tmp_path / "ix")
    manifest["codec"]["rescore_dtype"] = "float32"
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="rescore_dtype"):
        lik.Index.load(tmp_path / "ix")
    assert shard_paths(tmp_path / "ix")


@pytest.mark.parametrize(
    ("build_kwargs", "search_kwargs", "error", "match"),
    [
        ({"rescore_dtype": torch.float32}, None, ValueError, "rescore_dtype must be"),
        ({"rescore_dtype": "int8"}, None, ValueError, "rescore_dtype must be"),
        ({"rescore_dtype": torch.int8, "codec": "exact"}, None, ValueError, "rescore_dtype is for codec='plaid'"),
        ({"rescore_dtype": None}, {"rescore": 8}, ValueError, "rescore needs an exact copy"),
        ({"rescore_dtype": torch.int8}, {"rescore": 2}, ValueError, r"rescore must be 0 or at least k \(3\)"),
        ({"rescore_dtype": torch.int8}, {"rescore": 4.0}, TypeError, "rescore must be an integer"),
        ({"rescore_dtype": torch.int8}, {"rescore": True}, TypeError, "rescore must be an integer"),
    ],
)
def test_errors(build_kwargs, search_kwargs, error, match):
    kwargs = {"codec": "plaid", "dtype": torch.float32, **build_kwargs}
    if kwargs["codec"] == "exact":
        kwargs.pop("dtype")
    with pytest.raises(error, match=match) as raised:
        index = lik.Index.build(unit_docs(), **kwargs)
        index.search(queries(), 3, **search_kwargs)
    assert "\n" not in str(raised.value)


def test_exact_index_refuses_rescore():
    with pytest.raises(ValueError, match="rescore needs an exact copy"):
        lik.Index.build(unit_docs()).search(queries(), 2, rescore=4)


def test_module_defaults():
    assert rescore.DEFAULT_RESCORE == 32 and rescore.RESCORE_DTYPES == (torch.float16, torch.int8)


def test_rows_of_documents_match_their_slices():
    """_rows: each document's rows in order, empty documents and an empty selection included."""
    cu = torch.tensor([0, 3, 3, 7, 8, 8, 12])
    for docs in ([0, 1, 2, 3, 4, 5], [1, 4], [2], [], [0, 5], [1, 3, 5]):
        docs = torch.tensor(docs, dtype=torch.int64)
        expected = [torch.arange(int(cu[d]), int(cu[d + 1])) for d in docs.tolist()]
        expected = torch.cat(expected) if expected else torch.zeros(0, dtype=torch.int64)
        rows = rescore._rows(cu, docs)
        assert rows.dtype == torch.int64 and torch.equal(rows, expected)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float16])
def test_gather_reads_the_documents_across_segments(dtype):
    """_gather: the selected documents' rows and scales, packed in position order, from several segments (some with
    no selected document), zero-length documents included."""
    docs = unit_docs(seed=11)
    index = build(docs, dtype, shard_tokens=20)
    segments, copies = index.segments, [s.copy for s in index.segments]
    assert len(segments) > 2
    first_of = torch.tensor([0] + [s.num_docs for s in segments]).cumsum(0)
    rows = torch.cat([c.tokens for c in copies])
    scales = None if dtype == torch.float16 else torch.cat([c.scale for c in copies])
    cu = torch.cat(
        [
            c.cu_seqlens[:-1] + n
            for c, n in zip(copies, [0, *torch.tensor([c.tokens.shape[0] for c in copies]).cumsum(0).tolist()])
        ]
    )
    cu = torch.cat([cu, torch.tensor([rows.shape[0]])])
    last = int(first_of[1])  # the selection skips a whole segment's documents
    for chosen in ([1, 12], list(range(len(docs))), [d for d in range(len(docs)) if d >= last], [0], []):
        chosen = torch.tensor(chosen, dtype=torch.int64)
        tokens, scale, sub_cu = rescore._gather(segments, 0, chosen, "cpu")
        parts = [torch.arange(int(cu[d]), int(cu[d + 1])) for d in chosen.tolist()]
        index_rows = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        assert sub_cu.dtype == torch.int32 and torch.equal(
            sub_cu[1:].long(), torch.tensor([p.numel() for p in parts], dtype=torch.int64).cumsum(0)
        )
        assert torch.equal(tokens, rows[index_rows])
        assert (scale is None) == (scales is None) and (scale is None or torch.equal(scale, scales[index_rows]))


def test_one_gather_and_one_call_per_bucket(monkeypatch):
    """Documents several queries hold are gathered once, and each query bucket is scored against the union of
    every query's documents (results as float64 MaxSim of the copy ranks them)."""
    docs = unit_docs(seed=12)
    Q = [queries(seed=13, n=1, lq=4)[0], queries(seed=14, n=1, lq=2)[0], queries(seed=15, n=1, lq=4)[0]]
    index = build(docs, torch.int8, shard_tokens=20)
    corpus_rows = []
    real = rescore.score_packed
    monkeypatch.setattr(rescore, "score_packed", lambda *a: corpus_rows.append(a[1].shape[0]) or real(*a))
    gathered = []
    real_gather = rescore._gather
    monkeypatch.setattr(rescore, "_gather", lambda *a: gathered.append(a[2].clone()) or real_gather(*a))
    _, candidates = index.search(Q, 6, rescore=0)
    scores, ids = index.search(Q, 3, rescore=6)
    union = torch.unique(candidates[candidates >= 0])
    assert len(gathered) == 1 and torch.equal(gathered[0], union)
    lengths = torch.tensor([d.shape[0] for d in docs])
    assert union.numel() < int((candidates >= 0).sum())  # some documents are held by several queries
    assert corpus_rows and set(corpus_rows) == {int(lengths[union].sum())}  # every bucket against the union
    for row, query in enumerate(Q):
        ref = reference_scores(query[None], docs, torch.int8)[0]
        found = candidates[row][candidates[row] >= 0]
        best = ref[found].topk(3)
        assert torch.equal(ids[row], found[best.indices])


@pytest.mark.gpu
def test_rescore_speed_print(monkeypatch):
    """Prints (asserts only that rescoring ran): 64 queries of 32 tokens, best 64 of 10 000 documents of 50-150
    tokens (~1M) rescored from an int8 copy in host memory, GPU-resident codes: the search without and with
    rescoring, and the gather with its copy to the GPU (synchronised around it)."""
    import time

    torch.manual_seed(0)
    centers = F.normalize(torch.randn(256, 128), dim=-1)
    lengths = torch.randint(50, 151, (10_000,)).tolist()
    noise = [0.8 * torch.randn(n, 128) / 128**0.5 for n in lengths]
    docs = [F.normalize(centers[int(torch.randint(0, 256, ()))] + x, dim=-1).half() for x in noise]
    index = lik.Index.build(docs, codec="plaid", nbits=2, rescore_dtype=torch.int8, device="cuda")
    Q = F.normalize(torch.randn(64, 32, 128, device="cuda"), dim=-1).half()
    gathers, real = [], rescore._gather

    def gather(*args):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = real(*args)
        torch.cuda.synchronize()
        gathers.append(time.perf_counter() - start)
        return out

    monkeypatch.setattr(rescore, "_gather", gather)

    def timed(**kwargs):
        index.search(Q, 10, **kwargs)
        runs = []
        for _ in range(10):
            torch.cuda.synchronize()
            start = time.perf_counter()
            index.search(Q, 10, **kwargs)
            torch.cuda.synchronize()
            runs.append(time.perf_counter() - start)
        return 1e3 * sorted(runs)[5]

    plain, rescored = timed(rescore=0), timed(rescore=64)
    assert gathers
    print(
        f"\nrescore int8 Nq=64 R=64 T={sum(lengths)}: search {plain:.1f} ms, with rescore {rescored:.1f} ms, "
        f"gather + copy {1e3 * sorted(gathers)[len(gathers) // 2]:.1f} ms"
    )
