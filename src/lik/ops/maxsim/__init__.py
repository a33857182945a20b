"""MaxSim (ColBERT / ColPali late interaction): fused Triton kernels and their PyTorch reference."""

from .function import maxsim
from .packing import pack, unpack
from .reference import maxsim_reference
from .reference_varlen import maxsim_packed_reference, maxsim_varlen_reference
from .varlen import maxsim_packed, maxsim_varlen

__all__ = [
    "maxsim",
    "maxsim_reference",
    "maxsim_varlen",
    "maxsim_packed",
    "maxsim_varlen_reference",
    "maxsim_packed_reference",
    "pack",
    "unpack",
]
