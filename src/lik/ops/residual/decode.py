"""The residual loader: a tile of ColBERTv2-compressed tokens decoded in registers, and a decode kernel built on it.

A token is ``normalize(centroid[code] + bucket_weights[bucket])``, its ``d`` buckets packed ``nbits`` to a
dimension as ColBERT packs them (:mod:`lik.compression.packing`): a byte holds ``8 // nbits`` consecutive
dimensions, the first in the high bits, each group's bits in reversed order. The loader reads a tile's residual
bytes with one vectorised load (not a load per dimension), takes group ``s`` of every byte with a shift, looks its
weight up in a table indexed by the group as stored (:func:`group_weights`: the bit reversal done once on the host),
and interleaves the ``8 // nbits`` group tiles back into dimension order with ``tl.join`` + ``tl.reshape`` (register
moves). The centroid rows are one gather from the ``[K, d]`` table (L2-resident); the row norm is in fp32. The
loader's side data is one tensor, :func:`decode_table` (the weights, then the centroids), so that the token stream
takes it in an existing pointer slot.

:func:`decode_rows` is the ``DECODE`` loader of :func:`lik.core.token_stream.token_stream_kernel` (the compressed
scan) and the body of :func:`decode_kernel` (the bounded-scratch fallback, :func:`decode_into`).
"""

from __future__ import annotations

import functools
import weakref

import torch
import triton
import triton.language as tl

from lik.compression.packing import reversed_bit_map

__all__ = [
    "decode_rows",
    "decode_rows_select",
    "decode_kernel",
    "decode_into",
    "group_weights",
    "decode_table",
    "TABLE_HEADER",
]

# Bytes of a decode table before its centroids: the 2**nbits fp32 group weights (64 bytes), then the byte table
# (256 x 8 // nbits fp32: every byte's dimensions' weights, at most 8 KiB); 16-byte aligned centroid rows follow.
TABLE_HEADER = tl.constexpr(64 + 8192)
# codec -> {on_gpu: table}; a codec is immutable in use, so its table is built once per kind of device.
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@functools.cache
def _group_order(nbits: int) -> tuple[int, ...]:
    # group value as stored (its bits least significant first) -> bucket: the reversal of an nbits-bit number
    shift = 8 - nbits
    return tuple(int(reversed_bit_map(nbits)[g << shift]) >> shift for g in range(1 << nbits))


def group_weights(codec) -> torch.Tensor:
    """fp32 ``[2**nbits]`` on the codec's device: ``bucket_weights[bucket]`` indexed by the bucket's bits as a
    packed byte stores them (reversed), so that the loader needs no bit reversal.

    Example::

        >>> codec = lik.compression.ResidualCodec(torch.eye(8), torch.zeros(3), torch.tensor([0.0, 1, 2, 3]), 2)
        >>> group_weights(codec).tolist()  # stored 0b01 is bucket 0b10
        [0.0, 2.0, 1.0, 3.0]
    """
    order = torch.tensor(_group_order(codec.nbits), device=codec.device)
    return codec._weights32[order].contiguous()


def decode_table(codec, on_gpu: bool) -> torch.Tensor:
    """The loader's side data, 1-D contiguous on the codec's device: :data:`TABLE_HEADER` bytes holding
    :func:`group_weights` (fp32, 64 bytes) and the byte table (fp32 ``[256, 8 // nbits]``: the weights of a packed
    byte's dimensions, first dimension first), then the centroids ``[K, d]`` flattened, as stored when 16-bit (their
    fp32 values are exact in half the bytes; bfloat16 only on a GPU, where the kernel reads it natively), else fp32.
    Built once per codec and kind of device.

    Example::

        >>> codec = lik.compression.ResidualCodec(torch.eye(8), torch.zeros(1), torch.tensor([-1.0, 1.0]), 1)
        >>> table = decode_table(codec, False)
        >>> table[:2].tolist(), table[16 + 8 * 0b10000000 : 16 + 8 * 0b10000000 + 2].tolist(), table.shape
        ([-1.0, 1.0], [1.0, -1.0], torch.Size([2128]))
    """
    tables = _TABLES.setdefault(codec, {})
    table = tables.get(on_gpu)
    if table is None:
        exact16 = codec.centroids.dtype == torch.float16 or (codec.centroids.dtype == torch.bfloat16 and on_gpu)
        centroids = codec.centroids if exact16 else codec._centroids32
        header = TABLE_HEADER.value // centroids.element_size()
        table = torch.zeros(header + centroids.numel(), dtype=centroids.dtype, device=codec.device)
        weights = group_weights(codec)
        nbits, per_byte = codec.nbits, 8 // codec.nbits
        values = torch.arange(256, device=codec.device)[:, None]
        shifts = 8 - nbits * (torch.arange(per_byte, device=codec.device) + 1)
        words = table[:header].view(torch.float32)
        words[: weights.shape[0]] = weights
        words[16 : 16 + 256 * per_byte] = weights[(values >> shifts) & ((1 << nbits) - 1)].reshape(-1)
        table[header:] = centroids.reshape(-1)
        tables[on_gpu] = table
    return table


