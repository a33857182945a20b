"""MaxSim against ColBERTv2 / PLAID residual-compressed corpora: the codes decoded on chip inside the MaxSim loop
(``lik.maxsim_residual``; ``score_residual_packed`` for search, without autograd or checks), its PyTorch reference,
the gradient to the queries, and the on-chip decoder (``decode_into``)."""

from .function import ResidualMaxSimFunction, maxsim_residual
from .decode import decode_into
from .reference import decode_tokens, maxsim_residual_reference
from .scan import score_residual_packed
from .validation import ResidualInputs, check_residual_inputs

__all__ = [
    "maxsim_residual",
    "score_residual_packed",
    "decode_into",
    "ResidualMaxSimFunction",
    "decode_tokens",
    "maxsim_residual_reference",
    "ResidualInputs",
    "check_residual_inputs",
]
