"""Multi-scale deformable attention (the Deformable DETR family, RT-DETRv2 / D-FINE variant included): fused Triton
kernels and their grid_sample reference."""

from .function import (
    MSDeformAttnFunction,
    MultiScaleDeformableAttnFunction,
    ms_deform_attn,
)
from .reference import ms_deform_attn_reference, ms_deform_attn_v2_reference
from .v2 import MSDeformAttnV2Function, ms_deform_attn_v2

__all__ = [
    "ms_deform_attn",
    "ms_deform_attn_reference",
    "ms_deform_attn_v2",
    "ms_deform_attn_v2_reference",
    "MSDeformAttnV2Function",
    "MSDeformAttnFunction",
    "MultiScaleDeformableAttnFunction",
]
