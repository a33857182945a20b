"""Shared helpers for the deformable-attention tests: random problems, the float64 reference with gradients,
an independent loop-based specification, and error measures."""

from __future__ import annotations

import math

import torch

from lik.ops.msda import ms_deform_attn_reference


def level_tensors(hw, dtype=torch.int64, device="cpu"):
    shapes = torch.tensor(hw, dtype=dtype, device=device).reshape(-1, 2)
    sizes = shapes[:, 0] * shapes[:, 1]
    starts = (torch.cumsum(sizes, 0) - sizes).to(dtype)
    return shapes, starts, int(sizes.sum())


def rand_problem(rng, n, n_queries, heads, dim, hw, points, *, spread=1.3, dtype=torch.float32, device="cpu",
                 index_dtype=torch.int64):
    """Random inputs; locations drawn in [0.5 - spread/2, 0.5 + spread/2] so some fall off the maps."""
    shapes, starts, n_pixels = level_tensors(hw, index_dtype)
    levels = shapes.shape[0]
    value = torch.randn(n, n_pixels, heads, dim, generator=rng)
    loc = (torch.rand(n, n_queries, heads, levels, points, 2, generator=rng) - 0.5) * spread + 0.5
    weights = torch.rand(n, n_queries, heads, levels, points, generator=rng) + 0.1
    grad = torch.randn(n, n_queries, heads * dim, generator=rng)
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return (cast(value), shapes.to(device), starts.to(device), cast(loc), cast(weights), cast(grad))


def with_grads(fn, value, shapes, starts, loc, weights, grad, *, dtype=None, **kwargs):
    """Output and gradients of ``sum(out * grad)`` w.r.t. value, locations and weights (optionally upcast)."""
    leaves = [t.detach().clone() for t in (value, loc, weights)]
    if dtype is not None:
        leaves = [t.to(dtype) for t in leaves]
    leaves = [t.requires_grad_() for t in leaves]
    out = fn(leaves[0], shapes, starts, leaves[1], leaves[2], **kwargs)
    grads = torch.autograd.grad(out, leaves, grad.to(out.dtype))
    return (out.detach(), *grads)


def reference64(value, shapes, starts, loc, weights, grad):
    return with_grads(ms_deform_attn_reference, value, shapes, starts, loc, weights, grad, dtype=torch.float64)


def loop_spec(value, shapes, starts, loc, weights):
    """The definition written out point by point in float64 (independent of grid_sample), for tiny inputs."""
    n, _, heads, dim = value.shape
    _, n_queries, _, levels, points, _ = loc.shape
    out = torch.zeros(n, n_queries, heads, dim, dtype=torch.float64)
    v = value.double()
    for b in range(n):
        for q in range(n_queries):
            for m in range(heads):
                for lv in range(levels):
                    h, w = (int(s) for s in shapes[lv])
                    start = int(starts[lv])
                    for p in range(points):
                        px = float(loc[b, q, m, lv, p, 0]) * w - 0.5
                        py = float(loc[b, q, m, lv, p, 1]) * h - 0.5
                        x0, y0 = math.floor(px), math.floor(py)
                        for yy, xx, c in ((y0, x0, (x0 + 1 - px) * (y0 + 1 - py)),
                                          (y0, x0 + 1, (px - x0) * (y0 + 1 - py)),
                                          (y0 + 1, x0, (x0 + 1 - px) * (py - y0)),
                                          (y0 + 1, x0 + 1, (px - x0) * (py - y0))):
                            if 0 <= xx < w and 0 <= yy < h:
                                out[b, q, m] += float(weights[b, q, m, lv, p]) * c * v[b, start + yy * w + xx, m]
    return out.reshape(n, n_queries, heads * dim)


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    denom = ref.norm()
    if denom == 0:
        return (x - ref).norm().item()
    return ((x - ref).norm() / denom).item()


def assert_matches(got, ref, tol, what=""):
    """Relative Frobenius error under ``tol`` and no element off by more than ``tol`` times the largest one."""
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err = rel_err(got, ref)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.1e}"
    scale = ref.double().abs().max().item() if ref.numel() else 0.0
    worst = (got.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    assert worst <= tol * max(scale, 1e-30) * 10, f"{what}: worst element off by {worst:.2e} (scale {scale:.2e})"
