"""``lik.contrastive_loss`` under ``torch.compile`` (the ``aot_eager`` backend traces forward and backward as inductor
would, without a GPU): the composition of MaxSim's custom operators and ``F.cross_entropy`` is traced, and equals
the float64 reference."""

from __future__ import annotations

import pytest
import torch

import lik
from lik.ops.contrastive import contrastive_loss, contrastive_loss_reference

pytestmark = pytest.mark.skipif(not lik._device.interpreting(), reason="the kernels run under TRITON_INTERPRET=1")


def test_a_compiled_step_equals_the_reference(rng):
    Q = torch.randn(3, 4, 16, generator=rng).requires_grad_()
    D = torch.randn(4, 5, 16, generator=rng).requires_grad_()
    labels = torch.tensor([1, 0, 3])
    torch._dynamo.reset()
    step = torch.compile(lambda q, d: contrastive_loss(q, d, labels, temperature=0.5), backend="aot_eager")
    loss = step(Q, D)
    got = (loss, *torch.autograd.grad(loss, (Q, D)))
    q, d = Q.detach().double().requires_grad_(), D.detach().double().requires_grad_()
    want = contrastive_loss_reference(q, d, labels, temperature=0.5)
    for g, w in zip(got, (want, *torch.autograd.grad(want, (q, d)))):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=2e-6)
