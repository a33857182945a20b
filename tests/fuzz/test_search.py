"""Fuzz ``lik.search`` against a brute-force ranking of the float64 brute-force scores: every ``k`` from 0 to
``B``, any chunk size, both mask modes, masks and garbage, NaN documents (ranked last) and many exact ties (ranked
by lower index), on the kernels (interpreter) and the reference. Contents are exact (``coarse`` / ``dyadic``), so
the ranking is determined to the last tie."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lik
from lik._dispatch import uses_kernels

from .common import (
    EXACT_KINDS, LAYOUTS, PATHS, as_mask_argument, as_view, assert_matches, brute_maxsim, draw_mask, fuzz_settings,
    poison, run_on, values,
)


@dataclass(frozen=True)
class SearchCase:
    query_3d: bool
    n_q: int
    l_q: int
    n_docs: int
    l_d: int
    dim: int
    kind: str
    dtype: torch.dtype
    q_mask: str | None
    d_mask: str | None
    density: float
    garbage: bool
    nan_docs: bool
    mask_mode: str
    k_fraction: float
    chunk_size: int | None
    layouts: tuple[str, str]
    seed: int


@st.composite
def search_cases(draw):
    query_3d = draw(st.booleans())
    n_docs = draw(st.integers(0, 7))
    return SearchCase(
        query_3d=query_3d,
        n_q=draw(st.integers(0, 3)) if query_3d else 1,
        l_q=draw(st.integers(0, 4)),
        n_docs=n_docs,
        l_d=draw(st.integers(0, 9)),
        dim=draw(st.sampled_from([1, 2, 3, 7, 16])),
        kind=draw(st.sampled_from(EXACT_KINDS)),
        dtype=draw(st.sampled_from([torch.float32, torch.float16])),
        q_mask=draw(st.sampled_from([None, "bool", "int64"])),
        d_mask=draw(st.sampled_from([None, "bool", "int32"])),
        density=draw(st.sampled_from([0.0, 0.5, 0.8, 1.0])),
        garbage=draw(st.booleans()),
        nan_docs=draw(st.booleans()),
        mask_mode=draw(st.sampled_from(["exclude", "zero"])),
        k_fraction=draw(st.floats(0, 1)),
        chunk_size=draw(st.one_of(st.none(), st.integers(1, max(1, n_docs)))),
        layouts=tuple(draw(st.sampled_from(LAYOUTS)) for _ in range(2)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _brute_top_k(scores: torch.Tensor, k: int):
    """Rank by (NaN last, descending score, lower index), with Python's sort: one row at a time."""
    out_scores, out_ids = [], []
    for row in scores.tolist():
        order = sorted(range(len(row)), key=lambda j: (row[j] != row[j], -row[j] if row[j] == row[j] else 0, j))
        out_ids.append(order[:k])
        out_scores.append([row[j] for j in order[:k]])
    return (torch.tensor(out_scores, dtype=torch.float64).reshape(len(out_scores), k),
            torch.tensor(out_ids, dtype=torch.int64).reshape(len(out_ids), k))


@pytest.mark.parametrize("path", PATHS)
@fuzz_settings(1.0)
@given(case=search_cases())
def test_search_matches_brute_force_ranking(path, case):
    gen = torch.Generator().manual_seed(case.seed)
    Q = values(gen, (case.n_q, case.l_q, case.dim), case.kind, case.dtype)
    D = values(gen, (1, case.n_docs, case.l_d, case.dim), case.kind, case.dtype)
    if case.n_docs > 1:  # whole duplicated documents: tied scores whatever the queries
        D[0, -1] = D[0, 0]
    qm = draw_mask(gen, Q.shape[:-1], case.density) if case.q_mask else torch.ones(Q.shape[:-1], dtype=torch.bool)
    dm = draw_mask(gen, D.shape[:-1], case.density) if case.d_mask else torch.ones(D.shape[:-1], dtype=torch.bool)
    if case.garbage:
        Q, D = poison(Q, ~qm, gen), poison(D, ~dm, gen)
    if case.nan_docs and case.mask_mode == "exclude":
        # A NaN in a real token of some documents: their scores are NaN (where the query has a real token).
        nan_doc = torch.rand(case.n_docs, generator=gen) < 0.4
        for j in nan_doc.nonzero().flatten().tolist():
            real = dm[0, j].nonzero().flatten()
            if len(real):
                D[0, j, int(real[0]), 0] = float("nan")
    k = round(case.k_fraction * case.n_docs)

    Q_arg = as_view(Q if case.query_3d else Q[0], case.layouts[0])
    D_arg = as_view(D[0], case.layouts[1])
    qm_arg = as_mask_argument((qm if case.query_3d else qm[0]) if case.q_mask else None, case.q_mask, "contiguous")
    dm_arg = as_mask_argument(dm[0] if case.d_mask else None, case.d_mask, "transposed")
    with run_on(path):
        assert uses_kernels(Q_arg) == (path == "kernel")
        scores, ids = lik.search(Q_arg, D_arg, k, qm_arg, dm_arg, mask_mode=case.mask_mode,
                                 chunk_size=case.chunk_size)

    full, _ = brute_maxsim(Q.double(), D.double(), qm, dm, case.mask_mode)
    expected_scores, expected_ids = _brute_top_k(full, k)
    if not case.query_3d:
        expected_scores, expected_ids = expected_scores[0], expected_ids[0]
    assert scores.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, expected_ids), f"ids {ids.tolist()}, expected {expected_ids.tolist()} (scores {full})"
    assert_matches(scores, expected_scores, "scores", exact=True)
