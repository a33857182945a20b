"""K nearest neighbours between point clouds (PyTorch3D's ``knn_points``): a Triton kernel and its reference."""

from .function import KNN, knn_points
from .heuristic import KnnConfig, knn_config
from .reference import knn_reference

__all__ = ["knn_points", "KNN", "knn_reference", "KnnConfig", "knn_config"]
