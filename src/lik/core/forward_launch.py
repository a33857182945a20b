"""The launch of the tile loop's forward kernel (:func:`~lik.core.forward_kernel.maxsim_fwd_kernel`), described once
for every caller: MaxSim's padded, packed-corpus and packed-pairs layouts, Chamfer's nearest neighbours, and the
warm-up's choice of variants.

A layout describes itself as a :class:`ForwardProblem` (:func:`padded_problem`, :func:`packed_problem`); the
one function :func:`launch_forward` picks the tiles, allocates the per-chunk sums (and the winners), spells out the
kernel's arguments and launches it. The launch is recordable (:mod:`lik._replay`): every tensor it hands the kernel
is a view of the problem's tensors or of the two buffers it returns, except a strided query or scale it copies.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._device import cdiv
from .._launch import launch
from .._replay import made
from ..config.maxsim import feature_chunks, maxsim_forward_config, maxsim_forward_doc_programs, maxsim_varlen_config
from .division import divisor_constants
from .forward_kernel import maxsim_fwd_kernel
from .quantized import FLOAT, loader_chunks, loader_of
from .segments import PACKED, PADDED, PAIRS

__all__ = [
    "ForwardProblem", "padded_problem", "packed_problem", "launch_forward", "chunk_sums", "dot_precision",
    "set_strides", "scale_pointers", "whole_tiles", "last_tiles", "NARROW_TAIL_N", "NARROW_TAIL_MAX",
]


class ForwardProblem(NamedTuple):
    """What a layout hands the forward kernel (canonical tensors, already validated).

    ``q``: ``[Nq, Lq, d]`` (pairs: the packed ``[Tq, d]``); ``d``: ``[n_sets, B, Ld, d]`` (packed: ``[Td, d]``);
    ``q_mask`` bool ``[Nq, Lq]`` and ``d_mask`` bool ``[n_sets, B, Ld]`` (padded only) or None; ``cu_q`` (pairs) and
    ``cu_d`` (packed) int32 offsets; 8-bit rows carry fp32 ``q_scale`` / ``d_scale`` of their rows' shape.
    ``n_queries`` / ``q_len``: the queries and their (longest) length; ``n_docs`` / ``doc_len``: the documents and
    their padded length (0 when packed)."""

    layout: int
    q: torch.Tensor
    d: torch.Tensor
    q_mask: torch.Tensor | None
    d_mask: torch.Tensor | None
    cu_q: torch.Tensor | None
    cu_d: torch.Tensor | None
    q_scale: torch.Tensor | None
    d_scale: torch.Tensor | None
    n_queries: int
    q_len: int
    n_docs: int
    doc_len: int
    exclude: bool
    per_query: bool
    dot_precision: str


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs follow ``torch.get_float32_matmul_precision()``: "highest" means true fp32 products."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


def padded_problem(q, d, q_mask=None, d_mask=None, *, exclude=True, per_query=False, precision=None, q_scale=None,
                   d_scale=None) -> ForwardProblem:
    """Padded documents ``d [n_sets, B, Ld, dim]`` (``n_sets`` 1, or ``Nq`` with ``per_query``) against ``q [Nq, Lq,
    dim]``; ``precision`` of fp32 products: None follows the matmul precision, or "tf32" / "ieee"."""
    n_q, l_q, _ = q.shape
    _, n_docs, l_d, _ = d.shape
    return ForwardProblem(PADDED.value, q, d, q_mask, d_mask, None, None, q_scale, d_scale, n_q, l_q, n_docs, l_d,
                          exclude, per_query, precision or dot_precision(q.dtype))


def packed_problem(q, d, cu_d, q_mask=None, *, cu_q=None, max_seqlen_q=0, q_scale=None, d_scale=None
                   ) -> ForwardProblem:
    """A packed corpus ``d [Td, dim]`` (``cu_d`` int32 ``[B + 1]``) against dense ``q [Nq, Lq, dim]``, or, with
    ``cu_q``, packed pairs: query ``i`` (rows of ``q [Tq, dim]``) against document ``i`` only (``max_seqlen_q``:
    the longest query, which sizes the grid)."""
    n_docs = cu_d.numel() - 1
    if cu_q is None:
        n_q, l_q = q.shape[0], q.shape[1]
        return ForwardProblem(PACKED.value, q, d, q_mask, None, None, cu_d, q_scale, d_scale, n_q, l_q, n_docs, 0,
                              True, False, dot_precision(q.dtype))
    return ForwardProblem(PAIRS.value, q, d, None, None, cu_q, cu_d, q_scale, d_scale, 1, max_seqlen_q, n_docs, 0,
                          True, True, dot_precision(q.dtype))


def set_strides(x: torch.Tensor) -> tuple[int, ...]:
    """Strides of a canonical ``[n_sets, ...]`` tensor, with the set stride 0 when the set is shared."""
    return (0 if x.shape[0] == 1 else x.stride(0), *x.stride()[1:])


def scale_pointers(q_scale: torch.Tensor, d_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's two scale arguments of 8-bit rows, contiguous (the kernel derives their strides from the
    shapes; a scale is 1/d of its rows' bytes, so a strided one is copied)."""
    return q_scale.contiguous(), d_scale.contiguous()


