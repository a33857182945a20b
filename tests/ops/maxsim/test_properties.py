"""Property tests (hypothesis): whatever garbage sits in masked positions -- huge values, inf, NaN -- scores and
gradients do not change, on the kernels (interpreter) and on the reference path ("exclude" mode; the "zero" mode
is covered too, its masked similarities being exactly 0 whatever the stored values)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lik

from .helpers import kernel_with_grads

GARBAGE = [float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 65504.0]


@st.composite
def problems(draw):
    n_q = draw(st.integers(1, 3))
    l_q = draw(st.integers(1, 9))
    n_docs = draw(st.integers(1, 4))
    l_d = draw(st.integers(1, 20))
    dim = draw(st.sampled_from([1, 3, 16, 24]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    Q = torch.randn(n_q, l_q, dim, generator=gen)
    D = torch.randn(n_docs, l_d, dim, generator=gen)
    q_mask = torch.rand(n_q, l_q, generator=gen) > draw(st.floats(0.0, 0.9))
    d_mask = torch.rand(n_docs, l_d, generator=gen) > draw(st.floats(0.0, 0.9))
    fill_q = torch.tensor(draw(st.lists(st.sampled_from(GARBAGE), min_size=1, max_size=4)))
    fill_d = torch.tensor(draw(st.lists(st.sampled_from(GARBAGE), min_size=1, max_size=4)))
    grad = torch.randn(n_q, n_docs, generator=gen)
    return Q, D, q_mask, d_mask, fill_q, fill_d, grad


def _poison(x, mask, fill):
    x = x.clone()
    n_bad = int((~mask).sum())
    x[~mask] = fill[torch.arange(n_bad * x.shape[-1]) % len(fill)].reshape(n_bad, x.shape[-1])
    return x


@pytest.mark.parametrize("path", ["kernel", "reference"])
@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problem=problems())
def test_garbage_in_masked_positions_never_matters(monkeypatch, path, mask_mode, problem):
    if path == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    Q, D, q_mask, d_mask, fill_q, fill_d, grad = problem
    clean = kernel_with_grads(lik.maxsim, Q, D, q_mask, d_mask, grad, mask_mode=mask_mode)
    dirty = kernel_with_grads(
        lik.maxsim, _poison(Q, q_mask, fill_q), _poison(D, d_mask, fill_d), q_mask, d_mask, grad, mask_mode=mask_mode
    )
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b)
    assert torch.all(clean[1][~q_mask] == 0) and torch.all(clean[2][~d_mask] == 0)
