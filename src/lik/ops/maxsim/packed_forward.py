"""Forward launcher of packed MaxSim: packed documents (and, for pairs, packed queries) through the one launch of the
tile loop's forward kernel (:mod:`lik.core.forward_launch`), told so by its ``LAYOUT`` flag; or, for inference of
dense queries against a corpus of short documents, through the token stream (:mod:`lik.core.token_stream`), as
:func:`lik.config.packed.packed_stream_config` chooses."""

from __future__ import annotations

import torch

from ... import _device
from ..._device import cdiv
from ..._launch import launch
from ..._replay import made
from ...config.packed import PackedStreamConfig, packed_stream_config
from ...core.division import divisor_constants
from ...core.forward_launch import ForwardProblem, chunk_sums, launch_forward, packed_problem, scale_pointers
from ...core.quantized import loader_chunks, loader_of
from ...core.segments import PACKED
from ...core.token_stream import token_stream_kernel
from ...config.maxsim import feature_chunks
from .packing import PackedInputs

__all__ = [
    "packed_forward",
    "packed_forward_problem",
    "packed_launch",
    "stream_config",
    "launch_token_stream",
    "stream_launch",
]


def packed_forward_problem(inputs: PackedInputs):
    """The packed :class:`~lik.core.forward_launch.ForwardProblem` of validated packed inputs."""
    return packed_problem(
        inputs.q,
        inputs.d,
        inputs.cu_d,
        inputs.q_mask,
        cu_q=inputs.cu_q,
        max_seqlen_q=inputs.max_seqlen_q,
        q_scale=inputs.q_scale,
        d_scale=inputs.d_scale,
    )


def stream_config(problem: ForwardProblem, store_argmax: bool) -> PackedStreamConfig | None:
    """The token stream's tiles for ``problem``, or None where the document loop takes it (pairs, winners, an empty
    problem, long documents, wide embeddings)."""
    if problem.layout != PACKED.value or store_argmax:
        return None
    q, d = problem.q, problem.d
    if q.numel() == 0 or d.numel() == 0 or problem.n_docs == 0:
        return None
    return packed_stream_config(
        q_len=problem.q_len,
        n_queries=problem.n_queries,
        dim=q.shape[-1],
        dtype=d.dtype,
        device=q.device,
        n_rows=d.shape[0],
        n_docs=problem.n_docs,
    )


def packed_launch(problem: ForwardProblem, store_argmax: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`~lik.core.forward_launch.launch_forward`'s contract (per-chunk sums ``[n_chunks, Nq, B]``, winners),
    through the token stream where :func:`stream_config` gives it tiles."""
    cfg = stream_config(problem, store_argmax)
    if cfg is None:
        return launch_forward(problem, store_argmax)
    return launch_token_stream(problem, cfg), None


def launch_token_stream(problem: ForwardProblem, cfg: PackedStreamConfig) -> torch.Tensor:
    """Launch :func:`~lik.core.token_stream.token_stream_kernel` on a packed-corpus ``problem`` (not empty);
    returns the fp32 per-chunk sums ``[n_chunks, Nq, B]`` (announced to a recording: :func:`lik._replay.made`)."""
    q, d = problem.q, problem.d
    loader = loader_of(d.dtype)
    block_k, _ = loader_chunks(*feature_chunks(q.shape[-1], 1 << 30), loader)
    n_chunks = cdiv(problem.q_len, cfg.group_rows)
    partial = made(torch.empty((n_chunks, problem.n_queries, problem.n_docs), dtype=torch.float32, device=q.device))
    scales = (partial, partial) if problem.d_scale is None else scale_pointers(problem.q_scale, problem.d_scale)
    stream_launch(
        q, d, problem.q_mask, problem.cu_d, partial, scales, cfg, block_k, problem.dot_precision, LOADER=loader
    )
    return partial


def stream_launch(q, d, q_mask, cu, partial, scales, cfg, block_k: int, dot_precision, **loader) -> None:
    """Launch :func:`~lik.core.token_stream.token_stream_kernel` over the rows of ``d`` into ``partial`` (fp32
    ``[n_chunks, Nq, B]``, ``n_chunks = cdiv(Lq, cfg.group_rows)``): ``q [Nq, Lq, d]``, ``q_mask`` bool
    ``[Nq, Lq]`` or None, ``cu`` int32 ``[B + 1]``, ``scales`` the two scale slots, ``cfg`` a packed or residual
    stream config; ``loader`` the loader's constexprs (``LOADER``, and ``DECODE`` / ``NBITS`` for a decoder).
    Shared by the packed scan and the compressed scan, which differ only in what fills the loader's slots.

    Example::

        >>> stream_launch(q, d, None, cu, partial, (partial, partial), cfg, 128, dot_precision(q.dtype), LOADER=0)
    """
    n_chunks, n_q, n_docs = partial.shape
    n_rows = d.shape[0]
    n_row_blocks = cdiv(n_q * n_chunks, cfg.groups)
    # Programs per row block: the SMs' share, at most one per tile of rows (a program with no documents returns).
    share = cfg.programs_per_sm * _device.sm_count(q.device) // n_row_blocks
    programs = max(1, min(cdiv(n_rows, cfg.block_t), share))
    q_mask_arg, q_mask_strides = (q, (0, 0)) if q_mask is None else (q_mask.view(torch.uint8), q_mask.stride())
    launch(
        token_stream_kernel,
        (n_row_blocks * programs,),
        q,
        d,
        q_mask_arg,
        cu,
        partial,
        *scales,
        n_q,
        q.shape[1],
        n_docs,
        n_rows,
        n_chunks,
        n_row_blocks,
        programs,
        int(n_docs).bit_length(),
        *divisor_constants(n_row_blocks),
        *divisor_constants(n_chunks),
        *q.stride(),
        *d.stride(),
        *q_mask_strides,
        *partial.stride(),
        DIM=q.shape[-1],
        GROUP_ROWS=cfg.group_rows,
        GROUPS=cfg.groups,
        BLOCK_T=cfg.block_t,
        BLOCK_K=block_k,
        HAS_Q_MASK=q_mask is not None,
        DOT_PRECISION=dot_precision,
        SEGMENTS=cfg.segments,
        **loader,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        maxnreg=cfg.max_registers or None,
    )


def packed_forward(inputs: PackedInputs, store_argmax: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the forward kernel on packed inputs.

    Returns fp32 scores (pairs ``[N]``, corpus ``[Nq, B]``) and, with ``store_argmax``, the int32 winners as
    absolute rows of ``d`` (pairs ``[Tq]``, corpus ``[Nq, B, Lq]``; -1 where a row gets no gradient).
    Inference of a corpus of short documents takes the token stream (:func:`packed_launch`).
    """
    partial, argmax = packed_launch(packed_forward_problem(inputs), store_argmax)
    scores = chunk_sums(partial)
    return (scores[0] if inputs.pairs else scores), argmax
