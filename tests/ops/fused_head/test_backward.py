"""maxsim_from_hidden's gradients: closed form (interpreter) against the reference's autograd in float64, the
deterministic backward bitwise repeatable, gradcheck of the reference, masked positions exactly 0."""

from __future__ import annotations

import pytest
import torch

from lik.ops.fused_head import maxsim_from_hidden, maxsim_from_hidden_reference
from lik.ops.fused_head import backward as backward_module

from .helpers import leaves, problem

NAMES = ("Q", "H", "W", "b")


def _grads(fn, p, weights, **kw):
    scores = fn(p["Q"], p["H"], p["W"], p["b"], p["q_mask"], p["d_mask"], **kw)
    present = [p[n] for n in NAMES if p[n] is not None]
    return scores, torch.autograd.grad((scores * weights).sum(), present)


def _check(rng, p, **kw):
    weights = torch.randn(p["Q"].shape[0], p["H"].shape[-3] if p["H"].dim() > 2 else 4, generator=rng)
    ref_kw = {k: v for k, v in kw.items() if k != "backward"}
    scores, got = _grads(maxsim_from_hidden, leaves(p), weights, **kw)
    ref_scores, expected = _grads(maxsim_from_hidden_reference, leaves(p, torch.float64), weights.double(), **ref_kw)
    torch.testing.assert_close(scores.double(), ref_scores, rtol=2e-5, atol=2e-5)
    for name, g, e in zip(NAMES, got, expected):
        assert g.dtype == p[name].dtype, name
        torch.testing.assert_close(g.double(), e, rtol=1e-4, atol=1e-5, msg=name)
    return got


@pytest.mark.parametrize("backward", ["fast", "deterministic"])
@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
def test_gradients_match_reference(rng, backward, mask_mode):
    p = problem(rng, l_d=21)  # two tiles, the second ragged
    got = _check(rng, p, mask_mode=mask_mode, backward=backward)
    dh = got[1]
    assert (dh[~p["d_mask"]] == 0).all() and torch.isfinite(dh).all()  # garbage rows: exactly 0
    assert torch.isfinite(got[2]).all() and torch.isfinite(got[3]).all()


@pytest.mark.parametrize("normalize,bias", [(False, True), (True, False)])
def test_gradients_without_normalisation_or_bias(rng, normalize, bias):
    _check(rng, problem(rng, bias=bias, l_d=19), normalize=normalize)


def test_gradients_with_query_rows_split_over_programs(rng):
    p = problem(rng, n_q=5, l_q=7, n_docs=3, l_d=19)  # 35 rows: two programs per document in the interpreter
    from lik.ops.fused_head.forward import fused_head_config, row_splits

    assert row_splits(fused_head_config(d_model=40, d_out=24, rows=35), 35, 3, torch.device("cpu"))[0] == 2
    _check(rng, p, backward="deterministic")


def test_gradients_per_query_documents(rng):
    _check(rng, problem(rng, per_query=True, l_d=19, n_docs=2, l_q=4), backward="deterministic")


def test_gradients_packed(rng, monkeypatch):
    p = problem(rng, n_docs=4, l_d=21, masks=False)
    lengths = [21, 0, 1, 17]
    packed = dict(p, H=torch.cat([p["H"][i, :n] for i, n in enumerate(lengths)]), d_mask=None)
    cu = torch.tensor([0, 21, 21, 22, 39], dtype=torch.int32)
    monkeypatch.setattr(backward_module, "BACKWARD_BUDGET_BYTES", 4 * 22 * (2 * 40 + 4 * 24))  # several chunks
    _check(rng, packed, cu_seqlens=cu, backward="deterministic")


def test_chunks_do_not_change_the_gradients(rng, monkeypatch):
    p = problem(rng, n_docs=3, l_d=9)
    weights = torch.randn(3, 3, generator=rng)
    whole = _grads(maxsim_from_hidden, leaves(p), weights, backward="deterministic")[1]
    monkeypatch.setattr(backward_module, "BACKWARD_BUDGET_BYTES", 1)  # a document per chunk
    chunked = _grads(maxsim_from_hidden, leaves(p), weights, backward="deterministic")[1]
    for a, c in zip(whole, chunked):
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-7)


def test_deterministic_backward_is_bitwise_repeatable(rng):
    p = problem(rng, n_docs=2, l_d=19)
    weights = torch.randn(3, 2, generator=rng)
    first = _grads(maxsim_from_hidden, leaves(p), weights, backward="deterministic")[1]
    second = _grads(maxsim_from_hidden, leaves(p), weights, backward="deterministic")[1]
    for a, c in zip(first, second):
        assert torch.equal(a, c)


def test_ties_go_to_the_first_token(rng):
    """Equal hidden rows (within a tile and across tiles) project equally: the gradient goes to the first only."""
    p = problem(rng, n_docs=2, l_d=33, masks=False)
    H = p["H"].clone()
    H[0, 2] = H[0, 1]
    H[0, 20] = H[0, 1]
    p["Q"] = p["Q"].clone()
    p["Q"][:, :, :] = torch.nn.functional.normalize(torch.nn.functional.linear(H[0, 1], p["W"], p["b"]), dim=-1)
    p["H"] = H
    dh = _check(rng, p)[1]
    assert (dh[0, 1] != 0).any() and (dh[0, 2] == 0).all() and (dh[0, 20] == 0).all()


def test_zero_projection_row_gradient(rng):
    """A row projecting to 0 (norm below F.normalize's eps): dU = dP / eps, as F.normalize's clamp gives."""
    p = problem(rng, n_q=1, l_q=3, n_docs=1, l_d=1, masks=False, bias=False)
    p["H"] = torch.zeros_like(p["H"])
    scores, got = _grads(maxsim_from_hidden, leaves(p), torch.ones(1, 1))
    _, expected = _grads(maxsim_from_hidden_reference, leaves(p, torch.float64), torch.ones(1, 1, dtype=torch.float64))
    assert (scores == 0).all()
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.double(), e, rtol=1e-5, atol=1e-5 * e.abs().max().item())
    assert got[1].abs().max() > 1e6  # the 1 / eps scale, not clamped away


def test_only_some_inputs_require_grad(rng):
    p = problem(rng, n_docs=2, l_d=9)
    W = p["W"].clone().requires_grad_()
    scores = maxsim_from_hidden(p["Q"], p["H"], W, p["b"], p["q_mask"], p["d_mask"])
    (dw,) = torch.autograd.grad(scores.sum(), W)
    Wd = p["W"].double().requires_grad_()
    ref = maxsim_from_hidden_reference(p["Q"].double(), p["H"].double(), Wd, p["b"].double(), p["q_mask"],
                                       p["d_mask"])
    (ew,) = torch.autograd.grad(ref.sum(), Wd)
    torch.testing.assert_close(dw.double(), ew, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("normalize", [True, False])
def test_reference_gradcheck(rng, normalize):
    p = problem(rng, n_q=2, l_q=3, n_docs=2, l_d=4, d_model=5, d_out=3, garbage=False, dtype=torch.float64)
    q_mask, d_mask = p["q_mask"], p["d_mask"]

    def fn(Q, H, W, b):
        return maxsim_from_hidden_reference(Q, H, W, b, q_mask, d_mask, normalize=normalize)

    assert torch.autograd.gradcheck(fn, tuple(leaves(p)[n] for n in NAMES))
