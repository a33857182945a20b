"""The PyTorch specification of :func:`lik.contrastive_loss`: MaxSim scores, divided by the temperature, into
``F.cross_entropy`` (mean over queries); and the cross-entropy step alone, in closed form, for the kernel's tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..maxsim.reference import maxsim_reference

__all__ = ["contrastive_loss_reference", "cross_entropy_reference"]


def contrastive_loss_reference(
    Q: torch.Tensor,
    D: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    mask_mode: str = "exclude",
) -> torch.Tensor:
    """``F.cross_entropy(maxsim_reference(Q, D, q_mask, d_mask) / temperature, labels)``, labels defaulting to
    ``arange(Nq)``; differentiable (plain autograd).

    Args:
        Q: ``[Nq, Lq, d]``; D: ``[B, Ld, d]`` or ``[Nq, B, Ld, d]``; float16 / bfloat16 / float32 / float64.
        labels: int64 ``[Nq]`` in ``[0, B)``, or None for the diagonal.

    Returns:
        The mean loss, a 0-dim float32 tensor (float64 for float64 inputs).

    Example:
        >>> Q, D = torch.randn(4, 8, 16), torch.randn(6, 10, 16)
        >>> contrastive_loss_reference(Q, D, temperature=0.05).shape
        torch.Size([])
    """
    scores = maxsim_reference(Q, D, q_mask, d_mask, mask_mode=mask_mode)
    if labels is None:
        labels = torch.arange(scores.shape[0], device=scores.device)
    return F.cross_entropy(scores / temperature, labels)


def cross_entropy_reference(
    scores: torch.Tensor, labels: torch.Tensor | None, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, grad)`` of ``scores [Nq, B]``: the mean cross-entropy of ``scores / temperature`` and its gradient
    ``(softmax - onehot) / (Nq * temperature)``, in the scores' dtype (float64 in the tests).

    Example:
        >>> loss, grad = cross_entropy_reference(torch.randn(3, 5, dtype=torch.float64), None, 0.5)
    """
    n_q, n_docs = scores.shape
    if labels is None:
        labels = torch.arange(n_q, device=scores.device)
    x = scores / temperature
    lse = torch.logsumexp(x, dim=1)
    loss = (lse - x.gather(1, labels[:, None])[:, 0]).mean()
    onehot = F.one_hot(labels, n_docs).to(scores.dtype)
    return loss, (torch.softmax(x, dim=1) - onehot) / (n_q * temperature)
