"""The residual MaxSim kernel with winners (the gradient's forward): ColBERTv2 codes decoded on chip inside the
MaxSim loop, and its launcher.

Inference does not come here: it takes the token stream of :mod:`lik.core.token_stream` with the residual loader of
:mod:`.decode` (:mod:`.scan`), which walks runs of documents as full tiles. This kernel keeps the per-document loop
because the gradient needs each (query token, document)'s winning row, which the token stream does not track; it
uses the core's pieces for everything else: the query rows and their stacking
(:func:`~lik.core.tile.query_rows`, :func:`~lik.core.tile.group_offsets`,
:func:`~lik.core.tile.store_group_sums`), the packed document spans (:func:`~lik.core.segments.segment`), the
product (:func:`~lik.core.tile.tile_dot`) and the NaN-propagating max (:func:`~lik.core.reductions.nan_max`).

One program per (row block, document): the block's query rows stay on chip, the document's tokens are decoded tile
by tile (``BLOCK_N`` tokens: their centroid rows gathered, the residual bytes unpacked with ColBERT's bit order,
the bucket weights added from the ``2**nbits`` table, each row normalised in fp32) and multiplied with them; a
running max per row (with the winning token when a gradient is needed) is summed per query at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lik.core.division import DIVIDEND_LIMIT, divide, divisor_constants
from lik.core.forward_launch import dot_precision
from lik.core.reductions import nan_max
from lik.core.segments import segment
from lik.core.tile import NO_KEY, group_offsets, query_rows, store_group_sums, tile_dot

__all__ = ["residual_maxsim_kernel", "residual_forward", "MAX_KERNEL_DIM"]

# Widest d decoded on chip (a [BLOCK_N, d] tile beside [rows, d] query rows); wider codecs decode in chunks.
MAX_KERNEL_DIM = 256


@triton.jit
def bucket_indices(byte, pos, NBITS: tl.constexpr):
    """The bucket of the dimension at group ``pos`` of its packed ``byte`` (int32), as ColBERT packs them: the
    byte's groups first dimension first from the high bits, each group's bits least significant first (so the
    group read as a number is the bucket with its ``NBITS`` bits reversed)."""
    group = (byte >> (8 - NBITS * (pos + 1))) & ((1 << NBITS) - 1)
    if NBITS == 1:
        bucket = group
    elif NBITS == 2:
        bucket = ((group & 1) << 1) | (group >> 1)
    else:
        bucket = ((group & 1) << 3) | ((group & 2) << 1) | ((group >> 1) & 2) | (group >> 3)
    return bucket


@triton.jit
def bucket_weight(weights_ptr, bucket, inside, NBITS: tl.constexpr):
    """``bucket_weights[bucket]``: selects among the table's scalars for 1 and 2 bits (one or three selects per
    element instead of a load each), a gather from the 16-entry table (cached) for 4 bits."""
    if NBITS == 1:
        weight = tl.where(bucket == 0, tl.load(weights_ptr), tl.load(weights_ptr + 1))
    elif NBITS == 2:
        low = tl.where((bucket & 1) == 0, tl.load(weights_ptr), tl.load(weights_ptr + 1))
        high = tl.where((bucket & 1) == 0, tl.load(weights_ptr + 2), tl.load(weights_ptr + 3))
        weight = tl.where(bucket < 2, low, high)
    else:
        weight = tl.load(weights_ptr + bucket, mask=inside, other=0.0)
    return weight


@triton.jit
def decode_tile(
    codes_ptr,
    res_ptr,
    cent_ptr,
    weights_ptr,
    rows,
    col_in,
    n_centroids,
    DIM: tl.constexpr,
    NBITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``[BLOCK_N, BLOCK_D]`` fp32: the decoded tokens at absolute ``rows`` (zeros outside ``col_in`` and past
    ``DIM``): ``normalize(centroid[code] + bucket_weights[bucket])``. Codes are clamped to the table (checked on
    the host; a clamp keeps an unchecked one from reading outside it)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_in = offs_d < DIM
    inside = col_in[:, None] & d_in[None, :]
    code = tl.load(codes_ptr + rows, mask=col_in, other=0).to(tl.int64)
    code = tl.minimum(tl.maximum(code, 0), n_centroids - 1)
    # (16-bit stored centroids are read as stored: their fp32 values are exact, in half the bytes)
    centroid = tl.load(cent_ptr + code[:, None] * DIM + offs_d[None, :], mask=inside, other=0.0).to(tl.float32)
    # a byte holds 8 // NBITS dimensions; a token's residual is DIM * NBITS // 8 bytes
    byte = tl.load(
        res_ptr + rows[:, None] * (DIM * NBITS // 8) + (offs_d // (8 // NBITS))[None, :], mask=inside, other=0
    )
    bucket = bucket_indices(byte.to(tl.int32), (offs_d % (8 // NBITS))[None, :], NBITS)
    weight = bucket_weight(weights_ptr, bucket, inside, NBITS)
    x = tl.where(inside, centroid + weight, 0.0)
    norm = tl.sqrt(tl.sum(x * x, axis=1))
    # torch.nn.functional.normalize's eps: a zero row stays zero
    return x / tl.maximum(norm, 1e-12)[:, None]


@triton.jit(
    do_not_specialize=[
        "n_queries",
        "q_len",
        "n_rows",
        "n_chunks",
        "chunks_multiplier",
        "chunks_shift",
        "n_row_blocks",
        "blocks_multiplier",
        "blocks_shift",
        "stride_qn",
        "stride_ql",
        "stride_qmn",
        "stride_qml",
        "stride_pc",
        "stride_pn",
        "stride_wn",
        "stride_wl",
    ]
)
def residual_maxsim_kernel(
    q_ptr,
    q_mask_ptr,
    codes_ptr,
    res_ptr,
    cent_ptr,
    weights_ptr,
    cu_ptr,
    partial_ptr,
    win_ptr,
    n_queries,
    q_len,
    n_rows,
    n_centroids,
    n_row_blocks,
    blocks_multiplier,
    blocks_shift,
    n_chunks,
    chunks_multiplier,
    chunks_shift,
    stride_qn,
    stride_ql,
    stride_qmn,
    stride_qml,
    stride_pc,
    stride_pn,
    stride_wn,
    stride_wl,
    DIM: tl.constexpr,
    NBITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
    GROUPS: tl.constexpr,
    HAS_Q_MASK: tl.constexpr,
    TRACK_ARGMAX: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program ``(row block, document)``: writes ``partial[chunk, query, doc]`` (each row group's sum of its rows'
    maxima) and, with ``TRACK_ARGMAX``, ``winners[query, token, doc]`` (int64 absolute row of the winning token,
    -1 for a masked query token or an empty document). ``Q`` rows are contiguous in ``d``."""
    # one flat grid (a 2-D grid caps documents at 65 535); a document's row blocks are neighbouring programs, so
    # its codes come from DRAM once
    pid = tl.program_id(0)
    doc = divide(pid, blocks_multiplier, blocks_shift)
    row_block = pid - doc * n_row_blocks
    query, token, in_range, valid = query_rows(
        row_block,
        n_queries,
        q_len,
        n_chunks,
        chunks_multiplier,
        chunks_shift,
        q_mask_ptr,
        stride_qmn,
        stride_qml,
        GROUP_ROWS,
        GROUPS,
        HAS_Q_MASK,
    )
    offs_d = tl.arange(0, BLOCK_D)
    q_rows = tl.load(
        q_ptr + query[:, None] * stride_qn + token[:, None] * stride_ql + offs_d[None, :],
        mask=in_range[:, None] & (offs_d[None, :] < DIM),
        other=0.0,
    )
    start, length = segment(cu_ptr, doc, n_rows)
    BLOCK_M: tl.constexpr = GROUP_ROWS * GROUPS
    best = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    key = tl.full((BLOCK_M,), NO_KEY, tl.int32)
    for t0 in range(0, length, BLOCK_N):
        cols = t0 + tl.arange(0, BLOCK_N)
        col_in = cols < length
        tile = decode_tile(
            codes_ptr, res_ptr, cent_ptr, weights_ptr, start + cols, col_in, n_centroids, DIM, NBITS, BLOCK_D
        )
        sim = tile_dot(q_rows, tl.trans(tile.to(q_rows.dtype)), None, DOT_PRECISION)
        sim = tl.where(col_in[None, :], sim, float("-inf"))
        tile_best = tl.reduce(sim, 1, nan_max)
        if TRACK_ARGMAX:
            # lowest column equal to the tile's max, or the first NaN where the max is NaN
            nan_row = tile_best != tile_best
            hit = (sim == tile_best[:, None]) | (nan_row[:, None] & (sim != sim))
            col_key = tl.where(col_in, cols, NO_KEY)
            tile_key = tl.min(tl.where(hit, col_key[None, :], NO_KEY), axis=1)
            # strictly greater keeps the earlier tile on ties; a NaN already found stays the winner
            take = ((tile_best > best) | nan_row | (key == NO_KEY)) & (best == best)
            key = tl.where(take, tile_key, key)
        best = nan_max(best, tile_best)
    counted = valid & (length > 0)
    values = tl.where(counted, best, 0.0)
    offsets, group_in = group_offsets(
        row_block, n_queries, n_chunks, chunks_multiplier, chunks_shift, stride_pc, stride_pn, GROUPS
    )
    store_group_sums(partial_ptr, values, offsets, group_in, doc, 1, GROUP_ROWS, GROUPS)
    if TRACK_ARGMAX:
        winner = tl.where(counted & (key != NO_KEY), start + key.to(tl.int64), -1)
        tl.store(win_ptr + query * stride_wn + token * stride_wl + doc, winner, mask=in_range)


