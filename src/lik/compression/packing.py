"""Bit packing of residual bucket indices, byte for byte as ColBERTv2's ``ResidualCodec`` packs them.

A token of ``d`` dimensions has one bucket index ``b[j]`` in ``[0, 2**nbits)`` per dimension. ColBERT writes the
bits of each index least significant first (``(b >> arange(nbits)) & 1``), concatenates them over the dimensions
and packs that stream with ``numpy.packbits`` (the stream's first bit is a byte's most significant one). So a byte
holds ``8 // nbits`` consecutive dimensions, the first in the high bits, each with its bits in reversed order::

    nbits 2, dimensions j..j+3 with indices b0..b3 (bits b[k] = (b >> k) & 1):
    byte = b0[0] b0[1] b1[0] b1[1] b2[0] b2[1] b3[0] b3[1]     (most significant bit first)

ColBERT decodes a byte with two tables, kept here as :func:`reversed_bit_map` (reverses the bits inside each
``nbits`` group so that every group reads as an ordinary number) and :func:`decompression_lookup_table` (the
``8 // nbits`` group values of a byte, first dimension first). :func:`unpack_residual_bits` uses their composition,
one 256-row table, so unpacking is one gather on any device.
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "NBITS",
    "check_nbits_and_dim",
    "packed_dim",
    "reversed_bit_map",
    "decompression_lookup_table",
    "pack_residual_bits",
    "unpack_residual_bits",
]

NBITS = (1, 2, 4)


def check_nbits_and_dim(nbits, dim) -> None:
    """Refuse an ``nbits`` other than 1, 2 or 4 and a ``dim`` that is not a positive multiple of 8.

    ColBERT's packing needs ``dim * nbits`` to fill whole bytes for every ``nbits``, hence multiples of 8 (its
    ``compress`` is stricter still, ``dim % (8 * nbits) == 0``; the bytes for the other multiples of 8 follow the
    same stream and its decoder reads them).
    """
    if isinstance(nbits, bool) or not isinstance(nbits, int) or nbits not in NBITS:
        raise ValueError(f"nbits must be 1, 2 or 4, got {nbits!r}")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0 or dim % 8:
        raise ValueError(f"dim must be a positive multiple of 8 (ColBERT packs whole bytes), got {dim!r}")


def packed_dim(dim: int, nbits: int) -> int:
    """Bytes per token: ``dim * nbits // 8`` (ColBERT's ``dim // 8 * nbits``)."""
    check_nbits_and_dim(nbits, dim)
    return dim // 8 * nbits


@functools.cache
def _reversed_bit_map(nbits: int) -> tuple[int, ...]:
    mask = (1 << nbits) - 1
    table = []
    for byte in range(256):
        out = 0
        for shift in range(8 - nbits, -1, -nbits):  # the byte's groups, most significant first
            group = (byte >> shift) & mask
            reversed_group = sum(((group >> k) & 1) << (nbits - 1 - k) for k in range(nbits))
            out = (out << nbits) | reversed_group
        table.append(out)
    return tuple(table)


def reversed_bit_map(nbits: int) -> torch.Tensor:
    """ColBERT's ``reversed_bit_map``: uint8 ``[256]``, each byte with the bits of every ``nbits`` group reversed.

    Example::

        >>> reversed_bit_map(2)[0b01_00_00_00].item() == 0b10_00_00_00
        True
    """
    check_nbits_and_dim(nbits, 8)
    return torch.tensor(_reversed_bit_map(nbits), dtype=torch.uint8)


def decompression_lookup_table(nbits: int) -> torch.Tensor:
    """ColBERT's ``decompression_lookup_table``: uint8 ``[256, 8 // nbits]``, row ``v`` the base-``2**nbits``
    digits of ``v``, most significant first (``itertools.product(range(2**nbits), repeat=8 // nbits)``)."""
    check_nbits_and_dim(nbits, 8)
    per_byte = 8 // nbits
    values = torch.arange(256, dtype=torch.int32).unsqueeze(1)
    shifts = torch.arange(per_byte - 1, -1, -1, dtype=torch.int32) * nbits
    return ((values >> shifts) & ((1 << nbits) - 1)).to(torch.uint8)


@functools.cache
def _byte_to_buckets(nbits: int, device: torch.device) -> torch.Tensor:
    # The composition ColBERT applies in two gathers: a packed byte -> its dimensions' bucket indices.
    table = decompression_lookup_table(nbits)[reversed_bit_map(nbits).long()]
    return table.to(device)


def pack_residual_bits(buckets: torch.Tensor, nbits: int) -> torch.Tensor:
    """Pack bucket indices as ColBERT does.

    Args:
        buckets: integer ``[N, d]`` with values in ``[0, 2**nbits)``, ``d`` a multiple of 8; any device.
        nbits: 1, 2 or 4.

    Returns:
        uint8 ``[N, d * nbits // 8]`` on ``buckets``' device, equal to ColBERT's ``binarize`` output.

    Example::

        >>> pack_residual_bits(torch.tensor([[1, 0, 0, 0, 0, 0, 0, 3]]), 2).tolist()
        [[128, 3]]
    """
    if not isinstance(buckets, torch.Tensor) or buckets.dim() != 2:
        raise ValueError("buckets must be a 2-D tensor [N, d]")
    if buckets.dtype.is_floating_point or buckets.dtype.is_complex or buckets.dtype == torch.bool:
        raise TypeError(f"buckets must be an integer tensor, got {buckets.dtype}")
    n, dim = buckets.shape
    check_nbits_and_dim(nbits, dim)
    if n and (int(buckets.min()) < 0 or int(buckets.max()) >= 1 << nbits):
        raise ValueError(f"buckets must lie in [0, {1 << nbits}) for nbits={nbits}")
    shifts = torch.arange(nbits, device=buckets.device, dtype=torch.int32)
    bits = (buckets.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # [N, d, nbits], least significant bit first
    bits = bits.reshape(n, dim * nbits // 8, 8)
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], device=buckets.device, dtype=torch.int32)
    return (bits * weights).sum(-1).to(torch.uint8)  # numpy.packbits: the stream's first bit is the high bit


def unpack_residual_bits(packed: torch.Tensor, nbits: int) -> torch.Tensor:
    """Inverse of :func:`pack_residual_bits`: uint8 ``[N, B]`` -> uint8 bucket indices ``[N, B * 8 // nbits]``.

    Example::

        >>> unpack_residual_bits(torch.tensor([[128, 3]], dtype=torch.uint8), 2).tolist()
        [[1, 0, 0, 0, 0, 0, 0, 3]]
    """
    if not isinstance(packed, torch.Tensor) or packed.dim() != 2:
        raise ValueError("packed must be a 2-D tensor [N, d * nbits // 8]")
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    check_nbits_and_dim(nbits, 8)
    n, nbytes = packed.shape
    table = _byte_to_buckets(nbits, packed.device)
    return table[packed.long()].reshape(n, nbytes * 8 // nbits)