@triton.jit
def _slot_weight(byte, weights_ptr, w0, w1, w2, w3, SLOT: tl.constexpr, NBITS: tl.constexpr):
    """fp32 weights of the dimensions at group ``SLOT`` of each byte (``SLOT`` 0: the high bits)."""
    g = (byte >> (8 - NBITS * (SLOT + 1))) & ((1 << NBITS) - 1)
    if NBITS == 1:
        w = tl.where(g == 0, w0, w1)
    elif NBITS == 2:
        # two selects on the low bit, one on the high bit: no per-element load of the 4-entry table
        odd = (g & 1) != 0
        w = tl.where(g < 2, tl.where(odd, w1, w0), tl.where(odd, w3, w2))
    else:
        w = tl.load(weights_ptr + g)  # 16 entries, cached
    return w


@triton.jit
def _joined(byte, weights_ptr, w0, w1, w2, w3, A: tl.constexpr, B: tl.constexpr, NBITS: tl.constexpr):
    """``tl.join`` of the weights at groups ``A`` and ``B`` of each byte (the new last axis: ``A``'s, then ``B``'s)."""
    return tl.join(
        _slot_weight(byte, weights_ptr, w0, w1, w2, w3, A, NBITS),
        _slot_weight(byte, weights_ptr, w0, w1, w2, w3, B, NBITS),
    )


@triton.jit
def _decode(
    res_ptr,
    codes_ptr,
    table_ptr,
    rows,
    stride_rl,
    DIM: tl.constexpr,
    NBITS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BYTE_TABLE: tl.constexpr,
):
    """:func:`decode_rows`; ``BYTE_TABLE``: a byte's weights in one vector load from the byte table (L1-resident),
    else each dimension's by selects on its group's bits (a gather of the 16-entry table for 4 bits)."""
    BLOCK_T: tl.constexpr = rows.shape[0]
    PER_BYTE: tl.constexpr = 8 // NBITS
    BYTES: tl.constexpr = BLOCK_K // PER_BYTE
    offs_k = tl.arange(0, BLOCK_K)
    offs_b = tl.arange(0, BYTES)
    weights_ptr = table_ptr.to(tl.pointer_type(tl.float32), bitcast=True)
    code = tl.load(codes_ptr + rows).to(tl.int32)
    HEADER: tl.constexpr = TABLE_HEADER // (table_ptr.dtype.element_ty.primitive_bitwidth // 8)
    centroid_ptrs = table_ptr + HEADER + code[:, None] * DIM + offs_k[None, :]
    byte_ptrs = res_ptr + rows[:, None] * stride_rl + offs_b[None, :]
    if DIM == BLOCK_K:
        centroid = tl.load(centroid_ptrs).to(tl.float32)
        byte = tl.load(byte_ptrs).to(tl.int32)
    else:
        centroid = tl.load(centroid_ptrs, mask=offs_k[None, :] < DIM, other=0.0).to(tl.float32)
        byte = tl.load(byte_ptrs, mask=offs_b[None, :] < DIM // PER_BYTE, other=0).to(tl.int32)
    if BYTE_TABLE:
        offs_s = tl.arange(0, PER_BYTE)
        w = tl.load(weights_ptr + 16 + byte[:, :, None] * PER_BYTE + offs_s[None, None, :])
    else:
        w = _select_weights(byte, weights_ptr, NBITS)
    x = centroid + tl.reshape(w, (BLOCK_T, BLOCK_K))
    if DIM != BLOCK_K:
        x = tl.where(offs_k[None, :] < DIM, x, 0.0)
    # torch.nn.functional.normalize: x / max(|x|, 1e-12), a zero row stays zero (one reciprocal per row)
    inv = 1.0 / tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), 1e-12)
    return x * inv[:, None]


