"""Shared test helpers: random MaxSim problems and the float64 reference with its gradients."""

from __future__ import annotations

import torch

from lik.ops.maxsim.reference import maxsim_reference


def rand_problem(rng, n_q, l_q, n_docs, l_d, dim, *, per_query=False, squeeze=False, masks=True, dtype=torch.float32,
                 normalise=True):
    shape_q = (l_q, dim) if squeeze else (n_q, l_q, dim)
    shape_d = ((n_q,) if per_query else ()) + (n_docs, l_d, dim)
    Q = torch.randn(shape_q, generator=rng)
    D = torch.randn(shape_d, generator=rng)
    if normalise:
        Q = torch.nn.functional.normalize(Q, dim=-1) if dim else Q
        D = torch.nn.functional.normalize(D, dim=-1) if dim else D
    q_mask = d_mask = None
    if masks:
        q_mask = torch.rand(shape_q[:-1], generator=rng) > 0.25
        d_mask = torch.rand(shape_d[:-1], generator=rng) > 0.25
    return Q.to(dtype), D.to(dtype), q_mask, d_mask


def reference_with_grads(Q, D, q_mask, d_mask, grad, mask_mode="exclude"):
    """float64 scores and gradients of ``sum(scores * grad)``."""
    Q64 = Q.detach().double().requires_grad_()
    D64 = D.detach().double().requires_grad_()
    scores = maxsim_reference(Q64, D64, q_mask, d_mask, mask_mode=mask_mode)
    dq, dd = torch.autograd.grad(scores, (Q64, D64), grad.double(), allow_unused=True)
    return scores.detach(), dq, dd


def kernel_with_grads(fn, Q, D, q_mask, d_mask, grad, **kwargs):
    Qg = Q.detach().clone().requires_grad_()
    Dg = D.detach().clone().requires_grad_()
    scores = fn(Qg, Dg, q_mask, d_mask, **kwargs)
    dq, dd = torch.autograd.grad(scores, (Qg, Dg), grad.to(scores.dtype))
    return scores.detach(), dq, dd


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    denom = ref.norm()
    if denom == 0:
        return (x - ref).norm().item()
    return ((x - ref).norm() / denom).item()


def check_against_reference(Q, D, q_mask, d_mask, grad, *, mask_mode="exclude", backward="fast", tol=2e-6):
    """``lik.maxsim`` against the float64 reference: scores, both gradients (relative error below ``tol``, in the
    input dtypes) and exactly-zero gradients at masked positions. Returns ``(scores, dq, dd, reference scores)``."""
    import lik

    s, dq, dd = kernel_with_grads(lik.maxsim, Q, D, q_mask, d_mask, grad, mask_mode=mask_mode, backward=backward)
    rs, rdq, rdd = reference_with_grads(Q, D, q_mask, d_mask, grad, mask_mode)
    assert dq.dtype == Q.dtype and dd.dtype == D.dtype
    assert rel_err(s, rs) < tol
    assert rel_err(dq, rdq) < tol
    assert rel_err(dd, rdd) < tol
    if q_mask is not None:
        assert torch.all(dq[~q_mask] == 0)
    if d_mask is not None:
        assert torch.all(dd[~d_mask] == 0)
    return s, dq, dd, rs
