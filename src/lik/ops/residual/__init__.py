"""MaxSim against ColBERTv2 / PLAID residual-compressed corpora: the codes decoded on chip inside the MaxSim loop
(``lik.maxsim_residual``), its PyTorch reference and the gradient to the queries."""

from .function import ResidualMaxSimFunction, maxsim_residual
from .reference import decode_tokens, maxsim_residual_reference
from .validation import ResidualInputs, check_residual_inputs

__all__ = [
    "maxsim_residual",
    "ResidualMaxSimFunction",
    "decode_tokens",
    "maxsim_residual_reference",
    "ResidualInputs",
    "check_residual_inputs",
]
