"""Forward launcher of packed MaxSim: packed documents (and, for pairs, packed queries) through the one launch of the
tile loop's forward kernel (:mod:`lik.core.forward_launch`), told so by its ``LAYOUT`` flag."""

from __future__ import annotations

import torch

from ...core.forward_launch import chunk_sums, launch_forward, packed_problem
from .packing import PackedInputs

__all__ = ["packed_forward", "packed_forward_problem"]


def packed_forward_problem(inputs: PackedInputs):
    """The packed :class:`~lik.core.forward_launch.ForwardProblem` of validated packed inputs."""
    return packed_problem(inputs.q, inputs.d, inputs.cu_d, inputs.q_mask, cu_q=inputs.cu_q,
                          max_seqlen_q=inputs.max_seqlen_q, q_scale=inputs.q_scale, d_scale=inputs.d_scale)


def packed_forward(inputs: PackedInputs, store_argmax: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the forward kernel on packed inputs.

    Returns fp32 scores (pairs ``[N]``, corpus ``[Nq, B]``) and, with ``store_argmax``, the int32 winners as
    absolute rows of ``d`` (pairs ``[Tq]``, corpus ``[Nq, B, Lq]``; -1 where a row gets no gradient).
    """
    partial, argmax = launch_forward(packed_forward_problem(inputs), store_argmax)
    scores = chunk_sums(partial)
    return (scores[0] if inputs.pairs else scores), argmax
