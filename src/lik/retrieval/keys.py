"""A running top-k kept as one int64 key per candidate, so that merging a chunk of scores is one ``topk``.

Search order is: descending score, NaN last (below ``-inf``), ties (``-0.0`` and ``0.0`` included) to the lower
document id. A float32 score's bits map to an int32 of the same order (``bits ^ ((bits >> 31) & 0x7FFFFFFF)``: a
negative number's magnitude bits are flipped), NaN to the smallest int32 and both zeros to 0; that int fills the high
32 bits of the key and ``2**32 - 1 - id`` the low 32 bits (a lower id, a larger key). Keys are then distinct, their
order is the search order, and the largest ``k`` of a chunk and of the best so far is one ``topk``; scores and ids
are read back from the keys at the end (NaN as a quiet NaN, a zero as ``0.0``). Ids must be below ``2**32``.

:func:`candidate_keys` and :func:`decode_keys` are one elementwise kernel each (a search is a few launches per chunk,
not a dozen), or, for CPU tensors outside Triton's interpreter, the same arithmetic in PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._device import cdiv
from .._dispatch import uses_kernels
from .._launch import launch

__all__ = ["candidate_keys", "top_keys", "decode_keys", "MAX_ID", "candidate_keys_kernel", "decode_keys_kernel"]

MAX_ID = 2**32 - 1  # ids are stored as MAX_ID - id in the low 32 bits
_INT32_MIN = -(2**31)
_BLOCK = 1024


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
    bits = score.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    ordered = tl.where(score == 0.0, 0, ordered)  # -0.0 ties 0.0
    ordered = tl.where(score != score, -2147483648, ordered)  # NaN last
    if HAS_IDS:
        ids = tl.load(ids_ptr + cols, mask=inside, other=0) + first_id
    else:
        ids = cols + first_id
    key = (ordered.to(tl.int64) << 32) | (tl.full((BLOCK,), 4294967295, tl.int64) - ids)
    tl.store(keys_ptr + row * stride_kq + cols, key, mask=inside)


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
    return keys.topk(k, dim=-1, sorted=True).values


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
