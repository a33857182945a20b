"""benchmarks/msda_ceiling.py: its traffic kernel moves exactly the corners it claims to (the encoder-scale
ceiling in benchmarks/NOTES.md rests on it)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "msda_ceiling.py"


def load_script():
    spec = importlib.util.spec_from_file_location("msda_ceiling", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def small_problem(rng):
    shapes = torch.tensor([[6, 8], [3, 5], [2, 2]])
    sizes = shapes.prod(1)
    starts = sizes.cumsum(0) - sizes
    n, heads, dim, points, queries = 2, 3, 32, 4, 5
    value = torch.randn(n, int(sizes.sum()), heads, dim, generator=rng)
    # Locations inside, on the border and outside the maps (clamped onto them by corner_offsets), and one NaN.
    loc = torch.rand(n, queries, heads, len(shapes), points, 2, generator=rng) * 1.6 - 0.3
    loc[0, 0, 0, 0, 0] = float("nan")
    return dict(value=value, loc=loc, shapes=shapes, starts=starts)


@pytest.fixture
def traffic(rng):
    """(the script as a module, a small problem, its corner offsets and per-level row steps)."""
    ceiling = load_script()
    p = small_problem(rng)
    return (ceiling, p, *ceiling.corner_offsets(p))


def test_corner_offsets_stay_on_the_map(traffic):
    _, p, offsets, down = traffic
    value = p["value"]
    n, _, heads, _ = value.shape
    assert offsets.shape == (n, heads, p["loc"].shape[1], *p["loc"].shape[3:5])
    level_of = torch.arange(len(p["shapes"])).view(1, 1, 1, -1, 1).expand_as(offsets)
    pixel = (offsets.long() % value.stride(0)) // value.stride(1)
    start = p["starts"][level_of]
    width = p["shapes"][level_of, 1]
    height = p["shapes"][level_of, 0]
    x, y = (pixel - start) % width, (pixel - start) // width
    assert bool(((x >= 0) & (x + 1 < width) & (y >= 0) & (y + 1 < height)).all())
    assert torch.equal(down.long(), p["shapes"][:, 1] * value.stride(1))


def test_traffic_kernel_gathers_and_scatters_the_four_corners(traffic):
    ceiling, p, offsets, down = traffic
    value = p["value"]
    n, _, heads, dim = value.shape
    n_levels, n_points = offsets.shape[3:5]
    n_rows = n * heads * offsets.shape[2]
    block_rows = 4  # 30 rows: the last program is partly out of range
    out = torch.empty(n_rows, dim)
    grad = torch.zeros_like(value)
    ceiling.corner_traffic_kernel[(-(-n_rows // block_rows),)](
        value, grad, offsets, down, out, n_rows, n_levels, 0, n_levels, value.stride(1),
        BLOCK_R=block_rows, P=n_points, D=dim, GATHER=True, SCATTER=True)

    corners = offsets.view(n_rows, n_levels, n_points, 1).long() + torch.tensor(
        [0, value.stride(1)]).view(1, 1, 1, 2).repeat(1, 1, 1, 2)
    corners = corners + torch.tensor([0, 0, 1, 1]).view(1, 1, 1, 4) * down.long().view(1, -1, 1, 1)
    elements = corners[..., None] + torch.arange(dim)
    expected = value.flatten()[elements].sum((1, 2, 3))
    torch.testing.assert_close(out, expected)
    hits = torch.bincount(elements.flatten(), minlength=value.numel()).view(value.shape).float()
    assert torch.equal(grad, hits)
