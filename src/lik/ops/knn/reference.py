"""Pure-PyTorch K nearest neighbours: the specification of the kernels and the CPU path.

For each valid point ``p1[n, i]`` (``i < lengths1[n]``) the distance to every valid ``p2[n, j]``
(``j < lengths2[n]``) is ``sum_d (p1 - p2)**2`` (``norm=2``: squared, as PyTorch3D) or ``sum_d |p1 - p2|``
(``norm=1``), computed from the coordinate differences (exact for points far from the origin). The ``K``
smallest are listed in ascending order; equal distances go to the lower index; a NaN distance orders after every
number (``torch.sort``'s rule), so NaN neighbours come last, lowest index first. Slots past ``lengths2[n]`` (when
``K > lengths2[n]``) and rows past ``lengths1[n]`` hold distance 0 and index 0, as PyTorch3D pads them. Padded
points are never read into a result. Work is chunked so that no more than ``budget_bytes`` of distances (and
their sort) exist at once.
"""

from __future__ import annotations

import torch

from ...core.precision import accumulation_dtype

__all__ = ["knn_reference", "pair_distances", "DEFAULT_BUDGET_BYTES"]

DEFAULT_BUDGET_BYTES = 128 * 1024 * 1024


def pair_distances(a: torch.Tensor, b: torch.Tensor, norm: int) -> torch.Tensor:
    """``a [..., D]`` and ``b [..., D]`` (broadcast) -> ``sum_d (a - b)**2`` or ``sum_d |a - b|`` over the last
    dimension, in their dtype."""
    diff = a - b
    return (diff * diff).sum(-1) if norm == 2 else diff.abs().sum(-1)


@torch.no_grad()
def knn_reference(
    p1: torch.Tensor, p2: torch.Tensor, lengths1: torch.Tensor, lengths2: torch.Tensor, K: int, norm: int = 2,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``p1 [N, P1, D]``, ``p2 [N, P2, D]``, int64 lengths ``[N]`` -> ``(dists [N, P1, K], idx int64 [N, P1, K])``.

    Distances are float32 (float64 for float64 inputs), computed in that precision."""
    n, p1_size, dim = p1.shape
    acc = accumulation_dtype(p1.dtype)
    dists = torch.zeros((n, p1_size, K), dtype=acc, device=p1.device)
    idx = torch.zeros((n, p1_size, K), dtype=torch.int64, device=p1.device)
    len1, len2 = lengths1.tolist(), lengths2.tolist()
    item = torch.finfo(acc).bits // 8
    for cloud in range(n):
        rows_left, cols = len1[cloud], len2[cloud]
        if rows_left == 0 or cols == 0:
            continue
        k = min(K, cols)
        targets = p2[cloud, :cols].to(acc)
        # The difference block [rows, cols, D] and the sort's values and int64 indices [rows, cols] per chunk.
        per_row = cols * (max(dim, 1) + 1) * item + cols * 8
        rows = max(1, budget_bytes // per_row)
        for start in range(0, rows_left, rows):
            stop = min(rows_left, start + rows)
            dist = pair_distances(p1[cloud, start:stop, None, :].to(acc), targets[None, :, :], norm)
            values, order = torch.sort(dist, dim=1, stable=True)
            dists[cloud, start:stop, :k] = values[:, :k]
            idx[cloud, start:stop, :k] = order[:, :k]
    return dists, idx
