"""MaxSim (ColBERT / ColPali late interaction): fused Triton kernels and their PyTorch reference."""

from .function import maxsim
from .reference import maxsim_reference

__all__ = ["maxsim", "maxsim_reference"]
