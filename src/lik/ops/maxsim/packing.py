"""The packed (FlashAttention "varlen") layout: sequences concatenated along rows, delimited by ``cu_seqlens``.

A list of ``[L_i, dim]`` tensors becomes one ``[sum L_i, dim]`` tensor and an int32 ``cu_seqlens`` of length
``N + 1`` with ``cu_seqlens[0] == 0``, ``cu_seqlens[i + 1] - cu_seqlens[i] == L_i`` and ``cu_seqlens[N]`` equal
to the row count. A packed sequence has no padding, so no mask is needed to describe it.

The checks on ``cu_seqlens`` come in two parts: what its shape, dtype and device say (free), and what its values
say (they live on the device, so reading them costs a host synchronisation). :func:`cu_seqlens_stats` gathers
everything the value checks need into one small tensor, so that a caller validating several ``cu_seqlens``
synchronises once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .validation import (
    KERNEL_DTYPES, QUANTIZED_DTYPES, canonical_query, check_matches, check_quantized, check_width, quantize_query,
)

__all__ = [
    "pack",
    "unpack",
    "PackedInputs",
    "check_cu_seqlens",
    "cu_seqlens_stats",
    "check_cu_seqlens_values",
    "MAX_ROWS",
]

MAX_ROWS = 2**31 - 1  # cu_seqlens is int32: a packed tensor may hold at most this many rows


def check_cu_seqlens(name: str, cu_seqlens, device: torch.device | None) -> torch.Tensor:
    """Check what ``cu_seqlens`` says without reading its values; return it as contiguous int32.

    int64 is accepted (``torch.cumsum`` produces it) and converted on the device, which needs no synchronisation.
    ``device``: where it must be (None: anywhere).
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 (or int64), got dtype {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() == 0:
        raise ValueError(f"{name} must be 1-D of length N + 1 >= 1, got shape {list(cu_seqlens.shape)}")
    if device is not None and cu_seqlens.device != device:
        raise ValueError(f"{name} is on {cu_seqlens.device} but the embeddings are on {device}")
    return cu_seqlens.to(torch.int32).contiguous()


def cu_seqlens_stats(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int64 ``[first, last, smallest length, largest length]`` of a 1-D ``cu_seqlens``, on its device."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    if lengths.numel() == 0:  # N == 0: no sequence, no length
        lengths = torch.zeros(1, dtype=torch.int64, device=cu.device)
    return torch.stack([cu[0], cu[-1], lengths.min(), lengths.max()])


def check_cu_seqlens_values(name: str, stats: Sequence[int], n_rows: int) -> int:
    """Value checks from :func:`cu_seqlens_stats` (already on the host); return the longest sequence length."""
    first, last, shortest, longest = (int(v) for v in stats)
    if first != 0:
        raise ValueError(f"{name} must start at 0, got {first}")
    if shortest < 0:
        raise ValueError(f"{name} must be non-decreasing (a sequence has length {shortest})")
    if last != n_rows:
        raise ValueError(f"{name} must end at the packed row count {n_rows}, got {last}")
    return longest


def pack(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Concatenate ``[L_i, dim]`` tensors into the packed layout.

    Args:
        tensors: a non-empty sequence of 2-D tensors of one dtype, device and ``dim``; ``L_i`` may be 0.

    Returns:
        ``(packed [sum L_i, dim], cu_seqlens int32 [N + 1] on the same device, max_seqlen int)``.

    Example:
        >>> docs = [torch.randn(5, 128), torch.randn(0, 128), torch.randn(3, 128)]
        >>> packed, cu, max_len = lik.pack(docs)
        >>> packed.shape, cu.tolist(), max_len
        (torch.Size([8, 128]), [0, 5, 5, 8], 5)
    """
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"tensors must be a list or tuple of tensors, got {type(tensors).__name__}")
    if len(tensors) == 0:
        raise ValueError("tensors must hold at least one tensor (dim, dtype and device come from it)")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"tensors[{i}] must be [L, dim], got shape {list(t.shape)}")
        if t.shape[1] != first.shape[1] or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"tensors[{i}] is [{t.shape[1]}] {t.dtype} on {t.device} but tensors[0] is "
                f"[{first.shape[1]}] {first.dtype} on {first.device}: pack needs one dim, dtype and device"
            )
    lengths = [t.shape[0] for t in tensors]
    if sum(lengths) > MAX_ROWS:
        raise ValueError(f"tensors hold {sum(lengths)} rows; int32 cu_seqlens address at most {MAX_ROWS}")
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return torch.cat(list(tensors), dim=0), cu.to(first.device), max(lengths)


def unpack(packed: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """Split a packed ``[T, dim]`` tensor back into its ``[L_i, dim]`` sequences (views, no copy).

    ``cu_seqlens`` (int32 or int64, ``[N + 1]``) is read on the host, so a CUDA ``cu_seqlens`` costs one
    synchronisation; its values are checked (start 0, non-decreasing, end at ``T``).

    Example:
        >>> packed, cu, _ = lik.pack([torch.randn(5, 8), torch.randn(3, 8)])
        >>> [t.shape[0] for t in lik.unpack(packed, cu)]
        [5, 3]
    """
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"packed must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dim() < 1:
        raise ValueError("packed must have a row dimension, got a 0-d tensor")
    check_cu_seqlens("cu_seqlens", cu_seqlens, None)
    bounds = cu_seqlens.tolist()  # the caller's values: an int64 beyond int32 must fail, not wrap
    lengths = [stop - start for start, stop in zip(bounds[:-1], bounds[1:])] or [0]
    check_cu_seqlens_values("cu_seqlens", (bounds[0], bounds[-1], min(lengths), max(lengths)), packed.shape[0])
    return [packed[start:stop] for start, stop in zip(bounds[:-1], bounds[1:])]


def _check_embeddings(name: str, x, ndims: tuple[int, ...], shape_text: str, allow_float64: bool,
                      quantized: bool = False) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in ndims:
        raise ValueError(f"{name} must be {shape_text}, got shape {list(x.shape)}")
    allowed = KERNEL_DTYPES + ((torch.float64,) if allow_float64 or quantized else ())
    allowed += QUANTIZED_DTYPES if quantized else ()
    if x.dtype not in allowed:
        raise TypeError(f"{name} must have dtype in {[str(t) for t in allowed]}, got {x.dtype}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"{name} has {x.shape[0]} rows; int32 cu_seqlens address at most {MAX_ROWS}")
    check_width(name, x)
    return x


def _is_quantized(q, d, q_scale, d_scale) -> bool:
    """Whether the 8-bit checks apply (an 8-bit operand, or a scale passed)."""
    dtypes = {x.dtype for x in (q, d) if isinstance(x, torch.Tensor)}
    return bool(dtypes & set(QUANTIZED_DTYPES)) or q_scale is not None or d_scale is not None


def _check_matching(d: torch.Tensor, d_name: str, q: torch.Tensor, q_name: str, quantize_q: bool) -> None:
    """``d`` matches ``q`` (dtype, device, width); a float ``q`` about to be quantized to ``d``'s dtype is
    compared by width only (its device was checked with the scales)."""
    if not quantize_q:
        check_matches(d_name, d, q_name, q)
    elif d.shape[-1] != q.shape[-1]:
        raise ValueError(f"{d_name} has embedding dim {d.shape[-1]} but {q_name} has {q.shape[-1]}")


def _check_hint(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int or None, got {value!r}")
    return value


@dataclass(frozen=True)
class PackedInputs:
    """Validated inputs of the packed entry points.

    * pairs (:func:`lik.maxsim_varlen`): ``q [Tq, dim]``, ``cu_q`` int32 ``[N + 1]``, ``d [Td, dim]``,
      ``cu_d`` int32 ``[N + 1]``; pair ``i`` is query ``i`` against document ``i``.
    * corpus (:func:`lik.maxsim_packed`): ``q [Nq, Lq, dim]`` (a 2-D query gets a leading 1, see
      ``squeeze_query``), ``cu_q`` None, ``q_mask`` bool ``[Nq, Lq]`` or None, ``d``/``cu_d`` with ``B + 1``
      entries; every query against every document.

    ``max_seqlen_q`` is the longest query (pairs: the caller's hint, or the exact value when the values were
    read; corpus: ``Lq``). ``values_checked`` says whether ``cu_seqlens`` values were read and checked.
    """

    q: torch.Tensor
    d: torch.Tensor
    cu_q: torch.Tensor | None
    cu_d: torch.Tensor
    q_mask: torch.Tensor | None
    max_seqlen_q: int
    squeeze_query: bool
    values_checked: bool
    q_scale: torch.Tensor | None = None  # 8-bit rows: fp32, q.shape[:-1]
    d_scale: torch.Tensor | None = None  # 8-bit rows: fp32 [Td]

    @property
    def pairs(self) -> bool:
        return self.cu_q is not None

    @classmethod
    def build_pairs(cls, q, d, cu_seqlens_q, cu_seqlens_d, max_seqlen_q, max_seqlen_d, *, read_values: bool,
                    allow_float64: bool, q_scale=None, d_scale=None) -> PackedInputs:
        """Validate :func:`lik.maxsim_varlen`'s arguments.

        The ``cu_seqlens`` values are read and checked (one synchronisation for both) unless both hints are
        given; ``read_values`` reads them anyway (the CPU reference path, where reading costs nothing).
        """
        quantized = _is_quantized(q, d, q_scale, d_scale)
        q = _check_embeddings("q", q, (2,), "[total_q_tokens, dim]", allow_float64, quantized)
        d = _check_embeddings("d", d, (2,), "[total_d_tokens, dim]", allow_float64, quantized)
        quantize_q = False
        if quantized:
            q_scale, d_scale, quantize_q = check_quantized(q, d, q_scale, d_scale, q_name="q", d_name="d")
        _check_matching(d, "d", q, "q", quantize_q)
        cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
        cu_d = check_cu_seqlens("cu_seqlens_d", cu_seqlens_d, q.device)
        if cu_q.numel() != cu_d.numel():
            raise ValueError(
                f"cu_seqlens_q has {cu_q.numel() - 1} sequences but cu_seqlens_d has {cu_d.numel() - 1}: "
                "maxsim_varlen scores pairs (query i, document i)"
            )
        max_seqlen_q = _check_hint("max_seqlen_q", max_seqlen_q)
        max_seqlen_d = _check_hint("max_seqlen_d", max_seqlen_d)
        check_values = read_values or max_seqlen_q is None or max_seqlen_d is None
        if check_values:
            # One synchronisation for both tensors; the caller's own dtype, so an int64 value past int32 fails.
            stats = torch.cat([cu_seqlens_stats(cu_seqlens_q), cu_seqlens_stats(cu_seqlens_d)]).tolist()
            max_seqlen_q = check_cu_seqlens_values("cu_seqlens_q", stats[:4], q.shape[0])
            check_cu_seqlens_values("cu_seqlens_d", stats[4:], d.shape[0])
        if quantize_q:  # last: every check has passed
            q, q_scale = quantize_query(q, d.dtype)
        return cls(q, d, cu_q, cu_d, None, max_seqlen_q, False, check_values, q_scale, d_scale)

    @classmethod
    def build_corpus(cls, Q, d, cu_seqlens_d, q_mask, max_seqlen_d, *, read_values: bool,
                     allow_float64: bool, q_scale=None, d_scale=None) -> PackedInputs:
        """Validate :func:`lik.maxsim_packed`'s arguments; ``cu_seqlens_d``'s values are read and checked (one
        synchronisation) unless ``max_seqlen_d`` is given and ``read_values`` is False."""
        quantized = _is_quantized(Q, d, q_scale, d_scale)
        Q = _check_embeddings("Q", Q, (2, 3), "[Lq, dim] or [Nq, Lq, dim]", allow_float64, quantized)
        d = _check_embeddings("d", d, (2,), "[total_d_tokens, dim]", allow_float64, quantized)
        quantize_q = False
        if quantized:
            q_scale, d_scale, quantize_q = check_quantized(Q, d, q_scale, d_scale, q_name="Q", d_name="d")
        _check_matching(d, "d", Q, "Q", quantize_q)
        cu_d = check_cu_seqlens("cu_seqlens_d", cu_seqlens_d, Q.device)
        check_values = _check_hint("max_seqlen_d", max_seqlen_d) is None or read_values
        q, q_mask, squeeze = canonical_query(Q, q_mask)
        if check_values:
            check_cu_seqlens_values("cu_seqlens_d", cu_seqlens_stats(cu_seqlens_d).tolist(), d.shape[0])
        if quantize_q:  # last: every check has passed
            q, q_scale = quantize_query(q, d.dtype)
        elif q_scale is not None and squeeze:
            q_scale = q_scale.unsqueeze(0)
        return cls(q, d, None, cu_d, q_mask, q.shape[1], squeeze, check_values, q_scale, d_scale)

    def finish(self, scores: torch.Tensor) -> torch.Tensor:
        """Corpus scores ``[Nq, B]`` shaped the way ``Q`` was passed (pairs: ``[N]`` unchanged)."""
        return scores[0] if self.squeeze_query else scores
