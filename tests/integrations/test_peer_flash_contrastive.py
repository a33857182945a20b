"""flash-maxsim's ``colbert_contrastive_step`` on lik: its signature, its side effect (gradients accumulated into
``Q.grad`` / ``D.grad``, a loss outside autograd) and its loss, on the CPU against the composition flash-maxsim's
own test compares with (MaxSim scores into ``F.cross_entropy``); on a GPU against the real flash-maxsim 0.3.0,
whose step refuses CPU tensors."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from lik.integrations.flash_maxsim import colbert_contrastive_step
from lik.ops.maxsim.reference import maxsim_reference

peer = pytest.importorskip("flash_maxsim.flash_maxsim_contrastive")


def _inputs(rng, n_q=3, n_docs=4, l_q=4, l_d=5, dim=16, dtype=torch.float32, device="cpu"):
    Q = F.normalize(torch.randn(n_q, l_q, dim, generator=rng), dim=-1).to(device=device, dtype=dtype)
    D = F.normalize(torch.randn(n_docs, l_d, dim, generator=rng), dim=-1).to(device=device, dtype=dtype)
    return Q.requires_grad_(), D.requires_grad_()


def _expected(Q, D, labels=None):
    """float64 loss and gradients of the composition."""
    q, d = Q.detach().double().requires_grad_(), D.detach().double().requires_grad_()
    labels = torch.arange(Q.shape[0], device=Q.device) if labels is None else labels
    loss = F.cross_entropy(maxsim_reference(q, d), labels)
    return (loss.detach(), *torch.autograd.grad(loss, (q, d)))


def test_the_signature_is_flash_maxsims():
    ours = inspect.signature(colbert_contrastive_step).parameters
    theirs = inspect.signature(peer.colbert_contrastive_step).parameters
    assert [(p.name, p.default) for p in ours.values()] == [(p.name, p.default) for p in theirs.values()]


@pytest.mark.skipif(not __import__("lik")._device.interpreting(), reason="the kernels run under TRITON_INTERPRET=1")
def test_the_kernel_path_sets_the_gradients_and_returns_a_detached_loss(rng):
    Q, D = _inputs(rng)
    loss = colbert_contrastive_step(Q, D)
    want = _expected(Q, D)
    assert loss.dtype == torch.float32 and loss.shape == () and loss.grad_fn is None and not loss.requires_grad
    for got, expected in zip((loss, Q.grad, D.grad), want):
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-6)


def test_present_gradients_are_accumulated(rng, reference_path):
    Q, D = _inputs(rng)
    Q.grad = torch.full_like(Q, 0.25)
    D.grad = torch.full_like(D, -0.5)
    loss = colbert_contrastive_step(Q, D, torch.arange(3))
    want = _expected(Q, D)
    torch.testing.assert_close(loss.double(), want[0])
    torch.testing.assert_close(Q.grad.double(), want[1] + 0.25)
    torch.testing.assert_close(D.grad.double(), want[2] - 0.5)


def test_it_runs_under_no_grad_and_on_inputs_that_do_not_require_grad(rng, reference_path):
    Q, D = (x.detach() for x in _inputs(rng))
    with torch.no_grad():
        loss = colbert_contrastive_step(Q, D)
    want = _expected(Q, D)
    torch.testing.assert_close(loss.double(), want[0])
    torch.testing.assert_close(Q.grad.double(), want[1])
    assert not Q.requires_grad and not D.requires_grad


def test_labels_off_the_diagonal_are_taken(rng, reference_path):
    # (flash-maxsim refuses them: its kernel knows only the diagonal)
    Q, D = _inputs(rng)
    labels = torch.tensor([3, 3, 0])
    loss = colbert_contrastive_step(Q, D, labels)
    want = _expected(Q, D, labels)
    torch.testing.assert_close(loss.double(), want[0])
    torch.testing.assert_close(D.grad.double(), want[2])


@pytest.mark.parametrize(
    "case, error, match",
    [
        ("more queries than documents", ValueError, "needs Nq <= B"),
        ("2-D Q", ValueError, r"Q must be \[Nq, Lq, d\]"),
        ("4-D D", ValueError, r"D must be \[Nd, Ld, d\]"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(rng, reference_path, case, error, match):
    Q, D = _inputs(rng)
    if case == "more queries than documents":
        D = D[:2].detach().requires_grad_()
    elif case == "2-D Q":
        Q = Q[0].detach().requires_grad_()
    else:
        D = D[None].detach().requires_grad_()
    with pytest.raises(error, match=match):
        colbert_contrastive_step(Q, D)
    assert D.grad is None


def _close_to_max(got, want, fraction):
    """Every element within ``fraction`` of ``want``'s largest magnitude (flash-maxsim adds its dD in the input
    dtype by atomics, so elementwise tolerances would measure its rounding, not the step)."""
    err = (got.float() - want.float()).abs().max().item()
    assert err <= fraction * want.float().abs().max().item(), (err, want.float().abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype, shape",
    [
        (torch.float16, (4, 4, 8, 20, 16)),  # flash-maxsim's own test shapes
        (torch.float16, (32, 32, 32, 300, 128)),
        (torch.float16, (128, 128, 32, 180, 128)),  # ColBERT's training batch
        (torch.bfloat16, (4, 4, 8, 20, 16)),
        (torch.bfloat16, (32, 32, 32, 300, 128)),
    ],
)
def test_the_step_matches_flash_maxsims_on_a_gpu(rng, dtype, shape):
    n_q, n_docs, l_q, l_d, dim = shape
    Q, D = _inputs(rng, n_q, n_docs, l_q, l_d, dim, dtype=dtype, device="cuda")
    Qp, Dp = Q.detach().clone().requires_grad_(), D.detach().clone().requires_grad_()
    labels = torch.arange(n_q, device="cuda")
    loss = colbert_contrastive_step(Q, D, labels)
    their_loss = peer.colbert_contrastive_step(Qp, Dp, labels)
    torch.testing.assert_close(loss, their_loss, rtol=1e-4, atol=1e-4)  # the same products, summed in fp32
    fraction = 2e-2 if dtype == torch.float16 else 5e-2
    _close_to_max(Q.grad, Qp.grad, fraction)
    _close_to_max(D.grad, Dp.grad, fraction)
    assert Q.grad.dtype == dtype and D.grad.dtype == dtype
