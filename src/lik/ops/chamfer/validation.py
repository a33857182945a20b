"""Input checking for :func:`lik.chamfer_distance` and :func:`lik.nearest_neighbors` (shapes, dtypes, devices and
lengths), before any kernel runs; every error names the argument."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PointSets", "check_cloud_pair", "check_point_sets", "check_reductions", "valid_points", "POINT_DTYPES"]

POINT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class PointSets:
    """Validated clouds: ``x [N, P1, D]``, ``y [N, P2, D]`` and int64 lengths ``[N]`` on their device."""

    x: torch.Tensor
    y: torch.Tensor
    x_lengths: torch.Tensor
    y_lengths: torch.Tensor
    ragged: bool  # some cloud is shorter than its padded size


def valid_points(lengths: torch.Tensor, size: int) -> torch.Tensor:
    """bool ``[N, size]``: True for the first ``lengths[n]`` points of cloud ``n``."""
    return torch.arange(size, device=lengths.device)[None, :] < lengths[:, None]


def _lengths(name: str, lengths, n: int, size: int, device: torch.device) -> tuple[torch.Tensor, bool]:
    if lengths is None:
        return torch.full((n,), size, dtype=torch.int64, device=device), False
    if not isinstance(lengths, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape (N,), got {type(lengths).__name__}")
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {lengths.dtype}")
    if tuple(lengths.shape) != (n,):
        raise ValueError(f"{name} must have shape ({n},), got {tuple(lengths.shape)}")
    if lengths.device != device:
        raise ValueError(f"{name} is on {lengths.device}, the points on {device}")
    lengths = lengths.to(torch.int64)
    if n:
        # One host read: lengths out of range would make the kernels read past a cloud.
        low, high = (int(v) for v in torch.stack([lengths.min(), lengths.max()]).tolist())
        if low < 0 or high > size:
            raise ValueError(f"{name} must lie in [0, {size}], got values in [{low}, {high}]")
        return lengths, low < size
    return lengths, False


def check_cloud_pair(x, y, names: tuple[str, str] = ("x", "y")) -> None:
    """``x [N, P1, D]`` and ``y [N, P2, D]``: float tensors of one N, D, dtype and device (errors use ``names``)."""
    nx, ny = names
    for name, t in ((nx, x), (ny, y)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape (N, P, D), got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must have shape (N, P, D), got {tuple(t.shape)}")
        if t.dtype not in POINT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if y.shape[0] != x.shape[0]:
        raise ValueError(f"{ny} has {y.shape[0]} clouds, {nx} has {x.shape[0]}: they must match")
    if y.shape[2] != x.shape[2]:
        raise ValueError(f"{ny} has D = {y.shape[2]}, {nx} has D = {x.shape[2]}: they must match")
    if y.dtype != x.dtype:
        raise TypeError(f"{ny} is {y.dtype}, {nx} is {x.dtype}: they must match")
    if y.device != x.device:
        raise ValueError(f"{ny} is on {y.device}, {nx} on {x.device}: they must be on one device")


def check_point_sets(x, y, x_lengths=None, y_lengths=None) -> PointSets:
    """Validate ``x [N, P1, D]`` and ``y [N, P2, D]`` (same N, D, dtype and device) and their lengths."""
    check_cloud_pair(x, y)
    n = x.shape[0]
    xl, x_ragged = _lengths("x_lengths", x_lengths, n, x.shape[1], x.device)
    yl, y_ragged = _lengths("y_lengths", y_lengths, n, y.shape[1], y.device)
    return PointSets(x, y, xl, yl, x_ragged or y_ragged)


def check_reductions(batch_reduction, point_reduction, norm, has_normals: bool) -> None:
    """PyTorch3D's rules for the reduction arguments."""
    if batch_reduction not in (None, "mean", "sum"):
        raise ValueError(f'batch_reduction must be "mean", "sum" or None, got {batch_reduction!r}')
    if point_reduction not in (None, "mean", "sum", "max"):
        raise ValueError(f'point_reduction must be "mean", "sum", "max" or None, got {point_reduction!r}')
    if point_reduction is None and batch_reduction is not None:
        raise ValueError("batch_reduction must be None when point_reduction is None")
    if norm not in (1, 2) or isinstance(norm, bool):
        raise ValueError(f"norm must be 1 or 2, got {norm!r}")
    if point_reduction == "max" and has_normals:
        raise ValueError('x_normals and y_normals must be None when point_reduction is "max"')
