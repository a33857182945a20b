"""lik inside Hugging Face transformers: the ``MultiScaleDeformableAttention`` module and a one-line switch.

:class:`MultiScaleDeformableAttention` is a stateless ``nn.Module`` with the forward signature of the module of
that name in transformers' Deformable DETR family, backed by :func:`lik.ms_deform_attn`. It needs no import of
transformers (``lik.MultiScaleDeformableAttention`` is this class).

:func:`enable` switches the ``forward`` of transformers' own ``MultiScaleDeformableAttention`` in every modeling
module that defines one (Deformable DETR, Grounding DINO, MM Grounding DINO, RT-DETR, OmDet-Turbo, LW-DETR, RF-DETR,
PP-DocLayout...) and the ``multi_scale_deformable_attention_v2`` function of RT-DETRv2, D-FINE and DEIMv2 (a number
of points per level, bilinear or discrete sampling) to lik, so every such model, whenever built or loaded, runs lik
while the switch is on;
:func:`disable` returns them all to transformers' code. :func:`patch_model` swaps lik's module into one model for
good, switch or not.

Example:
    >>> import lik.integrations.transformers as lik_transformers
    >>> lik_transformers.enable()
    >>> model = DeformableDetrForObjectDetection.from_pretrained(...)   # its layers run lik.ms_deform_attn
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from ..ops.msda import ms_deform_attn, ms_deform_attn_v2
from . import _patching

__all__ = ["MultiScaleDeformableAttention", "enable", "disable", "enabled", "is_enabled", "patch_model"]


class MultiScaleDeformableAttention(nn.Module):
    """Stateless module with the forward signature of HF transformers' ``MultiScaleDeformableAttention``
    (Deformable DETR, Grounding DINO, Mask2Former-style pixel decoders, RT-DETR...), backed by
    :func:`lik.ms_deform_attn`.

    Shapes: ``value [N, S, M, D]``, ``value_spatial_shapes [L, 2]`` (H, W), ``value_spatial_shapes_list`` the same
    as Python ints, ``level_start_index [L]``, ``sampling_locations [N, Lq, M, L, P, 2]``, ``attention_weights
    [N, Lq, M, L, P]`` -> ``[N, Lq, M * D]`` in ``value``'s dtype.

    Example (swap it into a loaded transformers model):
        >>> for module in model.modules():
        ...     if hasattr(module, "attn") and type(module.attn).__name__ == "MultiScaleDeformableAttention":
        ...         module.attn = lik.MultiScaleDeformableAttention()

    It is also the layer Hugging Face's ``kernels`` maps transformers' layers to (``kernels.kernelize`` swaps this
    ``forward`` in; :mod:`lik.integrations.hf_kernels`): stateless, and flagged for ``kernels`` as trainable and
    ``torch.compile``-able.
    """

    # Read by the kernels package's kernelize: a backward exists, and torch.compile traces the op in one graph.
    has_backward = True
    can_torch_compile = True

    def forward(
        self,
        value: torch.Tensor,
        value_spatial_shapes: torch.Tensor,
        value_spatial_shapes_list: list[tuple[int, int]],
        level_start_index: torch.Tensor,
        sampling_locations: torch.Tensor,
        attention_weights: torch.Tensor,
        im2col_step: int = 64,
    ) -> torch.Tensor:
        # value_spatial_shapes_list is the host copy transformers keeps to avoid a sync; the kernels read the
        # device tensor, so it is only checked for agreement in length.
        if len(value_spatial_shapes_list) != value_spatial_shapes.shape[0]:
            raise ValueError(
                f"value_spatial_shapes_list has {len(value_spatial_shapes_list)} levels but value_spatial_shapes "
                f"has {value_spatial_shapes.shape[0]}"
            )
        return ms_deform_attn(value, value_spatial_shapes, level_start_index, sampling_locations,
                              attention_weights, im2col_step)


def _lik_forward(module: nn.Module, value, value_spatial_shapes, value_spatial_shapes_list, level_start_index,
                 sampling_locations, attention_weights, im2col_step: int = 64) -> torch.Tensor:
    """A transformers ``MultiScaleDeformableAttention.forward`` while the switch is on (the modules are
    stateless, so ``module`` itself is not read)."""
    return MultiScaleDeformableAttention.forward(module, value, value_spatial_shapes, value_spatial_shapes_list,
                                                 level_start_index, sampling_locations, attention_weights,
                                                 im2col_step)


# transformers modeling modules (5.x) defining a class named MultiScaleDeformableAttention that their attention
# layers instantiate; a module missing from (or failing to import in) the installed version is skipped.
_MODELING_MODULES = (
    "deformable_detr", "grounding_dino", "mm_grounding_dino", "rt_detr", "omdet_turbo", "lw_detr", "rf_detr",
    "pp_doclayout_v2", "pp_doclayout_v3", "pp_doclayout_v4",
)

# Modeling modules defining multi_scale_deformable_attention_v2(value, value_spatial_shapes, sampling_locations,
# attention_weights, num_points_list, method), which their attention layers call (D-FINE and DEIMv2 keep it as an
# instance attribute: routing the function object itself reaches those too).
_V2_MODULES = ("rt_detr_v2", "d_fine", "deimv2")

_SWITCH = _patching.Switch(__name__, "transformers", "transformers")

# ((H, W), ...), device -> (shapes, starts) tensors: transformers passes the levels as Python ints, and a fresh
# tensor per call would cost a host-to-device copy and a new check of the table each time.
_LEVEL_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _level_tensors(value_spatial_shapes, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(value_spatial_shapes, value_level_start_index)`` tensors on ``device`` for levels given as ``(H, W)``
    pairs of ints or as an int ``[L, 2]`` tensor (its starts are then computed on its device)."""
    if isinstance(value_spatial_shapes, torch.Tensor):
        shapes = value_spatial_shapes.to(device)
        sizes = shapes[:, 0] * shapes[:, 1]
        return shapes, torch.cumsum(sizes, 0) - sizes
    levels = tuple((int(height), int(width)) for height, width in value_spatial_shapes)
    key = (levels, device)
    found = _LEVEL_TABLES.get(key)
    if found is None:
        sizes = [height * width for height, width in levels]
        starts = [sum(sizes[:level]) for level in range(len(levels))]
        found = (torch.tensor(levels, dtype=torch.int64).reshape(-1, 2).to(device),
                 torch.tensor(starts, dtype=torch.int64).to(device))
        if len(_LEVEL_TABLES) >= 64:
            _LEVEL_TABLES.clear()
        _LEVEL_TABLES[key] = found
    return found


