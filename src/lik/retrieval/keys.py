"""A running top-k kept as one int64 key per candidate, so that ranking a chunk of scores is a couple of launches.

Search order is: descending score, NaN last (below ``-inf``), ties (``-0.0`` and ``0.0`` included) to the lower
document id. A float32 score's bits map to an int32 of the same order (``bits ^ ((bits >> 31) & 0x7FFFFFFF)``: a
negative number's magnitude bits are flipped), NaN to the smallest int32 and both zeros to 0; that int fills the high
32 bits of the key and ``2**32 - 1 - id`` the low 32 bits (a lower id, a larger key). Keys are then distinct and their
order is the search order; scores and ids are read back from the keys at the end (NaN as a quiet NaN, a zero as
``0.0``). Ids must be below ``2**32``.

The ``k`` largest keys of a chunk (``k`` up to :data:`BLOCK_K_MAX`) come from :func:`block_top_keys_kernel`: each
program keeps its block's ``k`` largest (``k`` block maxima, each one removed once found), and the blocks' results
are reduced the same way until one block is left: a chunk of 10 000 documents takes two launches, with no
``torch.topk`` (whose radix select makes a pass per byte of an int64 key). Larger ``k`` and CPU tensors outside
Triton's interpreter take :func:`candidate_keys` and ``torch.topk``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._device import cdiv
from .._dispatch import uses_kernels
from .._launch import launch

__all__ = ["candidate_keys", "top_keys", "chunk_top_keys", "merge_top_keys", "decode_keys", "MAX_ID", "BLOCK_K_MAX",
           "candidate_keys_kernel", "block_top_keys_kernel"]

MAX_ID = 2**32 - 1  # ids are stored as MAX_ID - id in the low 32 bits
BLOCK_K_MAX = 128  # the largest k the block kernel takes (each level then shrinks its input at least 8x)
_INT32_MIN = -(2**31)
_BLOCK = 1024


@triton.jit
def _keys(score, ids):
    """The keys of float32 ``score`` and int64 ``ids`` (see the module's docstring)."""
    bits = score.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    ordered = tl.where(score == 0.0, 0, ordered)  # -0.0 ties 0.0
    ordered = tl.where(score != score, -2147483648, ordered)  # NaN last
    return (ordered.to(tl.int64) << 32) | (tl.full(ids.shape, 4294967295, tl.int64) - ids)


@triton.jit(do_not_specialize=["n", "n_blocks", "first_id", "stride_sq", "stride_kq"])
def candidate_keys_kernel(scores_ptr, ids_ptr, keys_ptr, n, n_blocks, first_id, stride_sq, stride_kq,
                          HAS_IDS: tl.constexpr, BLOCK: tl.constexpr):
    """``keys[q, j]`` of ``scores[q, j]`` (float32, unit stride along j) and id ``first_id + ids[j]`` (``ids``:
    int64 positions, or ``j`` itself without ``HAS_IDS``); program ``q * n_blocks + b`` takes block ``b`` of row
    ``q``."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n_blocks
    cols = (pid - row * n_blocks) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n
    score = tl.load(scores_ptr + row * stride_sq + cols, mask=inside, other=0.0)
    if HAS_IDS:
        ids = tl.load(ids_ptr + cols, mask=inside, other=0) + first_id
    else:
        ids = cols + first_id
    tl.store(keys_ptr + row * stride_kq + cols, _keys(score, ids), mask=inside)


@triton.jit(do_not_specialize=["n", "n_blocks", "k", "first_id", "stride_sq", "stride_oq"])
def block_top_keys_kernel(src_ptr, ids_ptr, out_ptr, n, n_blocks, k, first_id, stride_sq, stride_oq,
                          FROM_SCORES: tl.constexpr, HAS_IDS: tl.constexpr, BLOCK: tl.constexpr):
    """``out[q, b * k : (b + 1) * k]``: the ``k`` largest keys of block ``b`` of row ``q``, largest first (the
    smallest int64 where the block has fewer). ``src`` holds keys, or with ``FROM_SCORES`` float32 scores whose
    keys are made here (ids as in :func:`candidate_keys_kernel`)."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n_blocks
    block = pid - row * n_blocks
    cols = block * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n
    if FROM_SCORES:
        score = tl.load(src_ptr + row * stride_sq + cols, mask=inside, other=0.0)
        if HAS_IDS:
            ids = tl.load(ids_ptr + cols, mask=inside, other=0) + first_id
        else:
            ids = cols + first_id
        key = tl.where(inside, _keys(score, ids), -9223372036854775808)
    else:
        key = tl.load(src_ptr + row * stride_sq + cols, mask=inside, other=-9223372036854775808)
    out = out_ptr + row * stride_oq + block * k
    for i in range(0, k):
        best = tl.max(key, axis=0)
        tl.store(out + i, best)
        key = tl.where(key == best, -9223372036854775808, key)  # keys are distinct: one is taken out


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


def top_keys(keys: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest keys of each row, largest first (``k`` at most the row's length)."""
    if 0 < k <= BLOCK_K_MAX and uses_kernels(keys) and keys.shape[0]:
        return _block_top(keys, k, None, 0, False)
    return keys.topk(k, dim=-1, sorted=True).values


def _block_top(src: torch.Tensor, k: int, ids, first_id: int, from_scores: bool) -> torch.Tensor:
    """The ``k`` largest keys of each row of ``src`` (keys, or float32 scores with ``from_scores``) by levels of
    :func:`block_top_keys_kernel`, largest first."""
    while True:
        if src.stride(-1) != 1:
            src = src.contiguous()
        n_queries, n = src.shape
        n_blocks = cdiv(n, _BLOCK)
        out = torch.empty((n_queries, n_blocks * k), dtype=torch.int64, device=src.device)
        launch(block_top_keys_kernel, (n_queries * n_blocks,), src, out if ids is None else ids, out, n, n_blocks, k,
               first_id, src.stride(0), out.stride(0), FROM_SCORES=from_scores, HAS_IDS=ids is not None,
               BLOCK=_BLOCK)
        if n_blocks == 1:
            return out
        src, ids, first_id, from_scores = out, None, 0, False


def chunk_top_keys(scores: torch.Tensor, first_id: int, ids: torch.Tensor | None, k: int) -> torch.Tensor:
    """The keys of the ``k`` best of float32 ``scores [Nq, n]`` (ids as in :func:`candidate_keys`), best first;
    ``k`` at most ``n``."""
    if 0 < k <= BLOCK_K_MAX and uses_kernels(scores) and scores.shape[0]:
        return _block_top(scores, k, ids, first_id, True)
    return top_keys(candidate_keys(scores, first_id, ids), k)


def merge_top_keys(best: torch.Tensor, new: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest of two rows of keys (``k`` at most their total), largest first."""
    return top_keys(torch.cat([best, new], dim=1), k)


def decode_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores float32, ids int64)`` of keys made by :func:`candidate_keys`."""
    ordered = (keys >> 32).to(torch.int32)
    bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
    scores = torch.where(ordered == _INT32_MIN, float("nan"), bits.view(torch.float32))
    return scores, MAX_ID - (keys & MAX_ID)
