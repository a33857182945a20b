"""MaxSim's forward kernel, which is the core tile loop's (:mod:`lik.core.forward_kernel`): kept under this name for
code that imports it from here."""

from ...core.forward_kernel import RUNTIME_INTS, maxsim_fwd_kernel, score_documents
from ...core.stream import settle_nan_winners, store_winners, write_document

__all__ = ["maxsim_fwd_kernel", "score_documents", "write_document", "store_winners", "settle_nan_winners",
           "RUNTIME_INTS"]