def _lik_v2(value, value_spatial_shapes, sampling_locations, attention_weights, num_points_list,
            method="default") -> torch.Tensor:
    """transformers' ``multi_scale_deformable_attention_v2`` while the switch is on: the levels (H, W) become
    cached tensors and :func:`lik.ms_deform_attn_v2` runs (``value [N, S, M, D]``, ``sampling_locations
    [N, Lq, M, sum(num_points_list), 2]``, ``attention_weights [N, Lq, M, sum(num_points_list)]`` ->
    ``[N, Lq, M * D]``)."""
    shapes, starts = _level_tensors(value_spatial_shapes, value.device)
    return ms_deform_attn_v2(value, shapes, starts, sampling_locations, attention_weights, list(num_points_list),
                             method)


def _stock_classes() -> list[type]:
    """transformers' ``MultiScaleDeformableAttention`` classes of the modeling modules that import here."""
    classes = []
    for short in _MODELING_MODULES:
        try:
            module = importlib.import_module(f"transformers.models.{short}.modeling_{short}")
        except ImportError:
            continue
        stock = getattr(module, "MultiScaleDeformableAttention", None)
        if isinstance(stock, type) and not issubclass(stock, MultiScaleDeformableAttention) and stock not in classes:
            classes.append(stock)
    return classes


def _stock_v2_functions() -> list:
    """transformers' ``multi_scale_deformable_attention_v2`` functions of the modeling modules that import here."""
    functions = []
    for short in _V2_MODULES:
        try:
            module = importlib.import_module(f"transformers.models.{short}.modeling_{short}")
        except ImportError:
            continue
        stock = getattr(module, "multi_scale_deformable_attention_v2", None)
        if callable(stock) and stock not in functions:
            functions.append(stock)
    return functions


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect."""
    return _SWITCH.on


@_SWITCH.enabler
def enable() -> None:
    """Make transformers' deformable attention run :func:`lik.ms_deform_attn`, until :func:`disable`.

    Changes: the ``forward`` of the ``MultiScaleDeformableAttention`` class of each modeling module in
    ``_MODELING_MODULES`` that imports runs lik's, and so does the ``multi_scale_deformable_attention_v2`` function
    of each module in ``_V2_MODULES`` (RT-DETRv2, D-FINE, DEIMv2: :func:`lik.ms_deform_attn_v2`, both methods).
    No class or name is replaced: every model of those families, built before or after the switch or loaded from
    a pickle, runs lik while it is on and transformers' own code after :func:`disable`; a model pickled meanwhile
    holds transformers' classes only. Idempotent; all or nothing.

    Raises:
        ImportError: transformers is not installed; the message gives the pip command.
    """
    _SWITCH.import_host("transformers")
    for stock in _stock_classes():
        _SWITCH.route(stock.forward, _lik_forward)
    for stock in _stock_v2_functions():
        _SWITCH.route(stock, _lik_v2)


def disable() -> None:
    """Undo :func:`enable`: transformers' deformable attention runs its own code again, in every model."""
    _SWITCH.restore()


def enabled():
    """Context manager: transformers' deformable attention runs lik inside the block only."""
    return _SWITCH.scoped(enable)


def patch_model(model: nn.Module) -> int:
    """Replace, in an already-built model, every submodule whose class is named ``MultiScaleDeformableAttention``
    by lik's (they are stateless, so nothing is lost). Returns how many were replaced. Unlike :func:`enable`, this
    is for good: the model then holds lik's class, whatever the switch, and a pickle of it needs lik to load.

    Example:
        >>> lik.integrations.transformers.patch_model(model)
        6
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ == "MultiScaleDeformableAttention" and not isinstance(
                    child, MultiScaleDeformableAttention):
                setattr(parent, name, MultiScaleDeformableAttention())
                replaced += 1
    return replaced
