"""lik.Index on CPU: build / save / load round trips, search against lik.search on the padded corpus, filters,
ties, k edge cases and the shard split. Kernels run under the interpreter where TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

import lik

from .helpers import grid_docs, grid_queries, padded


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)


def expected_search(Q, docs, k, q_mask=None, dtype=torch.float32):
    D, d_mask = padded(docs)
    return lik.search(Q.to(dtype), D.to(dtype), k, q_mask, d_mask)


def assert_same(result, expected):
    assert result[0].dtype == torch.float32 and result[1].dtype == torch.int64
    assert torch.equal(result[1], expected[1])
    torch.testing.assert_close(result[0], expected[0], rtol=0, atol=0, equal_nan=True)


@pytest.fixture(params=["kernel", "reference"])
def path(request, monkeypatch):
    """The Triton kernels (interpreter on CPU when TRITON_INTERPRET=1) and the CPU reference path."""
    if request.param == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    return request.param


@pytest.mark.parametrize("chunk_tokens", [1, 4, 1000])
@pytest.mark.parametrize("shard_tokens", [1, 8, 10_000])
def test_search_equals_lik_search_on_padded(rng, path, chunk_tokens, shard_tokens):
    docs = grid_docs(rng)
    index = lik.Index.build(docs, dtype=torch.float32, shard_tokens=shard_tokens, chunk_tokens=chunk_tokens,
                            progress=False)
    assert len(index) == len(docs)
    Q = grid_queries(rng)
    q_mask = torch.rand(Q.shape[:-1], generator=rng) > 0.3
    for k in (1, 4, len(docs)):
        assert_same(index.search(Q, k, q_mask), expected_search(Q, docs, k, q_mask))
    single = index.search(Q[1], 3)
    assert single[0].shape == (3,) and single[1].shape == (3,)
    assert_same(single, expected_search(Q[1], docs, 3))


def test_nan_documents_rank_last(path):
    docs = [torch.ones(2, 4), torch.tensor([[float("nan"), 0, 0, 0]]), torch.ones(1, 4), torch.zeros(3, 4)]
    index = lik.Index.build(docs, dtype=torch.float32, chunk_tokens=3, progress=False)
    scores, ids = index.search(torch.ones(2, 4), k=4)
    assert ids.tolist() == [0, 2, 3, 1]
    assert scores[:3].tolist() == [8.0, 8.0, 0.0] and scores[3].isnan()


def test_build_placement_and_device_options():
    docs = [torch.randn(3, 4), torch.randn(0, 4)]
    index = lik.Index.build(docs, placement="auto", device="cpu", chunk_tokens=2, progress=False)
    assert index.placement == "host" and index.device.type == "cpu" and index.chunk_tokens == 2
    with pytest.raises(ValueError, match="placement='gpu'"):
        lik.Index.build(docs, placement="gpu", device="cpu", progress=False)
    with pytest.raises(ValueError, match="placement must be one of"):
        lik.Index.build(docs, placement="ram", progress=False)
    with pytest.raises(TypeError, match="chunk_size"):
        lik.Index.build(docs, chunk_size=3, progress=False)
    with pytest.raises(TypeError, match="dtype"):
        lik.Index.build(docs, dtype=torch.int32, progress=False)


def test_ties_go_to_the_lower_id_and_empty_documents_score_zero():
    doc = torch.ones(2, 4)
    docs = [doc, torch.empty(0, 4), doc.clone(), torch.empty(0, 4), doc.clone()]
    index = lik.Index.build(docs, dtype=torch.float32, chunk_tokens=2, progress=False)
    scores, ids = index.search(-torch.ones(3, 4), k=5)
    # Every document with tokens scores -12, the empty ones 0: the empty ones first, then ids in order.
    assert ids.tolist() == [1, 3, 0, 2, 4]
    assert scores.tolist() == [0.0, 0.0, -12.0, -12.0, -12.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("placement", ["host", "disk"])
def test_save_load_round_trip(tmp_path, rng, dtype, placement):
    docs = grid_docs(rng)
    index = lik.Index.build(docs, dtype=dtype, shard_tokens=9, chunk_tokens=5, progress=False)
    index.save(tmp_path / "ix", progress=False)
    loaded = lik.Index.load(tmp_path / "ix", placement=placement, chunk_tokens=5)
    assert len(loaded) == len(docs) and loaded.dtype == dtype and loaded.d == docs[0].shape[1]
    assert [s.num_docs for s in loaded.segments] == [s.num_docs for s in index.segments]
    for mine, theirs in zip(index.segments, loaded.segments):
        assert torch.equal(mine.tokens.view(torch.uint8), theirs.tokens.view(torch.uint8))
        assert torch.equal(mine.cu_seqlens, theirs.cu_seqlens)
        assert (mine.scale is None) == (theirs.scale is None)
        if mine.scale is not None:
            assert torch.equal(mine.scale, theirs.scale)
    Q = grid_queries(rng)
    assert_same(loaded.search(Q, 5), index.search(Q, 5))
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        # Quarter multiples in [-1, 1] are exact in every float dtype: the stored corpus is the grid itself.
        assert_same(loaded.search(Q, 5), expected_search(Q, docs, 5))


def test_int8_matches_lik_search_on_the_quantized_padded_corpus(rng):
    docs = [torch.randn(n, 16, generator=rng) for n in (5, 0, 9, 3, 1, 7)]
    index = lik.Index.build(docs, dtype=torch.int8, chunk_tokens=6, progress=False)
    D, d_mask = padded(docs, fill=0.0)
    D_q, d_scale = lik.quantize(D, torch.int8)
    Q = torch.randn(2, 3, 16, generator=rng)
    scores, ids = index.search(Q, 6)
    want_scores, want_ids = lik.search(Q, D_q, 6, None, d_mask, d_scale=d_scale)
    torch.testing.assert_close(scores, want_scores, rtol=1e-5, atol=1e-5)
    assert torch.equal(ids, want_ids)


def test_fp8_round_trip_through_the_reference(tmp_path, rng, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    docs = [torch.randn(n, 8, generator=rng) for n in (4, 0, 6, 2)]
    index = lik.Index.build(docs, dtype=torch.float8_e4m3fn, chunk_tokens=5, progress=False)
    index.save(tmp_path / "fp8", progress=False)
    loaded = lik.Index.load(tmp_path / "fp8", placement="disk")
    assert loaded.dtype == torch.float8_e4m3fn
    D, d_mask = padded(docs, fill=0.0)
    D_q, d_scale = lik.quantize(D, torch.float8_e4m3fn)
    Q = torch.randn(2, 3, 8, generator=rng)
    scores, ids = loaded.search(Q, 4)
    want_scores, want_ids = lik.search(Q, D_q, 4, None, d_mask, d_scale=d_scale)
    torch.testing.assert_close(scores, want_scores, rtol=1e-5, atol=1e-5)
    assert torch.equal(ids, want_ids)


def test_doc_ids_restrict_the_search(rng):
    docs = grid_docs(rng)
    index = lik.Index.build(docs, dtype=torch.float32, chunk_tokens=4, progress=False)
    Q = grid_queries(rng)
    subset = [8, 0, 3, 3, 5, 1]
    chosen = sorted(set(subset))
    scores, ids = index.search(Q, 4, doc_ids=subset)
    want_scores, want_positions = expected_search(Q, [docs[i] for i in chosen], 4)
    assert torch.equal(ids, torch.tensor(chosen)[want_positions])
    torch.testing.assert_close(scores, want_scores, rtol=0, atol=0)
    assert index.search(Q, 0, doc_ids=[])[0].shape == (3, 0)
    with pytest.raises(ValueError, match="k must be in"):
        index.search(Q, 6, doc_ids=subset)
    with pytest.raises(ValueError, match="doc_ids"):
        index.search(Q, 1, doc_ids=[len(docs)])
    with pytest.raises(TypeError, match="doc_ids"):
        index.search(Q, 1, doc_ids=torch.tensor([0.5]))


def test_k_bounds_and_query_checks(rng):
    docs = grid_docs(rng)
    index = lik.Index.build(docs, progress=False)
    Q = grid_queries(rng)
    scores, ids = index.search(Q, 0)
    assert scores.shape == (3, 0) and ids.shape == (3, 0) and scores.dtype == torch.float32
    assert index.search(Q[0], 0)[1].shape == (0,)
    with pytest.raises(ValueError, match=r"k must be in \[0, 10\]"):
        index.search(Q, len(docs) + 1)
    with pytest.raises(ValueError, match="k must be in"):
        index.search(Q, -1)
    with pytest.raises(TypeError, match="k must be an integer"):
        index.search(Q, 2.0)
    with pytest.raises(ValueError, match="d=6"):
        index.search(torch.randn(3, 4, 7), 1)
    with pytest.raises(ValueError, match="q_mask"):
        index.search(Q, 1, torch.ones(3, 5, dtype=torch.bool))


def test_add_continues_ids_and_build_takes_an_iterator(rng):
    docs = grid_docs(rng)
    index = lik.Index.build(iter(docs[:4]), dtype=torch.float32, chunk_tokens=3, progress=False)
    index.add(d for d in docs[4:])
    assert len(index) == len(docs)
    Q = grid_queries(rng)
    assert_same(index.search(Q, 7), expected_search(Q, docs, 7))
    with pytest.raises(ValueError, match="d=6"):
        index.add([torch.randn(2, 5)])
    with pytest.raises(ValueError, match="empty"):
        lik.Index.build([], progress=False)
    with pytest.raises(TypeError, match=r"docs\[1\]"):
        lik.Index.build([torch.randn(2, 3), torch.ones(2, 3, dtype=torch.int64)], progress=False)


def test_build_streams_to_disk_and_the_shard_split_covers_the_corpus(tmp_path, rng):
    docs = grid_docs(rng)
    index = lik.Index.build(iter(docs), dtype=torch.float32, out=tmp_path / "ix", shard_tokens=6, progress=False,
                            placement="disk", chunk_tokens=4)
    assert len(list((tmp_path / "ix").glob("gen-*/shard-*.safetensors"))) > 2
    Q = grid_queries(rng)
    assert_same(index.search(Q, 5), expected_search(Q, docs, 5))
    for num_shards in (1, 3, 4, 11):
        ranges = []
        for shard in range(num_shards):
            part = lik.Index.load(tmp_path / "ix", shard=shard, num_shards=num_shards, placement="host")
            assert len(part) == len(docs)
            first, stop = part.local_range
            ranges.append((first, stop))
            held = [part.segments[i].slice_docs(0, part.segments[i].num_docs) for i in range(len(part.segments))]
            tokens = torch.cat([h.tokens for h in held]) if held else torch.empty(0, 6)
            want = torch.cat(docs[first:stop]) if stop > first else torch.empty(0, 6)
            assert torch.equal(tokens, want)
        assert ranges[0][0] == 0 and ranges[-1][1] == len(docs)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    with pytest.raises(ValueError, match="shard"):
        lik.Index.load(tmp_path / "ix", shard=2, num_shards=2)
    with pytest.raises(ValueError, match="shard and num_shards"):
        lik.Index.load(tmp_path / "ix", shard=0)
    with pytest.raises(ValueError, match="placement"):
        lik.Index.load(tmp_path / "ix", placement="ram")
    with pytest.raises(ValueError, match="placement='gpu'"):
        lik.Index.load(tmp_path / "ix", placement="gpu", device="cpu")


def test_no_queries_give_k_columns_and_bad_doc_ids_are_named(monkeypatch, rng):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    index = lik.Index.build(grid_docs(rng), progress=False)
    for doc_ids in (None, [1, 2, 3]):
        scores, ids = index.search(torch.empty(0, 4, 6), 3, doc_ids=doc_ids)
        assert scores.shape == (0, 3) and ids.shape == (0, 3)
        assert scores.dtype == torch.float32 and ids.dtype == torch.int64
    scores, ids = index.search(torch.empty(0, 4, 6), 0, torch.ones(0, 4, dtype=torch.bool))
    assert scores.shape == (0, 0)
    Q = grid_queries(rng)
    for bad in ("0123", b"\x00", [2**70], {1, 2}, [[1, 2]], [0.0], object()):
        with pytest.raises(TypeError, match="doc_ids"):
            index.search(Q, 1, doc_ids=bad)
    with pytest.raises(ValueError, match=r"doc_ids must be in \[0, 10\), got an id of 18446744073709551615"):
        index.search(Q, 1, doc_ids=torch.tensor([2**64 - 1], dtype=torch.uint64))
    with pytest.raises(ValueError, match=r"doc_ids must be in \[0, 10\)"):
        index.search(Q, 1, doc_ids=[-1])
    assert index.search(Q, 1, doc_ids=torch.tensor([3], dtype=torch.uint8))[1].tolist() == [[3]] * 3
