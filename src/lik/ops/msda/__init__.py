"""Multi-scale deformable attention (Deformable DETR family): fused Triton kernels and their grid_sample reference."""

from .function import (
    MSDeformAttnFunction,
    MultiScaleDeformableAttnFunction,
    ms_deform_attn,
)
from .reference import ms_deform_attn_reference

__all__ = [
    "ms_deform_attn",
    "ms_deform_attn_reference",
    "MSDeformAttnFunction",
    "MultiScaleDeformableAttnFunction",
]
