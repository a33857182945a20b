"""GPU-only checks of ``lik.contrastive_loss`` (`pytest -m gpu` on the device): parity with ``lik.maxsim`` +
``F.cross_entropy`` at ColBERT's training shape, replays with the full path's bits, bitwise repeatability of the
deterministic backward, the multi-program loss, hard negatives in bfloat16, CUDA labels out of range."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import lik
from lik import _launch
from lik.ops.contrastive import contrastive_loss
from lik.ops.contrastive import function as contrastive

pytestmark = pytest.mark.gpu

CUDA = "cuda"


def _problem(n_q, l_q, n_docs, l_d, dim, dtype, *, per_query=False, seed=0):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    Q = F.normalize(torch.randn(n_q, l_q, dim, device=CUDA, generator=gen), dim=-1).to(dtype)
    shape_d = ((n_q,) if per_query else ()) + (n_docs, l_d, dim)
    D = F.normalize(torch.randn(shape_d, device=CUDA, generator=gen), dim=-1).to(dtype)
    return Q, D


def _step(fn, Q, D):
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
    loss = fn(Qg, Dg)
    return (loss.detach(), *torch.autograd.grad(loss, (Qg, Dg)))


def _composition(labels, temperature, backward, **kw):
    return lambda q, d: F.cross_entropy(lik.maxsim(q, d, backward=backward, **kw) / temperature, labels)


def _full_path(fn, *args):
    saved = _launch.ENABLED
    _launch.ENABLED = False  # no replay: Triton's own launch
    try:
        return fn(*args)
    finally:
        _launch.ENABLED = saved


@pytest.mark.parametrize("n_docs", [128, 512])
@pytest.mark.parametrize("backward", ["fast", "deterministic"])
def test_colbert_step_equals_lik_maxsim_and_cross_entropy(n_docs, backward):
    Q, D = _problem(n_docs, 32, n_docs, 180, 128, torch.float16)
    labels = torch.arange(n_docs, device=CUDA)
    got = _step(lambda q, d: contrastive_loss(q, d, temperature=0.05, backward=backward), Q, D)
    want = _step(_composition(labels, 0.05, backward), Q, D)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for g, w in zip(got[1:], want[1:]):  # one float16 rounding of the same fp32 sums, give or take their order
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-3, atol=2e-6)


def test_replays_give_the_full_paths_bits():
    Q, D = _problem(64, 32, 96, 180, 128, torch.float16, seed=1)
    labels = torch.randint(0, 96, (64,), device=CUDA, generator=torch.Generator(device=CUDA).manual_seed(2))
    fn = lambda q, d: contrastive_loss(q, d, labels, temperature=0.1, backward="deterministic")  # noqa: E731
    full = _full_path(_step, fn, Q, D)
    contrastive.CALLS.clear()
    first = _step(fn, Q, D)
    assert any(type(v) is contrastive.Recorded for v in contrastive.CALLS.values())
    replayed = _step(fn, Q, D)
    for a, b, c in zip(full, first, replayed):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_the_deterministic_step_is_bitwise_repeatable_and_the_loss_is_in_every_mode():
    Q, D = _problem(128, 32, 128, 180, 128, torch.float16, seed=3)
    runs = [_step(lambda q, d: contrastive_loss(q, d, backward="deterministic"), Q, D) for _ in range(3)]
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0]))
    fast = [_step(lambda q, d: contrastive_loss(q, d, backward="fast"), Q, D)[0] for _ in range(3)]
    assert all(torch.equal(f, runs[0][0]) for f in fast)  # the loss does not depend on the backward


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hard_negatives_per_query_with_masks(dtype):
    Q, D = _problem(16, 32, 8, 100, 128, dtype, per_query=True, seed=4)
    gen = torch.Generator(device=CUDA).manual_seed(5)
    d_mask = torch.rand(16, 8, 100, device=CUDA, generator=gen) > 0.3
    d_mask[:, 3] = False  # an all-masked candidate in every set
    labels = torch.zeros(16, dtype=torch.long, device=CUDA)
    got = _step(lambda q, d: contrastive_loss(q, d, labels, temperature=0.2, d_mask=d_mask), Q, D)
    want = _step(_composition(labels, 0.2, "auto", d_mask=d_mask), Q, D)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol * 1e-2)
    assert not got[2][:, 3].any()


def test_a_cuda_label_out_of_range_gives_nan_without_a_sync():
    Q, D = _problem(4, 8, 5, 20, 64, torch.float16)
    loss, dq, _ = _step(lambda q, d: contrastive_loss(q, d, torch.tensor([0, 1, 7, 2], device=CUDA)), Q, D)
    assert math.isnan(loss.item()) and torch.isnan(dq[2]).all()


def test_a_large_batch_sums_partial_losses():
    # 1 024 x 2 048 scores: past SINGLE_PROGRAM_SCORES, row blocks over programs and a sum of their partials.
    scores = torch.randn(1024, 2048, device=CUDA) * 5
    labels = torch.randint(0, 2048, (1024,), device=CUDA)
    from lik.ops.contrastive.kernel import launch_cross_entropy
    from lik.ops.contrastive.reference import cross_entropy_reference

    loss, grad = launch_cross_entropy(scores, labels, 0.07)
    want_loss, want_grad = cross_entropy_reference(scores.double(), labels, 0.07)
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double(), want_grad, rtol=1e-4, atol=1e-9)
    again = launch_cross_entropy(scores, labels, 0.07)
    assert torch.equal(again[0], loss) and torch.equal(again[1], grad)
