"""Pure-PyTorch packed MaxSim: the specification of the packed kernels, and their CPU path.

Each sequence is sliced out of the packed tensors and scored through :func:`maxsim_reference`, so the packed
entry points inherit its semantics (NaN propagation, tie rule, float64, autograd) by construction: a packed
sequence is exactly an unpadded one. The loop runs on the host (``cu_seqlens`` is read once).
"""

from __future__ import annotations

import torch

from ...core.precision import accumulation_dtype
from .options import DEFAULT_OPTIONS, ScoreOptions
from .packing import PackedInputs
from .reference import connected_zeros, maxsim_reference

__all__ = ["maxsim_varlen_reference", "maxsim_packed_reference", "packed_reference"]


def packed_reference(inputs: PackedInputs, options: ScoreOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """Reference on validated inputs: pairs ``[N]`` or corpus ``[Nq, B]`` (float32, float64 for float64);
    ``options``: the reduction and normalisation (:mod:`.options`)."""
    kw = options.arguments()
    q, d = inputs.q, inputs.d
    acc = accumulation_dtype(q.dtype)
    d_bounds = inputs.cu_d.tolist()
    docs = [d[start:stop] for start, stop in zip(d_bounds[:-1], d_bounds[1:])]
    quantized = inputs.d_scale is not None
    # 8-bit rows carry their scales along (sliced like the rows); float rows pass None.
    d_scales = [inputs.d_scale[start:stop].unsqueeze(0) if quantized else None
                for start, stop in zip(d_bounds[:-1], d_bounds[1:])]
    if inputs.pairs:
        q_bounds = inputs.cu_q.tolist()
        queries = [q[start:stop] for start, stop in zip(q_bounds[:-1], q_bounds[1:])]
        q_scales = [inputs.q_scale[start:stop] if quantized else None
                    for start, stop in zip(q_bounds[:-1], q_bounds[1:])]
        scores = [maxsim_reference(qi, di.unsqueeze(0), q_scale=qs, d_scale=ds, **kw)
                  for qi, di, qs, ds in zip(queries, docs, q_scales, d_scales)]
        out_shape = (len(docs),)
    else:
        scores = [maxsim_reference(q, di.unsqueeze(0), inputs.q_mask, q_scale=inputs.q_scale, d_scale=ds, **kw)
                  for di, ds in zip(docs, d_scales)]  # each [Nq, 1]
        out_shape = (q.shape[0], len(docs))
    if not docs:  # no sequence at all: an empty result still connected to autograd (zero gradients)
        if quantized:  # inference only
            return torch.zeros(out_shape, dtype=torch.float32, device=q.device)
        return connected_zeros(out_shape, acc, q, d)
    return torch.cat(scores, dim=-1)


def maxsim_varlen_reference(
    q: torch.Tensor, d: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_d: torch.Tensor,
    *, q_scale: torch.Tensor | None = None, d_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scores of packed ``(query i, document i)`` pairs, looped through :func:`maxsim_reference`.

    Args:
        q: packed queries ``[total_q_tokens, dim]``; float16 / bfloat16 / float32 / float64.
        d: packed documents ``[total_d_tokens, dim]``, same dtype and device.
        cu_seqlens_q, cu_seqlens_d: int32 (or int64) ``[N + 1]`` offsets (checked: start 0, non-decreasing,
            end at the row count).

    Returns:
        ``[N]`` float32 (float64 for float64 inputs); an empty query or document scores 0.

    Example:
        >>> q, cu_q, _ = lik.pack([torch.randn(4, 16), torch.randn(2, 16)])
        >>> d, cu_d, _ = lik.pack([torch.randn(7, 16), torch.randn(0, 16)])
        >>> maxsim_varlen_reference(q, d, cu_q, cu_d).shape
        torch.Size([2])
    """
    inputs = PackedInputs.build_pairs(
        q, d, cu_seqlens_q, cu_seqlens_d, None, None, read_values=True, allow_float64=True,
        q_scale=q_scale, d_scale=d_scale,
    )
    return packed_reference(inputs)


def maxsim_packed_reference(
    Q: torch.Tensor, d: torch.Tensor, cu_seqlens_d: torch.Tensor, q_mask: torch.Tensor | None = None,
    *, q_scale: torch.Tensor | None = None, d_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Queries against a packed corpus, looped over documents through :func:`maxsim_reference`.

    Args:
        Q: ``[Lq, dim]`` or ``[Nq, Lq, dim]``.
        d: packed documents ``[total_d_tokens, dim]``; ``cu_seqlens_d`` int32 (or int64) ``[B + 1]``.
        q_mask: optional bool ``[Lq]`` / ``[Nq, Lq]``, True for real query tokens (a masked one adds 0).

    Returns:
        ``[B]`` for 2-D ``Q`` else ``[Nq, B]``; float32 (float64 for float64 inputs).

    Example:
        >>> d, cu_d, _ = lik.pack([torch.randn(7, 16), torch.randn(3, 16)])
        >>> maxsim_packed_reference(torch.randn(4, 16), d, cu_d).shape
        torch.Size([2])
    """
    inputs = PackedInputs.build_corpus(Q, d, cu_seqlens_d, q_mask, None, read_values=True, allow_float64=True,
                                       q_scale=q_scale, d_scale=d_scale)
    return inputs.finish(packed_reference(inputs))