# The narrow tiles after a long-query loop's whole tiles, and the most tokens they take: more than two narrow
# tiles cost more than the one clamped tile they replace (H100, benchmarks/NOTES.md "A narrow last tile").
NARROW_TAIL_N = 16
NARROW_TAIL_MAX = 32


def whole_tiles(cfg, doc_len: int, dim: int, loader: int, masked: bool, strided_rows: bool = False,
                query_elements: int = 0) -> bool:
    """Whether the long-query loop (neither persistent nor feature-chunked) reads an unmasked padded 8-bit corpus's
    whole tiles without a row clamp or a last-tile select: when its length is a multiple of the document tile or
    at most :data:`NARROW_TAIL_MAX` tokens past one (those then take :func:`last_tiles`' narrow tiles), and its rows
    are stored back to back (``strided_rows`` False: row stride ``dim``, feature stride 1), which lets the loop
    address them with the compile-time width as their stride (``stream.document_tile``). The loop addresses the
    query's rows the same way, with 32-bit offsets: the launcher hands it a contiguous query, which must have fewer
    than 2**31 elements (``query_elements``).

    Flags on the length's remainder, not on the length: at most three variants per config (clamped, whole, whole
    and a narrow tail), and False wherever the loop does not use them, so they add no variant there. 8-bit rows
    only: float rows were not faster without the clamp, and slower with the narrow tail (benchmarks/NOTES.md,
    "Whole tiles", "A narrow last tile")."""
    if not loader or masked or strided_rows or cfg.programs_per_sm != 0 or doc_len % cfg.block_n > NARROW_TAIL_MAX \
            or query_elements >= 2**31:
        return False  # (float rows return here, before any arithmetic: this runs on every launch)
    return feature_chunks(dim, cfg.block_k)[1] == 1  # features resident (no streamed-k loop)


def last_tiles(cfg, doc_len: int, dim: int, loader: int, masked: bool, strided_rows: bool = False,
               query_elements: int = 0) -> tuple[bool, int]:
    """The forward launch's ``(WHOLE_TILES, TAIL_N)`` for a document length: :func:`whole_tiles`, and the width of
    the tiles the long-query loop reads after the whole tiles (its last ``doc_len % block_n`` tokens), 0 when it
    reads whole tiles only or none (the launcher and ``lik.warmup`` ask for both; warmup's corpora are contiguous)."""
    whole = whole_tiles(cfg, doc_len, dim, loader, masked, strided_rows, query_elements)
    return whole, (min(NARROW_TAIL_N, cfg.block_n) if whole and doc_len % cfg.block_n else 0)


