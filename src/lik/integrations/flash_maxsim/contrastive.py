"""flash-maxsim's fused contrastive training step (``flash_maxsim.flash_maxsim_contrastive``) on
:func:`lik.contrastive_loss` (see :mod:`lik.integrations.flash_maxsim` for what differs)."""

from __future__ import annotations

import torch

from ...ops.contrastive import contrastive_loss

__all__ = ["colbert_contrastive_step"]


def colbert_contrastive_step(Q: torch.Tensor, D: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
    """One in-batch contrastive step, flash-maxsim's signature and side effect: the mean cross-entropy of the MaxSim
    scores ``[Nq, Nd]`` against ``labels`` (None: the diagonal, query ``i``'s positive is document ``i``), its
    gradients accumulated into ``Q.grad`` and ``D.grad`` (set when None).

    Args:
        Q: queries ``[Nq, Lq, d]``; float16 / bfloat16 / float32, CUDA (CPU runs lik's reference).
        D: documents ``[Nd, Ld, d]`` (``Nd >= Nq`` for the diagonal), same dtype and device.
        labels: optional int64 ``[Nq]`` in ``[0, Nd)``; flash-maxsim accepts only ``arange(Nq)``, lik any labels.

    Returns:
        The scalar fp32 loss, not connected to autograd (as flash-maxsim's).

    Computed by :func:`lik.contrastive_loss` (temperature 1, fast backward): MaxSim's forward, one cross-entropy
    kernel and MaxSim's backward launches, replayed from the second step of a shape. Works under
    ``torch.no_grad()`` too (the step makes its own graph, as flash-maxsim's kernel needs none).

    Example:
        >>> Q = torch.nn.functional.normalize(torch.randn(128, 32, 128), dim=-1).half().cuda()
        >>> D = torch.nn.functional.normalize(torch.randn(128, 180, 128), dim=-1).half().cuda()
        >>> loss = colbert_contrastive_step(Q, D)       # Q.grad, D.grad now hold the step's gradients
    """
    for name, x in (("Q", Q), ("D", D)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(f"{name} must be [{'Nq, Lq' if name == 'Q' else 'Nd, Ld'}, d], got shape {tuple(x.shape)}")
    # (A present .grad matches its tensor's shape, dtype and device: PyTorch refuses any other assignment.)
    # Leaves over the caller's storage: the step's graph is its own, whatever Q and D are part of.
    q = Q.detach().requires_grad_()
    d = D.detach().requires_grad_()
    with torch.enable_grad():
        loss = contrastive_loss(q, d, labels, backward="fast")
        dq, dd = torch.autograd.grad(loss, (q, d))
    for x, g in ((Q, dq), (D, dd)):
        if x.grad is None:
            x.grad = g
        else:
            x.grad.add_(g)
    return loss.detach()
