"""late-interaction-kernels' ``fused_head`` module on lik: :func:`maxsim_from_hidden` (documents given as hidden
states and a projection head, the projection fused into the scoring), delegating to :func:`lik.maxsim_from_hidden`
(see :mod:`lik.integrations.late_interaction_kernels` for what differs)."""

from __future__ import annotations

import torch

from ...ops.fused_head import maxsim_from_hidden as _lik_maxsim_from_hidden

__all__ = ["maxsim_from_hidden"]


def maxsim_from_hidden(Q: torch.Tensor, H_d: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None = None,
                       d_mask: torch.Tensor | None = None, normalize: bool = True) -> torch.Tensor:
    """MaxSim with the document-side projection fused in (late-interaction-kernels' ``maxsim_from_hidden``).

    Equals ``maxsim(Q, F.normalize(F.linear(H_d, W, b), dim=-1), d_mask=d_mask)`` (without the normalisation
    when ``normalize=False``), the projected documents never written to memory; autograd-aware (gradients to
    ``Q``, ``H_d``, ``W`` and ``b``).

    Args:
        Q: ``[Lq, d_out]`` or ``[Nq, Lq, d_out]``, already projected (and normalised).
        H_d: ``[Nd, Ld, d_model]`` hidden states.
        W: ``[d_out, d_model]`` (``torch.nn.Linear.weight``); b: ``[d_out]`` or None.
        d_mask: ``[Nd, Ld]`` mask, True (or non-zero) for real tokens (``[Ld]`` for a single document); a masked
            token never takes part in the max and a document with no valid token scores 0.
        normalize: L2-normalise each projected document token.

    Returns:
        float32 ``[Nq, Nd]`` (``[Nd]`` for 2-D ``Q``).

    Example:
        >>> head = torch.nn.Linear(768, 128)
        >>> Q = torch.nn.functional.normalize(torch.randn(4, 32, 128), dim=-1)
        >>> maxsim_from_hidden(Q, torch.randn(10, 180, 768), head.weight, head.bias).shape
        torch.Size([4, 10])
    """
    if not isinstance(Q, torch.Tensor) or Q.dim() not in (2, 3):
        raise ValueError(f"Q must be [Lq, d_out] or [Nq, Lq, d_out]; got {tuple(getattr(Q, 'shape', ()))}")
    if not isinstance(H_d, torch.Tensor) or H_d.dim() != 3:
        raise ValueError(f"H_d must be [Nd, Ld, d_model]; got {tuple(getattr(H_d, 'shape', ()))}")
    if not isinstance(W, torch.Tensor) or W.dim() != 2 or tuple(W.shape) != (Q.shape[-1], H_d.shape[-1]):
        raise ValueError(f"W must be [d_out={Q.shape[-1]}, d_model={H_d.shape[-1]}]; "
                         f"got {tuple(getattr(W, 'shape', ()))}")
    if b is not None and (not isinstance(b, torch.Tensor) or tuple(b.shape) != (Q.shape[-1],)):
        raise ValueError(f"b must be [d_out={Q.shape[-1]}]; got {tuple(getattr(b, 'shape', ()))}")
    if isinstance(d_mask, torch.Tensor) and d_mask.dim() == 1:
        d_mask = d_mask.unsqueeze(0)
    # The peer computes in one half-precision dtype whatever it is given; lik scores in the inputs' one dtype, so
    # a head kept in another dtype than the hidden states (fp32 weights, bf16 activations) is cast to theirs.
    dtype = H_d.dtype
    Q, W = Q.to(dtype), W.to(dtype)
    b = None if b is None else b.to(dtype)
    return _lik_maxsim_from_hidden(Q, H_d, W, b, None, d_mask, normalize=bool(normalize))
