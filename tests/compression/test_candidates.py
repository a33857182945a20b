"""PLAID candidate generation: the IVF and the three stages against the float64 loops of candidates_reference, in
blocks of every size, on the nasty inputs (empty corpus and documents, masked and all-masked queries, NaN / inf
padding, ties, NaN scores, non-contiguous views), the recall property and the refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lik._device
import lik.compression.candidates as candidates
import lik.compression.interaction as interaction
from lik.compression import build_ivf, generate_candidates
from lik.compression.candidates_reference import build_ivf_reference, generate_candidates_reference


def _corpus(n_docs=40, C=16, max_len=9, seed=0, offsets_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len, (n_docs,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(offsets_dtype)
    codes = torch.randint(0, C, (int(cu[-1]),), generator=g, dtype=torch.int32)
    return codes, cu


def _queries(Nq=5, Lq=6, d=8, C=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    centroids = F.normalize(torch.randn(C, d, generator=g), dim=-1)
    Q = torch.randn(Nq, Lq, d, generator=g)
    mask = torch.rand(Nq, Lq, generator=g) > 0.3
    return Q, mask, centroids


def _both(Q, mask, centroids, codes, cu, **kw):
    ids, offsets = build_ivf(codes, cu, centroids.shape[0])
    got = generate_candidates(Q, mask, centroids, ids, offsets, codes, cu, **kw)
    want = generate_candidates_reference(Q, mask, centroids, codes, cu, **kw)
    return got, want


@pytest.fixture(params=[1 << 30, 4096, 64], ids=["one-block", "small-blocks", "tiny-blocks"])
def block_bytes(request, monkeypatch):
    """Every test below runs with one block and with blocks so small that queries, query groups and token
    gathers are all split (64 bytes: one query per block, one pair per gather), on the PyTorch path of stage 3
    (the CPU's; the kernel's own tests are at the end: the interpreter runs one program per pair)."""
    monkeypatch.setattr(candidates, "BLOCK_BYTES", request.param)
    monkeypatch.setattr(lik._device, "interpreting", lambda: False)
    return request.param


@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_build_ivf_matches_reference(block_bytes, offsets_dtype):
    codes, cu = _corpus(n_docs=60, C=20, offsets_dtype=offsets_dtype, seed=3)
    ids, offsets = build_ivf(codes, cu, 24)  # 4 centroids without a token: empty lists
    want_ids, want_offsets = build_ivf_reference(codes, cu, 24)
    assert ids.dtype == torch.int32 and offsets.dtype == torch.int64
    assert torch.equal(ids, want_ids) and torch.equal(offsets, want_offsets)
    assert offsets[-4:].eq(offsets[-1]).all()


def test_build_ivf_edges():
    # Empty corpus (no document, then only empty documents), no centroid, one token, a non-contiguous codes view.
    for cu in (torch.zeros(1, dtype=torch.int64), torch.zeros(4, dtype=torch.int32)):
        ids, offsets = build_ivf(torch.empty(0, dtype=torch.int32), cu, 3)
        assert ids.numel() == 0 and offsets.tolist() == [0, 0, 0, 0]
    assert build_ivf(torch.empty(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 0)[1].tolist() == [0]
    ids, offsets = build_ivf(torch.tensor([1]), torch.tensor([0, 0, 1]), 2)
    assert ids.tolist() == [1] and offsets.tolist() == [0, 0, 1]
    codes = torch.tensor([[3, 9], [0, 9], [3, 9], [3, 9]], dtype=torch.int32)[:, 0]
    ids, offsets = build_ivf(codes, torch.tensor([0, 2, 4]), 4)
    assert ids.tolist() == [0, 0, 1] and offsets.tolist() == [0, 1, 1, 1, 3]


@pytest.mark.parametrize("threshold", [None, "mid"])
@pytest.mark.parametrize("n_probe", [1, 3, 16, 40])
def test_matches_reference(block_bytes, n_probe, threshold):
    codes, cu = _corpus()
    Q, mask, centroids = _queries()
    if threshold == "mid":  # halfway between two neighbouring centroid maxima: no fp32 / fp64 boundary case
        best = torch.einsum("qsd,cd->qsc", Q.double(), centroids.double()).amax(1).flatten().sort().values
        threshold = float(best[best.numel() // 2 - 1 : best.numel() // 2 + 1].mean())
    want = generate_candidates_reference(
        Q, mask, centroids, codes, cu, n_probe=n_probe, n_candidates=55, centroid_score_threshold=threshold
    )
    ids, offsets = build_ivf(codes, cu, 16)
    for n_candidates in (1, 7, 40, 55):  # 55 > N: -1 padding
        got = generate_candidates(
            Q,
            mask,
            centroids,
            ids,
            offsets,
            codes,
            cu,
            n_probe=n_probe,
            n_candidates=n_candidates,
            centroid_score_threshold=threshold,
        )
        assert got.dtype == torch.int64 and got.shape == (5, n_candidates)
        assert torch.equal(got, want[:, :n_candidates]), (n_candidates, got, want)
    if threshold is not None:  # the threshold pruned something: without it the ranking differs
        full = generate_candidates_reference(Q, mask, centroids, codes, cu, n_probe=n_probe, n_candidates=40)
        assert not torch.equal(full, want[:, :40])


def test_recall_property(block_bytes):
    # Every centroid probed, room for every document: each document with a token is a candidate of every query
    # with a valid token, in any order; empty documents and all-masked queries get nothing.
    codes, cu = _corpus(n_docs=50, C=12, seed=5)
    Q, mask, centroids = _queries(Nq=4, C=12, seed=6)
    mask[2] = False
    ids, offsets = build_ivf(codes, cu, 12)
    got = generate_candidates(Q, mask, centroids, ids, offsets, codes, cu, n_probe=12, n_candidates=50)
    with_tokens = set(torch.nonzero(cu.diff() > 0).flatten().tolist())
    assert 0 < len(with_tokens) < 50
    for i in (0, 1, 3):
        row = got[i][got[i] >= 0].tolist()
        assert len(row) == len(set(row)) and set(row) == with_tokens
        assert (got[i][len(row) :] == -1).all()
    assert (got[2] == -1).all()


def test_masked_padding_is_ignored(block_bytes):
    # NaN and inf in masked query tokens change nothing; an all-masked query has no candidate.
    codes, cu = _corpus()
    Q, mask, centroids = _queries()
    mask[3] = False
    dirty = Q.clone()
    dirty[~mask] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30] * 2)
    clean_got, want = _both(Q, mask, centroids, codes, cu, n_probe=2, n_candidates=10)
    dirty_got = generate_candidates(
        dirty, mask, centroids, *build_ivf(codes, cu, 16), codes, cu, n_probe=2, n_candidates=10
    )
    assert torch.equal(clean_got, want) and torch.equal(dirty_got, want)
    assert (want[3] == -1).all()


def test_ties_go_to_the_lower_document(block_bytes):
    # Documents 1, 2 and 4 hold the same centroids in different orders and counts: equal approximate scores.
    centroids = torch.eye(4)
    codes = torch.tensor([3, 0, 1, 1, 0, 0, 1, 2, 1, 0, 0], dtype=torch.int32)
    cu = torch.tensor([0, 1, 3, 6, 8, 11])
    Q = torch.tensor([[[1.0, 0.5, 0.0, -1.0], [0.0, 1.0, 0.2, -1.0]]])  # probes 0, 1 and 1, 2: never 3
    got, want = _both(Q, None, centroids, codes, cu, n_probe=2, n_candidates=5)
    # doc 3 holds 1 and 2: 0.5 + 1; docs 1, 2, 4: 1 + 1; doc 0 holds only centroid 3, never probed.
    assert got.tolist() == want.tolist() == [[1, 2, 4, 3, -1]]


def test_fully_pruned_candidates_rank_last(block_bytes):
    # Centroid 2 is probed (n_probe covers all) but below the threshold: document 1, which holds only it, stays a
    # candidate after document 0 and before the padding.
    centroids = torch.eye(3)
    codes, cu = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 1, 2])
    Q = torch.tensor([[[1.0, 0.0, 0.1]]])
    got, want = _both(Q, None, centroids, codes, cu, n_probe=3, n_candidates=3, centroid_score_threshold=0.5)
    assert got.tolist() == want.tolist() == [[0, 1, -1]]


def test_nan_scores_rank_last(block_bytes):
    codes, cu = _corpus(n_docs=20, C=8, seed=7)
    Q, mask, centroids = _queries(Nq=3, C=8, seed=8)
    centroids[5] = float("nan")
    got, want = _both(Q, mask, centroids, codes, cu, n_probe=8, n_candidates=20)
    assert torch.equal(got, want)
    nan_docs = {doc for doc in range(20) if (codes[cu[doc] : cu[doc + 1]] == 5).any()}
    row = got[0][got[0] >= 0].tolist()
    assert nan_docs and set(row[-len(nan_docs) :]) == nan_docs


def test_half_and_views(block_bytes):
    # fp16 queries and centroids, a non-contiguous Q and mask, int32 offsets and int64 codes, int64 ivf ids.
    codes, cu = _corpus(seed=9, offsets_dtype=torch.int32)
    Q, mask, centroids = _queries(seed=10)
    Qh = Q.half().transpose(0, 1).contiguous().transpose(0, 1)
    mask_view = mask.t().contiguous().t()
    assert not Qh.is_contiguous() and not mask_view.is_contiguous()
    ids, offsets = build_ivf(codes, cu, 16)
    got = generate_candidates(
        Qh, mask_view, centroids.half(), ids.long(), offsets, codes.long(), cu, n_probe=2, n_candidates=12
    )
    want = generate_candidates_reference(
        Qh.float(), mask, centroids.half().float(), codes, cu, n_probe=2, n_candidates=12
    )
    assert torch.equal(got, want)


def test_empty_and_tiny():
    Q, _, centroids = _queries(Nq=2, Lq=3, d=8, C=4)
    empty = torch.empty(0, dtype=torch.int32)
    for cu in (torch.zeros(1, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)):  # no tokens
        ids, offsets = build_ivf(empty, cu, 4)
        got = generate_candidates(Q, None, centroids, ids, offsets, empty, cu, n_probe=2, n_candidates=3)
        assert got.tolist() == [[-1] * 3] * 2
    ids, offsets = build_ivf(empty, torch.zeros(1, dtype=torch.int64), 0)
    got = generate_candidates(
        Q, None, centroids[:0], ids, offsets, empty, torch.zeros(1, dtype=torch.int64), n_probe=1, n_candidates=2
    )
    assert got.tolist() == [[-1, -1]] * 2
    codes, cu = torch.tensor([2], dtype=torch.int32), torch.tensor([0, 0, 1])
    ids, offsets = build_ivf(codes, cu, 4)
    args = (centroids, ids, offsets, codes, cu)
    assert generate_candidates(Q, None, *args, n_probe=4, n_candidates=1).tolist() == [[1], [1]]
    assert generate_candidates(Q, None, *args, n_probe=4, n_candidates=0).shape == (2, 0)
    assert generate_candidates(Q[:0], None, *args, n_probe=4, n_candidates=2).shape == (0, 2)
    assert generate_candidates(Q[:, :0], None, *args, n_probe=4, n_candidates=2).tolist() == [[-1, -1]] * 2


def test_refusals():
    codes, cu = _corpus()
    Q, mask, centroids = _queries()
    ids, offsets = build_ivf(codes, cu, 16)
    args = (Q, mask, centroids, ids, offsets, codes, cu)
    kw = dict(n_probe=2, n_candidates=4)

    def call(i=None, value=None, **over):
        a = list(args)
        if i is not None:
            a[i] = value
        return generate_candidates(*a, **{**kw, **over})

    cases = [
        (TypeError, "Q", dict(i=0, value=Q.long())),
        (ValueError, "Q", dict(i=0, value=Q[0])),
        (TypeError, "q_mask", dict(i=1, value=mask.int())),
        (ValueError, "q_mask", dict(i=1, value=mask[:, :2])),
        (ValueError, "centroids", dict(i=2, value=centroids[:, :4])),
        (TypeError, "ivf_doc_ids", dict(i=3, value=ids.float())),
        (ValueError, "ivf_offsets", dict(i=4, value=offsets[:-1])),
        (ValueError, "ivf_offsets", dict(i=4, value=offsets.flip(0))),
        (ValueError, "ivf_doc_ids", dict(i=3, value=ids + 100)),
        (ValueError, "codes", dict(i=5, value=codes + 16)),
        (TypeError, "codes", dict(i=5, value=codes.short())),
        (ValueError, "cu_seqlens", dict(i=6, value=cu[:-1])),
        (ValueError, "cu_seqlens", dict(i=6, value=cu.flip(0))),
        (ValueError, "n_probe", dict(n_probe=0)),
        (ValueError, "n_probe", dict(n_probe=True)),
        (ValueError, "n_candidates", dict(n_candidates=-1)),
        (ValueError, "n_candidates", dict(n_candidates=2.0)),
        (ValueError, "centroid_score_threshold", dict(centroid_score_threshold=float("nan"))),
        (ValueError, "centroid_score_threshold", dict(centroid_score_threshold="0.5")),
    ]
    for error, name, over in cases:
        with pytest.raises(error, match=name):
            call(**over)
    with pytest.raises(ValueError, match="num_centroids"):
        build_ivf(codes, cu, -1)
    with pytest.raises(ValueError, match="codes"):
        build_ivf(codes, cu, 8)
    with pytest.raises(ValueError, match="cu_seqlens"):
        build_ivf(codes, cu[1:], 16)


@pytest.mark.gpu
def test_gpu_matches_cpu_and_stays_in_budget(monkeypatch):
    # The GPU path (the interaction kernel) against the CPU's on a corpus big enough to split every stage with a
    # 4 MiB budget: fp32 inputs (products equal up to summation order; a near-tie may swap at the boundary), and
    # peak memory a small multiple of the budget. fp16 inputs (tensor-core scores): the recall property exactly.
    g = torch.Generator().manual_seed(0)
    C, d, n_docs = 2048, 128, 4_000
    lengths = torch.randint(0, 150, (n_docs,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    codes = torch.randint(0, C, (int(cu[-1]),), generator=g, dtype=torch.int32)
    centroids = F.normalize(torch.randn(C, d, generator=g), dim=-1)
    Q = F.normalize(torch.randn(64, 32, d, generator=g), dim=-1)
    mask = torch.rand(64, 32, generator=g) > 0.2
    kw = dict(n_probe=4, n_candidates=256, centroid_score_threshold=0.1)
    gpu = [t.cuda() for t in (Q, mask, centroids)]
    ids, offsets = build_ivf(codes.cuda(), cu.cuda(), C)
    assert torch.equal(ids.cpu(), build_ivf(codes, cu, C)[0])
    corpus = (ids, offsets, codes.cuda(), cu.cuda())
    monkeypatch.setattr(candidates, "BLOCK_BYTES", 1 << 22)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got = generate_candidates(*gpu, *corpus, **kw)
    assert torch.cuda.max_memory_allocated() - base < 16 * (1 << 22)
    monkeypatch.setattr(lik._device, "interpreting", lambda: False)
    monkeypatch.setattr(candidates, "BLOCK_BYTES", 1 << 30)  # the CPU's gathers in a few blocks, not thousands
    want = generate_candidates(Q, mask, centroids, ids.cpu(), offsets.cpu(), codes, cu, **kw)
    overlap = [len(set(a.tolist()) & set(b.tolist())) for a, b in zip(got.cpu(), want)]
    assert min(overlap) >= 250, overlap
    monkeypatch.setattr(candidates, "BLOCK_BYTES", 1 << 22)
    half = generate_candidates(gpu[0].half(), gpu[1], gpu[2].half(), *corpus, n_probe=C, n_candidates=n_docs)
    with_tokens = torch.nonzero(lengths > 0).flatten()
    for row in half.cpu():
        assert torch.equal(row[row >= 0].sort().values, with_tokens)


@pytest.fixture
def small_kernel_blocks(monkeypatch):
    """Token and query-token blocks of 4, so that tiny interpreter shapes walk several of each."""
    monkeypatch.setattr(interaction, "_BLOCK_T", 4)
    monkeypatch.setattr(interaction, "_MAX_BLOCK_L", 4)


@pytest.mark.parametrize("with_keep", [False, True])
def test_interaction_kernel_matches_torch(small_kernel_blocks, with_keep):
    # 6 pairs: documents of 1 to 9 tokens (1 to 3 token blocks), 6 query tokens (2 passes of 4), masked query
    # tokens holding NaN and inf, a document whose tokens are all pruned (-inf), a NaN kept score (NaN).
    g = torch.Generator().manual_seed(11)
    St = torch.randn(2, 5, 6, generator=g)
    St[:, :, 5] = float("nan")  # query token 5 is masked below: never read into a score
    St[1, :, 4] = float("inf")
    codes = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 4, 3, 2, 1], dtype=torch.int32)
    cu = torch.tensor([0, 9, 10, 12, 14])
    valid = torch.tensor([[1, 1, 1, 0, 1, 0], [1, 0, 1, 1, 0, 0]], dtype=torch.bool)
    keep = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 0]], dtype=torch.bool) if with_keep else None
    pair_q, pair_doc = torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([0, 1, 3, 0, 2, 3])
    if with_keep:
        St[0, 3, 0] = float("nan")  # kept centroid 3 of query 0: document 0 (which holds it) scores NaN
    got = interaction.centroid_interaction(St, valid, keep, pair_q, pair_doc, codes, cu)
    want = interaction.centroid_interaction_torch(St, valid, keep, pair_q, pair_doc, codes, cu, 1 << 20)
    torch.testing.assert_close(got, want, equal_nan=True)
    if with_keep:
        assert got[0].isnan() and got[1] == float("-inf") and got[2:].isfinite().all()  # doc 1: only centroid 4
    else:
        assert got.isfinite().all()


def test_kernel_path_matches_reference(small_kernel_blocks):
    # generate_candidates end to end with stage 3 in the kernel (the interpreter here, the GPU's path).
    codes, cu = _corpus(n_docs=8, C=6, max_len=7, seed=12)
    Q, mask, centroids = _queries(Nq=2, Lq=5, C=6, seed=13)
    got, want = _both(Q, mask, centroids, codes, cu, n_probe=2, n_candidates=6, centroid_score_threshold=0.0)
    assert torch.equal(got, want)


def test_interaction_kernel_compiles_for_sm90(monkeypatch):
    # The interpreter accepts code the real compiler rejects: compile every variant for Hopper (no GPU needed).
    sm90 = pytest.importorskip("tests.test_compile_sm90")
    St, valid = torch.randn(2, 5, 100), torch.ones(2, 100, dtype=torch.bool)
    codes, cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32), torch.tensor([0, 3, 4])
    pairs = torch.tensor([0, 1]), torch.tensor([0, 1])

    def workload():
        for Lq in (32, 100):  # one pass over the query tokens, two
            for keep in (None, torch.ones(2, 5, dtype=torch.bool)):
                interaction.centroid_interaction(St[..., :Lq].contiguous(), valid[:, :Lq], keep, *pairs, codes, cu)

    built = sm90.compile_for_sm90(sm90._record_launches(monkeypatch, workload))
    assert len(built) == 4
