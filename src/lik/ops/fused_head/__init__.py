"""``lik.maxsim_from_hidden``: MaxSim with the documents' projection head (``H W^T + b``, L2-normalised) fused in."""

from .function import FusedHeadFunction, maxsim_from_hidden
from .reference import maxsim_from_hidden_reference

__all__ = ["maxsim_from_hidden", "maxsim_from_hidden_reference", "FusedHeadFunction"]
