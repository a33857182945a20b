"""Documents to shards, in batches: documents are concatenated, converted to the index dtype (quantized per token for
8-bit indexes) where they already are, on the GPU when there is one, and moved to host memory in one copy per batch;
runs of whole documents are then packed into :class:`~lik.index.format.Shard` s, one shard in memory at a time.

Documents come one by one (``[L_i, d]`` tensors) or as :class:`DocumentBatch` es, as an encoder produces them
(padded ``[B, L, d]`` with a mask or lengths, or packed tokens with ``cu_seqlens``); both may be mixed in one iterable.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from ..ops.quantization import quantize
from .format import EIGHT_BIT, Shard
from .plaid_codec import CodecTrainer

__all__ = ["DocumentBatch", "as_int", "progress_bar", "shards_from", "pack", "BATCH_TOKENS"]

# Tokens converted per batch: large enough that the per-batch launches and copy are nothing next to the data
# (256 Ki tokens at d = 128 are 64 MB of fp16), small enough that a batch is a fraction of a shard.
BATCH_TOKENS = 1 << 18


class _HiddenBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_description(self, desc: str) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(iterable=None, *, progress: bool | None, **options):
    """A tqdm bar (over ``iterable``, or one to ``update``) where ``progress`` asks for one (``None``: on a terminal
    only), else ``iterable`` itself or a bar that does nothing. A hidden bar constructs no tqdm at all: tqdm's class
    lock is shared with forked processes, so a child killed while holding it would stall the parent's next bar.

    Example:
        >>> for shard in progress_bar(shards, progress=None, desc="write shards", unit="shard"): ...
    """
    stderr = sys.stderr
    shown = progress if progress is not None else stderr is not None and stderr.isatty()
    if shown:
        return tqdm(**options) if iterable is None else tqdm(iterable, **options)
    return _HiddenBar() if iterable is None else iterable


def as_int(value, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None


def _check_float(x, name: str, dims: int, shape: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape}, got {type(x).__name__}")
    if x.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D {shape}, got shape {list(x.shape)}")
    if not x.is_floating_point() or x.dtype in EIGHT_BIT:
        raise TypeError(f"{name} must be a float tensor (fp16/bf16/fp32/fp64), got {x.dtype}")
    return x.detach()


def _host_ints(values, name: str) -> list[int]:
    if isinstance(values, torch.Tensor):
        if values.dtype == torch.bool or values.is_floating_point() or values.is_complex() or values.dim() != 1:
            raise TypeError(f"{name} must be a 1-D integer tensor or sequence, got {values.dtype} {list(values.shape)}")
        return values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a 1-D integer tensor or sequence, got {type(values).__name__}")
    return [as_int(v, name) for v in values]


@dataclass(frozen=True, init=False)
class DocumentBatch:
    """Several documents at once for :meth:`lik.Index.build` / :meth:`lik.Index.add`, as an encoder yields them.

    Make one with :meth:`padded` (``[B, L, d]`` embeddings with a mask or lengths) or :meth:`packed` (packed
    ``[T, d]`` tokens with ``cu_seqlens``). It holds the documents' real tokens packed, ``tokens [T, d]`` (where the
    embeddings were: a GPU batch is converted on the GPU), and their ``lengths`` (host ints).

    Example:
        >>> def batches():
        ...     for embeddings, mask in encoder_outputs:          # [B, L, 128] on the GPU, bool [B, L]
        ...         yield lik.index.DocumentBatch.padded(embeddings, mask=mask)
        >>> index = lik.Index.build(batches(), dtype=torch.int8)   # ids 0, 1, ... in batch order
    """

    tokens: torch.Tensor
    lengths: tuple[int, ...]

    def __init__(self, tokens: torch.Tensor, lengths: Sequence[int]):
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "lengths", tuple(lengths))

    def __len__(self) -> int:
        return len(self.lengths)

    @classmethod
    def padded(cls, embeddings: torch.Tensor, mask: torch.Tensor | None = None, lengths=None) -> DocumentBatch:
        """``B`` documents from float ``embeddings [B, L, d]``: with a bool ``mask [B, L]`` (True: a real token,
        anywhere in the row; the document is its real tokens in order), or with ``lengths [B]`` (document ``b`` is
        ``embeddings[b, :lengths[b]]``), or neither (every document has ``L`` tokens)."""
        embeddings = _check_float(embeddings, "embeddings", 3, "[B, L, d]")
        n, width = embeddings.shape[0], embeddings.shape[1]
        if mask is not None and lengths is not None:
            raise ValueError("DocumentBatch.padded takes mask or lengths, not both")
        if lengths is not None:
            counts = _host_ints(lengths, "lengths")
            if len(counts) != n or any(not 0 <= c <= width for c in counts):
                raise ValueError(f"lengths must be {n} integers in [0, {width}], got {counts[:8]}...")
            if all(c == width for c in counts):
                return cls(embeddings.reshape(n * width, -1), counts)
            keep = torch.arange(width) < torch.tensor(counts, dtype=torch.int64)[:, None]
            return cls(embeddings[keep.to(embeddings.device)], counts)
        if mask is None:
            return cls(embeddings.reshape(n * width, -1), [width] * n)
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor [B, L], got {getattr(mask, 'dtype', type(mask).__name__)}")
        if mask.shape != embeddings.shape[:2]:
            raise ValueError(f"mask must have shape {list(embeddings.shape[:2])}, got {list(mask.shape)}")
        mask = mask.to(embeddings.device)
        return cls(embeddings[mask], mask.sum(dim=1).tolist())

    @classmethod
    def packed(cls, tokens: torch.Tensor, cu_seqlens) -> DocumentBatch:
        """Documents packed along rows: float ``tokens [T, d]`` and ``cu_seqlens [B + 1]`` (int tensor or
        sequence: from 0, non-decreasing, ending at ``T``; document ``b`` is ``tokens[cu[b]:cu[b + 1]]``)."""
        tokens = _check_float(tokens, "tokens", 2, "[T, d]")
        offsets = _host_ints(cu_seqlens, "cu_seqlens")
        if not offsets or offsets[0] != 0 or offsets[-1] != tokens.shape[0]:
            raise ValueError(f"cu_seqlens must start at 0 and end at T = {tokens.shape[0]}, got {offsets[:1]}"
                             f"..{offsets[-1:]}")
        lengths = [b - a for a, b in zip(offsets, offsets[1:])]
        if any(length < 0 for length in lengths):
            raise ValueError("cu_seqlens must be non-decreasing")
        return cls(tokens, lengths)


def _batches(docs: Iterable, d: int | None, limit: int) -> Iterator[tuple[list[torch.Tensor], list[int], int]]:
    """``(token tensors [T_i, d] to concatenate, lengths, first item number)`` of runs of single documents (one
    device and dtype, about ``limit`` tokens) and of each :class:`DocumentBatch`; every item's width checked
    against ``d``."""
    group, lengths, count, first, kind = [], [], 0, 0, None

    def flush():
        return group, lengths, first

    for number, item in enumerate(docs):
        if isinstance(item, DocumentBatch):
            if group:
                yield flush()
                group, lengths, count = [], [], 0
            if d is not None and item.tokens.shape[1] != d:
                raise ValueError(f"docs[{number}] has d={item.tokens.shape[1]}, the index has d={d}")
            d = item.tokens.shape[1]
            yield [item.tokens], list(item.lengths), number
            continue
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"docs[{number}] must be a torch.Tensor [L, d] or a lik.index.DocumentBatch, got "
                            f"{type(item).__name__}")
        if item.dim() != 2:
            hint = " (a batch [B, L, d]: wrap it in lik.index.DocumentBatch.padded)" if item.dim() == 3 else ""
            raise ValueError(f"docs[{number}] must be 2-D [L, d], got shape {list(item.shape)}{hint}")
        if d is not None and item.shape[1] != d:
            raise ValueError(f"docs[{number}] has d={item.shape[1]}, the index has d={d}")
        if not item.is_floating_point() or item.dtype in EIGHT_BIT:
            raise TypeError(f"docs[{number}] must be a float tensor (fp16/bf16/fp32/fp64), got {item.dtype}")
        d = item.shape[1]
        if group and (kind != (item.device, item.dtype) or count >= limit):
            yield flush()
            group, lengths, count = [], [], 0
        if not group:
            kind, first = (item.device, item.dtype), number
        group.append(item.detach())
        lengths.append(item.shape[0])
        count += item.shape[0]
    if group:
        yield flush()


class _Staging:
    """A pinned host buffer that CPU batches bound for the GPU are concatenated into, so each crosses in one
    asynchronous copy at the link's pinned rate (reused: the previous batch's copy is waited for first)."""

    def __init__(self, device: torch.device):
        self.device, self.buffer, self.used = device, None, False

    def gather(self, parts: list[torch.Tensor]) -> torch.Tensor:
        rows = sum(t.shape[0] for t in parts)
        if rows == 0:
            return torch.cat(parts)
        first = parts[0]
        if self.buffer is None or self.buffer.shape[0] < rows or self.buffer.dtype != first.dtype or \
                self.buffer.shape[1:] != first.shape[1:]:
            self.buffer = torch.empty((max(rows, BATCH_TOKENS), *first.shape[1:]), dtype=first.dtype, pin_memory=True)
        elif self.used:
            torch.cuda.current_stream(self.device).synchronize()
        self.used = True
        return torch.cat(parts, out=self.buffer[:rows])


def _convert(tokens: torch.Tensor, dtype: torch.dtype, device: torch.device | None, resident: bool, codec=None):
    """``tokens`` in the index ``dtype`` (quantized per token for 8-bit: on the GPU when ``tokens`` or the index's
    ``device`` is one), with the fp32 scales of an 8-bit index; moved to host memory in one copy, or, ``resident``,
    to ``device``. With a ``codec`` (a compressed index): its residuals uint8 and codes int32, compressed on the
    codec's device."""
    cuda = device is not None and device.type == "cuda"
    if codec is not None:
        if tokens.numel() and not bool(torch.isfinite(tokens).all()):
            raise ValueError("docs must be finite (no NaN or inf) for codec='plaid'")
        scale, stored = codec.compress(tokens)
    elif dtype in EIGHT_BIT:
        if tokens.device.type == "cpu" and cuda and tokens.numel():
            tokens = tokens.to(device, non_blocking=tokens.is_pinned())
        stored, scale = quantize(tokens, dtype)
    else:
        stored, scale = tokens.to(dtype), None  # (converted first: a GPU batch crosses in the smaller dtype)
    where = device if resident and cuda else torch.device("cpu")
    return stored.to(where), None if scale is None else scale.to(where)


