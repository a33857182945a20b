"""``lik.contrastive_loss``: the kernel path (Triton's interpreter, float32 and float16) against the float64
composition ``F.cross_entropy(maxsim_reference(Q, D) / temperature, labels)`` and against ``lik.maxsim`` +
``F.cross_entropy``; the reference path (float64: gradcheck); the nasty cases and the checks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import lik
from lik.ops.contrastive import contrastive_loss, contrastive_loss_reference

from ..maxsim.helpers import rand_problem

kernels = pytest.mark.skipif(
    not lik._device.interpreting(), reason="the kernels run on the CPU under TRITON_INTERPRET=1"
)


def _grads(fn, Q, D, *args, **kwargs):
    Qg = Q.detach().clone().requires_grad_()
    Dg = D.detach().clone().requires_grad_()
    loss = fn(Qg, Dg, *args, **kwargs)
    dq, dd = torch.autograd.grad(loss, (Qg, Dg))
    return loss.detach(), dq, dd


def _check(Q, D, labels=None, *, rtol=1e-5, atol=2e-6, backward="fast", **kwargs):
    """The kernel path against the float64 composition; returns the kernel path's (loss, dQ, dD)."""
    got = _grads(contrastive_loss, Q, D, labels, backward=backward, **kwargs)
    want = _grads(contrastive_loss_reference, Q.double(), D.double(), labels, **kwargs)
    assert got[0].dtype == torch.float32 and got[0].shape == ()
    assert got[1].dtype == Q.dtype and got[2].dtype == D.dtype
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=rtol, atol=atol, equal_nan=True)
    return got


@kernels
# (the deterministic backward is also taken by test_gradients_equal_lik_maxsim_and_cross_entropy)
@pytest.mark.parametrize("backward", ["fast", pytest.param("deterministic", marks=pytest.mark.slow)])
def test_in_batch_diagonal_with_masks(rng, backward):
    Q, D, q_mask, d_mask = rand_problem(rng, 3, 4, 5, 6, 16)
    _check(Q, D, q_mask=q_mask, d_mask=d_mask, temperature=0.5, backward=backward)


@kernels
def test_labels_off_the_diagonal_repeated_more_queries_than_documents(rng):
    Q, D, _, _ = rand_problem(rng, 4, 3, 3, 5, 8, masks=False)
    _check(Q, D, torch.tensor([2, 2, 0, 2]), temperature=0.05, rtol=1e-4, atol=1e-5)


@kernels
def test_hard_negatives_as_a_candidate_set_per_query(rng):
    Q, D, q_mask, d_mask = rand_problem(rng, 2, 3, 4, 5, 8, per_query=True)
    _check(Q, D, torch.tensor([0, 3]), q_mask=q_mask, d_mask=d_mask, temperature=0.2)


@kernels
def test_gradients_equal_lik_maxsim_and_cross_entropy(rng):
    Q, D, _, _ = rand_problem(rng, 3, 4, 4, 6, 16, masks=False)
    got = _grads(contrastive_loss, Q, D, temperature=0.1, backward="deterministic")
    want = _grads(lambda q, d: F.cross_entropy(lik.maxsim(q, d, backward="deterministic") / 0.1, torch.arange(3)), Q, D)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=2e-6)


@kernels
def test_one_query_one_document_has_zero_loss_and_gradients(rng):
    Q, D, _, _ = rand_problem(rng, 1, 3, 1, 4, 8, masks=False)
    loss, dq, dd = _check(Q, D)
    assert loss.item() == 0.0 and not dq.any() and not dd.any()


@kernels
def test_an_all_masked_document_scores_zero_and_gets_no_gradient(rng):
    Q, D, q_mask, d_mask = rand_problem(rng, 2, 3, 3, 4, 8)
    d_mask[1] = False
    D[1] = float("nan")  # garbage under the mask stays out
    loss, dq, dd = _check(Q, D, torch.tensor([0, 2]), q_mask=q_mask, d_mask=d_mask)
    assert math.isfinite(loss.item()) and not dd[1].any()


@kernels
def test_a_nan_in_a_valid_token_makes_the_loss_nan(rng):
    Q, D, _, _ = rand_problem(rng, 2, 3, 3, 4, 8, masks=False)
    D[2, 1, 0] = float("nan")
    loss, dq, dd = _check(Q, D)
    assert math.isnan(loss.item()) and torch.isnan(dq).any()


@kernels
def test_non_contiguous_views_and_zero_mask_mode(rng):
    Q, D, q_mask, d_mask = rand_problem(rng, 3, 4, 3, 5, 8)
    Qt = Q.transpose(0, 1).contiguous().transpose(0, 1)  # [3, 4, 8] with strides of [4, 3, 8]
    Dv = torch.cat([D, D], dim=-1)[..., ::2]  # every other feature of a wider tensor
    assert not Qt.is_contiguous() and not Dv.is_contiguous()
    _check(Qt, Dv, q_mask=q_mask, d_mask=d_mask, mask_mode="zero", temperature=2.0)


@kernels
@pytest.mark.parametrize("l_q, l_d", [(0, 4), (3, 0)])
def test_empty_sides_score_zero(rng, l_q, l_d):
    # Every score is an empty sum (0): the loss is log(B) and no gradient flows.
    Q, D, _, _ = rand_problem(rng, 2, l_q, 3, l_d, 8, masks=False)
    loss, dq, dd = _check(Q, D)
    assert loss.item() == pytest.approx(math.log(3)) and not dq.any() and not dd.any()