def _rows_config(n_q: int, l_q: int, max_rows: int) -> tuple[int, int, int]:
    """``(GROUP_ROWS, GROUPS, n_chunks)``: a query's tokens in groups of the power-of-two bucket of ``Lq``
    (capped at 64), up to ``max_rows`` rows per block (short queries stacked: each decoded tile serves them all:
    the decode, not the product, is the work a row block repeats), at least 16 rows (the smallest tensor-core
    product)."""
    group_rows = min(triton.next_power_of_2(max(l_q, 1)), 64)
    n_chunks = triton.cdiv(l_q, group_rows)
    total = n_q * n_chunks
    groups = max(1, min(max_rows // group_rows, triton.next_power_of_2(total)))
    groups = max(groups, 16 // group_rows)
    return group_rows, groups, n_chunks


def residual_forward(q, q_mask, codes, residuals, codec, cu, track_argmax: bool):
    """Launch the kernel. ``q`` ``[Nq, Lq, d]`` fp16 / bf16 / fp32 (rows contiguous in ``d``), ``cu`` int32
    ``[B + 1]`` checked. Returns ``(scores fp32 [Nq, B], winners int64 [Nq, Lq, B] or None)``."""
    n_q, l_q, dim = q.shape
    n_docs = int(cu.shape[0]) - 1
    device = q.device
    # 128-row blocks on a GPU once there are that many rows (half the decodes of 64; 8 warps hold the tile)
    max_rows = 128 if q.is_cuda and n_q * l_q >= 128 else 64
    group_rows, groups, n_chunks = _rows_config(n_q, l_q, max_rows)
    n_row_blocks = triton.cdiv(n_q * n_chunks, groups)
    if n_docs > 1 and n_row_blocks * n_docs >= DIVIDEND_LIMIT:  # program ids are 32-bit: two runs of documents
        half = n_docs // 2
        first, first_win = residual_forward(q, q_mask, codes, residuals, codec, cu[: half + 1], track_argmax)
        second, second_win = residual_forward(q, q_mask, codes, residuals, codec, cu[half:], track_argmax)
        both = None if first_win is None else torch.cat([first_win, second_win], dim=2)
        return torch.cat([first, second], dim=1), both
    scores = torch.zeros(n_q, n_docs, dtype=torch.float32, device=device)
    winners = None
    if track_argmax:
        winners = torch.full((n_q, l_q, n_docs), -1, dtype=torch.int64, device=device)
    if n_q == 0 or l_q == 0 or n_docs == 0:
        return scores, winners
    if q.stride(-1) != 1:
        q = q.contiguous()
    exact16 = codec.centroids.dtype == torch.float16 or (codec.centroids.dtype == torch.bfloat16 and q.is_cuda)
    centroids = codec.centroids if exact16 else codec._centroids32
    multiplier, shift = divisor_constants(n_chunks)
    partial = torch.empty(n_chunks, n_q, n_docs, dtype=torch.float32, device=device)
    mask = q_mask.view(torch.uint8) if q_mask is not None else q  # (bool bytes read as flags)
    block_d = max(16, triton.next_power_of_2(dim))
    block_n = 64 if block_d <= 128 else 32
    win = winners if winners is not None else partial
    blocks_multiplier, blocks_shift = divisor_constants(n_row_blocks)
    grid = (n_row_blocks * n_docs,)
    residual_maxsim_kernel[grid](
        q,
        mask,
        codes.contiguous(),
        residuals.contiguous(),
        centroids.contiguous(),
        codec._weights32.contiguous(),
        cu,
        partial,
        win,
        n_q,
        l_q,
        int(codes.shape[0]),
        codec.num_centroids,
        n_row_blocks,
        blocks_multiplier,
        blocks_shift,
        n_chunks,
        multiplier,
        shift,
        q.stride(0),
        q.stride(1),
        mask.stride(0) if q_mask is not None else 0,
        mask.stride(1) if q_mask is not None else 0,
        partial.stride(0),
        partial.stride(1),
        win.stride(0) if winners is not None else 0,
        win.stride(1) if winners is not None else 0,
        DIM=dim,
        NBITS=codec.nbits,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        GROUP_ROWS=group_rows,
        GROUPS=groups,
        HAS_Q_MASK=q_mask is not None,
        TRACK_ARGMAX=track_argmax,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=8 if group_rows * groups >= 128 else 4,
        num_stages=2,
    )
    scores = partial.sum(0) if n_chunks > 1 else partial[0]
    return scores, winners
