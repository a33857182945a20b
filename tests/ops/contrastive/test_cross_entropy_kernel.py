"""The cross-entropy kernel of ``lik.contrastive_loss`` against its float64 closed form, and the closed form against
``F.cross_entropy``'s autograd: every config branch (one program, partial sums over programs, several column tiles,
ragged last tiles), labels off the diagonal and repeated, NaN and inf scores, out-of-range labels, sizes 1."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lik.ops.contrastive.kernel import cross_entropy_config, launch_cross_entropy
from lik.ops.contrastive.reference import cross_entropy_reference

pytestmark = pytest.mark.skipif(
    not __import__("lik._device", fromlist=["x"]).interpreting(),
    reason="the kernel runs on the CPU through TRITON_INTERPRET=1",
)

# (block_r, block_b, programs, num_warps): one program and one tile; several row blocks and column tiles with
# ragged ends; partial sums over programs in a grid-stride loop (more row blocks than programs).
CONFIGS = [(8, 32, 1, 1), (2, 8, 1, 1), (2, 4, 2, 1), (1, 16, 3, 1)]


def _check(scores, labels, temperature, config, *, atol=2e-6):
    loss, grad = launch_cross_entropy(scores, labels, temperature, config=config)
    want_loss, want_grad = cross_entropy_reference(scores.double(), labels, temperature)
    assert loss.dtype == torch.float32 and loss.shape == () and grad.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-6, atol=atol, equal_nan=True)
    torch.testing.assert_close(grad.double(), want_grad, rtol=1e-5, atol=atol, equal_nan=True)
    return loss, grad


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("n_q, n_docs", [(1, 1), (1, 9), (5, 5), (5, 19), (7, 33)])
def test_loss_and_gradient_match_the_closed_form(rng, config, n_q, n_docs):
    scores = torch.randn(n_q, n_docs, generator=rng) * 4
    labels = torch.randint(0, n_docs, (n_q,), generator=rng)
    _check(scores, labels, 0.7, config)
    if n_q <= n_docs:
        _check(scores, None, 1.0, config)


def test_strided_labels(rng):
    scores = torch.randn(5, 7, generator=rng)
    labels = torch.randint(0, 7, (5, 3), generator=rng)[:, 1]
    assert labels.stride(0) == 3
    _check(scores, labels, 0.5, (2, 4, 2, 1))


def test_one_candidate_has_zero_loss_and_gradient():
    loss, grad = launch_cross_entropy(torch.tensor([[3.5], [-2.0]]), torch.zeros(2, dtype=torch.long), 0.05)
    assert loss.item() == 0.0 and torch.equal(grad, torch.zeros(2, 1))


def test_repeated_labels_and_small_temperature(rng):
    scores = torch.randn(6, 10, generator=rng)
    labels = torch.tensor([3, 3, 3, 0, 9, 3])
    _check(scores, labels, 0.02, (2, 4, 2, 1), atol=1e-5)


def test_the_default_config_matches_too(rng):
    scores = torch.randn(9, 23, generator=rng)
    config = cross_entropy_config(9, 23, True)
    assert config[2] > 1  # the interpreter's default splits rows over programs
    _check(scores, None, 0.3, None)


def test_no_gradient_buffer_when_not_asked(rng):
    scores = torch.randn(4, 6, generator=rng)
    loss, grad = launch_cross_entropy(scores, None, 1.0, write_grad=False, config=(2, 4, 2, 1))
    assert grad is None
    torch.testing.assert_close(loss.double(), cross_entropy_reference(scores.double(), None, 1.0)[0])


def test_a_nan_score_makes_its_row_nan_and_leaves_the_others(rng):
    scores = torch.randn(4, 6, generator=rng)
    scores[2, 5] = float("nan")
    loss, grad = _check(scores, None, 1.0, (1, 4, 2, 1))
    assert math.isnan(loss.item())
    assert torch.isnan(grad[2]).all() and torch.isfinite(grad[[0, 1, 3]]).all()


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # (the interpreter's numpy computes inf - inf)
def test_infinite_scores_follow_cross_entropy(rng):
    # +inf: softmax(inf - inf) is NaN in F.cross_entropy too; -inf in a non-target column takes no probability.
    scores = torch.randn(3, 5, generator=rng)
    scores[0, 4] = float("inf")
    scores[1, 3] = float("-inf")
    loss, grad = launch_cross_entropy(scores, None, 1.0, config=(2, 4, 1, 1))
    x = scores.double().requires_grad_()
    want = F.cross_entropy(x, torch.arange(3))
    (want_grad,) = torch.autograd.grad(want, x)
    assert math.isnan(loss.item()) and math.isnan(want.item())
    torch.testing.assert_close(grad[1:].double(), want_grad[1:], rtol=1e-5, atol=1e-7)
    assert grad[1, 3].item() == 0.0 and torch.isnan(grad[0]).all()


def test_a_label_out_of_range_gives_nan_for_its_row(rng):
    # (the kernel's guard for CUDA labels, which are not read on the host)
    scores = torch.randn(3, 4, generator=rng)
    loss, grad = launch_cross_entropy(scores, torch.tensor([0, 4, -1]), 1.0, config=(2, 4, 1, 1))
    assert math.isnan(loss.item())
    assert torch.isnan(grad[1:]).all() and torch.isfinite(grad[0]).all()


def test_the_loss_is_repeatable(rng):
    scores = torch.randn(9, 13, generator=rng)
    first = launch_cross_entropy(scores, None, 0.1, config=(2, 4, 3, 1))
    again = launch_cross_entropy(scores, None, 0.1, config=(2, 4, 3, 1))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_the_closed_form_is_cross_entropys_autograd(rng):
    scores = torch.randn(5, 7, dtype=torch.float64, generator=rng).requires_grad_()
    labels = torch.tensor([6, 0, 0, 2, 5])
    want = F.cross_entropy(scores / 0.3, labels)
    (want_grad,) = torch.autograd.grad(want, scores)
    loss, grad = cross_entropy_reference(scores.detach(), labels, 0.3)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)
