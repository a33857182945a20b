"""late-interaction-kernels' ``fused_head.maxsim_from_hidden`` on lik against the real late-interaction-kernels
0.4.5's CPU reference (``maxsim_from_hidden_reference``: its kernel needs a GPU), with its signature, masks and
gradients; and the compatibility module's promise that the submodule is covered."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

import lik
import lik.integrations.late_interaction_kernels as ours
from lik.integrations.late_interaction_kernels import fused_head

peer_head = pytest.importorskip("late_interaction_kernels.fused_head")
reference = pytest.importorskip("late_interaction_kernels.reference")


def _inputs(rng, n_q=3, n_docs=4, l_d=21, d_model=40, d_out=24):
    Q = F.normalize(torch.randn(n_q, 5, d_out, generator=rng), dim=-1)
    H = torch.randn(n_docs, l_d, d_model, generator=rng)
    W = torch.randn(d_out, d_model, generator=rng) / d_model**0.5
    b = 0.1 * torch.randn(d_out, generator=rng)
    d_mask = torch.rand(n_docs, l_d, generator=rng) > 0.3
    d_mask[1] = False  # a document with no valid token: 0 for both
    return Q, H, W, b, d_mask


def test_submodule_is_covered_with_the_peers_signature():
    assert set(peer_head.__all__ if hasattr(peer_head, "__all__") else ["maxsim_from_hidden"]) <= set(
        fused_head.__all__)
    assert "fused_head" in ours.__all__ and ":mod:`.fused_head`" in ours.__doc__
    assert "fused_head.maxsim_from_hidden" not in ours.__doc__.split("Not covered:")[1].split("Deliberate")[0]
    theirs = inspect.signature(peer_head.maxsim_from_hidden)
    mine = inspect.signature(fused_head.maxsim_from_hidden)
    assert [(p.name, p.default, p.kind) for p in theirs.parameters.values()] == [
        (p.name, p.default, p.kind) for p in mine.parameters.values()]


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_scores_equal_the_peers_reference(rng, normalize, bias):
    Q, H, W, b, d_mask = _inputs(rng)
    b = b if bias else None
    expected = reference.maxsim_from_hidden_reference(Q, H, W, b, d_mask, normalize=normalize)
    got = fused_head.maxsim_from_hidden(Q, H, W, b, d_mask, normalize)
    assert got.dtype == torch.float32 and got.shape == (3, 4)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (got[:, 1] == 0).all()
    single = fused_head.maxsim_from_hidden(Q[0], H[:1], W, b, d_mask[0], normalize)  # 2-D Q, 1-D mask
    torch.testing.assert_close(single, expected[0, :1], rtol=1e-5, atol=1e-5)


def test_gradients_equal_the_peers_reference(rng):
    Q, H, W, b, d_mask = _inputs(rng)
    weights = torch.randn(3, 4, generator=rng)

    def grads(fn):
        leaves = [x.clone().requires_grad_() for x in (Q, H, W, b)]
        scores = fn(*leaves[:4], d_mask)
        return torch.autograd.grad((scores * weights).sum(), leaves)

    expected = grads(lambda q, h, w, bb, m: reference.maxsim_from_hidden_reference(q, h, w, bb, m))
    for g, e in zip(grads(fused_head.maxsim_from_hidden), expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


def test_delegates_to_lik_and_casts_the_head_to_the_hidden_dtype(rng):
    Q, H, W, b, d_mask = _inputs(rng, n_docs=2, l_d=9)
    expected = lik.ops.fused_head.maxsim_from_hidden(Q, H, W, b, d_mask=d_mask)
    torch.testing.assert_close(fused_head.maxsim_from_hidden(Q, H, W.double(), b.double(), d_mask), expected)


@pytest.mark.parametrize("change,words", [
    (dict(Q=torch.randn(5)), "Q must be"),
    (dict(H_d=torch.randn(4, 40)), "H_d must be"),
    (dict(W=torch.randn(23, 40)), "W must be"),
    (dict(b=torch.randn(7)), "b must be"),
])
def test_errors_keep_the_peers_words(rng, change, words):
    Q, H, W, b, d_mask = _inputs(rng, n_docs=2, l_d=9)
    args = dict(Q=Q, H_d=H, W=W, b=b, d_mask=d_mask)
    args.update(change)
    with pytest.raises(ValueError, match=words):
        fused_head.maxsim_from_hidden(**args)


@pytest.mark.gpu
def test_scores_and_gradients_equal_the_peers_kernel_on_a_gpu():
    gen = torch.Generator(device="cuda").manual_seed(0)
    Q = F.normalize(torch.randn(4, 32, 128, device="cuda", generator=gen), dim=-1).half()
    H = torch.randn(50, 180, 768, device="cuda", generator=gen).half()
    W = (torch.randn(128, 768, device="cuda", generator=gen) / 768**0.5).half()
    b = (0.1 * torch.randn(128, device="cuda", generator=gen)).half()
    d_mask = torch.rand(50, 180, device="cuda", generator=gen) > 0.2

    def run(fn):
        leaves = [x.clone().requires_grad_() for x in (Q, H, W, b)]
        scores = fn(*leaves, d_mask)
        return scores, torch.autograd.grad(scores.sum(), leaves)

    theirs, their_grads = run(peer_head.maxsim_from_hidden)
    mine, my_grads = run(fused_head.maxsim_from_hidden)
    torch.testing.assert_close(mine, theirs, rtol=2e-2, atol=2e-2)  # both round the projected rows to fp16
    for g, e in zip(my_grads, their_grads):
        assert ((g.float() - e.float()).norm() / e.float().norm()).item() < 2e-2