@kernels
def test_float16_inputs(rng):
    Q, D, q_mask, d_mask = rand_problem(rng, 3, 4, 4, 5, 16, dtype=torch.float16)
    _check(Q, D, q_mask=q_mask, d_mask=d_mask, temperature=0.5, rtol=2e-3, atol=2e-3)


@kernels
def test_the_incoming_gradient_scales_and_no_grad_gives_the_loss(rng):
    Q, D, _, _ = rand_problem(rng, 2, 3, 3, 4, 8, masks=False)
    loss, dq, dd = _grads(lambda q, d: 3 * contrastive_loss(q, d), Q, D)
    want = _grads(lambda q, d: 3 * contrastive_loss_reference(q, d), Q.double(), D.double())
    for g, w in zip((loss, dq, dd), want):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(contrastive_loss(Q, D).double(), want[0] / 3, rtol=1e-6, atol=1e-7)


def test_float64_runs_the_reference_and_passes_gradcheck(rng):
    Q, D, q_mask, d_mask = rand_problem(rng, 3, 2, 4, 3, 5, dtype=torch.float64)
    Q.requires_grad_()
    D.requires_grad_()
    labels = torch.tensor([1, 1, 3])
    fn = lambda q, d: contrastive_loss(q, d, labels, temperature=0.3, q_mask=q_mask, d_mask=d_mask)  # noqa: E731
    assert fn(Q, D).dtype == torch.float64
    torch.testing.assert_close(
        fn(Q, D), contrastive_loss_reference(Q, D, labels, temperature=0.3, q_mask=q_mask, d_mask=d_mask)
    )
    assert torch.autograd.gradcheck(fn, (Q, D))


def test_labels_default_to_the_diagonal_for_candidate_sets_too(rng):
    # (documented: one rule for 3-D and 4-D D; pass labels when each set's positive sits elsewhere)
    Q, D, _, _ = rand_problem(rng, 2, 3, 3, 4, 8, per_query=True, masks=False, dtype=torch.float64)
    want = contrastive_loss_reference(Q, D, torch.arange(2))
    torch.testing.assert_close(contrastive_loss(Q, D), want)
    with pytest.raises(ValueError, match="labels=None"):
        contrastive_loss(Q, D[:, :1])


def test_the_reference_is_the_float64_brute_force(rng):
    Q = torch.randn(3, 2, 4, dtype=torch.float64, generator=rng)
    D = torch.randn(4, 3, 4, dtype=torch.float64, generator=rng)
    scores = torch.einsum("nsk,btk->nbst", Q, D).amax(-1).sum(-1) / 0.7
    want = torch.stack([torch.logsumexp(scores[i], 0) - scores[i, i] for i in range(3)]).mean()
    torch.testing.assert_close(contrastive_loss_reference(Q, D, temperature=0.7), want)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda Q, D: contrastive_loss(Q[0], D), ValueError, "Q must be"),
        (lambda Q, D: contrastive_loss(Q[:0], D), ValueError, "Q holds no query"),
        (lambda Q, D: contrastive_loss(Q, D[:0]), ValueError, "D holds no document"),
        (lambda Q, D: contrastive_loss(Q, D[:2]), ValueError, "labels=None"),
        (lambda Q, D: contrastive_loss(Q, D, [0, 1, 2]), TypeError, "labels must be"),
        (lambda Q, D: contrastive_loss(Q, D, torch.arange(3, dtype=torch.int32)), TypeError, "labels must be int64"),
        (lambda Q, D: contrastive_loss(Q, D, torch.arange(2)), ValueError, r"labels must have shape \[Nq\]"),
        (lambda Q, D: contrastive_loss(Q, D, torch.tensor([0, 4, 1])), ValueError, r"labels must lie in \[0, B\)"),
        (lambda Q, D: contrastive_loss(Q, D, torch.tensor([0, -1, 1])), ValueError, "got -1"),
        (lambda Q, D: contrastive_loss(Q, D, temperature=0.0), ValueError, "temperature"),
        (lambda Q, D: contrastive_loss(Q, D, temperature=float("nan")), ValueError, "temperature"),
        (lambda Q, D: contrastive_loss(Q, D, temperature=True), TypeError, "temperature"),
        (lambda Q, D: contrastive_loss(Q, D, temperature=torch.tensor(1.0)), TypeError, "temperature"),
        (lambda Q, D: contrastive_loss(Q, D, backward="fastest"), ValueError, "backward"),
        (lambda Q, D: contrastive_loss(Q, D, mask_mode="none"), ValueError, "mask_mode"),
        (lambda Q, D: contrastive_loss(Q, D.half()), TypeError, "D has dtype"),
        (lambda Q, D: contrastive_loss(Q, D, d_mask=torch.ones(4, 5, dtype=torch.bool)), ValueError, "d_mask"),
        (lambda Q, D: contrastive_loss(Q, lik.quantize(D, torch.int8)[0]), TypeError, "8-bit"),
        (lambda Q, D: contrastive_loss(Q, "D"), TypeError, "D must be a torch.Tensor"),
    ],
)
def test_bad_input_is_refused_by_name_before_any_kernel(rng, call, error, match, monkeypatch):
    from lik.ops.contrastive import function

    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(function, "launch_cross_entropy", no_launch)
    monkeypatch.setattr(function, "_FullTraining", no_launch)
    Q, D = torch.randn(3, 2, 8, generator=rng), torch.randn(4, 6, 8, generator=rng)
    with pytest.raises(error, match=match):
        call(Q.requires_grad_(), D)
