"""A running top-k kept as one int64 key per candidate, so that merging a chunk of scores is one ``topk``.

Search order is: descending score, NaN last (below ``-inf``), ties (``-0.0`` and ``0.0`` included) to the lower
document id. A float32 score's bits map to an int32 of the same order (``bits ^ ((bits >> 31) & 0x7FFFFFFF)``: a
negative number's magnitude bits are flipped), NaN to the smallest int32 and both zeros to 0; that int fills the high
32 bits of the key and ``2**32 - 1 - id`` the low 32 bits (a lower id, a larger key). Keys are then distinct, their
order is the search order, and the largest ``k`` of a chunk and of the best so far is one ``topk``; scores and ids
are read back from the keys at the end (NaN as a quiet NaN, a zero as ``0.0``). Ids must be below ``2**32``.

:func:`candidate_keys` and :func:`decode_keys` are one elementwise kernel each (a search is a few launches per chunk,
not a dozen), or, for CPU tensors outside Triton's interpreter, the same arithmetic in PyTorch. :func:`merge_keys`
takes a chunk's ``k <= 64`` best in two kernels: each block of 1 024 candidates keeps its top ``k`` (rounded up to a
power of two) and one program per row takes the top ``k`` of those and of the best so far. ``torch.topk`` of
100 000 int64 keys is a multi-block radix select, a dozen launches of a few microseconds each: at one query over 5M
resident tokens it cost a third of the scoring kernel's time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._device import cdiv, next_power_of_2
from .._dispatch import uses_kernels
from .._launch import launch

__all__ = [
    "candidate_keys", "top_keys", "merge_keys", "decode_keys", "MAX_ID", "FUSED_K", "ROW_WIDTH",
    "candidate_keys_kernel", "block_top_keys_kernel", "row_top_keys_kernel", "decode_keys_kernel",
]

MAX_ID = 2**32 - 1  # ids are stored as MAX_ID - id in the low 32 bits
_INT32_MIN = -(2**31)
_INT64_MIN = -(2**63)  # below every key (a key's low half is at least 1: ids stay below MAX_ID)
_BLOCK = 1024
FUSED_K = 64  # merge_keys takes the two-kernel path up to this k (padded to a power of two)
ROW_WIDTH = 8192  # keys one program of row_top_keys_kernel holds (the widest row it merges)
# Older Triton has tl.sort but no tl.topk: the blocks are then sorted whole and their first K kept.
_HAS_TOPK = hasattr(tl, "topk")


@triton.jit
def _ordered_key(score, ids):
    """int64 search-order keys of float32 ``score`` and int64 ids (see the module docstring)."""
    bits = score.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    ordered = tl.where(score == 0.0, 0, ordered)  # -0.0 ties 0.0
    ordered = tl.where(score != score, -2147483648, ordered)  # NaN last
    return (ordered.to(tl.int64) << 32) | (4294967295 - ids)


@triton.jit
def _largest(x, K: tl.constexpr, HAS_TOPK: tl.constexpr):
    """The ``K`` largest of 1-D ``x``, largest first (the whole of ``x`` sorted, where tl.topk is missing)."""
    if HAS_TOPK:
        return tl.topk(x, K)
    else:
        return tl.sort(x, descending=True)


@triton.jit
def _block_keys(scores_ptr, ids_ptr, n, n_blocks, first_id, stride_sq, HAS_IDS: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``q * n_blocks + b``'s row ``q``, block ``b``, the block's columns, which of them are below ``n``, and
    their keys (of ``scores[q, j]`` and id ``first_id + ids[j]``, or ``first_id + j`` without ``HAS_IDS``)."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n_blocks
    block = pid - row * n_blocks
    cols = block * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n
    score = tl.load(scores_ptr + row * stride_sq + cols, mask=inside, other=0.0)
    if HAS_IDS:
        ids = tl.load(ids_ptr + cols, mask=inside, other=0) + first_id
    else:
        ids = cols + first_id
    return row, block, cols, inside, _ordered_key(score, ids)


@triton.jit(do_not_specialize=["n", "n_blocks", "first_id", "stride_sq", "stride_kq"])
def candidate_keys_kernel(scores_ptr, ids_ptr, keys_ptr, n, n_blocks, first_id, stride_sq, stride_kq,
                          HAS_IDS: tl.constexpr, BLOCK: tl.constexpr):
    """``keys[q, j]`` of ``scores[q, j]`` (float32, unit stride along j) and id ``first_id + ids[j]`` (``ids``:
    int64 positions, or ``j`` itself without ``HAS_IDS``); program ``q * n_blocks + b`` takes block ``b`` of row
    ``q``."""
    row, block, cols, inside, key = _block_keys(scores_ptr, ids_ptr, n, n_blocks, first_id, stride_sq, HAS_IDS, BLOCK)
    tl.store(keys_ptr + row * stride_kq + cols, key, mask=inside)


@triton.jit(do_not_specialize=["n", "n_blocks", "first_id", "stride_sq", "stride_oq"])
def block_top_keys_kernel(scores_ptr, ids_ptr, out_ptr, n, n_blocks, first_id, stride_sq, stride_oq,
                          HAS_IDS: tl.constexpr, BLOCK: tl.constexpr, K: tl.constexpr, OUT: tl.constexpr,
                          HAS_TOPK: tl.constexpr):
    """The ``K`` largest keys of block ``b`` of row ``q`` (program ``q * n_blocks + b``; candidates as for
    :func:`candidate_keys_kernel`), largest first, into ``out[q, b * K : (b + 1) * K]``; a block of fewer than ``K``
    candidates pads with int64 min. ``OUT``: ``K`` with tl.topk, ``BLOCK`` (the sorted block, its first ``K``
    stored) without."""
    row, block, cols, inside, key = _block_keys(scores_ptr, ids_ptr, n, n_blocks, first_id, stride_sq, HAS_IDS, BLOCK)
    key = tl.where(inside, key, -9223372036854775808)
    top = _largest(key, K, HAS_TOPK)
    slots = tl.arange(0, OUT)
    tl.store(out_ptr + row * stride_oq + block * K + slots, top, mask=slots < K)


@triton.jit(do_not_specialize=["n", "k", "stride_iq", "stride_oq"])
def row_top_keys_kernel(keys_ptr, out_ptr, scores_ptr, ids_ptr, n, k, stride_iq, stride_oq, WIDTH: tl.constexpr,
                        K: tl.constexpr, OUT: tl.constexpr, HAS_TOPK: tl.constexpr, DECODE: tl.constexpr):
    """The ``k <= K`` largest of row ``q``'s ``n <= WIDTH`` keys (program ``q``), largest first, into
    ``out[q, :k]``; with ``DECODE``, their scores and ids instead (``scores`` / ``ids [Nq, k]``, row stride
    ``stride_oq``), as :func:`decode_keys_kernel` reads them: the end of a search in the same launch."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, WIDTH)
    key = tl.load(keys_ptr + row * stride_iq + cols, mask=cols < n, other=-9223372036854775808)
    top = _largest(key, K, HAS_TOPK)
    slots = tl.arange(0, OUT)
    if DECODE:
        ordered = (top >> 32).to(tl.int32)
        bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
        score = tl.where(ordered == -2147483648, float("nan"), bits.to(tl.float32, bitcast=True))
        tl.store(scores_ptr + row * stride_oq + slots, score, mask=slots < k)
        tl.store(ids_ptr + row * stride_oq + slots, 4294967295 - (top & 4294967295), mask=slots < k)
    else:
        tl.store(out_ptr + row * stride_oq + slots, top, mask=slots < k)


