"""lik: fused Triton GPU kernels for late-interaction retrieval and multi-scale deformable attention.

Public functions (see README.md for shapes and semantics):

* :func:`lik.maxsim` -- ColBERT / ColPali MaxSim scores with a training backward.
* :func:`lik.maxsim_reference` -- the pure-PyTorch specification (CPU path, tests).
* :func:`lik.search` -- exact top-k MaxSim search over a corpus, in memory-bounded chunks.
"""

from .ops.maxsim import maxsim, maxsim_reference

__version__ = "0.1.0"

__all__ = ["maxsim", "maxsim_reference", "__version__"]
