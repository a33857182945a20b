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


# Machine epsilon (the spacing of the floats in [1, 2)): one ulp of x is at most ULP * |x|.
ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-23}


def scored_documents(H, W, b=None, d_mask=None, *, dtype=torch.float64, normalize=True):
    """float64 ``[..., Ld, d_out]``: the projected rows as the forward kernel scores them, computed in float64 (the
    kernel: fp32 accumulation) and rounded once to ``dtype`` (kernel.py: the normalised rows are rounded to the input
    dtype before the product with Q). The unfused path in half precision rounds twice (``F.linear``'s output, then
    ``F.normalize``'s); the kernel only once."""
    H = H.double() if d_mask is None else torch.where(d_mask[..., None], H.double(), 0)
    D = F.linear(H, W.double(), None if b is None else b.double())
    if normalize:
        D = F.normalize(D, dim=-1)
    return D.to(dtype).double()


def similarities(Q, D, d_mask=None):
    """float64 ``[Nq, B, Lq, Ld]`` of queries ``[Nq, Lq, d]`` and shared documents ``[B, Ld, d]``; masked document
    tokens -inf ("exclude")."""
    sim = torch.einsum("nsk,jtk->njst", Q.double(), D)
    return sim if d_mask is None else sim.masked_fill(~d_mask[None, :, None, :], float("-inf"))


def check_winners(sim, winners, q_mask, slack: float) -> int:
    """Asserts that the kernel's ``winners [Nq, B, Lq]`` are -1 exactly where a query token takes no gradient (masked,
    or no valid document token) and elsewhere a token whose similarity is within ``slack`` of the row's maximum;
    returns how many differ from the first float64 argmax (near-ties: the rounding of the kernel's fp32 arithmetic)."""
    best, first = sim.max(-1)
    counts = torch.isfinite(best)
    if q_mask is not None:
        counts &= q_mask[:, None, :]
    assert torch.equal(winners >= 0, counts), "winners: -1 where the reference has a winner, or the reverse"
    chosen = sim.gather(-1, winners.clamp_min(0).long()[..., None])[..., 0]
    deficit = torch.where(counts, best - chosen, 0)
    flips = int((counts & (winners.long() != first)).sum())
    assert deficit.max().item() <= slack, (
        f"winners short of the max by up to {deficit.max().item():.3g} (> {slack:.3g}); {flips} of "
        f"{int(counts.sum())} differ from float64's")
    return flips


def winner_scores(Q, H, W, b, q_mask, d_mask, winners, *, normalize=True):
    """float64 ``[Nq, B]``, differentiable in ``Q``, ``H``, ``W``, ``b``: each query token's similarity with the
    given winner (-1: none) in the unrounded projection, summed. Its gradients are the exact gradients at those
    winners, which the kernel's backward computes (fp32, from the unrounded projection)."""
    H = H if d_mask is None else torch.where(d_mask[..., None], H, 0)
    D = F.linear(H, W, b)
    if normalize:
        D = F.normalize(D, dim=-1)
    n_docs, l_d, d_out = D.shape
    index = (torch.arange(n_docs, device=D.device)[None, :, None] * l_d + winners.clamp_min(0).long())
    rows = D.reshape(-1, d_out)[index.reshape(-1)].reshape(*winners.shape, d_out)
    sim = (Q[:, None] * rows).sum(-1)
    keep = winners >= 0
    if q_mask is not None:
        keep &= q_mask[:, None, :]
    return torch.where(keep, sim, 0).sum(-1)
