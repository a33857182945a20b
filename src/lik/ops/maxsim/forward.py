"""MaxSim's padded forward launcher: canonical inputs (:class:`~lik.ops.maxsim.validation.MaxSimInputs`) to the one
launch of the tile loop's forward kernel (:mod:`lik.core.forward_launch`, which holds the launch arithmetic)."""

from __future__ import annotations

import torch

from ...core.forward_launch import (
    NARROW_TAIL_MAX, NARROW_TAIL_N, chunk_sums, dot_precision, last_tiles, launch_forward, padded_problem,
    scale_pointers, set_strides, whole_tiles,
)
from .validation import MaxSimInputs

__all__ = [
    "maxsim_forward", "forward_problem", "chunk_sums", "dot_precision", "set_strides", "scale_pointers",
    "whole_tiles", "last_tiles", "NARROW_TAIL_N", "NARROW_TAIL_MAX",
]


def forward_problem(inputs: MaxSimInputs):
    """The padded :class:`~lik.core.forward_launch.ForwardProblem` of canonical inputs."""
    return padded_problem(inputs.q, inputs.d, inputs.q_mask, inputs.d_mask, exclude=inputs.mask_mode == "exclude",
                          per_query=inputs.per_query_documents, precision=inputs.dot_precision,
                          q_scale=inputs.q_scale, d_scale=inputs.d_scale)


def maxsim_forward(inputs: MaxSimInputs, store_argmax: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the forward kernel on canonical inputs.

    Returns fp32 scores ``[Nq, B]`` and, if ``store_argmax``, ``[Nq, B, Lq]`` winner indices (-1 where a row
    gets no gradient: masked query token, empty document, or a masked winner in ``mask_mode="zero"``): int16
    when ``Ld < 32 768`` (half the memory a training step keeps between forward and backward), else int32.
    """
    partial, argmax = launch_forward(forward_problem(inputs), store_argmax)
    return chunk_sums(partial), argmax
