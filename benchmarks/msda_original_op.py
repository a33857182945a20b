"""Build and load the original Deformable-DETR CUDA op (``models/ops`` of fundamentalvision/Deformable-DETR) for
same-process comparisons. Its source is not part of lik: fetch it, patch it for current PyTorch (``x.type().is_cuda()``
-> ``x.is_cuda()``, ``AT_DISPATCH_FLOATING_TYPES(value.type(), ...)`` -> ``value.scalar_type()``,
``x.data<T>()`` -> ``x.data_ptr<T>()``) and point ``--original-src`` (or ``LIK_ORIGINAL_MSDA_SRC``) at the checkout.

    from msda_original_op import load_original_op
    MSDeformAttnFunction = load_original_op("/path/to/Deformable-DETR")   # builds with nvcc for this GPU (~1 min)

The returned class is the repository's own ``MSDeformAttnFunction`` (``models/ops/functions/ms_deform_attn_func.py``),
importing the freshly built ``MultiScaleDeformableAttention`` extension, so its Python side is timed too.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

import torch

__all__ = ["load_original_op", "OriginalModule"]


def load_original_op(src_dir: str, build_dir: str | None = None, verbose: bool = False):
    """Compile the extension for the current GPU's architecture and return the original ``MSDeformAttnFunction``."""
    from torch.utils.cpp_extension import load

    ops = os.path.join(src_dir, "models", "ops")
    src = os.path.join(ops, "src")
    major, minor = torch.cuda.get_device_capability()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    build_dir = build_dir or os.path.join("/tmp", "original_msda_build")
    os.makedirs(build_dir, exist_ok=True)
    started = time.perf_counter()
    extension = load(
        name="MultiScaleDeformableAttention",
        sources=[os.path.join(src, "vision.cpp"), os.path.join(src, "cpu", "ms_deform_attn_cpu.cpp"),
                 os.path.join(src, "cuda", "ms_deform_attn_cuda.cu")],
        extra_include_paths=[src],
        extra_cflags=["-O3", "-DWITH_CUDA"],
        extra_cuda_cflags=["-O3", "-DWITH_CUDA", "-DCUDA_HAS_FP16=1", "-D__CUDA_NO_HALF_OPERATORS__",
                           "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__"],
        build_directory=build_dir,
        verbose=verbose,
    )
    print(f"original op built in {time.perf_counter() - started:.0f} s", flush=True)
    sys.modules["MultiScaleDeformableAttention"] = extension
    path = os.path.join(ops, "functions", "ms_deform_attn_func.py")
    spec = importlib.util.spec_from_file_location("original_ms_deform_attn_func", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MSDeformAttnFunction


class OriginalModule(torch.nn.Module):
    """HF transformers' ``MultiScaleDeformableAttention`` signature over the original op (what transformers 4.x did
    with its bundled copy of the same CUDA source)."""

    function = None  # set to load_original_op(...)'s result before building a model

    def forward(self, value, value_spatial_shapes, value_spatial_shapes_list, level_start_index, sampling_locations,
                attention_weights, im2col_step=64):
        return type(self).function.apply(value, value_spatial_shapes, level_start_index, sampling_locations,
                                         attention_weights, im2col_step)
