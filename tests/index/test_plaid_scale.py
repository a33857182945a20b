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
        torch.testing.assert_close(grouped[0], one_group[0], rtol=0, atol=0)
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