def forward_config(problem: ForwardProblem, store_argmax: bool):
    """The tiles of ``problem``'s launch: the padded heuristic, or the packed one."""
    dim, device = problem.q.shape[-1], problem.q.device
    if problem.layout == PADDED.value:
        return maxsim_forward_config(q_len=problem.q_len, n_queries=problem.n_queries, dim=dim, dtype=problem.q.dtype,
                                     per_query=problem.per_query, device=device, doc_len=problem.doc_len,
                                     argmax=store_argmax)
    return maxsim_varlen_config(q_len=max(1, problem.q_len), n_queries=problem.n_queries, dim=dim,
                                dtype=problem.q.dtype, pairs=problem.layout == PAIRS.value, device=device)


def _winners(problem: ForwardProblem, store_argmax: bool, empty: bool) -> torch.Tensor | None:
    """The winners' buffer: int16 for padded documents shorter than 32 768 tokens (half the memory a training step
    keeps until its backward), int32 absolute rows for packed ones; -1 first where the kernel may not write."""
    if not store_argmax:
        return None
    q, device = problem.q, problem.q.device
    if problem.layout == PADDED.value:
        dtype = torch.int16 if problem.doc_len < 2**15 else torch.int32
        shape = (problem.n_queries, problem.n_docs, problem.q_len)
    else:
        dtype = torch.int32
        shape = (q.shape[0],) if problem.layout == PAIRS.value else (problem.n_queries, problem.n_docs, problem.q_len)
    argmax = made(torch.empty(shape, dtype=dtype, device=device))
    # Pairs: with unchecked cu_seqlens some packed query rows may belong to no pair, and the backward must see
    # "no gradient" there. The other layouts' kernel writes every entry.
    if empty or problem.layout == PAIRS.value:
        argmax.fill_(-1)
    return argmax