@triton.jit
def _select_weights(byte, weights_ptr, NBITS: tl.constexpr):
    """``[T, BYTES, 8 // NBITS]`` fp32 weights of each byte's dimensions, by selects on the groups' bits."""
    w0 = tl.load(weights_ptr)
    w1 = tl.load(weights_ptr + 1)
    w2 = w0
    w3 = w1
    if NBITS == 2:
        w2 = tl.load(weights_ptr + 2)
        w3 = tl.load(weights_ptr + 3)
    # Interleave the group tiles: join's new axis is the fastest, so the first join pairs groups PER_BYTE / 2
    # apart and the last pairs neighbours; the flattened order is then the byte's dimensions in order.
    if NBITS == 4:
        w = _joined(byte, weights_ptr, w0, w1, w2, w3, 0, 1, NBITS)
    elif NBITS == 2:
        w = tl.join(
            _joined(byte, weights_ptr, w0, w1, w2, w3, 0, 2, NBITS),
            _joined(byte, weights_ptr, w0, w1, w2, w3, 1, 3, NBITS),
        )
    else:
        even = tl.join(
            _joined(byte, weights_ptr, w0, w1, w2, w3, 0, 4, NBITS),
            _joined(byte, weights_ptr, w0, w1, w2, w3, 2, 6, NBITS),
        )
        odd = tl.join(
            _joined(byte, weights_ptr, w0, w1, w2, w3, 1, 5, NBITS),
            _joined(byte, weights_ptr, w0, w1, w2, w3, 3, 7, NBITS),
        )
        w = tl.join(even, odd)
    return tl.reshape(w, (w.shape[0], w.shape[1], 8 // NBITS))


@triton.jit
def decode_rows(
    res_ptr,
    codes_ptr,
    table_ptr,
    rows,
    stride_rl,
    DIM: tl.constexpr,
    NBITS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """fp32 ``[len(rows), BLOCK_K]``: the decoded tokens at (valid, absolute) ``rows``, zero past ``DIM``.

    ``res_ptr`` uint8 rows of ``DIM * NBITS // 8`` bytes (row stride ``stride_rl``), ``codes_ptr`` int32 / int64
    codes in the table (checked on the host), ``table_ptr`` :func:`decode_table`. ``BLOCK_K`` is a power of two
    >= ``DIM``. A byte's weights come from the byte table in one vector load."""
    return _decode(res_ptr, codes_ptr, table_ptr, rows, stride_rl, DIM, NBITS, BLOCK_K, True)


@triton.jit
def decode_rows_select(
    res_ptr,
    codes_ptr,
    table_ptr,
    rows,
    stride_rl,
    DIM: tl.constexpr,
    NBITS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """:func:`decode_rows` with the weights chosen by selects on each group's bits (no byte table load)."""
    return _decode(res_ptr, codes_ptr, table_ptr, rows, stride_rl, DIM, NBITS, BLOCK_K, False)


@triton.jit(do_not_specialize=["n_rows"])
def decode_kernel(
    res_ptr,
    codes_ptr,
    table_ptr,
    out_ptr,
    n_rows,
    stride_rl,
    stride_ol,
    DIM: tl.constexpr,
    NBITS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """``out[t] = decoded token t`` in ``out``'s dtype, for ``BLOCK_T`` tokens a program (``out`` rows contiguous
    in ``d``)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    inside = rows < n_rows
    x = decode_rows(
        res_ptr,
        codes_ptr,
        table_ptr,
        tl.minimum(rows, n_rows - 1),
        stride_rl,
        DIM,
        NBITS,
        BLOCK_K,
    )
    offs_k = tl.arange(0, BLOCK_K)
    tl.store(
        out_ptr + rows[:, None] * stride_ol + offs_k[None, :],
        x.to(out_ptr.dtype.element_ty),
        mask=inside[:, None] & (offs_k[None, :] < DIM),
    )


def decode_into(out: torch.Tensor, codes: torch.Tensor, residuals: torch.Tensor, codec) -> torch.Tensor:
    """Decode ``codes [T]`` / ``residuals [T, d * nbits // 8]`` (known good, on ``out``'s device) into ``out``
    ``[T, d]`` (float16 / bfloat16 / float32, rows contiguous in ``d``) with :func:`decode_kernel`; returns ``out``
    (equal to ``codec.decompress(codes, residuals, out.dtype)`` up to fp32 rounding)."""
    n_rows, dim = int(codes.shape[0]), codec.dim
    if n_rows == 0:
        return out
    block_k = max(16, triton.next_power_of_2(dim))
    block_t = max(16, 8192 // block_k)
    residuals = residuals if residuals.stride(-1) == 1 else residuals.contiguous()
    decode_kernel[(triton.cdiv(n_rows, block_t),)](
        residuals,
        codes,
        decode_table(codec, out.is_cuda),
        out,
        n_rows,
        residuals.stride(0),
        out.stride(0),
        DIM=dim,
        NBITS=codec.nbits,
        BLOCK_K=block_k,
        BLOCK_T=block_t,
        num_warps=8 if block_t * block_k >= 8192 else 4,
    )
    return out
