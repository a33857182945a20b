"""Fuzz the packed scorers against the float64 brute force of ``common.pair_score``: ``lik.maxsim_packed`` (dense
queries against a ragged corpus) and ``lik.maxsim_varlen`` (ragged pairs), with empty and one-token sequences,
odd widths, query masks, garbage in masked query rows and around the packed views, exact ties, the length hints
given or read, scores and gradients through both backwards, on the kernels (interpreter) and the reference."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import event, example, given
from hypothesis import strategies as st

import lik
from lik._dispatch import uses_kernels

from .common import (
    EXACT_KINDS, KINDS, LAYOUTS, PATHS, as_mask_argument, as_view, assert_matches, draw_mask, fuzz_settings,
    grads_of, pair_score, poison, run_on, values,
)

WIDTHS = [1, 2, 3, 5, 8, 16, 17, 33]


def _cu_seqlens(lengths, dtype) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=dtype)


def _duplicate_rows(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Copy some rows of ``x [T, dim]`` over later rows: exact ties inside and across sequences."""
    if x.shape[0] > 1:
        source = torch.randint(0, x.shape[0] - 1, (x.shape[0],), generator=gen)
        take = (torch.arange(x.shape[0]) > source) & (torch.rand(x.shape[0], generator=gen) < 0.5)
        x[take] = x[source[take]]
    return x


def _nan_in_one_row(x: torch.Tensor, valid: torch.Tensor, gen: torch.Generator) -> None:
    real = valid.nonzero()
    if len(real):
        row = tuple(real[int(torch.randint(0, len(real), (), generator=gen))])
        x[row + (int(torch.randint(0, x.shape[-1], (), generator=gen)),)] = float("nan")


@dataclass(frozen=True)
class PackedCase:
    query_3d: bool
    n_q: int
    l_q: int
    doc_lengths: tuple[int, ...]
    dim: int
    kind: str
    dtype: torch.dtype
    q_mask: str | None
    density: float
    garbage: bool
    valid_nan: bool
    layouts: tuple[str, str, str]  # Q, d, q_mask
    cu_dtype: torch.dtype
    hint: bool  # max_seqlen_d given
    backward: str
    seed: int