class _ShardFiller:
    """Host batches to shards: a shard closes after the document that brings it to ``shard_tokens`` tokens (as if
    documents came one at a time), so the shard split does not depend on how documents were batched."""

    def __init__(self, shard_tokens: int, dtype: torch.dtype):
        self.shard_tokens, self.dtype = shard_tokens, dtype
        self.tokens, self.scales, self.lengths, self.count = [], [], [], 0

    def add(self, tokens, scale, lengths: list[int]) -> Iterator[Shard]:
        start, row = 0, 0
        while start < len(lengths):
            stop, total = start, self.count
            while stop < len(lengths) and total < self.shard_tokens:
                total += lengths[stop]
                stop += 1
            rows = total - self.count
            self.tokens.append(tokens[row : row + rows])
            self.scales.append(None if scale is None else scale[row : row + rows])
            self.lengths.extend(lengths[start:stop])
            self.count, row, start = total, row + rows, stop
            if self.count >= self.shard_tokens:
                yield self.close()

    def close(self) -> Shard:
        shard = pack(self.tokens, self.scales, self.lengths, self.tokens[0].shape[1], self.dtype)
        self.tokens, self.scales, self.lengths, self.count = [], [], [], 0
        return shard


def _trained_first(batches: Iterator, trainer: CodecTrainer, bar) -> Iterator:
    """``batches`` as they come, after the codec was trained on the first ones (held back until the trainer's
    ``train_tokens`` tokens, or the end, are in hand); ``bar`` says so meanwhile."""
    held, count = [], 0
    bar.set_description("train codec")
    for batch in batches:
        held.append(batch)
        count += sum(t.shape[0] for t in batch[0])
        if count >= trainer.train_tokens:
            break
    if held:
        trainer.train([t for parts, _, _ in held for t in parts], [n for _, lengths, _ in held for n in lengths])
    bar.set_description("index documents")
    yield from held
    del held
    yield from batches


