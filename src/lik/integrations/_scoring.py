"""The integrations' one door to MaxSim over dense batches: validation once, then the internal scoring entry.

A host library's drop-in (PyLate's ``colbert_scores``, sentence-transformers' ``util.maxsim``, colpali-engine's
``maxsim_inbatch``) converts and shapes its arguments, then calls :func:`score_dense` once. Two paths, the same
scores bit for bit:

* inference (no gradient wanted): the arguments are validated once into the canonical bundle
  (:meth:`~lik.ops.maxsim.validation.MaxSimInputs.build`) and scored by
  :func:`~lik.ops.maxsim.function.score_canonical`, with no replay key. Host libraries rerank and evaluate batches
  whose shapes change from call to call; keying them would record a replay per shape, and fill (and so empty)
  the replay table that holds the training step's recording;
* training (a gradient wanted): :func:`lik.maxsim`, whose key replays a repeated step's recorded forward and
  backward launches (docs/design.md, "The host path"), checks settled by the key: :func:`score_canonical` would
  run the full host path on every step.
"""

from __future__ import annotations

import torch

from ..ops.maxsim.function import maxsim, score_canonical
from ..ops.maxsim.validation import MaxSimInputs

__all__ = ["score_dense"]


def score_dense(
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    mask_mode: str = "exclude",
) -> torch.Tensor:
    """:func:`lik.maxsim` ``(Q, D, q_mask, d_mask, mask_mode=mask_mode)`` for an integration: the same arguments,
    checks and scores (``Q [Lq, d]`` or ``[Nq, Lq, d]``, ``D [B, Ld, d]`` or ``[Nq, B, Ld, d]``, optional masks ->
    float32 ``[B]`` / ``[Nq, B]``, float64 for float64 inputs), inference scored through the internal entry.

    Example:
        >>> score_dense(torch.randn(4, 32, 128), torch.randn(10, 180, 128), mask_mode="zero").shape
        torch.Size([4, 10])
    """
    if torch.is_grad_enabled() and (getattr(Q, "requires_grad", False) or getattr(D, "requires_grad", False)):
        return maxsim(Q, D, q_mask, d_mask, mask_mode=mask_mode)
    inputs = MaxSimInputs.build(Q, D, q_mask, d_mask, mask_mode, allow_float64=True)
    return inputs.finish(score_canonical(inputs))
