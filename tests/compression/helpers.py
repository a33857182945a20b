"""Plain references for the compression tests: bit strings built one bit at a time, float64 arithmetic."""

from __future__ import annotations

import torch


def pack_reference(buckets: torch.Tensor, nbits: int) -> torch.Tensor:
    """ColBERT's layout spelled out: each index's bits least significant first, the stream packed high bit first."""
    rows = []
    for row in buckets.tolist():
        stream = [(value >> k) & 1 for value in row for k in range(nbits)]
        rows.append([int("".join(map(str, stream[i : i + 8])), 2) for i in range(0, len(stream), 8)])
    return torch.tensor(rows, dtype=torch.uint8).reshape(len(rows), buckets.shape[1] * nbits // 8)


def colbert_tables_reference(nbits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ColBERT's two decoding tables as its constructor builds them (the loop copied from colbert-ai 0.2.22)."""
    from itertools import product

    reversed_bit_map = []
    mask = (1 << nbits) - 1
    for i in range(256):
        z = 0
        for j in range(8, 0, -nbits):
            x = (i >> (j - nbits)) & mask
            y = 0
            for k in range(nbits - 1, -1, -1):
                y += ((x >> (nbits - k - 1)) & 1) * (2**k)
            z |= y
            if j > nbits:
                z <<= nbits
        reversed_bit_map.append(z)
    lookup = torch.tensor(list(product(range(2**nbits), repeat=8 // nbits))).to(torch.uint8)
    return torch.tensor(reversed_bit_map).to(torch.uint8), lookup


def encode_reference(x, centroids, cutoffs):
    """float64 codes (largest inner product) and buckets (``cutoffs[i-1] < r <= cutoffs[i]``), one token at a time."""
    x64, c64, cut = x.double(), centroids.double(), cutoffs.double().tolist()
    codes, buckets = [], []
    for token in x64:
        code = int(torch.argmax(c64 @ token))
        codes.append(code)
        buckets.append([sum(1 for c in cut if r > c) for r in (token - c64[code]).tolist()])
    return torch.tensor(codes), torch.tensor(buckets)


def decode_reference(codes, buckets, centroids, weights) -> torch.Tensor:
    """float64 ``(c + w[b]) / |c + w[b]|``."""
    x = centroids.double()[codes.long()] + weights.double()[buckets.long()]
    return x / x.norm(dim=-1, keepdim=True)