def candidate_keys(scores: torch.Tensor, first_id: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """int64 keys ``[Nq, n]`` of float32 ``scores [Nq, n]`` whose document ids are ``first_id + j`` (or
    ``first_id + ids[j]`` with int64 ``ids [n]``); every id below :data:`MAX_ID`."""
    n_queries, n = scores.shape
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    if not uses_kernels(scores):
        position = torch.arange(n, device=scores.device) if ids is None else ids
        bits = scores.view(torch.int32)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        ordered = torch.where(scores == 0, 0, ordered)
        ordered = torch.where(scores.isnan(), _INT32_MIN, ordered).to(torch.int64)
        return (ordered << 32) | (MAX_ID - (first_id + position))
    keys = torch.empty((n_queries, n), dtype=torch.int64, device=scores.device)
    if n_queries and n:
        n_blocks = cdiv(n, _BLOCK)
        launch(candidate_keys_kernel, (n_queries * n_blocks,), scores, keys if ids is None else ids, keys, n,
               n_blocks, first_id, scores.stride(0), keys.stride(0), HAS_IDS=ids is not None, BLOCK=_BLOCK)
    return keys


def top_keys(keys: torch.Tensor, k: int, decode: bool = False):
    """The ``k`` largest keys of each row ``[Nq, n]``, largest first (``k`` at most the row's length): one program a
    row for ``k <= FUSED_K`` and ``n <= ROW_WIDTH`` where kernels run, ``torch.topk`` otherwise. ``decode``: their
    ``(scores, ids)`` (:func:`decode_keys`; in the same launch on the fused path)."""
    n_queries, n = keys.shape
    top = max(2, next_power_of_2(k))  # (a top of one is a different reduction in older Triton's tl.topk)
    if not (uses_kernels(keys) and 0 < k and top <= FUSED_K and n <= ROW_WIDTH and n_queries):
        best = keys.topk(k, dim=-1, sorted=True).values
        return decode_keys(best) if decode else best
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    width = max(next_power_of_2(n), top)
    device = keys.device
    if decode:
        scores = torch.empty((n_queries, k), dtype=torch.float32, device=device)
        out = ids = torch.empty((n_queries, k), dtype=torch.int64, device=device)
    else:
        out = scores = ids = torch.empty((n_queries, k), dtype=torch.int64, device=device)
    launch(row_top_keys_kernel, (n_queries,), keys, out, scores, ids, n, k, keys.stride(0), out.stride(0),
           WIDTH=width, K=top, OUT=top if _HAS_TOPK else width, HAS_TOPK=_HAS_TOPK, DECODE=decode,
           num_warps=4 if width <= 2048 else 8)
    return (scores, ids) if decode else out


def merge_keys(scores: torch.Tensor, first_id: int, ids: torch.Tensor | None, best: torch.Tensor | None,
               k: int, decode: bool = False):
    """The ``k`` largest keys, largest first, of float32 ``scores [Nq, n]`` (ids as for :func:`candidate_keys`) and
    the keys ``best [Nq, k']`` kept so far (None: none): ``[Nq, min(k, n + k')]``. Where kernels run and ``k <=
    FUSED_K``, each block of 1 024 candidates is cut to its top ``k`` in the kernel that makes the keys (the
    ``[Nq, n]`` keys are never written), then one :func:`top_keys` launch merges; otherwise every key is made and
    one ``torch.topk`` merges. ``decode``: the ``(scores, ids)`` of those keys instead (a search's last merge)."""
    n_queries, n = scores.shape
    top = max(2, next_power_of_2(k))
    k = min(k, n + (0 if best is None else best.shape[1]))
    if not uses_kernels(scores) or top > FUSED_K or n <= top or n_queries == 0:
        keys = candidate_keys(scores, first_id, ids)
        keys = keys if best is None else torch.cat([best, keys], dim=1)
        return top_keys(keys, k, decode)
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    n_blocks = cdiv(n, _BLOCK)
    width = 0 if best is None else best.shape[1]
    # The best so far first, then each block's top (ties cannot happen: keys are distinct).
    reduced = torch.empty((n_queries, width + n_blocks * top), dtype=torch.int64, device=scores.device)
    blocks = reduced
    if width:
        reduced[:, :width] = best
        blocks = reduced[:, width:]
    launch(block_top_keys_kernel, (n_queries * n_blocks,), scores, blocks if ids is None else ids, blocks, n,
           n_blocks, first_id, scores.stride(0), reduced.stride(0), HAS_IDS=ids is not None, BLOCK=_BLOCK, K=top,
           OUT=top if _HAS_TOPK else _BLOCK, HAS_TOPK=_HAS_TOPK)
    return top_keys(reduced, k, decode)


@triton.jit(do_not_specialize=["n"])
def decode_keys_kernel(keys_ptr, scores_ptr, ids_ptr, n, BLOCK: tl.constexpr):
    """``scores[i]`` (float32) and ``ids[i]`` (int64) of the contiguous keys ``keys[i]``, ``i < n``."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    key = tl.load(keys_ptr + offsets, mask=inside, other=0)
    ordered = (key >> 32).to(tl.int32)
    bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
    score = tl.where(ordered == -2147483648, float("nan"), bits.to(tl.float32, bitcast=True))
    tl.store(scores_ptr + offsets, score, mask=inside)
    tl.store(ids_ptr + offsets, tl.full((BLOCK,), 4294967295, tl.int64) - (key & 4294967295), mask=inside)


def decode_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores float32, ids int64)`` of keys made by :func:`candidate_keys` (one kernel: the end of a search is a
    few launches, not a dozen)."""
    if uses_kernels(keys):
        keys = keys.contiguous()
        scores = torch.empty(keys.shape, dtype=torch.float32, device=keys.device)
        ids = torch.empty(keys.shape, dtype=torch.int64, device=keys.device)
        if keys.numel():
            launch(decode_keys_kernel, (cdiv(keys.numel(), _BLOCK),), keys, scores, ids, keys.numel(), BLOCK=_BLOCK)
        return scores, ids
    ordered = (keys >> 32).to(torch.int32)
    bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
    scores = torch.where(ordered == _INT32_MIN, float("nan"), bits.view(torch.float32))
    return scores, MAX_ID - (keys & MAX_ID)
