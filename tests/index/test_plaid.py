"""lik.Index with codec="plaid": build, add, save / load (bit-exact codes), placements, shards, removal, streaming
builds, damaged files; exhaustive search against float64 MaxSim of the decoded tokens."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import lik
from lik.compression import ResidualCodec, train_codec
from lik.index import plaid_codec, plaid_search
from lik.ops.residual import check_residual_inputs, maxsim_residual_reference

from .helpers import read_json, shard_paths

D = 16
LENGTHS = (5, 0, 3, 7, 1, 4, 9, 2, 6, 3, 8, 1, 0, 5, 4, 7, 2, 6, 3, 5)


@pytest.fixture(autouse=True)
def reference_scorer(request, monkeypatch):
    """The residual scorer's PyTorch reference in place of its kernel (tests/ops/residual test the kernel; through
    the interpreter it costs seconds a search), except in tests that ask for ``real_kernel``."""
    if "real_kernel" in request.fixturenames:
        return

    def reference(Q, q_mask, codes, residuals, codec, cu_seqlens):
        inputs = check_residual_inputs(Q, codes, residuals, codec, cu_seqlens, q_mask)
        return inputs.finish(maxsim_residual_reference(inputs))

    monkeypatch.setattr(plaid_search, "score_residual_packed", reference)


@pytest.fixture
def real_kernel():
    """Score with lik.maxsim_residual itself (its kernel through the interpreter)."""


def make_docs(seed: int = 0, lengths=LENGTHS, d: int = D) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [F.normalize(torch.randn(n, d, generator=g), dim=-1) for n in lengths]


def queries(seed: int = 1, n: int = 3, lq: int = 5, d: int = D) -> torch.Tensor:
    return torch.randn(n, lq, d, generator=torch.Generator().manual_seed(seed))


def decoded(codec: ResidualCodec, docs) -> list[torch.Tensor]:
    """Each document compressed and decoded by the codec alone (fp32 decode, float64 after)."""
    out = []
    for doc in docs:
        if doc.shape[0] == 0:
            out.append(torch.zeros(0, codec.dim, dtype=torch.float64))
        else:
            out.append(codec.decompress(*codec.compress(doc)).double())
    return out


def reference_scores(codec, docs, Q, q_mask=None) -> torch.Tensor:
    """float64 ``[Nq, N]`` MaxSim (masked query tokens add 0, an empty document scores 0)."""
    Q = Q.double().reshape(-1, Q.shape[-2], Q.shape[-1])
    mask = torch.ones(Q.shape[:2], dtype=torch.bool) if q_mask is None else q_mask.reshape(Q.shape[:2])
    out = torch.zeros(Q.shape[0], len(docs), dtype=torch.float64)
    for j, doc in enumerate(decoded(codec, docs)):
        if doc.shape[0]:
            out[:, j] = ((Q @ doc.T).amax(-1) * mask).sum(-1)
    return out


def assert_top_k(scores, ids, ref, k, live=None):
    """``(scores, ids)`` are the top ``k`` of float64 ``ref [Nq, N]`` (over ``live`` ids), ties to the lower id."""
    ref = ref.clone()
    if live is not None:
        dead = torch.ones(ref.shape[1], dtype=torch.bool)
        dead[live] = False
        ref[:, dead] = float("-inf")
    order = torch.sort(-ref, dim=1, stable=True).indices[:, :k]
    assert torch.equal(ids.reshape(order.shape), order)
    torch.testing.assert_close(scores.reshape(order.shape).double(), ref.gather(1, order), atol=1e-4, rtol=1e-5)


def test_exhaustive_search_through_the_residual_kernel(real_kernel):
    docs = make_docs()
    index = lik.Index.build(docs, codec="plaid", nbits=2, dtype=torch.float32, progress=False)
    Q = queries()
    q_mask = torch.ones(3, 5, dtype=torch.bool)
    q_mask[1, 3:] = False
    assert_top_k(*index.search(Q, 6, q_mask), reference_scores(index.codec, docs, Q, q_mask), 6)


@pytest.mark.parametrize("nbits", [1, 2, 4])
def test_exhaustive_search_equals_float64_maxsim_of_the_decoded_tokens(nbits):
    docs = make_docs()
    index = lik.Index.build(docs, codec="plaid", nbits=nbits, dtype=torch.float32, progress=False)
    assert index.codec.nbits == nbits and index.d == D and len(index) == len(docs)
    Q = queries()
    q_mask = torch.ones(3, 5, dtype=torch.bool)
    q_mask[1, 3:] = False
    q_mask[2] = False  # an all-masked query: every document scores 0, ties to the lower id
    ref = reference_scores(index.codec, docs, Q, q_mask)
    scores, ids = index.search(Q, 6, q_mask)
    assert_top_k(scores, ids, ref, 6)
    assert ids[2].tolist() == list(range(6)) and scores[2].abs().max() == 0
    s1, i1 = index.search(Q[0], 4)  # 2-D query
    assert_top_k(s1[None], i1[None], reference_scores(index.codec, docs, Q[:1]), 4)
    # Ragged queries (a list) and a doc_ids filter.
    s2, i2 = index.search([Q[0], Q[1, :2]], 3, doc_ids=[3, 4, 5, 6, 7])
    ref2 = torch.cat([reference_scores(index.codec, docs, Q[:1]), reference_scores(index.codec, docs, Q[1:2, :2])])
    assert_top_k(s2, i2, ref2, 3, live=[3, 4, 5, 6, 7])


def test_codes_and_codec_round_trip_bit_exact(tmp_path):
    docs = make_docs(3)
    index = lik.Index.build(docs, codec="plaid", nbits=2, dtype=torch.float32, shard_tokens=20, progress=False)
    codec = index.codec
    codes, residuals = codec.compress(torch.cat(docs))
    assert torch.equal(torch.cat([s.codes for s in index.segments]), codes)
    assert torch.equal(torch.cat([s.tokens for s in index.segments]), residuals)
    index.save(tmp_path / "ix")
    manifest = read_json(tmp_path / "ix" / "manifest.json")
    assert manifest["version"] == 4 and manifest["codec"]["nbits"] == 2 and manifest["dtype"] == "float32"
    assert manifest["codec"]["num_centroids"] == codec.num_centroids and len(manifest["shards"]) > 1
    for placement in ("host", "disk", "auto"):
        loaded = lik.Index.load(tmp_path / "ix", placement=placement)
        assert torch.equal(torch.cat([s.codes for s in loaded.segments]), codes)
        assert torch.equal(torch.cat([s.tokens for s in loaded.segments]), residuals)
        for name in ("centroids", "bucket_cutoffs", "bucket_weights"):
            assert torch.equal(getattr(loaded.codec, name), getattr(codec, name))
        assert float(loaded.codec.avg_residual) == float(codec.avg_residual)
        Q = queries(4)
        assert [torch.equal(a, b) for a, b in zip(loaded.search(Q, 5), index.search(Q, 5))] == [True, True]
    # get() decodes: the stored codes through the codec, fp32.
    got = loaded.get([6, 1, 0])
    assert got[1].shape == (0, D)
    assert torch.equal(got[0], codec.decompress(*codec.compress(docs[6])))
    # Building straight to disk gives the same bytes' worth of codes (same training on the same documents).
    built = lik.Index.build(docs, codec="plaid", nbits=2, dtype=torch.float32, out=tmp_path / "out", progress=False)
    assert torch.equal(torch.cat([s.codes for s in built.segments]), codes)
    assert torch.equal(built.codec.centroids, codec.centroids)


def test_add_reuses_the_codec_and_save_keeps_it(tmp_path):
    docs = make_docs(5)
    index = lik.Index.build(docs[:12], codec="plaid", nbits=4, dtype=torch.float32, progress=False)
    centroids = index.codec.centroids.clone()
    index.add(docs[12:], progress=False)
    assert torch.equal(index.codec.centroids, centroids) and len(index) == len(docs)
    Q = queries(6)
    assert_top_k(*index.search(Q, 7), reference_scores(index.codec, docs, Q), 7)
    index.save(tmp_path / "ix")
    loaded = lik.Index.load(tmp_path / "ix")
    loaded.add([docs[0]], progress=False)  # a loaded index compresses with its stored codec
    assert torch.equal(loaded.segments[-1].codes, index.codec.compress(docs[0])[0])
    assert_top_k(*loaded.search(Q, 7), reference_scores(index.codec, docs + [docs[0]], Q), 7)
    with pytest.raises(ValueError, match="d=8, the index has d=16"):
        loaded.add([torch.randn(2, 8)])


def test_remove_and_compact(tmp_path):
    docs = make_docs(7)
    index = lik.Index.build(docs, codec="plaid", nbits=2, dtype=torch.float32, shard_tokens=15, progress=False)
    Q = queries(8)
    ref = reference_scores(index.codec, docs, Q)
    gone = [0, 3, 6, 10, 19]
    live = [i for i in range(len(docs)) if i not in gone]
    index.remove(gone)
    assert_top_k(*index.search(Q, 8), ref, 8, live=live)
    index.save(tmp_path / "removed")
    assert_top_k(*lik.Index.load(tmp_path / "removed").search(Q, 8), ref, 8, live=live)
    before = sum(s.num_tokens for s in index.segments)
    index.compact()
    assert sum(s.num_tokens for s in index.segments) == before - sum(LENGTHS[i] for i in gone)
    assert_top_k(*index.search(Q, 8), ref, 8, live=live)
    index.save(tmp_path / "compacted")
    loaded = lik.Index.load(tmp_path / "compacted")
    assert_top_k(*loaded.search(Q, len(live)), ref, len(live), live=live)
    assert torch.equal(loaded.get([4])[0], index.codec.decompress(*index.codec.compress(docs[4])))


def test_shard_and_num_shards_hold_their_documents(tmp_path):
    docs = make_docs(9)
    index = lik.Index.build(docs, codec="plaid", nbits=2, dtype=torch.float32, shard_tokens=10, progress=False)
    index.save(tmp_path / "ix")
    codes, residuals = index.codec.compress(torch.cat(docs))
    offsets = torch.tensor((0,) + LENGTHS).cumsum(0)
    n = len(docs)
    for shard in range(3):
        part = lik.Index.load(tmp_path / "ix", shard=shard, num_shards=3, placement="disk")
        lo, hi = part.local_range
        assert (lo, hi) == (n * shard // 3, n * (shard + 1) // 3)
        a, b = int(offsets[lo]), int(offsets[hi])
        assert torch.equal(torch.cat([s.codes for s in part.segments]), codes[a:b])
        assert torch.equal(torch.cat([s.tokens for s in part.segments]), residuals[a:b])
        assert part.codec.nbits == 2 and len(part) == n
        with pytest.raises(ValueError, match="one shard of a distributed index"):
            part.add([docs[0]])


def test_streaming_build_trains_on_the_first_batches(monkeypatch, tmp_path):
    docs = make_docs(11, lengths=(6,) * 30)
    consumed = []

    def stream():
        for start in range(0, 30, 5):  # encoder batches of 5 documents (30 tokens)
            consumed.append(start)
            yield lik.index.DocumentBatch.packed(torch.cat(docs[start : start + 5]), [6 * i for i in range(6)])

    monkeypatch.setattr(plaid_codec, "TRAIN_TOKENS", 60)
    index = lik.Index.build(
        stream(), codec="plaid", nbits=2, dtype=torch.float32, out=tmp_path / "ix", shard_tokens=50, progress=False
    )
    # Trained on the first two batches (60 tokens), by ColBERTv2's plan over them (a centroid per 4 tokens: few).
    expected = train_codec(torch.cat(docs[:10]), torch.arange(0, 61, 6), 2, num_centroids=15)
    assert torch.equal(index.codec.centroids, expected.centroids)
    assert torch.equal(index.codec.bucket_cutoffs, expected.bucket_cutoffs)
    assert consumed == [0, 5, 10, 15, 20, 25] and len(index) == 30
    codes, _ = expected.compress(torch.cat(docs))
    assert torch.equal(torch.cat([s.codes for s in index.segments]), codes)
    assert len(read_json(tmp_path / "ix" / "manifest.json")["shards"]) == 4


def test_damaged_files_are_refused(tmp_path):
    docs = make_docs(12)
    lik.Index.build(docs, codec="plaid", nbits=2, dtype=torch.float32, out=tmp_path / "ix", progress=False)
    directory = tmp_path / "ix"
    manifest = read_json(directory / "manifest.json")
    codec_path = directory / manifest["generation"] / "codec.safetensors"
    shard = shard_paths(directory)[0]

    def flip(path, offset=-3):
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x55
        path.write_bytes(bytes(data))

    flip(shard)
    with pytest.raises(ValueError, match="checksum mismatch.*shard is corrupt"):
        lik.Index.load(directory)
    lik.Index.load(directory, verify=False)  # sizes and headers still pass
    flip(shard)
    flip(codec_path)
    with pytest.raises(ValueError, match="codec.safetensors: checksum mismatch"):
        lik.Index.load(directory)
    flip(codec_path)
    original = (directory / "manifest.json").read_text()
    for change, message in [
        (lambda m: m["codec"].update(nbits=4), "residuals"),
        (lambda m: m["codec"].update(nbits=3), "codec.nbits' must be 1, 2 or 4"),
        (lambda m: m["codec"].update(num_centroids=m["codec"]["num_centroids"] + 1), "'centroids' must be"),
        (lambda m: m["codec"].update(file="../x"), "plain file name"),
        (lambda m: m.update(version=3), "'codec' belongs to format version 4"),
        (lambda m: m.update(dtype="int8"), "must be a float dtype"),
        (lambda m: m["codec"].update(bytes=1), "codec file has"),
    ]:
        m = json.loads(original)
        change(m)
        (directory / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(ValueError, match=message):
            lik.Index.load(directory)
    (directory / "manifest.json").write_text(original)
    codec_path.unlink()
    with pytest.raises(FileNotFoundError, match="codec file listed in the manifest is missing"):
        lik.Index.load(directory)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"codec": "pq"}, ValueError, "codec must be one of"),
        ({"codec": "plaid", "nbits": 3}, ValueError, "nbits must be 1, 2 or 4, got 3"),
        ({"codec": "plaid", "nbits": True}, ValueError, "nbits must be 1, 2 or 4"),
        ({"codec": "plaid", "dtype": torch.int8}, ValueError, "dtype must be float16, bfloat16 or float32"),
        ({"nbits": 2}, ValueError, "nbits is for codec='plaid' only"),
    ],
)
def test_bad_arguments_are_one_line_errors(kwargs, error, message):
    with pytest.raises(error, match=message) as info:
        lik.Index.build(make_docs(), **kwargs)
    assert "\n" not in str(info.value)


def test_bad_documents_and_search_arguments():
    with pytest.raises(ValueError, match="multiple of 8"):
        lik.Index.build([torch.randn(30, 12)], codec="plaid", progress=False)
    bad = make_docs()
    bad[3] = bad[3].clone()
    bad[3][0, 0] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        lik.Index.build(bad, codec="plaid", dtype=torch.float32, progress=False)
    with pytest.raises(ValueError, match="no token"):
        lik.Index.build([torch.zeros(0, D)] * 3, codec="plaid", progress=False)
    with pytest.raises(ValueError, match="docs is empty"):
        lik.Index.build([], codec="plaid", progress=False)
    exact = lik.Index.build(make_docs(), dtype=torch.float32, progress=False)
    with pytest.raises(ValueError, match="n_probe / candidates apply to a compressed index"):
        exact.search(queries(), 2, n_probe=4)
    index = lik.Index.build(make_docs(), codec="plaid", dtype=torch.float32, progress=False)
    with pytest.raises(ValueError, match="n_probe must be positive"):
        index.search(queries(), 2, n_probe=0)
    with pytest.raises(ValueError, match="candidates must be at least k"):
        index.search(queries(), 5, candidates=4)
    with pytest.raises(TypeError, match="n_probe must be an integer"):
        index.search(queries(), 2, n_probe=1.5)
    assert "codec=plaid, nbits=2" in repr(index)


def test_codes_outside_the_centroids_are_refused_without_checksums(tmp_path):
    lik.Index.build(make_docs(13), codec="plaid", dtype=torch.float32, out=tmp_path / "ix", progress=False)
    shard = shard_paths(tmp_path / "ix")[0]
    header = json.loads(shard.read_bytes()[8 : 8 + int.from_bytes(shard.read_bytes()[:8], "little")])
    start = 8 + int.from_bytes(shard.read_bytes()[:8], "little") + header["codes"]["data_offsets"][0]
    data = bytearray(shard.read_bytes())
    data[start : start + 4] = (10**6).to_bytes(4, "little")
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"codes outside \[0, \d+\).*corrupt shard"):
        lik.Index.load(tmp_path / "ix", verify=False)
