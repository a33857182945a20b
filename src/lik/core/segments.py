"""Segments: where each sequence of a batch starts and how long it is, padded or packed.

A *padded* batch stores sequence ``i`` at ``base + i * stride`` with one length for all (a mask says which
tokens are real); a *packed* batch stores its sequences back to back, sequence ``i`` being rows
``cu_seqlens[i] .. cu_seqlens[i + 1]`` (FlashAttention's convention, int32 offsets read on the device).
Kernels ask :func:`document_span` for a document and never see which layout it came from.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "PADDED", "PACKED", "PAIRS", "segment", "find_segment", "search_steps", "document_span", "document_scales",
    "program_tiles",
]

# How a forward kernel finds its documents (and, for PAIRS, its queries): a constexpr flag.
PADDED = tl.constexpr(0)  # documents [n_sets, B, Ld, d], one length
PACKED = tl.constexpr(1)  # documents packed by cu_seqlens_d, every query against every document
PAIRS = tl.constexpr(2)  # queries and documents packed, query i against document i


@triton.jit
def segment(cu_ptr, index, n_rows, valid=None):
    """Rows ``[start, start + length)`` of packed sequence ``index``, clamped to ``[0, n_rows]`` (offsets that
    were not checked on the host can give wrong numbers, never an out-of-bounds access); ``valid`` false: an
    empty sequence at row 0, nothing read (an index past the last sequence)."""
    if valid is None:
        start = tl.load(cu_ptr + index).to(tl.int64)
        end = tl.load(cu_ptr + index + 1).to(tl.int64)
    else:
        start = tl.load(cu_ptr + index, mask=valid, other=0).to(tl.int64)
        end = tl.load(cu_ptr + index + 1, mask=valid, other=0).to(tl.int64)
    start = tl.minimum(tl.maximum(start, 0), n_rows)
    end = tl.minimum(tl.maximum(end, start), n_rows)
    return start, (end - start).to(tl.int32)


@triton.jit
def find_segment(cu_ptr, rows, n_segments, n_steps):
    """The sequence holding each of ``rows``: the largest ``j < n_segments`` with ``cu[j] <= row``.

    A branch-free binary search of ``n_steps = search_steps(n_segments)`` runtime steps (no recompile per ``N``);
    empty sequences (equal neighbours in ``cu``) are skipped by construction.
    """
    lo = (rows * 0).to(tl.int64)
    hi = lo + n_segments
    for _ in range(n_steps):
        mid = (lo + hi) // 2
        right = tl.load(cu_ptr + mid).to(tl.int64) <= rows
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def program_tiles(cu_ptr, first, n_segments, step, n_rows, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr = 128):
    """Tiles of ``BLOCK_N`` rows a persistent program walks over packed sequences ``first``, ``first + step``, ...
    (each at least one: an empty sequence still takes a step, in which it is written)."""
    total = tl.zeros((), tl.int32)
    for chunk in range(0, tl.cdiv(n_segments - first, step), CHUNK):
        index = first + (chunk + tl.arange(0, CHUNK)) * step
        valid = index < n_segments
        _, length = segment(cu_ptr, index, n_rows, valid)
        total += tl.sum(tl.where(valid, tl.maximum(tl.cdiv(length, BLOCK_N), 1), 0), axis=0)
    return total


def search_steps(n_segments: int) -> int:
    """Steps of :func:`find_segment` over ``n_segments`` sequences."""
    return max(0, n_segments - 1).bit_length()


@triton.jit
def document_span(
    doc, doc_base, doc_mask_base, cu_d_ptr, doc_len, n_d_rows, stride_db, stride_dl, stride_dmb, LAYOUT: tl.constexpr,
):
    """Where document ``doc`` lives: ``(pointer to its token 0, pointer to its first mask byte, length, row
    offset)``; the row offset turns a token index into an absolute row of the packed tensor (0 when padded)."""
    if LAYOUT == PADDED:
        return doc_base + doc * stride_db, doc_mask_base + doc * stride_dmb, doc_len, doc * 0
    start, length = segment(cu_d_ptr, doc, n_d_rows)
    return doc_base + start * stride_dl, doc_mask_base, length, start


@triton.jit
def document_scales(doc, scale_base, row_offset, stride_dsb, stride_dsl, LAYOUT: tl.constexpr):
    """Pointer to the per-row scale of document ``doc``'s token 0 (8-bit documents): the scales follow the
    document's rows, strided when padded, at the document's absolute row offset when packed."""
    if LAYOUT == PADDED:
        return scale_base + doc * stride_dsb
    return scale_base + row_offset * stride_dsl
