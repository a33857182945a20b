"""Shared inputs for the fused head's tests: small odd-sized problems with garbage in their padded positions."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import lik


def definition(Q, H, W, b=None, q_mask=None, d_mask=None, *, normalize=True, mask_mode="exclude"):
    """The promise, spelled out: ``lik.maxsim`` of the projected (and normalised) documents, in float64, with
    masked hidden rows zeroed first (garbage there must not matter)."""
    H = H.double() if d_mask is None else torch.where(d_mask[..., None], H.double(), 0)
    D = F.linear(H, W.double(), None if b is None else b.double())
    if normalize:
        D = F.normalize(D, dim=-1)
    return lik.maxsim(Q.double(), D, q_mask, d_mask, mask_mode=mask_mode)


def problem(rng, *, n_q=3, l_q=5, n_docs=4, l_d=37, d_model=40, d_out=24, per_query=False, bias=True,
            masks=True, garbage=True, dtype=torch.float32):
    """``dict(Q, H, W, b, q_mask, d_mask)``: d_model not a multiple of the interpreter's 32-wide k chunk, d_out not
    a power of two, Ld over two 16-token tiles; one document fully masked, one query token masked, inf and NaN in
    masked hidden rows."""
    Q = F.normalize(torch.randn(n_q, l_q, d_out, generator=rng), dim=-1).to(dtype)
    shape = (n_q, n_docs, l_d, d_model) if per_query else (n_docs, l_d, d_model)
    H = torch.randn(*shape, generator=rng).to(dtype)
    W = (torch.randn(d_out, d_model, generator=rng) / d_model**0.5).to(dtype)
    b = (0.1 * torch.randn(d_out, generator=rng)).to(dtype) if bias else None
    q_mask = d_mask = None
    if masks:
        q_mask = torch.rand(n_q, l_q, generator=rng) > 0.2
        q_mask[0, -1] = False
        d_mask = torch.rand(*shape[:-1], generator=rng) > 0.3
        if n_docs > 1:
            d_mask[..., 1, :] = False  # a document with no valid token
        if garbage:
            H = H.clone()
            H[~d_mask] = float("nan")
            H[..., 0, :][~d_mask[..., 0]] = float("inf")
    return dict(Q=Q, H=H, W=W, b=b, q_mask=q_mask, d_mask=d_mask)


def leaves(inputs: dict, dtype=None) -> dict:
    """Copies of the float inputs that require grad (masks as they are)."""
    out = {}
    for name, x in inputs.items():
        if isinstance(x, torch.Tensor) and x.dtype.is_floating_point:
            x = x.detach().to(dtype or x.dtype).clone().requires_grad_()
        out[name] = x
    return out
