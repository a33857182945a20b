"""MaxSim against a Python list of separately allocated documents, read where they lie (no joined copy).

A caller holding documents as a list of ``[L_i, d]`` tensors (colpali-engine's page lists) would otherwise join
them into one tensor before scoring: a copy of every byte (263 MB for 1 000 ColPali pages) that the device makes
before its first product and that raises the call's peak memory by as much. Here the forward kernel reads each
document at its own address, through an int64 table of offsets from the list's first non-empty document in
16-byte units (``DOC_TABLE`` in :mod:`lik.core.segments`): documents of one length take the padded launch, ragged
ones the packed launch with ``cu_seqlens`` built from their lengths. Scores are those of :func:`lik.maxsim` on the
stacked documents (equal lengths) or of :func:`lik.maxsim_packed` on the joined ones (ragged), bit for bit: the
same kernel and tiles, only the addresses come from the table.

Which lists qualify (:meth:`DocumentList.build`; otherwise it returns ``None`` and the caller joins): every
document on the query rows' device, where the kernels run for them, contiguous and 16-byte aligned. The checks
that keep every read inside the documents' memory run before any launch (device, contiguity, and each length
counted from the document's bytes, so a document of another dtype or shape is still read only inside its own
bytes); the checks that only decide whether the numbers mean anything (two dimensions, one dtype, one width) run
once, after the first launch while the device works, and raise naming the first bad document before any score
is returned.

Inference only: float rows, no masks, no gradient.

Example:
    >>> q = torch.randn(20, 1, 128, device="cuda", dtype=torch.bfloat16)   # rows [Nq, Lq, d]
    >>> pages = [torch.randn(n, 128, device="cuda", dtype=torch.bfloat16) for n in (1030, 700, 1030)]
    >>> documents = DocumentList.build(pages, q)
    >>> maxsim_document_list(q, documents).shape                          # fp32 [Nq, len(pages)]
    torch.Size([20, 3])
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import torch

from ..._dispatch import uses_kernels
from .forward import maxsim_forward
from .packed_forward import packed_forward
from .packing import PackedInputs
from .validation import MaxSimInputs

__all__ = ["DocumentList", "maxsim_document_list"]

# Where the table's offsets point must be 16-byte aligned: the kernels then load rows as wide vectors.
_ALIGNMENT = 16
_nbytes = attrgetter("nbytes")
_device = attrgetter("device")
_dtype = attrgetter("dtype")
_shape = attrgetter("shape")
_requires_grad = attrgetter("requires_grad")


@dataclass
class DocumentList:
    """A list of ``[L_i, d]`` documents prepared for :func:`maxsim_document_list`.

    ``lengths``: int64 ``[B]`` (numpy), each document's bytes over one row's; ``table``: int64 ``[B]`` on the
    device, each document's offset from ``origin`` (the first non-empty document) in 16-byte units, 0 for an
    empty one. ``checked`` turns True once the dimensions, dtypes and widths have been verified."""

    documents: list[torch.Tensor]
    name: str
    origin: torch.Tensor
    table: torch.Tensor
    lengths: np.ndarray
    dim: int
    checked: bool = False

    @classmethod
    def build(cls, documents: list[torch.Tensor], like: torch.Tensor, name: str = "documents"
              ) -> "DocumentList | None":
        """Prepare ``documents`` (a non-empty list of tensors) to be scored against query rows ``like``
        (``[..., d]``), or ``None`` when they cannot be read in place (see the module doc). ``name`` is what errors
        call the list."""
        dim = like.shape[-1]
        if not documents or dim == 0 or not uses_kernels(like):
            return None
        # A device index is the cheaper pass; CPU and meta tensors share index -1, so on the CPU (the
        # interpreter) the devices themselves are compared.
        device = like.get_device()
        if set(map(torch.Tensor.get_device, documents)) != {device}:
            return None
        if device < 0 and set(map(_device, documents)) != {like.device}:
            return None
        if not all(map(torch.Tensor.is_contiguous, documents)):
            return None
        n = len(documents)
        lengths = np.fromiter(map(_nbytes, documents), dtype=np.int64, count=n) // (dim * like.element_size())
        addresses = np.fromiter(map(torch.Tensor.data_ptr, documents), dtype=np.int64, count=n)
        real = lengths > 0
        first = int(np.argmax(real)) if real.any() else 0
        origin = documents[first]
        if origin.dtype != like.dtype or (addresses[real] % _ALIGNMENT).any():
            return None
        offsets = np.where(real, (addresses - addresses[first]) // _ALIGNMENT, 0)
        table = torch.from_numpy(offsets).to(like.device, non_blocking=True)
        return cls(list(documents), name, origin, table, lengths, dim)

    def check(self) -> None:
        """Raise naming what is wrong when a document is not ``[L, d]`` in the origin's dtype, ``d`` being the
        query rows' width (once per list). Two C-level passes: the shapes (a set, so equal documents are one entry)
        and the dtypes."""
        if self.checked:
            return
        documents, dtype, name = self.documents, self.origin.dtype, self.name
        shapes = set(map(_shape, documents))
        if set(map(len, shapes)) != {2}:
            i = next(i for i, document in enumerate(documents) if document.dim() != 2)
            raise ValueError(f"{name}[{i}] must be a [L, d] tensor, got {documents[i].shape}")
        if set(map(_dtype, documents)) != {dtype}:
            i = next(i for i, document in enumerate(documents) if document.dtype != dtype)
            raise TypeError(f"{name}[{i}] has dtype {documents[i].dtype}; every item must have dtype {dtype}")
        widths = {shape[1] for shape in shapes}
        if len(widths) > 1:
            raise ValueError(f"{name}: every item must have the same embedding width, got {sorted(widths)}")
        if widths != {self.dim}:
            raise ValueError(f"{name} has embedding width {widths.pop()} but the queries have {self.dim}")
        self.checked = True


def maxsim_document_list(q: torch.Tensor, documents: DocumentList, start: int = 0, stop: int | None = None
                         ) -> torch.Tensor:
    """MaxSim of query rows ``q`` (``[Nq, Lq, d]``, the documents' dtype and device) against documents
    ``start:stop`` of ``documents``, read in place: fp32 ``[Nq, stop - start]``, each a sum over the ``Lq`` rows
    of their max over the document's tokens (0 for an empty document). Inference only.

    Raises:
        ValueError: ``q`` or a document requires grad while gradients are enabled; a document that is not 2-D or
            not of the queries' width (:meth:`DocumentList.check`, after the first launch).
        TypeError: a document of another dtype (the same check).
    """
    if torch.is_grad_enabled() and (q.requires_grad or any(map(_requires_grad, documents.documents))):
        raise ValueError("maxsim_document_list is inference only: run it under torch.no_grad()")
    lengths = documents.lengths[start:stop]
    n_docs, (n_q, l_q, dim) = len(lengths), q.shape
    table = documents.table[start:start + n_docs]
    longest = int(lengths.max()) if n_docs else 0
    if longest == 0:  # no document or only empty ones: every score is 0
        documents.check()
        return torch.zeros((n_q, n_docs), dtype=torch.float32, device=q.device)
    origin = documents.origin
    if lengths.min() == longest:
        # The stand-in gives the kernel its origin, dtype and shape; the table gives the addresses.
        stand_in = origin.as_strided((1, n_docs, longest, dim), (0, 0, 0, 0))
        scores = maxsim_forward(MaxSimInputs(q, stand_in, None, None, "exclude", False, False), False, table)[0]
    else:
        cu = np.zeros(n_docs + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu[1:])
        if cu[-1] >= 2**31:
            raise ValueError(f"{documents.name}: {cu[-1]} rows in one call; int32 offsets hold fewer than 2**31")
        cu_d = torch.from_numpy(cu.astype(np.int32)).to(q.device, non_blocking=True)
        stand_in = origin.as_strided((int(cu[-1]), dim), (0, 0))
        inputs = PackedInputs(q, stand_in, None, cu_d, None, l_q, False, True)
        scores = packed_forward(inputs, False, table)[0]
    documents.check()  # on the host while the device scores
    return scores