def shards_from(docs: Iterable, d, dtype, shard_tokens: int, progress, device=None, resident: bool = False,
                codec=None, rescore=None) -> Iterator[Shard]:
    """Yield :class:`Shard` s of about ``shard_tokens`` tokens from ``docs`` (``[L_i, d]`` tensors and
    :class:`DocumentBatch` es); never holds more than one shard's documents and one batch. ``device``: where an
    8-bit index quantizes batches of CPU documents (a CUDA device; else where they are). ``resident``: the shards'
    tensors stay on that CUDA device (a GPU-resident index: no round trip through host memory). ``codec``: a
    :class:`lik.compression.ResidualCodec`, or a :class:`~lik.index.plaid_codec.CodecTrainer` that trains one on
    the first batches (it then holds them, about ``train_tokens`` tokens, besides a shard): compressed shards.
    ``rescore``: with a codec, each shard also keeps an exact copy of its documents in that dtype (float16 or
    int8, quantized as an exact index of it stores them) in host memory, as its ``copy``."""
    device = None if device is None else torch.device(device)
    filler = _ShardFiller(shard_tokens, torch.uint8 if codec is not None else dtype)
    # The copy's own filler sees the same lengths, so its shards close with the compressed ones.
    copies = None if rescore is None else _ShardFiller(shard_tokens, rescore)
    staging = None
    if (dtype in EIGHT_BIT or codec is not None) and device is not None and device.type == "cuda":
        staging = _Staging(device)
    batches = _batches(docs, d, min(BATCH_TOKENS, shard_tokens))
    trainer = codec if isinstance(codec, CodecTrainer) else None
    bar = progress_bar(progress=progress, desc="index documents", unit="doc")
    if trainer is not None and trainer.codec is None:
        batches = _trained_first(batches, trainer, bar)
    try:
        for parts, lengths, _ in batches:
            if staging is not None and parts[0].device.type == "cpu":
                tokens = staging.gather(parts)
            else:
                tokens = parts[0] if len(parts) == 1 else torch.cat(parts)
            stored, scale = _convert(tokens, dtype, device, resident, None if trainer is None and codec is None
                                     else (trainer.codec if trainer is not None else codec))
            shards = list(filler.add(stored, scale, lengths))
            if copies is not None:
                exact = copies.add(*_convert(tokens, rescore, device, False), lengths)
                shards = [replace(shard, copy=copy) for shard, copy in zip(shards, exact, strict=True)]
            yield from shards
            bar.update(len(lengths))
    finally:
        bar.close()
    if filler.lengths:
        shard = filler.close()
        yield shard if copies is None else replace(shard, copy=copies.close())


def pack(tokens, scales, lengths, d, dtype) -> Shard:
    """One shard of documents given as lists of token tensors, their scales (8-bit) and lengths."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    packed = torch.cat(tokens) if tokens else torch.empty(0, d, dtype=dtype)
    scale = torch.cat(scales) if dtype in EIGHT_BIT or (scales and scales[0] is not None) else None
    return Shard(packed, cu, scale)
