"""Deterministic MaxSim ``dD`` by sorting the winners: a gather in a fixed order, no atomics, no one-hot products.

``dD[set, j, t] = sum_{n, s : argmax[n, j, s] = t} w[n, j] * Q[n, s]``. Each (query, document, query token)
triple with a winner contributes one query row to one document row. Sorting the triples by their document row
(a stable sort, so ties keep the (query, document, token) order) makes every document row's contributions one
contiguous segment; one program per document row then sums its segment, block by block, in that order. The
work is one gather of ``Nq * B * Lq`` query rows, the same element count as the fp32 atomic scatter, instead of
the one-hot dD's ``2 * Nq * B * Lq * Ld * d`` tensor-core FLOPs (the forward's cost again).

Memory: the sort works on documents in chunks so that its keys, order and the sort's own buffers stay within a
fixed workspace (``sort_workspace_entries`` triples per chunk, about 44 bytes each at peak) whatever ``B``.
Keys take the narrowest integer type that holds a chunk's row count (16 bits up to 32 767 rows: half the radix
passes of 32-bit keys); ``sort_chunk_rows`` can cap a chunk's rows to get there.

Packed documents (``LAYOUT`` ``PACKED`` / ``PAIRS``): the winners are absolute rows of ``[Td, d]`` and are the
keys themselves; a program's row finds its document in ``cu_seqlens_d`` (a binary search per program, not per
contribution). A corpus (every query scored every document) sorts a chunk of documents at a time as above, and
each pass stores only the rows of its own documents. Pairs sort every packed query token at once (one
contribution each, in token order) and weight a row by its one pair's gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._device import cdiv
from ..._launch import launch
from ..._replay import made
from ...core.forward_launch import set_strides
from ...core.segments import PACKED, PADDED, PAIRS, find_segment, search_steps

__all__ = [
    "maxsim_bwd_dd_sorted_kernel", "winner_keys_kernel", "sorted_winners", "launch_dd_sorted", "chunk_documents",
]

# The gradient's row stride follows the batch size: not specialised (no recompile when B changes). Embedding
# strides stay specialised (16-byte aligned rows, vector loads; benchmarks/NOTES.md, "Aligned embedding strides").
_BATCH_STRIDES = ["stride_gn", "stride_gb"]


@triton.jit(do_not_specialize=["n_queries", "q_len", "chunk_docs", "doc_len", "first_doc", "n_k_blocks",
                               "n_docs", "n_doc_steps", *_BATCH_STRIDES])
def maxsim_bwd_dd_sorted_kernel(
    q_ptr, grad_ptr, order_ptr, starts_ptr, dd_ptr, cu_d_ptr,
    n_queries, q_len, chunk_docs, doc_len, first_doc, n_k_blocks, n_docs, n_doc_steps,
    stride_qn, stride_ql, stride_qk,
    stride_gn, stride_gb,
    stride_ddn, stride_ddb, stride_ddl, stride_ddk,
    DIM: tl.constexpr,
    PER_QUERY: tl.constexpr,
    BLOCK_ENTRIES: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LAYOUT: tl.constexpr = 0,  # PADDED, PACKED or PAIRS (lik.core.segments)
):
    """One program per (document row of the chunk, feature block).

    ``order`` lists flat indices into the chunk's winners laid out ``[chunk_docs, Nq, Lq]``, grouped by document
    row; ``starts[r] : starts[r + 1]`` is row ``r``'s segment (``r = (set * chunk_docs + doc) * doc_len + t``).
    The row's document is known, so a contribution's query token is its index minus the document's base (no
    64-bit division). Blocks of ``BLOCK_ENTRIES`` contributions are gathered at once and reduced in a fixed
    tree; blocks are added in segment order. A row with an empty segment (no winner, masked, padding) stores
    exactly 0. Packed layouts: ``row`` is an absolute row of the packed documents (see the module docstring);
    pairs come with ``PER_QUERY`` (one weight per row) and flat indices that are packed query tokens."""
    pid = tl.program_id(0).to(tl.int64)
    k_block = pid % n_k_blocks
    row = pid // n_k_blocks
    if LAYOUT == PADDED:
        position = row % doc_len
        rest = row // doc_len
        doc_local = rest % chunk_docs
        doc_set = rest // chunk_docs
        doc = first_doc + doc_local
    else:
        doc = find_segment(cu_d_ptr, row, n_docs, n_doc_steps)
        doc_local = doc - first_doc
        doc_set = row * 0
    kk = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = kk < DIM
    if LAYOUT == PACKED:
        # A corpus pass sorts the winners of its documents only: the other rows belong to other passes.
        # (tl.where rather than `&` with a scalar: the interpreter widens a vector & scalar to int32.)
        k_ok = tl.where((doc_local >= 0) & (doc_local < chunk_docs), k_ok, False)
    offs = tl.arange(0, BLOCK_ENTRIES)
    if PER_QUERY:
        # Only query ``doc_set`` scores this document (pairs: only the row's pair): one weight, one query's tokens.
        if LAYOUT == PAIRS:
            doc_base = doc_set
        else:
            doc_base = (doc_local * n_queries + doc_set) * q_len
        weight = tl.load(grad_ptr + doc_set * stride_gn + doc * stride_gb)
        q_base = q_ptr + doc_set * stride_qn
    else:
        doc_base = doc_local * n_queries * q_len
        weight_base = grad_ptr + doc * stride_gb
    segment_start = tl.load(starts_ptr + row)
    segment_end = tl.load(starts_ptr + row + 1)
    acc = tl.zeros((BLOCK_K,), tl.float32)
    for first in range(segment_start, segment_end, BLOCK_ENTRIES):
        entries = first + offs
        in_segment = entries < segment_end
        # Within one document the index fits 32 bits (Nq * Lq < 2**31 is checked on the host).
        local = (tl.load(order_ptr + entries, mask=in_segment, other=0) - doc_base).to(tl.int32)
        if PER_QUERY:
            row_ptrs = q_base + local.to(tl.int64) * stride_ql
            weights = tl.where(in_segment, weight, 0.0)
        else:
            query = local // q_len
            token = local - query * q_len
            row_ptrs = q_ptr + query.to(tl.int64) * stride_qn + token.to(tl.int64) * stride_ql
            weights = tl.load(weight_base + query.to(tl.int64) * stride_gn, mask=in_segment, other=0.0)
        rows = tl.load(row_ptrs[:, None] + kk[None, :] * stride_qk, mask=in_segment[:, None] & k_ok[None, :],
                       other=0.0)
        acc += tl.sum(weights[:, None] * rows.to(tl.float32), axis=0)
    if LAYOUT == PADDED:
        dd_row_ptr = dd_ptr + doc_set * stride_ddn + doc * stride_ddb + position * stride_ddl
    else:
        dd_row_ptr = dd_ptr + row * stride_ddl
    tl.store(dd_row_ptr + kk * stride_ddk, acc.to(dd_ptr.dtype.element_ty), mask=k_ok)


@triton.jit(do_not_specialize=["n_queries", "chunk_docs", "q_len", "doc_len", "n_rows", "n_winners",
                               "stride_an", "stride_ab"])
def winner_keys_kernel(
    argmax_ptr, keys_ptr,
    n_queries, chunk_docs, q_len, doc_len, n_rows, n_winners,
    stride_an, stride_ab, stride_al,
    PER_QUERY: tl.constexpr,
    BLOCK: tl.constexpr,
    LAYOUT: tl.constexpr = 0,  # PADDED, PACKED or PAIRS (lik.core.segments)
):
    """``keys[(doc * Nq + query) * Lq + token]``: the document row of each winner, ``(set * Bc + doc) * doc_len +
    argmax[query, doc, token]`` (``set`` = query for per-query documents, else 0; packed layouts: the winner
    itself, an absolute row), or ``n_rows`` (after every row) where there is no winner. One pass instead of the
    six tensor operations it replaces (host launch cost dominates small training steps)."""
    flat = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = flat < n_winners
    token = flat % q_len
    rest = flat // q_len
    query = rest % n_queries
    doc = rest // n_queries
    winner = tl.load(argmax_ptr + query * stride_an + doc * stride_ab + token * stride_al, mask=in_range, other=-1)
    if LAYOUT == PADDED:
        doc_row = doc
        if PER_QUERY:
            doc_row = query * chunk_docs + doc
        key = tl.where(winner >= 0, doc_row * doc_len + winner.to(tl.int64), n_rows)
    else:
        key = tl.where(winner >= 0, winner.to(tl.int64), n_rows)
    tl.store(keys_ptr + flat, key.to(keys_ptr.dtype.element_ty), mask=in_range)


_KEYS_BLOCK = 1024


def sorted_winners(argmax: torch.Tensor, doc_len: int, per_query: bool, *, packed_rows: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the winners of ``argmax [Nq, Bc, Lq]`` (int16 / int32, -1: none) by document row.

    Returns ``(order, starts)``: ``order`` (int64) lists flat indices into the winners laid out
    ``[Bc, Nq, Lq]`` in the order of their document row ``(set * Bc + doc) * doc_len + winner`` (``set`` is the
    query for per-query documents, else 0), stable, so a row's contributions keep their (query, token) order;
    ``starts`` (int64, ``n_rows + 1``) are the segment bounds. Triples without a winner sort past the last row.
    ``packed_rows``: the winners are absolute rows of packed documents with that many rows, and are the keys.
    A stable device sort and a binary search: deterministic, no host synchronisation."""
    n_q, chunk_docs, l_q = argmax.shape
    n_sets = n_q if per_query else 1
    n_rows = n_sets * chunk_docs * doc_len if packed_rows is None else packed_rows
    # The narrowest key type: a radix sort makes one pass per key byte.
    key_dtype = next(t for t in (torch.int16, torch.int32, torch.int64) if n_rows < torch.iinfo(t).max)
    device = argmax.device
    n_winners = argmax.numel()
    keys = made(torch.empty(n_winners, dtype=key_dtype, device=device))
    if n_winners:
        launch(
            winner_keys_kernel, (cdiv(n_winners, _KEYS_BLOCK),),
            argmax, keys, n_q, chunk_docs, l_q, doc_len, n_rows, n_winners, *argmax.stride(),
            PER_QUERY=per_query, BLOCK=_KEYS_BLOCK, LAYOUT=(PADDED if packed_rows is None else PACKED).value,
        )
    sorted_keys, order = torch.sort(keys, stable=True)
    del keys
    starts = torch.searchsorted(sorted_keys, torch.arange(n_rows + 1, device=device, dtype=key_dtype))
    return made(order), made(starts)


