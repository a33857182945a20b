"""Input checking for multi-scale deformable attention.

:func:`check_inputs` looks at shapes, dtypes and devices only, so it never synchronises with the GPU. The level
table's values (every level inside ``value``) are checked by :func:`check_level_table`, which reads the table to
the host once per table and caches the result (docs/design.md, "Deformable attention semantics"). Each error
names the offending argument. Nothing is copied here (the launchers copy a non-contiguous input once).
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["check_inputs", "check_inputs_v2", "check_level_table", "checked_cell_count", "level_table", "KERNEL_DTYPES",
           "METHODS"]

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FLOAT_DTYPES = KERNEL_DTYPES + (torch.float64,)
_INDEX_DTYPES = (torch.int32, torch.int64)
METHODS = ("default", "discrete")


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
    _check(value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights, im2col_step)


def _check(value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights, im2col_step,
           counts=None) -> None:
    """:func:`check_inputs`; with ``counts`` (RT-DETRv2's points per level) the samples are ``[N, Lq, M, T, 2]``
    and ``[N, Lq, M, T]``, whose own shapes :func:`check_inputs_v2` has checked: only their N, M and level count
    are compared here (no stand-in tensors in the layout above: each would cost an allocation per call)."""
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
    if counts is None and (loc.dim() != 6 or loc.shape[-1] != 2):
        raise ValueError(f"sampling_locations must be [N, Lq, M, L, P, 2], got shape {list(loc.shape)}")
    n, _, m, _ = value.shape
    if loc.shape[0] != n or loc.shape[2] != m or (loc.shape[3] if counts is None else len(counts)) != n_levels:
        raise ValueError(
            f"sampling_locations has shape {list(loc.shape)}, which does not match N={n}, M={m} of value and "
            f"L={n_levels} of value_spatial_shapes"
        )
    if counts is None and tuple(weights.shape) != tuple(loc.shape[:-1]):
        raise ValueError(
            f"attention_weights must be [N, Lq, M, L, P] = {list(loc.shape[:-1])}, got {list(weights.shape)}"
        )
    for name, t in (("value_spatial_shapes", shapes), ("value_level_start_index", starts),
                    ("sampling_locations", loc), ("attention_weights", weights)):
        if t.device != value.device:
            raise ValueError(f"{name} is on {t.device} but value is on {value.device}")


def check_inputs_v2(value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
                    num_points_list, method="default") -> tuple[int, ...]:
    """:func:`check_inputs` for RT-DETRv2 / D-FINE's layout; returns ``num_points_list`` as a tuple of ints.

    Expected: ``sampling_locations [N, Lq, M, T, 2]`` and ``attention_weights [N, Lq, M, T]`` with every level's
    points flattened (``T = sum(num_points_list)``), ``num_points_list`` L non-negative ints, ``method`` one of
    ``"default"`` (bilinear) or ``"discrete"`` (nearest pixel).
    """
    if method not in METHODS:
        raise ValueError(f"method must be 'default' or 'discrete', got {method!r}")
    if isinstance(num_points_list, torch.Tensor) or not isinstance(num_points_list, (list, tuple)):
        raise TypeError(f"num_points_list must be a list of ints, got {type(num_points_list).__name__}")
    if any(isinstance(p, bool) or not isinstance(p, int) for p in num_points_list):
        raise TypeError(f"num_points_list must hold ints, got {list(num_points_list)!r}")
    if any(p < 0 for p in num_points_list):
        raise ValueError(f"num_points_list must be non-negative, got {list(num_points_list)}")
    loc = _tensor("sampling_locations", sampling_locations)
    weights = _tensor("attention_weights", attention_weights)
    if loc.dim() != 5 or loc.shape[-1] != 2:
        raise ValueError(f"sampling_locations must be [N, Lq, M, sum(num_points_list), 2], got shape "
                         f"{list(loc.shape)}")
    total = sum(num_points_list)
    if loc.shape[3] != total:
        raise ValueError(f"sampling_locations has {loc.shape[3]} points per head but num_points_list sums to "
                         f"{total}")
    if tuple(weights.shape) != tuple(loc.shape[:-1]):
        raise ValueError(
            f"attention_weights must be [N, Lq, M, sum(num_points_list)] = {list(loc.shape[:-1])}, got "
            f"{list(weights.shape)}"
        )
    shapes = _tensor("value_spatial_shapes", value_spatial_shapes)
    if shapes.dim() == 2 and shapes.shape[0] != len(num_points_list):
        raise ValueError(f"num_points_list has {len(num_points_list)} levels but value_spatial_shapes has "
                         f"{shapes.shape[0]}")
    if isinstance(value, torch.Tensor) and value.dim() == 4 and (loc.shape[0], loc.shape[2]) != (value.shape[0],
                                                                                                  value.shape[2]):
        raise ValueError(f"sampling_locations has shape {list(loc.shape)}, which does not match N={value.shape[0]}, "
                         f"M={value.shape[2]} of value")
    counts = tuple(num_points_list)
    _check(value, shapes, value_level_start_index, loc, weights, 64, counts)
    return counts


def level_table(value_spatial_shapes: torch.Tensor, value_level_start_index: torch.Tensor,
                n_pixels: int) -> list[tuple[int, int, int]]:
    """Host copy of the level table as ``[(H, W, start), ...]`` (one synchronisation for a CUDA table), checked
    against ``S = n_pixels``: every H, W and start non-negative, each level inside value
    (``start + H * W <= S``) and all levels together no larger than it (``sum(H * W) <= S``).

    Example:
        >>> level_table(torch.tensor([[3, 4], [2, 2]]), torch.tensor([0, 12]), 16)    # [(3, 4, 0), (2, 2, 12)]
        >>> level_table(torch.tensor([[3, 4], [2, 2]]), torch.tensor([0, 13]), 16)    # ValueError
    """
    shapes = value_spatial_shapes.tolist()
    starts = value_level_start_index.tolist()
    total = 0
    for level, ((height, width), start) in enumerate(zip(shapes, starts)):
        if height < 0 or width < 0:
            raise ValueError(f"value_spatial_shapes[{level}] = ({height}, {width}) is negative")
        if start < 0:
            raise ValueError(f"value_level_start_index[{level}] = {start} is negative")
        if start + height * width > n_pixels:
            raise ValueError(
                f"value_level_start_index[{level}] = {start} with H*W = {height * width} runs past S = {n_pixels} "
                f"(value's dimension 1)"
            )
        total += height * width
    if total > n_pixels:
        raise ValueError(f"value_spatial_shapes: the levels hold sum(H*W) = {total} pixels, more than value's "
                         f"S = {n_pixels}")
    return [(h, w, s) for (h, w), s in zip(shapes, starts)]


# Tables that passed, by identity: id(shapes) -> weak references to (shapes, starts), S and their version counters.
# Weak, so a cached table never keeps memory alive; a dead reference never matches, so a reused id is harmless.
# Cleared when full.
_FITTING_TABLES: dict[int, tuple] = {}
FITTING_TABLES_LIMIT = 64


def _versions(shapes: torch.Tensor, starts: torch.Tensor):
    if shapes.is_inference() or starts.is_inference():
        return None  # an inference tensor has no version counter: cached by identity alone
    return shapes._version, starts._version


def check_level_table(value_spatial_shapes: torch.Tensor, value_level_start_index: torch.Tensor,
                      n_pixels: int) -> None:
    """:func:`level_table`'s checks, cached: a table seen before with the same ``S`` and unchanged since (the same
    tensors, the same version counters, which every in-place write moves) costs one dictionary look-up; any other
    is read to the host (a synchronisation when it lives on the GPU) and checked. During CUDA graph capture a
    table not yet checked cannot be read and is left to the kernels, which never address a pixel outside value.

    Example:
        >>> check_level_table(shapes, starts, value.shape[1])   # reads and checks the table
        >>> check_level_table(shapes, starts, value.shape[1])   # a look-up
        >>> starts[1] += 1; check_level_table(shapes, starts, value.shape[1])   # changed in place: read again
    """
    if _cached(value_spatial_shapes, value_level_start_index, n_pixels) is not None:
        return
    if value_spatial_shapes.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    levels = level_table(value_spatial_shapes, value_level_start_index, n_pixels)
    versions = _versions(value_spatial_shapes, value_level_start_index)
    # The deterministic backward's corner cells, (H + 1) x (W + 1) per non-empty level, known here without a read.
    cells = sum((h + 1) * (w + 1) for h, w, _ in levels if h > 0 and w > 0)
    if len(_FITTING_TABLES) >= FITTING_TABLES_LIMIT:
        _FITTING_TABLES.clear()
    _FITTING_TABLES[id(value_spatial_shapes)] = (weakref.ref(value_spatial_shapes),
                                                 weakref.ref(value_level_start_index), n_pixels, versions, cells)


def _cached(shapes: torch.Tensor, starts: torch.Tensor, n_pixels: int) -> tuple | None:
    """The cache entry of a table that passed with this ``S`` and is unchanged since, else None."""
    seen = _FITTING_TABLES.get(id(shapes))
    if (seen is not None and seen[0]() is shapes and seen[1]() is starts and seen[2] == n_pixels
            and (seen[3] is None or seen[3] == (shapes._version, starts._version))):
        return seen
    return None


def checked_cell_count(shapes: torch.Tensor, starts: torch.Tensor, n_pixels: int) -> int | None:
    """``sum((H + 1) * (W + 1))`` over the non-empty levels of a table :func:`check_level_table` has cached and that
    is unchanged since (no read of the table), else None: the corner-cell count of the deterministic backward.

    Example:
        >>> check_level_table(shapes, starts, value.shape[1]); checked_cell_count(shapes, starts, value.shape[1])
    """
    seen = _cached(shapes, starts, n_pixels)
    return None if seen is None else seen[4]
