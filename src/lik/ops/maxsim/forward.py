"""Host side of the fused MaxSim forward: tiles from the heuristic, launch arithmetic, and the launch of
:func:`lik.ops.maxsim.forward_kernel.maxsim_fwd_kernel` (the kernels and their addressing are described there).
"""

from __future__ import annotations

import torch

from ..._config import cdiv, feature_chunks, maxsim_forward_config, maxsim_forward_doc_programs
from ..._launch import launch
from ...core.division import divisor_constants
from ...core.quantized import loader_chunks, loader_of
from ...core.forward_kernel import maxsim_fwd_kernel
from .validation import MaxSimInputs

__all__ = [
    "maxsim_forward", "chunk_sums", "dot_precision", "set_strides", "scale_pointers", "whole_tiles", "last_tiles",
    "NARROW_TAIL_N", "NARROW_TAIL_MAX",
]


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs follow ``torch.get_float32_matmul_precision()``: "highest" means true fp32 products."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


def set_strides(x: torch.Tensor) -> tuple[int, ...]:
    """Strides of a canonical ``[n_sets, ...]`` tensor, with the set stride 0 when the set is shared."""
    return (0 if x.shape[0] == 1 else x.stride(0), *x.stride()[1:])


def _mask_arg(mask: torch.Tensor | None, fallback: torch.Tensor, ndim: int):
    if mask is None:
        return fallback, (0,) * ndim
    return mask.view(torch.uint8), mask.stride()


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
    address them with the compile-time width as their stride (``tile.document_tile``). The loop addresses the
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


def maxsim_forward(
    inputs: MaxSimInputs, store_argmax: bool, recorder=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the forward kernel on canonical inputs.

    Returns fp32 scores ``[Nq, B]`` and, if ``store_argmax``, ``[Nq, B, Lq]`` winner indices (-1 where a row
    gets no gradient: masked query token, empty document, or a masked winner in ``mask_mode="zero"``): int16
    when ``Ld < 32 768`` (half the memory a training step keeps between forward and backward), else int32.
    ``recorder(grid, args, options, partial)``, if given, is called after the launch with what was launched
    (:mod:`lik.ops.maxsim.replay` files it for replays); an empty problem launches nothing and calls nothing.
    """
    q, d = inputs.q, inputs.d
    n_q, l_q, dim = q.shape
    n_sets, n_docs, l_d, _ = d.shape
    device = q.device
    argmax_dtype = torch.int16 if l_d < 2**15 else torch.int32
    argmax = torch.empty((n_q, n_docs, l_q), dtype=argmax_dtype, device=device) if store_argmax else None
    if min(n_q, n_docs, l_q, l_d, dim) == 0:
        if argmax is not None:
            argmax.fill_(-1)
        return torch.zeros((n_q, n_docs), dtype=torch.float32, device=device), argmax

    cfg = maxsim_forward_config(
        q_len=l_q,
        n_queries=n_q,
        dim=dim,
        dtype=q.dtype,
        per_query=inputs.per_query_documents,
        device=device,
        doc_len=l_d,
        argmax=store_argmax,
    )
    n_chunks = cdiv(l_q, cfg.group_rows)
    n_row_blocks = cdiv(n_q * n_chunks, cfg.groups)
    partial = torch.empty((n_chunks, n_q, n_docs), dtype=torch.float32, device=device)
    block_k, num_k = feature_chunks(dim, cfg.block_k)
    d_scale, loader = inputs.d_scale, 0
    scale_ptrs = (partial, partial)  # float rows: never read
    if d_scale is not None:
        loader = loader_of(d.dtype)
        block_k, num_k = loader_chunks(block_k, num_k, loader)
        scale_ptrs = scale_pointers(inputs.q_scale, d_scale)
    q_mask, q_mask_strides = _mask_arg(inputs.q_mask, q, 2)
    d_mask, d_mask_strides = _mask_arg(inputs.d_mask, d, 3)
    d_strides = set_strides(d)
    d_mask_strides = (0 if n_sets == 1 else d_mask_strides[0], *d_mask_strides[1:])
    argmax_arg = argmax if argmax is not None else partial
    argmax_strides = argmax.stride() if argmax is not None else (0, 0, 0)
    doc_programs = maxsim_forward_doc_programs(cfg, n_row_blocks=n_row_blocks, n_docs=n_docs, device=device)
    grid = (n_row_blocks * doc_programs,)
    whole, tail = last_tiles(cfg, l_d, dim, loader, inputs.d_mask is not None,
                             bool(loader) and (d_strides[2] != dim or d_strides[3] != 1), q.numel())
    if whole and not q.is_contiguous():
        q = q.contiguous()  # (whole tiles address the query's rows by the width too; the query is the small side)
    args = (
        q, d, q_mask, d_mask, partial, partial, partial, argmax_arg, *scale_ptrs,
        n_q, l_q, n_docs, l_d, 0, 0, n_chunks, n_row_blocks, doc_programs,
        *divisor_constants(n_row_blocks), *divisor_constants(n_chunks),
        *q.stride(), *d_strides, *q_mask_strides, *d_mask_strides, *partial.stride(), *argmax_strides,
    )
    options = dict(
        DIM=dim,
        GROUP_ROWS=cfg.group_rows,
        GROUPS=cfg.groups,
        BLOCK_N=cfg.block_n,
        BLOCK_K=block_k,
        NUM_K=num_k,
        HAS_Q_MASK=inputs.q_mask is not None,
        HAS_D_MASK=inputs.d_mask is not None,
        EXCLUDE=inputs.mask_mode == "exclude",
        STORE_ARGMAX=store_argmax,
        DOT_PRECISION=inputs.dot_precision or dot_precision(q.dtype),
        PERSISTENT=cfg.programs_per_sm > 0,
        FLAT_K=int(cfg.flat_k),
        LOADER=loader,
        WHOLE_TILES=whole,
        TAIL_N=tail,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        maxnreg=cfg.max_registers or None,
    )
    launch(maxsim_fwd_kernel, grid, *args, **options)
    if recorder is not None:
        recorder(grid, args, options, partial)
    return chunk_sums(partial), argmax


def chunk_sums(partial: torch.Tensor) -> torch.Tensor:
    """Scores ``[Nq, B]`` from the kernel's per-chunk sums ``[n_chunks, Nq, B]`` (a long query's row blocks add up
    on the host: exact, a score is a sum over query tokens)."""
    return partial[0] if partial.shape[0] == 1 else partial.sum(dim=0)
