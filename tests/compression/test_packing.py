"""Bit packing: ColBERT's byte layout against a bit-by-bit reference, round trips, refusals."""

from __future__ import annotations

import pytest
import torch

from lik.compression.packing import (
    decompression_lookup_table,
    pack_residual_bits,
    packed_dim,
    reversed_bit_map,
    unpack_residual_bits,
)

from .helpers import colbert_tables_reference, pack_reference


@pytest.mark.parametrize("nbits", [1, 2, 4])
@pytest.mark.parametrize("n, dim", [(0, 8), (1, 8), (5, 24), (7, 40), (3, 136)])
def test_pack_matches_bitwise_reference_and_round_trips(nbits, n, dim):
    g = torch.Generator().manual_seed(nbits * 1000 + dim + n)
    buckets = torch.randint(0, 2**nbits, (n, dim), generator=g)
    packed = pack_residual_bits(buckets, nbits)
    assert packed.dtype == torch.uint8 and packed.shape == (n, packed_dim(dim, nbits))
    assert torch.equal(packed, pack_reference(buckets, nbits))
    assert torch.equal(unpack_residual_bits(packed, nbits), buckets.to(torch.uint8))


@pytest.mark.parametrize("nbits", [1, 2, 4])
def test_every_byte_round_trips(nbits):
    # All 256 byte values decode to indices that pack back to the same byte.
    packed = torch.arange(256, dtype=torch.uint8).reshape(256, 1).repeat(1, nbits)
    assert torch.equal(pack_residual_bits(unpack_residual_bits(packed, nbits), nbits), packed)


def test_layout_of_one_byte():
    # nbits 2: dimension 0 in the two high bits, its bit 0 above its bit 1.
    b = torch.tensor([[1, 2, 3, 0, 0, 0, 0, 0]])
    assert pack_residual_bits(b, 2).tolist() == [[0b10_01_11_00, 0]]
    assert pack_residual_bits(torch.tensor([[1, 0, 0, 0, 0, 0, 0, 1]]), 1).tolist() == [[0b1000_0001]]
    assert pack_residual_bits(torch.tensor([[1, 8, 0, 0, 0, 0, 0, 0]]), 4).tolist() == [[0b1000_0001, 0, 0, 0]]


@pytest.mark.parametrize("nbits", [1, 2, 4])
def test_tables_equal_colberts_construction(nbits):
    expected_map, expected_lookup = colbert_tables_reference(nbits)
    assert torch.equal(reversed_bit_map(nbits), expected_map)
    assert torch.equal(decompression_lookup_table(nbits), expected_lookup)


def test_non_contiguous_input():
    buckets = torch.randint(0, 4, (16, 6), generator=torch.Generator().manual_seed(0)).T  # [6, 16] strided
    assert torch.equal(pack_residual_bits(buckets, 2), pack_reference(buckets.contiguous(), 2))


@pytest.mark.parametrize("dim", [0, 4, 12, 130])
def test_dim_not_a_multiple_of_8_is_refused(dim):
    with pytest.raises(ValueError, match="dim must be a positive multiple of 8"):
        pack_residual_bits(torch.zeros(2, dim, dtype=torch.int64), 2)


@pytest.mark.parametrize("nbits", [0, 3, 8, True, 2.0])
def test_bad_nbits_is_refused(nbits):
    with pytest.raises(ValueError, match="nbits must be 1, 2 or 4"):
        pack_residual_bits(torch.zeros(2, 8, dtype=torch.int64), nbits)
    with pytest.raises(ValueError, match="nbits must be 1, 2 or 4"):
        unpack_residual_bits(torch.zeros(2, 2, dtype=torch.uint8), nbits)


def test_bad_values_and_dtypes_are_refused():
    with pytest.raises(ValueError, match=r"buckets must lie in \[0, 4\)"):
        pack_residual_bits(torch.full((1, 8), 4), 2)
    with pytest.raises(ValueError, match="buckets must lie"):
        pack_residual_bits(torch.full((1, 8), -1), 2)
    with pytest.raises(TypeError, match="buckets must be an integer tensor"):
        pack_residual_bits(torch.zeros(1, 8), 2)
    with pytest.raises(TypeError, match="packed must be uint8"):
        unpack_residual_bits(torch.zeros(1, 2, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="packed must be a 2-D tensor"):
        unpack_residual_bits(torch.zeros(2, dtype=torch.uint8), 2)
