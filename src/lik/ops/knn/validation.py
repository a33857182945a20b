"""Input checking for :func:`lik.knn_points` (shapes, dtypes, devices, lengths, ``K``, ``norm``), before any kernel
runs; every error names the argument."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..chamfer.validation import POINT_DTYPES, check_cloud_pair

__all__ = ["KnnInputs", "check_knn_inputs", "valid_slots", "KNN_DTYPES", "MAX_K"]

KNN_DTYPES = POINT_DTYPES
# The running top-K of a row lives in registers: 32 slots per row is the most the kernels keep.
MAX_K = 32


@dataclass(frozen=True)
class KnnInputs:
    """Validated clouds: ``p1 [N, P1, D]``, ``p2 [N, P2, D]``, int64 lengths ``[N]`` on their device, ``K``,
    ``norm``."""

    p1: torch.Tensor
    p2: torch.Tensor
    lengths1: torch.Tensor
    lengths2: torch.Tensor
    K: int
    norm: int


def valid_slots(lengths1: torch.Tensor, lengths2: torch.Tensor, p1_size: int, k: int) -> torch.Tensor:
    """bool ``[N, P1, K]``: True where slot ``k`` of row ``i`` holds a neighbour (``i < lengths1[n]`` and
    ``k < lengths2[n]``)."""
    rows = torch.arange(p1_size, device=lengths1.device)[None, :] < lengths1[:, None]
    slots = torch.arange(k, device=lengths2.device)[None, :] < lengths2[:, None]
    return rows[:, :, None] & slots[:, None, :]


def _lengths(name: str, lengths, n: int, size: int, device: torch.device) -> torch.Tensor:
    if lengths is None:
        return torch.full((n,), size, dtype=torch.int64, device=device)
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
        # One host read: a length past the padded size would make the kernels read past a cloud.
        low, high = (int(v) for v in torch.stack([lengths.min(), lengths.max()]).tolist())
        if low < 0 or high > size:
            raise ValueError(f"{name} must lie in [0, {size}], got values in [{low}, {high}]")
    return lengths


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_knn_inputs(p1, p2, lengths1, lengths2, norm, K, version, return_nn, return_sorted) -> KnnInputs:
    """Validate the arguments of :func:`lik.knn_points` (PyTorch3D's names) into a :class:`KnnInputs`."""
    check_cloud_pair(p1, p2, ("p1", "p2"))
    if not isinstance(K, int) or isinstance(K, bool):
        raise TypeError(f"K must be an int, got {type(K).__name__}")
    if not 1 <= K <= MAX_K:
        raise ValueError(f"K must lie in [1, {MAX_K}], got {K}")
    if norm not in (1, 2) or isinstance(norm, bool):
        raise ValueError(f"norm must be 1 or 2, got {norm!r}")
    if not isinstance(version, int) or isinstance(version, bool):
        raise TypeError(f"version must be an int (it is accepted and ignored), got {type(version).__name__}")
    _flag("return_nn", return_nn)
    _flag("return_sorted", return_sorted)
    n = p1.shape[0]
    l1 = _lengths("lengths1", lengths1, n, p1.shape[1], p1.device)
    l2 = _lengths("lengths2", lengths2, n, p2.shape[1], p2.device)
    return KnnInputs(p1, p2, l1, l2, K, norm)
