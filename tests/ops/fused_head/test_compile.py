"""maxsim_from_hidden under torch.compile (the aot_eager backend traces forward and backward as inductor would):
the kernels are reached as custom operators, inference and training give the eager values."""

from __future__ import annotations

import torch

from lik.ops.fused_head import maxsim_from_hidden

from .helpers import leaves, problem


def test_compiled_training_and_inference_match_eager(rng):
    torch._dynamo.reset()
    p = problem(rng, n_docs=2, l_d=19)
    weights = torch.randn(3, 2, generator=rng)

    def step(Q, H, W, b):
        return (maxsim_from_hidden(Q, H, W, b, p["q_mask"], p["d_mask"], backward="deterministic") * weights).sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    eager_leaves, compiled_leaves = leaves(p), leaves(p)
    names = ("Q", "H", "W", "b")
    eager = step(*(eager_leaves[n] for n in names))
    got = compiled(*(compiled_leaves[n] for n in names))
    torch.testing.assert_close(got, eager)
    expected = torch.autograd.grad(eager, [eager_leaves[n] for n in names])
    for g, e in zip(torch.autograd.grad(got, [compiled_leaves[n] for n in names]), expected):
        torch.testing.assert_close(g, e)
    with torch.no_grad():
        inference = torch.compile(lambda Q, H: maxsim_from_hidden(Q, H, p["W"], None, d_mask=p["d_mask"]),
                                  backend="aot_eager", fullgraph=True)
        expected = maxsim_from_hidden(p["Q"], p["H"], p["W"], None, d_mask=p["d_mask"])
        assert torch.isfinite(expected).all()
        torch.testing.assert_close(inference(p["Q"], p["H"]), expected)
