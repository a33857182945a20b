"""Chamfer distance and nearest neighbours (k = 1) between point sets: a fused Triton kernel and its reference."""

from .function import chamfer_distance, nearest_neighbors
from .reference import nearest_neighbors_reference

__all__ = ["chamfer_distance", "nearest_neighbors", "nearest_neighbors_reference"]
