"""What candidate search at a billion tokens relies on, at test sizes: queries scored in groups (each group scores
the union of its own candidates) give the results of one group, masks and partial last groups included; the
value checks of generate_candidates can be skipped for a known-good corpus and then read nothing."""

from __future__ import annotations

import pytest
import torch

import lik
from lik.compression import candidates as plaid_candidates
from lik.index import plaid_search

from .test_plaid import make_docs, queries, reference_scores

LENGTHS = (5, 3, 7, 1, 4, 9, 2, 6, 3, 8, 1, 5, 4, 7, 2, 6, 3, 5, 2, 4)


@pytest.fixture
def index():
    return lik.Index.build(
        make_docs(3, LENGTHS), codec="plaid", nbits=2, dtype=torch.float32, shard_tokens=40, progress=False
    )


def test_scoring_groups_change_nothing(index, monkeypatch):
    Q = queries(11, n=4, lq=3)
    q_mask = torch.ones(4, 3, dtype=torch.bool)
    q_mask[2, 1:] = False  # a masked query in a later group: its own mask must follow it
    n_candidates = 6
    one_group = index.search(Q, 4, q_mask, n_probe=2, candidates=n_candidates)
    ref = reference_scores(index.codec, make_docs(3, LENGTHS), Q, q_mask)
    for per_group in (1, 3):  # groups of one, and a partial last group
        monkeypatch.setattr(plaid_search, "SCORED_PAIRS", per_group * n_candidates)
        grouped = index.search(Q, 4, q_mask, n_probe=2, candidates=n_candidates)
        assert torch.equal(grouped[1], one_group[1])
        # Off the GPU each group's scores are one BLAS product, whose sums a CPU blocks by the product's shape: equal
        # to an ulp or two (on the GPU another batch shape may take another scan configuration, below).
        torch.testing.assert_close(grouped[0], one_group[0], rtol=5e-7, atol=0)
        # And both are the exact scores of the codec's decoded documents.
        found = grouped[1] >= 0
        assert found.any()
        want = ref.gather(1, grouped[1].clamp_min(0))[found]
        torch.testing.assert_close(grouped[0][found].double(), want, atol=1e-4, rtol=1e-5)


def test_groups_of_one_query_without_candidates(index, monkeypatch):
    # A query with no valid token has no candidate: its group is skipped, the others are scored.
    Q = queries(12, n=3, lq=3)
    q_mask = torch.ones(3, 3, dtype=torch.bool)
    q_mask[1] = False
    monkeypatch.setattr(plaid_search, "SCORED_PAIRS", 4)
    scores, ids = index.search(Q, 3, q_mask, n_probe=3, candidates=4)
    assert (ids[1] == -1).all() and scores[1].isneginf().all()
    assert (ids[[0, 2]] >= 0).all()


def _corpus(index):
    segment = index.segments[0]
    cu = segment.cu_seqlens.to(torch.int32)
    ivf = plaid_candidates.build_ivf(segment.codes, cu, index.codec.num_centroids)
    return segment.codes, cu, ivf


def test_value_checks_can_be_skipped(index):
    codes, cu, (ivf_ids, ivf_offsets) = _corpus(index)
    Q = queries(13, n=2, lq=3)
    kw = dict(n_probe=2, n_candidates=5)
    args = (Q, None, index.codec.centroids, ivf_ids, ivf_offsets)
    checked = plaid_candidates.generate_candidates(*args, codes, cu, **kw)
    unchecked = plaid_candidates.generate_candidates(*args, codes, cu, **kw, check_values=False)
    assert torch.equal(checked, unchecked)
    # Trailing codes past cu_seqlens[-1]: refused when checked; skipped, they are never read.
    longer = torch.cat([codes, codes[:3]])
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to"):
        plaid_candidates.generate_candidates(*args, longer, cu, **kw)
    assert torch.equal(plaid_candidates.generate_candidates(*args, longer, cu, **kw, check_values=False), checked)


def test_skipped_checks_read_no_value(index, monkeypatch):
    codes, cu, (ivf_ids, ivf_offsets) = _corpus(index)
    calls = []
    real = plaid_candidates._ValueChecks.add

    def spy(self, flag, error):
        calls.append(error)
        return real(self, flag, error)

    monkeypatch.setattr(plaid_candidates._ValueChecks, "add", spy)
    args = (queries(14, n=1, lq=2), None, index.codec.centroids, ivf_ids, ivf_offsets, codes, cu)
    plaid_candidates.generate_candidates(*args, n_probe=1, n_candidates=3, check_values=False)
    assert calls == []
    plaid_candidates.generate_candidates(*args, n_probe=1, n_candidates=3)
    assert len(calls) >= 4  # offsets, codes, IVF offsets, IVF ids


@pytest.mark.gpu
def test_scoring_groups_on_the_gpu(monkeypatch):
    """200 000 clustered tokens on the GPU, 64 queries: groups of 1, 8 and all queries give the same top 10."""
    # (Any real candidate search also runs groups: 256 queries of 4 096 candidates score in 32 groups of 8.)
    g = torch.Generator(device="cuda").manual_seed(0)
    centres = torch.nn.functional.normalize(torch.randn(256, 128, device="cuda", generator=g), dim=-1)
    n_docs = 2_000
    lengths = torch.randint(60, 141, (n_docs,), device="cuda", generator=g)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    owner = torch.repeat_interleave(torch.arange(n_docs, device="cuda"), lengths)
    topics = torch.randint(0, 256, (n_docs, 4), device="cuda", generator=g)
    pick = topics[owner, torch.randint(0, 4, (owner.numel(),), device="cuda", generator=g)]
    noise = torch.randn(owner.numel(), 128, device="cuda", generator=g) * (0.8 / 128**0.5)
    tokens = torch.nn.functional.normalize(centres[pick] + noise, dim=-1).half()
    batch = lik.index.DocumentBatch.packed(tokens, cu)
    index = lik.Index.build([batch], codec="plaid", nbits=2, num_centroids=1024, placement="gpu", progress=False)
    docs = torch.randint(0, owner.numel(), (64, 32), device="cuda", generator=g)
    Q = torch.nn.functional.normalize(tokens[docs].float() + 0.02 * torch.randn_like(tokens[docs].float()), dim=-1)
    Q = Q.half()
    results = []
    for pairs in (1 << 30, 8 * 256, 256):  # every query in one group, groups of 8, groups of 1
        monkeypatch.setattr(plaid_search, "SCORED_PAIRS", pairs)
        results.append(index.search(Q, 10, n_probe=4, candidates=256))
    for scores, ids in results[1:]:
        # Another batch shape may pick another scan configuration (another order of the fp32 sums): equal up to
        # rounding, and the same documents but where rounding reorders a near tie.
        torch.testing.assert_close(scores, results[0][0], rtol=1e-5, atol=1e-4)
        assert (ids == results[0][1]).float().mean() > 0.99
    assert (results[0][1] >= 0).all()
