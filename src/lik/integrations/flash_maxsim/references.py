"""flash-maxsim's plain-PyTorch MaxSim references (``maxsim_naive*``), with flash-maxsim's semantics.

They materialise the ``[B, Lq, Ld]`` similarities, as code without a fused kernel does, and keep flash-maxsim's
conventions where they differ from lik's scorers: the similarities, maxima and sums stay in the input dtype
(``maxsim_naive_fp32`` reduces in float32), and a document of length 0 scores ``-inf``. lik's own specification
of MaxSim is :func:`lik.maxsim_reference`.
"""

from __future__ import annotations

import torch

from .scoring import _tensor

__all__ = [
    "maxsim_naive",
    "maxsim_naive_fp32",
    "maxsim_at_operator",
    "maxsim_bmm",
    "maxsim_chunked",
    "maxsim_naive_batched",
    "maxsim_naive_int8",
]


def _similarities(Q: torch.Tensor, D: torch.Tensor, doc_lengths=None) -> torch.Tensor:
    """``[B, Lq, Ld]`` products of ``Q [Lq, d]`` with ``D [B, Ld, d]``, ``-inf`` past each document's length."""
    _tensor("Q", Q, (2,))
    _tensor("D", D, (3,))
    sims = torch.matmul(Q, D.transpose(1, 2))
    if doc_lengths is not None:
        lengths = torch.as_tensor(doc_lengths, device=D.device)
        padding = torch.arange(D.shape[1], device=D.device) >= lengths[:, None]
        sims = sims.masked_fill(padding[:, None, :], float("-inf"))
    return sims


def maxsim_naive(Q: torch.Tensor, D: torch.Tensor, doc_lengths=None) -> torch.Tensor:
    """``Q [Lq, d]``, ``D [B, Ld, d]``, optional ``doc_lengths [B]`` -> ``[B]`` in the input dtype.

    Example:
        >>> maxsim_naive(torch.randn(32, 128), torch.randn(10, 300, 128)).shape
        torch.Size([10])
    """
    return _similarities(Q, D, doc_lengths).amax(dim=2).sum(dim=1)


def maxsim_naive_fp32(Q: torch.Tensor, D: torch.Tensor, doc_lengths=None) -> torch.Tensor:
    """:func:`maxsim_naive` with the maxima and sums in float32 (the products stay in the input dtype)."""
    return _similarities(Q, D, doc_lengths).float().amax(dim=2).sum(dim=1)


def maxsim_at_operator(Q: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """:func:`maxsim_naive` as one ``[Lq, B * Ld]`` matrix product."""
    _tensor("Q", Q, (2,))
    _tensor("D", D, (3,))
    n_docs, doc_len, dim = D.shape
    sims = (Q @ D.reshape(n_docs * doc_len, dim).T).view(Q.shape[0], n_docs, doc_len)
    return sims.amax(dim=2).sum(dim=0)


def maxsim_bmm(Q: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """:func:`maxsim_naive` through ``torch.bmm`` of the broadcast query."""
    _tensor("Q", Q, (2,))
    _tensor("D", D, (3,))
    sims = torch.bmm(Q.expand(D.shape[0], -1, -1), D.transpose(1, 2))
    return sims.amax(dim=2).sum(dim=1)


def maxsim_chunked(Q: torch.Tensor, D: torch.Tensor, chunk_size: int = 1000, fp32_reduce: bool = False
                   ) -> torch.Tensor:
    """:func:`maxsim_naive` (or :func:`maxsim_naive_fp32` with ``fp32_reduce``), ``chunk_size`` documents at a
    time."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    naive = maxsim_naive_fp32 if fp32_reduce else maxsim_naive
    return torch.cat([naive(Q, D[start:start + chunk_size]) for start in range(0, D.shape[0], chunk_size)])


def maxsim_naive_batched(Q: torch.Tensor, D: torch.Tensor, doc_lengths=None, shared_docs: bool = True
                         ) -> torch.Tensor:
    """``Q [Nq, Lq, d]`` against ``D [B, Ld, d]`` (``shared_docs``) or ``D [Nq, B, Ld, d]`` -> ``[Nq, B]``, one
    :func:`maxsim_naive` per query (``doc_lengths``: ``[B]``, the same for every query)."""
    _tensor("Q", Q, (3,))
    return torch.stack([maxsim_naive(Q[i], D if shared_docs else D[i], doc_lengths) for i in range(Q.shape[0])])


def maxsim_naive_int8(Q: torch.Tensor, D_int8: torch.Tensor, d_scales: torch.Tensor) -> torch.Tensor:
    """``D_int8 * d_scales`` (``[B, Ld]`` or ``[B, Ld, 1]``) dequantized to ``Q``'s dtype, then
    :func:`maxsim_naive`."""
    if d_scales.dim() == 2:
        d_scales = d_scales[..., None]
    return maxsim_naive(Q, (D_int8.float() * d_scales.float()).to(Q.dtype))