def launch_forward(problem: ForwardProblem, store_argmax: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the forward kernel on ``problem``.

    Returns ``(partial, argmax)``: fp32 per-chunk row sums ``[n_chunks, Nq, B]`` (pairs ``[n_chunks, 1, N]``;
    :func:`chunk_sums` adds them up) and, with ``store_argmax``, the winners (-1 where a row gets no gradient:
    masked query token, empty document, masked winner in ``mask_mode="zero"``): padded ``[Nq, B, Lq]`` token
    indices, packed absolute rows of ``d`` (corpus ``[Nq, B, Lq]``, pairs ``[Tq]``). An empty problem launches
    nothing and returns zeros. A recorded launch announces its winners, then its sums, as the call's last buffers
    (:func:`lik._replay.made`)."""
    q, d, layout = problem.q, problem.d, problem.layout
    device, dim = q.device, q.shape[-1]
    n_q, l_q, n_docs = problem.n_queries, problem.q_len, problem.n_docs
    padded, pairs = layout == PADDED.value, layout == PAIRS.value
    empty = (min(n_q, n_docs, l_q, problem.doc_len, dim) == 0) if padded else (
        q.numel() == 0 or d.numel() == 0 or n_docs == 0)
    argmax = _winners(problem, store_argmax, empty)
    if empty:
        return torch.zeros((1, n_q, n_docs), dtype=torch.float32, device=device), argmax

    cfg = forward_config(problem, store_argmax)
    loader = loader_of(d.dtype)
    block_k, num_k = loader_chunks(*feature_chunks(dim, cfg.block_k), loader)
    groups = 1 if pairs else cfg.groups
    if pairs:  # at least one program per pair (the hint only sizes the grid; a program walks its query's chunks)
        n_chunks = n_row_blocks = max(1, cdiv(l_q, cfg.group_rows))
    else:
        n_chunks = cdiv(l_q, cfg.group_rows)
        n_row_blocks = cdiv(n_q * n_chunks, groups)
    partial = made(torch.empty((n_chunks, n_q, n_docs), dtype=torch.float32, device=device))
    # Padded: the config's persistence as it is. Packed: stacked rows in inference only (winners, 8-bit rows and
    # streamed feature chunks keep a program per document).
    persistent = cfg.programs_per_sm > 0 and (padded or (
        not pairs and not store_argmax and cfg.groups > 1 and loader == FLOAT and num_k == 1))
    doc_programs = n_docs
    if persistent:
        doc_programs = maxsim_forward_doc_programs(cfg, n_row_blocks=n_row_blocks, n_docs=n_docs, device=device)
    whole, tail = False, 0
    if padded:
        d_strides = set_strides(d)
        strided_rows = bool(loader) and (d_strides[2] != dim or d_strides[3] != 1)
        whole, tail = last_tiles(cfg, problem.doc_len, dim, loader, problem.d_mask is not None, strided_rows,
                                 q.numel())
        if whole and not q.is_contiguous():
            q = q.contiguous()  # (whole tiles address the query's rows by the width too; the query is the small side)
        q_strides = q.stride()
    else:
        d_strides = (0, 0, *d.stride())
        q_strides = (0, *q.stride()) if pairs else q.stride()
    q_mask, d_mask = problem.q_mask, problem.d_mask
    q_mask_arg, q_mask_strides = (q, (0, 0)) if q_mask is None else (q_mask.view(torch.uint8), q_mask.stride())
    d_mask_arg, d_mask_strides = (d, (0, 0, 0)) if d_mask is None else (d_mask.view(torch.uint8), d_mask.stride())
    if d_mask is not None and d_mask.shape[0] == 1:
        d_mask_strides = (0, *d_mask_strides[1:])
    scales = (partial, partial) if problem.d_scale is None else scale_pointers(problem.q_scale, problem.d_scale)
    # Unread pointers (a layout's missing offsets, float rows' scales, inference's winners) are placeholders of the
    # same dtype for every call of a layout, so they never make a variant of their own.
    cu_q = problem.cu_q if pairs else (partial if padded else problem.cu_d)
    cu_d = partial if padded else problem.cu_d
    argmax_arg = partial if argmax is None else argmax
    argmax_strides = (0, 0, 1) if pairs else ((0, 0, 0) if argmax is None else argmax.stride())
    launch(
        maxsim_fwd_kernel, (n_row_blocks * doc_programs,),
        q, d, q_mask_arg, d_mask_arg, cu_q, cu_d, partial, argmax_arg, *scales,
        n_q, l_q, n_docs, problem.doc_len, q.shape[0] if pairs else 0, 0 if padded else d.shape[0],
        n_chunks, n_row_blocks, doc_programs, *divisor_constants(n_row_blocks), *divisor_constants(n_chunks),
        *q_strides, *d_strides, *q_mask_strides, *d_mask_strides, *partial.stride(), *argmax_strides,
        DIM=dim, GROUP_ROWS=cfg.group_rows, GROUPS=groups, BLOCK_N=cfg.block_n, BLOCK_K=block_k, NUM_K=num_k,
        HAS_Q_MASK=q_mask is not None, HAS_D_MASK=d_mask is not None, EXCLUDE=problem.exclude,
        STORE_ARGMAX=store_argmax, DOT_PRECISION=problem.dot_precision, PERSISTENT=persistent, LAYOUT=layout,
        # packed launches keep the flat feature loop and cap registers only where persistent
        FLAT_K=int(cfg.flat_k) if padded else 1, LOADER=loader, WHOLE_TILES=whole, TAIL_N=tail,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        maxnreg=(cfg.max_registers or None) if padded or persistent else None,
    )
    return partial, argmax


def chunk_sums(partial: torch.Tensor) -> torch.Tensor:
    """Scores ``[Nq, B]`` from the kernel's per-chunk sums ``[n_chunks, Nq, B]`` (a long query's row blocks add up
    on the host: exact, a score is a sum over query tokens)."""
    return partial[0] if partial.shape[0] == 1 else partial.sum(dim=0)
