"""Documents to shards: check each ``[L_i, d]`` document, store it in the index dtype (quantized per token for 8-bit
indexes) and pack runs of documents into :class:`~lik.index.format.Shard` s, one shard in memory at a time."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator

import torch
from tqdm import tqdm

from ..ops.quantization import quantize
from .format import EIGHT_BIT, Shard

__all__ = ["as_int", "quiet", "shards_from", "pack"]


def quiet(progress: bool | None) -> bool | None:
    """tqdm's ``disable``: ``None`` (the default) shows bars on a terminal only."""
    return None if progress is None else not progress


def as_int(value, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None


def _prepare(doc, d: int | None, dtype: torch.dtype, number: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not isinstance(doc, torch.Tensor):
        raise TypeError(f"docs[{number}] must be a torch.Tensor [L, d], got {type(doc).__name__}")
    if doc.dim() != 2:
        raise ValueError(f"docs[{number}] must be 2-D [L, d], got shape {list(doc.shape)}")
    if d is not None and doc.shape[1] != d:
        raise ValueError(f"docs[{number}] has d={doc.shape[1]}, the index has d={d}")
    if not doc.is_floating_point() or doc.dtype in EIGHT_BIT:
        raise TypeError(f"docs[{number}] must be a float tensor (fp16/bf16/fp32/fp64), got {doc.dtype}")
    doc = doc.detach().cpu()
    if dtype in EIGHT_BIT:
        return quantize(doc, dtype)
    return doc.to(dtype), None


def shards_from(docs: Iterable[torch.Tensor], d, dtype, shard_tokens: int, progress) -> Iterator[Shard]:
    """Yield :class:`Shard` s of about ``shard_tokens`` tokens; never holds more than one shard's documents."""
    pending, scales, lengths, count = [], [], [], 0
    for number, doc in enumerate(tqdm(docs, desc="index documents", unit="doc", disable=quiet(progress))):
        tokens, scale = _prepare(doc, d, dtype, number)
        d = tokens.shape[1]
        pending.append(tokens)
        scales.append(scale)
        lengths.append(tokens.shape[0])
        count += tokens.shape[0]
        if count >= shard_tokens:
            yield pack(pending, scales, lengths, d, dtype)
            pending, scales, lengths, count = [], [], [], 0
    if pending:
        yield pack(pending, scales, lengths, d, dtype)


def pack(tokens, scales, lengths, d, dtype) -> Shard:
    """One shard of documents given as lists of token tensors, their scales (8-bit) and lengths."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    packed = torch.cat(tokens) if tokens else torch.empty(0, d, dtype=dtype)
    scale = torch.cat(scales) if dtype in EIGHT_BIT else None
    return Shard(packed, cu, scale)
