"""The forward program of packed pairs: query ``i`` (rows of the packed queries) against document ``i`` only.

:func:`lik.maxsim_varlen`'s layout (``LAYOUT == PAIRS`` in :func:`~lik.core.forward_kernel.maxsim_fwd_kernel`).
A program owns one pair and takes the row chunks ``row_block``, ``row_block + n_row_blocks``, ... of its query,
so a ``max_seqlen_q`` hint below the true longest query costs speed, never tokens. The document is streamed by
the tile loop every layout shares (:func:`~lik.core.stream.maxsim_doc_rows`) over its true length.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .quantized import row_scales, scale_rows
from .segments import segment
from .stream import maxsim_doc_rows
from .tile import NO_KEY, counted_rows

__all__ = ["score_pairs"]


@triton.jit
def score_pairs(
    q_ptr, d_ptr, cu_q_ptr, cu_d_ptr, partial_ptr, argmax_ptr, row_block, pair, n_row_blocks, n_q_rows, n_d_rows,
    stride_ql, stride_qk, stride_dl, stride_dk, stride_pc, stride_pb, stride_al,
    q_scale_ptr, d_scale_ptr,
    DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_K: tl.constexpr,
    STORE_ARGMAX: tl.constexpr, DOT_PRECISION: tl.constexpr, REDUCTION: tl.constexpr, LOADER: tl.constexpr,
):
    """Write ``partial[row_block, 0, pair]`` (the program's share of the pair's score) and each of its query
    rows' winner as an absolute row of the packed documents (-1: no gradient)."""
    doc_start, doc_len = segment(cu_d_ptr, pair, n_d_rows)
    q_start, pair_len = segment(cu_q_ptr, pair, n_q_rows)
    rows = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    total = tl.zeros((BLOCK_M,), tl.float32)
    for first in range(row_block * BLOCK_M, pair_len, n_row_blocks * BLOCK_M):
        in_range = first + rows < pair_len
        token = q_start + first + rows
        q_row_ptrs = q_ptr + token * stride_ql
        q_scale = row_scales(q_scale_ptr + token, in_range, LOADER)  # contiguous [Tq]
        if NUM_K == 1:
            q_rows = tl.load(
                q_row_ptrs[:, None] + offs_k[None, :] * stride_qk,
                mask=in_range[:, None] & (offs_k[None, :] < DIM),
                other=0.0,
            )
        else:  # wide embeddings: the tile loop reloads the query per feature chunk
            q_rows = tl.zeros((BLOCK_M, BLOCK_K), q_ptr.dtype.element_ty)
        # A packed document has no padding and no mask: every in-range token is valid ("exclude": an empty
        # document has no valid token and scores 0).
        best, key, n_valid = maxsim_doc_rows(
            q_rows, q_row_ptrs, in_range, stride_qk, d_ptr + doc_start * stride_dl, d_ptr, doc_len, stride_dl,
            stride_dk, 0, d_scale_ptr + doc_start, 1,
            DIM, BLOCK_M, BLOCK_N, BLOCK_K, NUM_K, False, True, STORE_ARGMAX, DOT_PRECISION, REDUCTION, LOADER,
        )
        counted = counted_rows(in_range, n_valid, True)
        if STORE_ARGMAX:
            winner = tl.where(counted & (key != NO_KEY), doc_start + (key >> 1), -1)
            tl.store(argmax_ptr + token * stride_al, winner.to(tl.int32), mask=in_range)
        total += tl.where(counted, scale_rows(best, q_scale, LOADER), 0.0)
    tl.store(partial_ptr + row_block * stride_pc + pair * stride_pb, tl.sum(total, axis=0))