def chunk_documents(
    n_queries: int, q_len: int, n_docs: int, workspace_entries: int, rows_per_doc: int = 1, max_rows: int = 0
) -> int:
    """Documents per sort chunk: as many as keep ``n_queries * docs * q_len`` winners within the workspace and,
    if ``max_rows`` is set, ``docs * rows_per_doc`` document rows (sort keys) within ``max_rows``."""
    docs = min(n_docs, workspace_entries // max(1, n_queries * q_len))
    if max_rows:
        docs = min(docs, max_rows // max(1, rows_per_doc))
    return max(1, docs)


def launch_dd_sorted(grad, q, argmax, dd, *, per_query: bool, cfg, block_k: int, n_k_blocks: int,
                     cu_d: torch.Tensor | None = None, pairs: bool = False):
    """Deterministic dD into ``dd [n_sets, B, Ld, dim]`` (input dtype): sort the winners of a chunk of documents,
    then one program per document row gathers its segment. Every row of ``dd`` is written (empty rows as 0).

    Packed documents pass ``cu_d`` (int32 ``[B + 1]``) and ``dd [1, 1, Td, dim]`` (a view of ``[Td, dim]``); the
    saved winners are absolute rows. ``pairs``: ``q [1, Tq, dim]`` holds every packed query token, ``argmax
    [1, 1, Tq]``, ``grad [1, n_pairs]`` (pair ``i`` scored document ``i``)."""
    n_sets, n_docs, l_d, dim = dd.shape
    n_q, l_q, _ = q.shape
    if n_q * l_q >= 2**31:
        raise ValueError(f"the sorted dD needs Nq * Lq < 2**31 query tokens, got {n_q} x {l_q}")
    if cu_d is None:
        layout, n_rows, packed_docs, packed_rows = PADDED, n_sets * l_d, 0, None
        step = chunk_documents(n_q, l_q, n_docs, cfg.sort_workspace_entries, n_sets * l_d, cfg.sort_chunk_rows)
    else:
        # Every pass launches a program per packed row; those of other passes' documents store nothing.
        layout, packed_docs, packed_rows = (PAIRS if pairs else PACKED), cu_d.numel() - 1, l_d
        n_rows = l_d
        step = argmax.shape[1] if pairs else chunk_documents(n_q, l_q, packed_docs, cfg.sort_workspace_entries)
    for first_doc in range(0, argmax.shape[1], step):
        chunk_docs = min(step, argmax.shape[1] - first_doc)
        order, starts = sorted_winners(argmax[:, first_doc:first_doc + chunk_docs], l_d, per_query,
                                       packed_rows=packed_rows)
        launch(
            maxsim_bwd_dd_sorted_kernel,
            ((chunk_docs * n_rows if cu_d is None else n_rows) * n_k_blocks,),
            q, grad, order, starts, dd, starts if cu_d is None else cu_d,
            n_q, l_q, chunk_docs, l_d, first_doc, n_k_blocks, packed_docs, search_steps(packed_docs),
            *q.stride(), *grad.stride(), *set_strides(dd),
            DIM=dim, PER_QUERY=per_query, BLOCK_ENTRIES=cfg.sort_entries, BLOCK_K=block_k, LAYOUT=layout.value,
            num_warps=cfg.sort_warps,
        )
