"""Input checking for multi-scale deformable attention.

Every check looks at shapes, dtypes and devices only, so none of them synchronises with the GPU; each error names
the offending argument. Nothing is copied here (the launchers copy a non-contiguous input once).
"""

from __future__ import annotations

import torch

__all__ = ["check_inputs", "KERNEL_DTYPES"]

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FLOAT_DTYPES = KERNEL_DTYPES + (torch.float64,)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _float(name: str, x: torch.Tensor) -> None:
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")


def check_inputs(value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
                 im2col_step=64) -> None:
    """Raise ``TypeError`` / ``ValueError`` naming the first bad argument; return None when all are consistent.

    Expected: ``value [N, S, M, D]``, ``value_spatial_shapes [L, 2]`` and ``value_level_start_index [L]`` (int32
    or int64), ``sampling_locations [N, Lq, M, L, P, 2]``, ``attention_weights [N, Lq, M, L, P]``, all on one
    device. ``im2col_step`` must be an int; its value is ignored.
    """
    value = _tensor("value", value)
    shapes = _tensor("value_spatial_shapes", value_spatial_shapes)
    starts = _tensor("value_level_start_index", value_level_start_index)
    loc = _tensor("sampling_locations", sampling_locations)
    weights = _tensor("attention_weights", attention_weights)
    if isinstance(im2col_step, bool) or not isinstance(im2col_step, int):
        raise TypeError(f"im2col_step must be an int (it is accepted and ignored), got {type(im2col_step).__name__}")

    _float("value", value)
    _float("sampling_locations", loc)
    _float("attention_weights", weights)
    for name, t in (("value_spatial_shapes", shapes), ("value_level_start_index", starts)):
        if t.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")

    if value.dim() != 4:
        raise ValueError(f"value must be [N, S, M, D], got shape {list(value.shape)}")
    if shapes.dim() != 2 or shapes.shape[1] != 2:
        raise ValueError(f"value_spatial_shapes must be [L, 2] rows of (H, W), got shape {list(shapes.shape)}")
    n_levels = shapes.shape[0]
    if tuple(starts.shape) != (n_levels,):
        raise ValueError(f"value_level_start_index must be [L] = [{n_levels}], got shape {list(starts.shape)}")
    if loc.dim() != 6 or loc.shape[-1] != 2:
        raise ValueError(f"sampling_locations must be [N, Lq, M, L, P, 2], got shape {list(loc.shape)}")
    n, _, m, _ = value.shape
    if loc.shape[0] != n or loc.shape[2] != m or loc.shape[3] != n_levels:
        raise ValueError(
            f"sampling_locations has shape {list(loc.shape)}, which does not match N={n}, M={m} of value and "
            f"L={n_levels} of value_spatial_shapes"
        )
    if tuple(weights.shape) != tuple(loc.shape[:-1]):
        raise ValueError(
            f"attention_weights must be [N, Lq, M, L, P] = {list(loc.shape[:-1])}, got {list(weights.shape)}"
        )
    for name, t in (("value_spatial_shapes", shapes), ("value_level_start_index", starts),
                    ("sampling_locations", loc), ("attention_weights", weights)):
        if t.device != value.device:
            raise ValueError(f"{name} is on {t.device} but value is on {value.device}")
