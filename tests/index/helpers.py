"""Ragged corpora on an exact grid (multiples of 1/4, small d), so every path gives identical fp32 scores and ties
are frequent; and their padded equivalents for :func:`lik.search`."""

from __future__ import annotations

import torch

LENGTHS = (5, 0, 3, 7, 1, 4, 0, 2, 6, 3)


def grid_docs(rng: torch.Generator, lengths=LENGTHS, dim: int = 6) -> list[torch.Tensor]:
    return [torch.randint(-4, 5, (n, dim), generator=rng).float() / 4 for n in lengths]


def grid_queries(rng: torch.Generator, n_q: int = 3, l_q: int = 4, dim: int = 6) -> torch.Tensor:
    return torch.randint(-4, 5, (n_q, l_q, dim), generator=rng).float() / 4


def padded(docs: list[torch.Tensor], fill: float = float("nan")) -> tuple[torch.Tensor, torch.Tensor]:
    """``(D [B, Lmax, d], d_mask [B, Lmax])``, ``fill`` (NaN: masked positions must never count) in the padding."""
    longest = max(1, max(doc.shape[0] for doc in docs))
    D = torch.full((len(docs), longest, docs[0].shape[1]), fill, dtype=docs[0].dtype)
    mask = torch.zeros(len(docs), longest, dtype=torch.bool)
    for i, doc in enumerate(docs):
        D[i, : doc.shape[0]] = doc
        mask[i, : doc.shape[0]] = True
    return D, mask
