"""Fuzz ``lik.ms_deform_attn`` against a float64 brute force of bilinear sampling (``grid_sample`` with zeros
padding and ``align_corners=False``, written out corner by corner): sizes from 0, one-pixel and empty levels,
odd channel counts, level tables with gaps (garbage there is never read), locations off the maps and exactly on
pixel centres and edges, int32 / int64 tables, mixed dtypes, non-contiguous views, gradients of value, locations
and weights through the fast and the deterministic backward, on the kernels (interpreter) and the reference.
A level table that does not fit ``value`` is refused with ``ValueError`` on every path."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lik
from lik.ops.msda.function import _uses_kernels

from .common import LAYOUTS, PATHS, as_view, assert_matches, fuzz_settings, grads_of, run_on

CORNERS = ((0, 0), (1, 0), (0, 1), (1, 1))  # (dx, dy)


def brute_msda(value, levels, loc, weights):
    """float64 ``[N, Lq, M * D]`` from ``value [N, S, M, D]``, ``levels [(H, W, start)]``, ``loc [N, Lq, M, L, P,
    2]`` and ``weights [N, Lq, M, L, P]``: pixel = location * size - 0.5, each of the four corners weighted by
    its bilinear factor and read as zero outside its map. Differentiable in all three tensors."""
    n, _, m, d = value.shape
    lq = loc.shape[1]
    out = torch.zeros(n, lq, m, d, dtype=torch.float64)
    batch = torch.arange(n)[:, None, None, None]
    head = torch.arange(m)[None, None, :, None]
    for level, (h, w, start) in enumerate(levels):
        if h * w == 0:
            continue
        px = loc[:, :, :, level, :, 0] * w - 0.5  # [N, Lq, M, P]
        py = loc[:, :, :, level, :, 1] * h - 0.5
        x0, y0 = torch.floor(px.detach()), torch.floor(py.detach())
        fx, fy = px - x0, py - y0
        for dx, dy in CORNERS:
            xx, yy = x0 + dx, y0 + dy
            inside = (xx >= 0) & (xx < w) & (yy >= 0) & (yy < h)
            pixel = torch.where(inside, start + yy * w + xx, start).long()
            corner = (fx if dx else 1 - fx) * (fy if dy else 1 - fy)
            factor = torch.where(inside, corner * weights[:, :, :, level, :], 0)
            sampled = value[batch, pixel, head]  # [N, Lq, M, P, D]
            sampled = torch.where(inside[..., None], sampled, 0)
            out = out + (factor[..., None] * sampled).sum(3)
    return out.reshape(n, lq, m * d)


@dataclass(frozen=True)
class MsdaCase:
    n: int
    lq: int
    heads: int
    channels: int
    levels: tuple[tuple[int, int, int], ...]  # (H, W, gap before the level)
    tail: int  # rows of garbage after the last level
    points: int
    on_grid: bool  # locations on multiples of 1/16: pixel centres and edges exactly
    value_dtype: torch.dtype
    coord_dtype: torch.dtype
    index_dtype: torch.dtype
    layouts: tuple[str, str, str]
    deterministic: bool
    seed: int


@st.composite
def msda_cases(draw):
    size = st.one_of(st.integers(1, 4), st.just(0))
    return MsdaCase(
        n=draw(st.integers(0, 2)),
        lq=draw(st.integers(0, 4)),
        heads=draw(st.integers(1, 3)),
        channels=draw(st.sampled_from([1, 2, 3, 5, 8])),
        levels=tuple(draw(st.lists(st.tuples(size, size, st.integers(0, 2)), min_size=1, max_size=3))),
        tail=draw(st.integers(0, 2)),
        points=draw(st.integers(1, 3)),
        on_grid=draw(st.booleans()),
        value_dtype=draw(st.sampled_from([torch.float32, torch.float16])),
        coord_dtype=draw(st.sampled_from([torch.float32, torch.float16])),
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        layouts=tuple(draw(st.sampled_from(LAYOUTS)) for _ in range(3)),
        deterministic=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@contextlib.contextmanager
def _deterministic(enabled: bool):
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved)


def _level_table(case: MsdaCase):
    table, start = [], 0
    for h, w, gap in case.levels:
        start += gap
        table.append((h, w, start))
        start += h * w
    return table, start + case.tail


@pytest.mark.parametrize("path", PATHS)
@fuzz_settings(1.0)
@given(case=msda_cases())
def test_ms_deform_attn_matches_brute_force(path, case):
    gen = torch.Generator().manual_seed(case.seed)
    table, n_pixels = _level_table(case)
    n_levels = len(table)
    value = torch.randn(case.n, n_pixels, case.heads, case.channels, generator=gen, dtype=torch.float64)
    covered = torch.zeros(n_pixels, dtype=torch.bool)
    for h, w, start in table:
        covered[start:start + h * w] = True
    value[:, ~covered] = float("nan")  # gaps and tail: never read
    loc_shape = (case.n, case.lq, case.heads, n_levels, case.points, 2)
    if case.on_grid:
        loc = torch.randint(-4, 21, loc_shape, generator=gen).double() / 16
    else:
        loc = torch.rand(loc_shape, generator=gen, dtype=torch.float64) * 1.6 - 0.3
    weights = torch.rand(loc_shape[:-1], generator=gen, dtype=torch.float64)
    value = value.to(case.value_dtype)
    loc, weights = loc.to(case.coord_dtype), weights.to(case.coord_dtype)
    grad = torch.randn(case.n, case.lq, case.heads * case.channels, generator=gen)
    shapes = torch.tensor([(h, w) for h, w, _ in table], dtype=case.index_dtype).reshape(n_levels, 2)
    starts = torch.tensor([s for _, _, s in table], dtype=case.index_dtype)

    args = [as_view(t, layout, requires_grad=True) for t, layout in zip((value, loc, weights), case.layouts)]
    with run_on(path), _deterministic(case.deterministic):
        assert _uses_kernels(*args) == (path == "kernel")
        out = lik.ms_deform_attn(args[0], shapes, starts, args[1], args[2])
        grads = grads_of(out, args, grad)

    leaves = [t.double().requires_grad_() for t in (value, loc, weights)]
    expected = brute_msda(leaves[0], table, leaves[1], leaves[2])
    ref_grads = grads_of(expected, leaves, grad.double())
    low = case.value_dtype == torch.float16 or case.coord_dtype == torch.float16
    rtol = 2e-3 if low else 2e-5
    assert out.dtype == case.value_dtype
    assert_matches(out, expected, "out", exact=False, rtol=rtol)
    assert torch.all(grads[0][:, ~covered] == 0), "gradient reached value rows outside every level"
    for name, g, r, t in zip(("value", "locations", "weights"), grads, ref_grads, (value, loc, weights)):
        assert g.dtype == t.dtype
        # A location gradient is a difference of neighbouring pixels times the map size.
        scale = max((max(h, w) for h, w, _ in table), default=1) if name == "locations" else 1
        assert_matches(g, r, f"grad {name}", exact=False, rtol=rtol, scale=scale)


@dataclass(frozen=True)
class BadTableCase:
    sizes: tuple[tuple[int, int], ...]
    bad_level: int
    overshoot: int  # how far the bad level runs past S (at least 1)
    negative_start: bool
    index_dtype: torch.dtype


@st.composite
def bad_tables(draw):
    sizes = tuple(draw(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 4)), min_size=1, max_size=3)))
    return BadTableCase(
        sizes=sizes,
        bad_level=draw(st.integers(0, len(sizes) - 1)),
        overshoot=draw(st.integers(1, 6)),
        negative_start=draw(st.booleans()),
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
    )


@pytest.mark.parametrize("path", PATHS)
@fuzz_settings(1.0)
@given(case=bad_tables())
def test_level_table_past_value_is_refused(path, case):
    """A level that starts before 0 or runs past ``S`` is refused before any kernel reads ``value``."""
    sizes = [h * w for h, w in case.sizes]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    n_pixels = sum(sizes)
    if case.negative_start:
        starts[case.bad_level] = -case.overshoot
    else:
        starts[case.bad_level] = n_pixels - sizes[case.bad_level] + case.overshoot
    value = torch.randn(1, n_pixels, 2, 3)
    loc = torch.rand(1, 2, 2, len(sizes), 2, 2)
    weights = torch.rand(1, 2, 2, len(sizes), 2)
    shapes = torch.tensor(case.sizes, dtype=case.index_dtype)
    with run_on(path), pytest.raises(ValueError, match="value_level_start_index|value_spatial_shapes"):
        lik.ms_deform_attn(value, shapes, torch.tensor(starts, dtype=case.index_dtype), loc, weights)
