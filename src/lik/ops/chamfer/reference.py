"""Pure-PyTorch nearest neighbours (k = 1): the specification of the kernel and the CPU path.

For each valid point ``x[n, i]`` (``i < x_lengths[n]``) the distance to every valid ``y[n, j]`` is
``sum_k (x - y)**2`` (``norm=2``, squared as in PyTorch3D) or ``sum_k |x - y|`` (``norm=1``), computed from the
differences (exact for coordinates far from the origin), and the smallest wins; ties go to the lowest ``j``; a
NaN distance wins (the minimum is NaN, its first NaN index is kept, as ``torch.min``). A point with no valid
neighbour (empty ``y`` cloud) and a padded point get distance 0 and index -1. Work is chunked so that no more
than ``budget_bytes`` of distances exist at once.
"""

from __future__ import annotations

import torch

from ...core.precision import accumulation_dtype
__all__ = ["nearest_neighbors_reference", "DEFAULT_BUDGET_BYTES"]

DEFAULT_BUDGET_BYTES = 128 * 1024 * 1024




@torch.no_grad()
def nearest_neighbors_reference(
    x: torch.Tensor, y: torch.Tensor, x_lengths: torch.Tensor, y_lengths: torch.Tensor, norm: int = 2,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [N, P1, D]``, ``y [N, P2, D]``, int64 lengths ``[N]`` -> ``(dists [N, P1], idx int64 [N, P1])``.

    Distances are in float32 (float64 for float64 inputs)."""
    n, p1, dim = x.shape
    acc = accumulation_dtype(x.dtype)
    dists = torch.zeros((n, p1), dtype=acc, device=x.device)
    idx = torch.full((n, p1), -1, dtype=torch.int64, device=x.device)
    x_len, y_len = x_lengths.tolist(), y_lengths.tolist()
    for cloud in range(n):
        lx, ly = x_len[cloud], y_len[cloud]
        if lx == 0 or ly == 0:
            continue
        targets = y[cloud, :ly].to(acc)
        rows = max(1, budget_bytes // max(1, ly * max(dim, 1) * torch.finfo(acc).bits // 8))
        for start in range(0, lx, rows):
            points = x[cloud, start:min(lx, start + rows)].to(acc)
            diff = points[:, None, :] - targets[None, :, :]
            dist = (diff * diff).sum(-1) if norm == 2 else diff.abs().sum(-1)
            best, arg = dist.min(dim=1)
            nan_rows = torch.isnan(dist).any(dim=1)
            if nan_rows.any():
                first_nan = torch.isnan(dist).to(torch.int8).argmax(dim=1)
                arg = torch.where(nan_rows, first_nan, arg)
                best = torch.where(nan_rows, float("nan"), best)
            dists[cloud, start:start + len(points)] = best
            idx[cloud, start:start + len(points)] = arg
    return dists, idx