@st.composite
def packed_cases(draw):
    query_3d = draw(st.booleans())
    return PackedCase(
        query_3d=query_3d,
        n_q=draw(st.integers(0, 3)) if query_3d else 1,
        l_q=draw(st.integers(0, 6)),
        doc_lengths=tuple(draw(st.lists(st.one_of(st.integers(0, 3), st.integers(4, 20)), max_size=5))),
        dim=draw(st.sampled_from(WIDTHS)),
        kind=draw(st.sampled_from(KINDS)),
        dtype=draw(st.sampled_from([torch.float32, torch.float16])),
        q_mask=draw(st.sampled_from([None, "bool", "int64", "uint8"])),
        density=draw(st.sampled_from([0.0, 0.5, 1.0])),
        garbage=draw(st.booleans()),
        valid_nan=draw(st.booleans()),
        layouts=tuple(draw(st.sampled_from(LAYOUTS)) for _ in range(3)),
        cu_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        hint=draw(st.booleans()),
        backward=draw(st.sampled_from(["fast", "deterministic"])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


# Known: an empty document against masked garbage in the query.
EMPTY_DOC_MASKED_NAN_QUERY = PackedCase(True, 2, 3, (3, 0, 2), 8, "dyadic", torch.float32, "bool", 0.5, True, False,
                                        ("contiguous",) * 3, torch.int32, True, "fast", 3)


@pytest.mark.parametrize("path", PATHS)
@fuzz_settings(1.0)
@given(case=packed_cases())
@example(case=EMPTY_DOC_MASKED_NAN_QUERY)
def test_maxsim_packed_matches_brute_force(path, case):
    gen = torch.Generator().manual_seed(case.seed)
    total = sum(case.doc_lengths)
    Q = values(gen, (case.n_q, case.l_q, case.dim), case.kind, case.dtype)
    d = _duplicate_rows(values(gen, (total, case.dim), case.kind, case.dtype), gen)
    qm = draw_mask(gen, Q.shape[:-1], case.density) if case.q_mask else torch.ones(Q.shape[:-1], dtype=torch.bool)
    if case.garbage:
        Q = poison(Q, ~qm, gen)
    if case.valid_nan:
        if bool(torch.rand((), generator=gen) < 0.5):
            _nan_in_one_row(Q, qm, gen)
        else:
            _nan_in_one_row(d, torch.ones(total, dtype=torch.bool), gen)
    grad = values(gen, (case.n_q, len(case.doc_lengths)), "coarse" if case.kind in EXACT_KINDS else "gaussian")
    cu = _cu_seqlens(case.doc_lengths, case.cu_dtype)

    Q_arg = as_view(Q if case.query_3d else Q[0], case.layouts[0], requires_grad=True)
    d_arg = as_view(d, case.layouts[1], requires_grad=True)
    qm_arg = as_mask_argument((qm if case.query_3d else qm[0]) if case.q_mask else None, case.q_mask, case.layouts[2])
    hint = max(case.doc_lengths, default=0) if case.hint else None
    with run_on(path):
        assert uses_kernels(Q_arg) == (path == "kernel")
        scores = lik.maxsim_packed(Q_arg, d_arg, cu, qm_arg, hint, backward=case.backward)
        dq, dd = grads_of(scores, (Q_arg, d_arg), grad if case.query_3d else grad[0])

    Q64, d64 = Q.double().requires_grad_(), d.double().requires_grad_()
    rows, gap = [], float("inf")
    for n in range(case.n_q):
        row = []
        for j in range(len(case.doc_lengths)):
            doc = d64[int(cu[j]):int(cu[j + 1])]
            score, g = pair_score(Q64[n], qm[n], doc, torch.ones(doc.shape[0], dtype=torch.bool), "exclude")
            row.append(score)
            gap = min(gap, g)
        rows.append(torch.stack(row) if row else torch.zeros(0, dtype=torch.float64))
    expected = torch.stack(rows) if rows else torch.zeros(0, len(case.doc_lengths), dtype=torch.float64)

    assert scores.dtype == torch.float32
    exact = case.kind in EXACT_KINDS
    assert_matches(scores, expected if case.query_3d else expected[0], "scores", exact=exact)
    assert dq.dtype == case.dtype and dd.dtype == case.dtype
    assert torch.all(dq[~(qm if case.query_3d else qm[0])] == 0), "gradient reached a masked query token"
    if torch.isnan(expected).any() or (not exact and gap < 1e-5 * (1 + case.dim)):
        event("gradients not compared: NaN in a real token, or a near-tie")
        return
    rdq, rdd = grads_of(expected, (Q64, d64), grad)
    rtol = 1e-5 if case.dtype == torch.float32 else 2e-3
    assert_matches(dq, rdq if case.query_3d else rdq[0], "grad Q", exact=exact, rtol=rtol)
    assert_matches(dd, rdd, "grad d", exact=exact, rtol=rtol)


@dataclass(frozen=True)
class VarlenCase:
    pairs: tuple[tuple[int, int], ...]  # (query length, document length)
    dim: int
    kind: str
    dtype: torch.dtype
    valid_nan: bool
    layouts: tuple[str, str]
    cu_dtype: torch.dtype
    hints: str  # "none", "exact", "low_q" (a max_seqlen_q below the truth: still exact)
    backward: str
    seed: int


@st.composite
def varlen_cases(draw):
    return VarlenCase(
        pairs=tuple(draw(st.lists(st.tuples(st.integers(0, 6), st.one_of(st.integers(0, 3), st.integers(4, 20))),
                                  max_size=5))),
        dim=draw(st.sampled_from(WIDTHS)),
        kind=draw(st.sampled_from(KINDS)),
        dtype=draw(st.sampled_from([torch.float32, torch.float16])),
        valid_nan=draw(st.booleans()),
        layouts=tuple(draw(st.sampled_from(LAYOUTS)) for _ in range(2)),
        cu_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        hints=draw(st.sampled_from(["none", "exact", "low_q"])),
        backward=draw(st.sampled_from(["fast", "deterministic"])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@pytest.mark.parametrize("path", PATHS)
@fuzz_settings(1.0)
@given(case=varlen_cases())
def test_maxsim_varlen_matches_brute_force(path, case):
    gen = torch.Generator().manual_seed(case.seed)
    q_lengths = [p[0] for p in case.pairs]
    d_lengths = [p[1] for p in case.pairs]
    q = values(gen, (sum(q_lengths), case.dim), case.kind, case.dtype)
    d = _duplicate_rows(values(gen, (sum(d_lengths), case.dim), case.kind, case.dtype), gen)
    if case.valid_nan:
        target = q if bool(torch.rand((), generator=gen) < 0.5) else d
        _nan_in_one_row(target, torch.ones(target.shape[0], dtype=torch.bool), gen)
    grad = values(gen, (len(case.pairs),), "coarse" if case.kind in EXACT_KINDS else "gaussian")
    cu_q, cu_d = _cu_seqlens(q_lengths, case.cu_dtype), _cu_seqlens(d_lengths, case.cu_dtype)
    max_q, max_d = max(q_lengths, default=0), max(d_lengths, default=0)
    if case.hints == "none":
        hints = (None, None)
    elif case.hints == "exact":
        hints = (max_q, max_d)
    else:
        hints = (int(torch.randint(0, max_q + 1, (), generator=gen)), max_d)

    q_arg = as_view(q, case.layouts[0], requires_grad=True)
    d_arg = as_view(d, case.layouts[1], requires_grad=True)
    with run_on(path):
        assert uses_kernels(q_arg) == (path == "kernel")
        scores = lik.maxsim_varlen(q_arg, d_arg, cu_q, cu_d, *hints, backward=case.backward)
        dq, dd = grads_of(scores, (q_arg, d_arg), grad)

    q64, d64 = q.double().requires_grad_(), d.double().requires_grad_()
    parts, gap = [], float("inf")
    for i in range(len(case.pairs)):
        qi, di = q64[int(cu_q[i]):int(cu_q[i + 1])], d64[int(cu_d[i]):int(cu_d[i + 1])]
        score, g = pair_score(qi, torch.ones(qi.shape[0], dtype=torch.bool), di,
                              torch.ones(di.shape[0], dtype=torch.bool), "exclude")
        parts.append(score)
        gap = min(gap, g)
    expected = torch.stack(parts) if parts else torch.zeros(0, dtype=torch.float64)

    assert scores.dtype == torch.float32
    exact = case.kind in EXACT_KINDS
    assert_matches(scores, expected, "scores", exact=exact)
    assert dq.dtype == case.dtype and dd.dtype == case.dtype
    if torch.isnan(expected).any() or (not exact and gap < 1e-5 * (1 + case.dim)):
        event("gradients not compared: NaN in a real token, or a near-tie")
        return
    rdq, rdd = grads_of(expected, (q64, d64), grad)
    rtol = 1e-5 if case.dtype == torch.float32 else 2e-3
    assert_matches(dq, rdq, "grad q", exact=exact, rtol=rtol)
    assert_matches(dd, rdd, "grad d", exact=exact, rtol=rtol)
