"""The scoring options of the MaxSim scorers beyond the plain max: the reduction over a query token's document
tokens (``reduction``, ``tau``, ``top_k``), length normalisation (``normalize_by``) and the 8-bit copy of ``D``
kept for the backward (``save_d_as``); their checks, and the PyTorch form of the reductions (the references').

* ``reduction="max"``: ``max_t s[t]`` (MaxSim).
* ``reduction="smooth", tau``: ``tau * logsumexp(s / tau)`` over the token's document tokens (the max as ``tau``
  goes to 0; ``log(n) * tau`` above it for ``n`` equal similarities).
* ``reduction="topk", top_k``: the mean of the ``top_k`` largest similarities (ties: lower token first); with
  fewer than ``top_k`` tokens in the reduction, the mean of those there are. ``top_k = 1`` is the max.
* ``normalize_by="query_tokens"``: each score divided by its query's valid token count (a query with none
  scores 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "REDUCTIONS", "NORMALIZATIONS", "MAX_TOP_K", "ScoreOptions", "check_options", "reduce_similarities",
    "query_token_counts", "DEFAULT_OPTIONS",
]

REDUCTIONS = ("max", "smooth", "topk")
NORMALIZATIONS = ("none", "query_tokens")
# A row's running top-k lives in registers next to its similarity tile: 16 slots is what fits beside it.
MAX_TOP_K = 16


@dataclass(frozen=True)
class ScoreOptions:
    reduction: str = "max"
    tau: float = 1.0
    top_k: int = 1
    normalize_by: str = "none"
    save_d_as: torch.dtype | None = None

    @property
    def plain(self) -> bool:
        """The plain MaxSim call (the replayed, tile-loop path)."""
        return self.reduction == "max" and self.normalize_by == "none" and self.save_d_as is None

    @property
    def normalized(self) -> bool:
        return self.normalize_by == "query_tokens"

    def arguments(self) -> dict:
        """The keyword arguments of the public scorers that give these options (``save_d_as`` aside)."""
        return {"reduction": self.reduction, "tau": self.tau if self.reduction == "smooth" else None,
                "top_k": self.top_k if self.reduction == "topk" else None, "normalize_by": self.normalize_by}


DEFAULT_OPTIONS = ScoreOptions()


def check_options(reduction="max", tau=None, top_k=None, normalize_by="none", save_d_as=None) -> ScoreOptions:
    """Check the scoring options (before anything runs); errors name the argument."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if normalize_by not in NORMALIZATIONS:
        raise ValueError(f"normalize_by must be one of {NORMALIZATIONS}, got {normalize_by!r}")
    if tau is not None and reduction != "smooth":
        raise ValueError(f"tau is only for reduction='smooth', got reduction={reduction!r}")
    if top_k is not None and reduction != "topk":
        raise ValueError(f"top_k is only for reduction='topk', got reduction={reduction!r}")
    if reduction == "smooth":
        if isinstance(tau, bool) or not isinstance(tau, (int, float)):
            raise TypeError(f"tau must be a positive float for reduction='smooth', got {tau!r}")
        tau = float(tau)
        if not (0.0 < tau < float("inf")):
            raise ValueError(f"tau must be a positive finite float, got {tau!r}")
    if reduction == "topk":
        if isinstance(top_k, bool) or not isinstance(top_k, int):
            raise TypeError(f"top_k must be an int in 1..{MAX_TOP_K} for reduction='topk', got {top_k!r}")
        if not 1 <= top_k <= MAX_TOP_K:
            raise ValueError(
                f"top_k must be in 1..{MAX_TOP_K} (the running top-k is kept in registers), got {top_k}"
            )
    if save_d_as is not None and save_d_as != torch.int8:
        raise ValueError(f"save_d_as must be None or torch.int8, got {save_d_as!r}")
    return ScoreOptions(reduction, 1.0 if tau is None else tau, 1 if top_k is None else top_k, normalize_by,
                        save_d_as)


def reduce_similarities(sim: torch.Tensor, counted: torch.Tensor | None, options: ScoreOptions) -> torch.Tensor:
    """Each row's reduction over the last axis of ``sim [..., Ld]`` (columns outside the reduction already
    ``-inf``; ``counted``: bool broadcastable to ``sim``, True where a column takes part, None for all); a row
    with no column in the reduction must be masked out by the caller. Autograd flows (float64 in the tests)."""
    if options.reduction == "max":
        return sim.max(dim=-1).values
    if options.reduction == "smooth":
        return options.tau * torch.logsumexp(sim / options.tau, dim=-1)
    k = min(options.top_k, sim.shape[-1])
    # Stable: equal values keep token order, so the lower token is chosen first (NaN sorts above every number).
    top = torch.sort(sim, dim=-1, descending=True, stable=True).values[..., :k]
    n = sim.shape[-1] if counted is None else counted.sum(dim=-1, keepdim=True)
    count = torch.clamp(torch.clamp(torch.as_tensor(n, device=sim.device), max=options.top_k), min=1)
    slot = torch.arange(k, device=sim.device)
    return torch.where(slot < count, top, 0).sum(dim=-1) / count.squeeze(-1).to(sim.dtype)


def query_token_counts(q_mask: torch.Tensor | None, n_queries: int, q_len: int, device) -> torch.Tensor:
    """fp32 ``[Nq]``: each query's valid token count (``q_mask``'s True tokens, or ``Lq``), at least 1 (a query with
    no valid token scores 0, divided by anything)."""
    if q_mask is None:
        return torch.full((n_queries,), float(max(q_len, 1)), device=device)
    return q_mask.sum(dim=-1).clamp(min=1).to(torch.float32)
