"""Multi-scale deformable attention cases: lik against the PyTorch path of Deformable DETR / transformers and, where
it has been built, the original Deformable-DETR CUDA op.

Problems (M = 8 heads, D = 32 channels, L = 4 levels, P = 4 points, "realistic" sampling: reference points plus
Deformable DETR's initial offset pattern plus noise): the decoder (N = 4 images at 800x1333: levels 100x167 ..
13x21, 300 and 900 queries) and the encoder (N = 2 at 1536x2048: levels 192x256 .. 24x32, Lq = S = 65 280), fp32, and
the encoder in bf16. ``fwd`` times a training forward (inputs that require grad, through the autograd Function),
``bwd`` an ``autograd.grad`` of that output on a retained graph. The floor is the minimal bytes (each input read
once, each output written once) at the run's copy bandwidth. The check compares with the float64 reference.

The original op is built from a Deformable-DETR checkout that ``LIK_ORIGINAL_MSDA_SRC`` points at (its
``models/ops`` sources, patched for current PyTorch: ``.type().is_cuda()`` -> ``.is_cuda()``,
``AT_DISPATCH_FLOATING_TYPES(value.type(), ...)`` -> ``value.scalar_type()``, ``.data<T>()`` ->
``.data_ptr<T>()``), with nvcc, once per process (~1 min); unset, its column is skipped.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys

import torch
import torch.nn.functional as F

from .cases import Case, CaseMethod, floor_record

__all__ = ["msda_cases", "make_problem", "detr_core", "load_original_op", "OriginalModule", "ENCODER", "DECODER",
           "DECODER_900"]

ENCODER = dict(name="encoder", n=2, hw=[(192, 256), (96, 128), (48, 64), (24, 32)], queries=None)
DECODER = dict(name="decoder", n=4, hw=[(100, 167), (50, 84), (25, 42), (13, 21)], queries=300)
DECODER_900 = dict(DECODER, name="decoder-900", queries=900)
SMOKE = dict(name="smoke", n=1, hw=[(6, 8), (3, 4)], queries=5)
HEADS, DIM, POINTS = 8, 32, 4
ORIGINAL_SRC = "LIK_ORIGINAL_MSDA_SRC"


def detr_core(value, shapes_list, loc, weights):
    """The Deformable-DETR / transformers PyTorch formulation: grid_sample per level, stack, weight, sum."""
    n, _, heads, dim = value.shape
    _, lq, _, levels, points, _ = loc.shape
    per_level = value.split([h * w for h, w in shapes_list], dim=1)
    grids = 2 * loc - 1
    sampled = []
    for level, (h, w) in enumerate(shapes_list):
        v = per_level[level].flatten(2).transpose(1, 2).reshape(n * heads, dim, h, w)
        g = grids[:, :, :, level].transpose(1, 2).flatten(0, 1)
        sampled.append(F.grid_sample(v, g, mode="bilinear", padding_mode="zeros", align_corners=False))
    w = weights.transpose(1, 2).reshape(n * heads, 1, lq, levels * points)
    out = (torch.stack(sampled, dim=-2).flatten(-2) * w).sum(-1).view(n, heads * dim, lq)
    return out.transpose(1, 2).contiguous()


def make_problem(scale: dict, sampling: str, dtype: torch.dtype, seed: int = 0, device="cuda",
                 heads: int = HEADS, dim: int = DIM, points: int = POINTS) -> dict:
    """``value``, ``shapes``, ``starts``, ``loc``, ``weights``, ``grad`` (an output gradient) and ``hw`` of one
    problem; ``sampling`` is ``"realistic"`` or ``"uniform"``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hw = scale["hw"]
    shapes = torch.tensor(hw, dtype=torch.int64, device=device)
    sizes = shapes[:, 0] * shapes[:, 1]
    starts = torch.cumsum(sizes, 0) - sizes
    n_pixels, n, levels = int(sizes.sum()), scale["n"], len(hw)
    lq = scale["queries"] or n_pixels
    value = torch.randn(n, n_pixels, heads, dim, device=device, generator=gen)
    logits = torch.randn(n, lq, heads, levels * points, device=device, generator=gen)
    weights = logits.softmax(-1).view(n, lq, heads, levels, points)
    norm = torch.tensor([[w, h] for h, w in hw], dtype=torch.float32, device=device)  # (W, H) per level
    if sampling == "uniform":
        loc = torch.rand(n, lq, heads, levels, points, 2, device=device, generator=gen)
    else:
        if scale["queries"] is None:  # encoder: every pixel of every level is a query at its own centre
            refs = []
            for h, w in hw:
                ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
                refs.append(torch.stack([(xs.flatten() + 0.5) / w, (ys.flatten() + 0.5) / h], -1))
            ref = torch.cat(refs).expand(n, lq, 2)
        else:  # decoder: learned reference points spread over the image
            ref = torch.rand(n, lq, 2, device=device, generator=gen)
        # Deformable DETR's sampling_offsets bias: head m looks along angle 2*pi*m/M, point p at (p+1) pixels.
        theta = torch.arange(heads, device=device, dtype=torch.float32) * (2 * math.pi / heads)
        direction = torch.stack([theta.cos(), theta.sin()], -1)
        direction = direction / direction.abs().max(-1, keepdim=True).values
        steps = torch.arange(1, points + 1, device=device, dtype=torch.float32)
        offsets = direction[:, None, None, :] * steps[None, None, :, None]  # [M, 1, P, 2] pixels
        noise = torch.randn(n, lq, heads, levels, points, 2, device=device, generator=gen)
        loc = ref[:, :, None, None, None, :] + (offsets + noise) / norm[None, None, None, :, None, :]
    grad = torch.randn(n, lq, heads * dim, device=device, generator=gen)

    def cast(t):
        return t.to(dtype).contiguous()

    return dict(value=cast(value), shapes=shapes, starts=starts, loc=cast(loc), weights=cast(weights),
                grad=cast(grad), hw=hw)


