"""Inference scan of a compressed corpus: :func:`score_residual_packed`, the token stream of
:mod:`lik.core.token_stream` with the residual loader of :mod:`.decode` (every tile decoded on chip, no decompressed
copy anywhere), or, where :func:`lik.config.residual.residual_stream_config` says it is faster (many query row
blocks, each of which would decode every tile again), the fallback: runs of whole documents decoded into one
bounded scratch buffer, each scored by ``maxsim_packed``'s scan.
"""

from __future__ import annotations

import torch

from lik import _device
from lik._device import cdiv
from lik._dispatch import uses_kernels
from lik.config.residual import ResidualStreamConfig, residual_stream_config
from lik.core.forward_launch import dot_precision
from lik.ops.maxsim.packed_forward import stream_launch
from lik.ops.maxsim.packed_function import PackedQuery, score_packed

from .decode import decode_into, decode_rows, decode_rows_select, decode_table
from .reference import maxsim_residual_reference
from .validation import ResidualInputs

__all__ = ["score_residual_packed", "residual_stream", "residual_fallback", "residual_scores"]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def residual_stream(q, q_mask, codes, residuals, codec, cu, cfg: ResidualStreamConfig) -> torch.Tensor:
    """Launch the token stream with the residual loader; ``q [Nq, Lq, d]`` fp16 / bf16 / fp32 (``d`` <= 128, any
    strides), ``cu`` int32 contiguous, nothing empty. Returns the fp32 per-chunk sums ``[n_chunks, Nq, B]``."""
    n_q, l_q, dim = q.shape
    block_k = max(16, _device.next_power_of_2(dim))
    partial = torch.empty((cdiv(l_q, cfg.group_rows), n_q, int(cu.shape[0]) - 1), dtype=torch.float32, device=q.device)
    # the decode table and the codes take the 8-bit query and document scales' slots
    stream_launch(
        q,
        residuals,
        q_mask,
        cu,
        partial,
        (decode_table(codec, q.is_cuda), codes),
        cfg,
        block_k,
        dot_precision(q.dtype),
        LOADER=0,
        DECODE=decode_rows if cfg.byte_table else decode_rows_select,
        NBITS=codec.nbits,
    )
    return partial


def residual_fallback(q, q_mask, codes, residuals, codec, cu, cu_host, chunk_tokens: int) -> torch.Tensor:
    """Scores ``[Nq, B]``: runs of whole documents of about ``chunk_tokens`` tokens (a longer document is one run)
    decoded by :func:`decode_into` into one scratch buffer of ``q``'s dtype, each run scored by
    :func:`lik.ops.maxsim.packed_function.score_packed`. ``cu_host`` int64 CPU ``[B + 1]``."""
    n_docs = int(cu_host.shape[0]) - 1
    scores = torch.empty(q.shape[0], n_docs, dtype=torch.float32, device=q.device)
    query = PackedQuery(q, q_mask, None)
    lengths = cu_host[1:] - cu_host[:-1]
    scratch = torch.empty(
        min(int(cu_host[-1]), max(chunk_tokens, int(lengths.max()))), codec.dim, dtype=q.dtype, device=q.device
    )
    # each run ends at the last document boundary at most chunk_tokens past its start
    first = 0
    while first < n_docs:
        lo = int(cu_host[first])
        last = int(torch.searchsorted(cu_host, lo + chunk_tokens, right=True)) - 1
        last = min(max(last, first + 1), n_docs)
        hi = int(cu_host[last])
        d = decode_into(scratch[: hi - lo], codes[lo:hi], residuals[lo:hi], codec)
        sub_cu = (cu[first : last + 1] - lo).contiguous()
        scores[:, first:last] = score_packed(query, d, sub_cu)
        first = last
    return scores


def residual_scores(inputs: ResidualInputs, cu_host: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 scores ``[Nq, B]`` of checked inputs on a kernel device (``q`` fp16 / bf16 / fp32), by the path
    :func:`~lik.config.residual.residual_stream_config` picks. ``cu_host``: the offsets on the host if known
    (the fallback reads them otherwise)."""
    q, q_mask, codes, residuals, codec, cu = (
        inputs.q,
        inputs.q_mask,
        inputs.codes,
        inputs.residuals,
        inputs.codec,
        inputs.cu,
    )
    n_q, l_q, dim = q.shape
    n_docs = inputs.n_docs
    if n_q == 0 or l_q == 0 or n_docs == 0 or codes.shape[0] == 0:
        return torch.zeros(n_q, n_docs, dtype=torch.float32, device=q.device)
    codes = codes if codes.is_contiguous() else codes.contiguous()
    residuals = residuals if residuals.stride(-1) == 1 else residuals.contiguous()
    cfg = residual_stream_config(q_len=l_q, n_queries=n_q, dim=dim, dtype=q.dtype, device=q.device, nbits=codec.nbits)
    if cfg.chunk_tokens:
        cu_host = cu.to("cpu", torch.int64) if cu_host is None else cu_host
        return residual_fallback(q, q_mask, codes, residuals, codec, cu, cu_host, cfg.chunk_tokens)
    partial = residual_stream(q, q_mask, codes, residuals, codec, cu, cfg)
    return partial.sum(0) if partial.shape[0] > 1 else partial[0]


def score_residual_packed(Q, q_mask, codes, residuals, codec, cu_seqlens) -> torch.Tensor:
    """MaxSim of queries against a compressed packed corpus for search: inference only, arguments known good (a
    stored index's chunk: nothing is checked again and, on the fused path, nothing is read back from the device).

    Args:
        Q: ``[Nq, Lq, d]`` float16 / bfloat16 / float32 (float64 runs the reference), any strides.
        q_mask: bool ``[Nq, Lq]`` (True = real token) or None.
        codes: int32 / int64 ``[T]`` in ``[0, K)``; residuals: uint8 ``[T, d * nbits // 8]`` (rows contiguous).
        codec: a :class:`lik.compression.ResidualCodec` on ``Q``'s device.
        cu_seqlens: int32 contiguous ``[N + 1]``, 0 first, ``T`` last, non-decreasing.

    Returns:
        float32 ``[Nq, N]`` (float64 for float64 ``Q``): :func:`lik.maxsim_residual`'s scores.

    Example::

        >>> scores = score_residual_packed(Q, None, codes, residuals, codec, cu)  # [Nq, N]
    """
    inputs = ResidualInputs(Q, q_mask, codes, residuals, cu_seqlens, codec, False, 0)
    if Q.dtype not in _KERNEL_DTYPES or not uses_kernels(Q) or Q.shape[-1] > 256:
        return maxsim_residual_reference(inputs)
    return residual_scores(inputs)
