"""Backward of packed MaxSim: the padded backward's kernels on views of the packed tensors.

The forward saved each query row's winner as an *absolute* row of the packed ``d`` (-1: no gradient), so the
documents are a ``[1, B, Td, dim]`` view with document stride 0 and every kernel of ``backward.py`` /
``backward_sorted.py`` applies as is:

* corpus (dense queries ``[Nq, Lq, dim]``, winners ``[Nq, B, Lq]``): exactly the padded launches on that view;
* pairs (packed queries ``[Tq, dim]``, winners ``[Tq]``): one query of ``Tq`` tokens against one document (the
  view), each token weighted by its own pair's gradient (``PairWeights``: the kernels find the pair in
  ``cu_seqlens_q``);
* deterministic ``dD`` (both): the sorted-winners gather with absolute rows as keys (``LAYOUT`` ``PACKED`` /
  ``PAIRS``), each row's document found in ``cu_seqlens_d``.
"""

from __future__ import annotations

import torch

from ...config.maxsim import maxsim_backward_config
from .backward import PairWeights, feature_blocks, launch_dd_atomic, maxsim_backward_dq
from .backward_sorted import launch_dd_sorted
from .packing import PackedInputs

__all__ = ["packed_backward", "packed_backward_dq", "packed_backward_dd"]


def _broadcast(x: torch.Tensor, *sizes: int) -> torch.Tensor:
    """``x`` behind leading dimensions of ``sizes`` with stride 0: every index reads the same ``x``, and no
    stride that follows a packed length reaches a kernel (no new variant when ``Tq`` or ``Td`` changes)."""
    return x.as_strided((*sizes, *x.shape), (0,) * len(sizes) + x.stride())


def _backward_views(grad: torch.Tensor, inputs: PackedInputs, argmax: torch.Tensor):
    """``(grad [Nq, B], q [Nq, Lq, dim], argmax [Nq, B, Lq], pairs)`` in the padded backward's layout."""
    if inputs.pairs:
        pairs = PairWeights(inputs.cu_q, grad.shape[0])
        return _broadcast(grad, 1), _broadcast(inputs.q, 1), _broadcast(argmax, 1, 1), pairs
    return grad, inputs.q, argmax, None


def _documents(x: torch.Tensor, n_docs: int) -> torch.Tensor:
    """``[Td, dim]`` as ``[1, n_docs, Td, dim]`` with document stride 0 (absolute winners index its rows)."""
    return _broadcast(x, 1, n_docs)


def packed_backward_dq(grad: torch.Tensor, inputs: PackedInputs, argmax: torch.Tensor) -> torch.Tensor:
    """Gradient of the packed (pairs) or dense (corpus) queries, in their dtype; a gather, deterministic."""
    q, d = inputs.q, inputs.d
    grad_v, q_v, argmax_v, pairs = _backward_views(grad, inputs, argmax)
    dq = maxsim_backward_dq(grad_v, _documents(d, argmax_v.shape[1]), argmax_v, q_v.shape, q.dtype, pairs=pairs)
    return dq.view(q.shape)


def packed_backward_dd(
    grad: torch.Tensor, inputs: PackedInputs, argmax: torch.Tensor, *, deterministic: bool
) -> torch.Tensor:
    """Gradient of the packed documents ``[Td, dim]`` in their dtype: the sorted gather (``deterministic``) or
    fp32 atomics."""
    q, d = inputs.q, inputs.d
    dim = d.shape[1]
    n_docs = inputs.cu_d.numel() - 1
    if d.numel() == 0 or q.numel() == 0 or n_docs == 0:
        return torch.zeros_like(d, memory_format=torch.contiguous_format)
    cfg = maxsim_backward_config(dim=dim, dtype=d.dtype, device=d.device)
    block_k, n_k_blocks = feature_blocks(dim, cfg.block_k)
    grad_v, q_v, argmax_v, pairs = _backward_views(grad, inputs, argmax)
    if deterministic:
        dd = torch.empty(d.shape, dtype=d.dtype, device=d.device)
        launch_dd_sorted(grad_v, q_v, argmax_v, _documents(dd, 1), per_query=inputs.pairs, cfg=cfg,
                         block_k=block_k, n_k_blocks=n_k_blocks, cu_d=inputs.cu_d, pairs=inputs.pairs)
        return dd
    dd32 = torch.zeros(d.shape, dtype=torch.float32, device=d.device)
    launch_dd_atomic(grad_v, q_v, argmax_v, _documents(dd32, argmax_v.shape[1]), cfg=cfg, block_k=block_k,
                     n_k_blocks=n_k_blocks, pairs=pairs)
    return dd32.to(d.dtype)


def packed_backward(grad_scores, q, d, cu_q, cu_d, argmax, max_seqlen_q, need_dq, need_dd, deterministic):
    """``(dq, dd)`` of the packed scores (None where not needed), each in its input's dtype."""
    inputs = PackedInputs(q, d, cu_q, cu_d, None, max_seqlen_q, False, True)
    grad_scores = grad_scores.float().contiguous()
    dq = packed_backward_dq(grad_scores, inputs, argmax) if need_dq else None
    dd = packed_backward_dd(grad_scores, inputs, argmax, deterministic=deterministic) if need_dd else None
    return dq, dd
