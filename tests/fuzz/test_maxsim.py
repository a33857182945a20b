"""Fuzz ``lik.maxsim`` against the float64 brute force of ``common.pair_score``: both mask modes, both backwards,
2-D / 3-D ``Q``, 3-D / 4-D ``D``, sizes from 0, odd widths, bool and integer masks, exact ties, garbage in masked
positions and around non-contiguous views, scores and gradients, on the kernels (interpreter) and the reference."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import event, example, given
from hypothesis import strategies as st

import lik
from lik._dispatch import uses_kernels

from .common import (
    EXACT_KINDS, KINDS, LAYOUTS, PATHS, as_mask_argument, as_view, assert_matches, brute_maxsim, draw_mask,
    fuzz_settings, grads_of, poison, run_on, values,
)

WIDTHS = [1, 2, 3, 5, 8, 16, 17, 33]
MASK_FORMS = [None, "bool", "int64", "int32", "uint8"]


@dataclass(frozen=True)
class Case:
    query_3d: bool
    per_query_docs: bool
    n_q: int
    l_q: int
    n_docs: int
    l_d: int
    dim: int
    kind: str
    dtype: torch.dtype
    q_mask: str | None  # None or the form of the mask argument
    d_mask: str | None
    density: float  # chance that a token is real
    garbage: bool  # garbage in masked positions
    duplicates: bool  # copies of earlier document tokens later in the document (exact ties)
    valid_nan: bool  # a NaN in one real token ("exclude" mode only)
    layouts: tuple[str, str, str, str]  # Q, D, q_mask, d_mask
    backward: str
    seed: int


@st.composite
def cases(draw):
    query_3d = draw(st.booleans())
    kind = draw(st.sampled_from(KINDS))
    return Case(
        query_3d=query_3d,
        per_query_docs=query_3d and draw(st.booleans()),
        n_q=draw(st.integers(0, 3)) if query_3d else 1,
        l_q=draw(st.integers(0, 6)),
        n_docs=draw(st.integers(0, 4)),
        l_d=draw(st.one_of(st.integers(0, 6), st.integers(7, 20))),
        dim=draw(st.sampled_from(WIDTHS)),
        kind=kind,
        dtype=draw(st.sampled_from([torch.float32, torch.float16])),
        q_mask=draw(st.sampled_from(MASK_FORMS)),
        d_mask=draw(st.sampled_from(MASK_FORMS)),
        density=draw(st.sampled_from([0.0, 0.3, 0.7, 1.0])),
        garbage=draw(st.booleans()),
        duplicates=draw(st.booleans()),
        valid_nan=draw(st.booleans()),
        layouts=tuple(draw(st.sampled_from(LAYOUTS)) for _ in range(4)),
        backward=draw(st.sampled_from(["fast", "deterministic"])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _build(case: Case, mask_mode: str):
    """Canonical contents (``[Nq, Lq, d]``, ``[Ns, B, Ld, d]``, bool masks, the upstream gradient) and what the
    call receives (views in the case's layouts, masks in their forms)."""
    gen = torch.Generator().manual_seed(case.seed)
    n_sets = case.n_q if case.per_query_docs else 1
    Q = values(gen, (case.n_q, case.l_q, case.dim), case.kind, case.dtype)
    D = values(gen, (n_sets, case.n_docs, case.l_d, case.dim), case.kind, case.dtype)
    if case.duplicates and case.l_d > 1:
        source = torch.randint(0, case.l_d - 1, (case.l_d,), generator=gen)
        later = torch.arange(case.l_d) > source
        take = later & (torch.rand(case.l_d, generator=gen) < 0.5)
        D[:, :, take] = D[:, :, source[take]]
    qm = draw_mask(gen, Q.shape[:-1], case.density) if case.q_mask else torch.ones(Q.shape[:-1], dtype=torch.bool)
    dm = draw_mask(gen, D.shape[:-1], case.density) if case.d_mask else torch.ones(D.shape[:-1], dtype=torch.bool)
    if case.garbage:
        Q, D = poison(Q, ~qm, gen), poison(D, ~dm, gen)
    if case.valid_nan and mask_mode == "exclude":
        for x, m in ((Q, qm), (D, dm)):
            real = m.nonzero()
            if len(real) and bool(torch.rand((), generator=gen) < 0.5):
                x[tuple(real[int(torch.randint(0, len(real), (), generator=gen))])] = float("nan")
    grad = values(gen, (case.n_q, case.n_docs), "coarse" if case.kind in EXACT_KINDS else "gaussian", torch.float32)

    # The caller's view of the same contents: Q 2-D or 3-D, D shared (3-D) or per query (4-D).
    q_arg = Q if case.query_3d else Q[0]
    d_arg = D if case.per_query_docs else D[0]
    qm_arg = qm if case.query_3d else qm[0]
    dm_arg = dm if case.per_query_docs else dm[0]
    call = dict(
        Q=as_view(q_arg, case.layouts[0], requires_grad=True),
        D=as_view(d_arg, case.layouts[1], requires_grad=True),
        q_mask=as_mask_argument(qm_arg if case.q_mask else None, case.q_mask, case.layouts[2]),
        d_mask=as_mask_argument(dm_arg if case.d_mask else None, case.d_mask or "bool", case.layouts[3]),
    )
    return Q, D, qm, dm, grad, call


# Known: a side with no valid token, with masked garbage on the other side (NaN on the reference path today).
EMPTY_DOCS_MASKED_NAN_QUERY = Case(True, False, 2, 3, 2, 0, 8, "dyadic", torch.float32, "bool", None, 0.3, True,
                                   False, False, ("contiguous",) * 4, "fast", 1)
EMPTY_QUERY_MASKED_INF_DOCS = Case(True, False, 1, 0, 2, 3, 8, "dyadic", torch.float32, None, "bool", 0.3, True,
                                   False, False, ("contiguous",) * 4, "deterministic", 2)


@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
@pytest.mark.parametrize("path", PATHS)
@fuzz_settings(1.0)
@given(case=cases())
@example(case=EMPTY_DOCS_MASKED_NAN_QUERY)
@example(case=EMPTY_QUERY_MASKED_INF_DOCS)
def test_maxsim_matches_brute_force(path, mask_mode, case):
    Q, D, qm, dm, grad, call = _build(case, mask_mode)
    with run_on(path):
        assert uses_kernels(call["Q"]) == (path == "kernel")
        scores = lik.maxsim(**call, mask_mode=mask_mode, backward=case.backward)
        dq, dd = grads_of(scores, (call["Q"], call["D"]), grad if case.query_3d else grad[0])

    Q64 = Q.double().requires_grad_()
    D64 = D.double().requires_grad_()
    expected, gap = brute_maxsim(Q64, D64, qm, dm, mask_mode)
    expected_shape = (case.n_q, case.n_docs) if case.query_3d else (case.n_docs,)
    assert scores.dtype == torch.float32 and tuple(scores.shape) == expected_shape
    exact = case.kind in EXACT_KINDS
    assert_matches(scores, expected if case.query_3d else expected[0], "scores", exact=exact)

    assert dq.dtype == case.dtype and dd.dtype == case.dtype
    # Masked and padded positions get exactly 0, whatever they hold.
    assert torch.all(dq[~(qm if case.query_3d else qm[0])] == 0), "gradient reached a masked query token"
    assert torch.all(dd[~(dm if case.per_query_docs else dm[0])] == 0), "gradient reached a masked document token"
    if torch.isnan(expected).any():
        event("gradients not compared: NaN in a real token (only the scores are specified)")
        return
    if not exact and gap < 1e-5 * (1 + case.dim):
        event("gradients not compared: a near-tie (float32 rounding may pick the other winner)")
        return
    rdq, rdd = grads_of(expected, (Q64, D64), grad)
    if not case.query_3d:
        rdq = rdq[0]
    if not case.per_query_docs:
        rdd = rdd[0]
    rtol = 1e-5 if case.dtype == torch.float32 else 2e-3
    assert_matches(dq, rdq, "grad Q", exact=exact, rtol=rtol)
    assert_matches(dd, rdd, "grad D", exact=exact, rtol=rtol)