def load_original_op(src_dir: str, build_dir: str | None = None, verbose: bool = False):
    """Compile the original op's extension for the current GPU and return its ``MSDeformAttnFunction`` (the
    repository's own Python class, ``models/ops/functions/ms_deform_attn_func.py``, so its Python side is timed too).
    Built once per process."""
    if "original_ms_deform_attn_func" in sys.modules:
        return sys.modules["original_ms_deform_attn_func"].MSDeformAttnFunction
    from torch.utils.cpp_extension import load

    ops = os.path.join(src_dir, "models", "ops")
    src = os.path.join(ops, "src")
    major, minor = torch.cuda.get_device_capability()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    build_dir = build_dir or os.path.join("/tmp", "original_msda_build")
    os.makedirs(build_dir, exist_ok=True)
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
    sys.modules["MultiScaleDeformableAttention"] = extension
    path = os.path.join(ops, "functions", "ms_deform_attn_func.py")
    spec = importlib.util.spec_from_file_location("original_ms_deform_attn_func", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["original_ms_deform_attn_func"] = module
    return module.MSDeformAttnFunction


class OriginalModule(torch.nn.Module):
    """HF transformers' ``MultiScaleDeformableAttention`` signature over the original op (what transformers 4.x did
    with its bundled copy of the same CUDA source)."""

    function = None  # set to load_original_op(...)'s result before building a model

    def forward(self, value, value_spatial_shapes, value_spatial_shapes_list, level_start_index, sampling_locations,
                attention_weights, im2col_step=64):
        return type(self).function.apply(value, value_spatial_shapes, level_start_index, sampling_locations,
                                         attention_weights, im2col_step)


def _inputs(scale: dict, dtype: torch.dtype):
    def inputs(device: torch.device, smoke: bool) -> dict:
        if smoke:
            p = make_problem(SMOKE, "realistic", torch.float32, device=device, heads=2, dim=4, points=2)
        else:
            p = make_problem(scale, "realistic", dtype, device=device)
        p["leaves"] = [p[k].detach().clone().requires_grad_() for k in ("value", "loc", "weights")]
        return p

    return inputs


def _lik(p, v, loc, w):
    import lik

    return lik.ms_deform_attn(v, p["shapes"], p["starts"], loc, w)


def _pytorch(p, v, loc, w):
    return detr_core(v, p["hw"], loc, w)


def _original(p, v, loc, w):
    return load_original_op(os.environ[ORIGINAL_SRC]).apply(v, p["shapes"], p["starts"], loc, w, 64)


def _forward(fn):
    def build(p):
        return lambda: fn(p, *p["leaves"])

    return build


def _backward(fn):
    def build(p):
        out = fn(p, *p["leaves"])
        return lambda: torch.autograd.grad(out, p["leaves"], p["grad"], retain_graph=True)

    return build


def _reference(backward: bool):
    def reference(p):
        import lik

        x = [t.detach().double().requires_grad_(backward) for t in p["leaves"]]
        out = lik.ms_deform_attn_reference(x[0], p["shapes"], p["starts"], x[1], x[2])
        if not backward:
            return out.detach()
        return tuple(torch.autograd.grad(out, x, p["grad"].double()))

    return reference


def _floor(backward: bool):
    def floor(p, ceilings):
        def size(t):
            return t.numel() * t.element_size()

        inputs = size(p["value"]) + size(p["loc"]) + size(p["weights"])
        nbytes = (2 * inputs + size(p["grad"])) if backward else (inputs + size(p["grad"]))
        return floor_record(0.0, nbytes, ceilings)

    return floor


def msda_cases() -> list[Case]:
    """The deformable-attention cases, in table order."""
    cases = []
    problems = ((DECODER, torch.float32, "fp32", 1e-4), (DECODER_900, torch.float32, "fp32", 1e-4),
                (ENCODER, torch.float32, "fp32", 1e-4), (ENCODER, torch.bfloat16, "bf16", 2e-2))
    for scale, dtype, tag, tolerance in problems:
        for phase in ("fwd", "bwd"):
            wrap = _backward if phase == "bwd" else _forward
            methods = {"lik": CaseMethod(wrap(_lik))}
            if dtype == torch.float32:  # the original op has float and double kernels only
                methods["cuda-op"] = CaseMethod(wrap(_original), needs_cuda=True, env=ORIGINAL_SRC)
            methods["pytorch"] = CaseMethod(wrap(_pytorch))
            # The encoder's fp32 location gradient is 1.3e-3 from float64 by fp32 coordinates (benchmarks/NOTES.md),
            # as for grid_sample itself.
            tol = 5e-3 if phase == "bwd" and scale is ENCODER and dtype == torch.float32 else tolerance
            pixels = sum(h * w for h, w in scale["hw"])
            queries = f"{scale['queries']} queries" if scale["queries"] else f"Lq = S = {pixels:,}".replace(",", " ")
            name = scale["name"].split("-")[0]
            label = f"{name} {tag} {'backward' if phase == 'bwd' else 'forward'} (N {scale['n']}, {queries})"
            cases.append(Case(
                "msda", f"msda/{scale['name']}-{tag}-{phase}", label, _inputs(scale, dtype), methods,
                floor=_floor(phase == "bwd"),
                reference=_reference(phase == "bwd"), tolerance=tol,
                params={"scale": scale["name"], "dtype": tag, "phase": phase},
            ))
    return cases
