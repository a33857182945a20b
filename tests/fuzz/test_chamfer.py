"""Fuzz ``lik.nearest_neighbors`` and ``lik.chamfer_distance`` against a float64 brute force of the distance matrix:
clouds of 0 and 1 points, ragged lengths (int64 / int32) with garbage in the padding, integer grids full of exact
ties and duplicated points, point clouds and feature sets (both kernel routes), both norms, every reduction,
weights and normals, non-contiguous views, NaN points, gradients through both backwards, on the kernels
(interpreter) and the reference.

Where the contract lets a kernel route pick among near-equal candidates (docs: candidates within about 2**-17
relative on the direct route, about 1e-7 * |x - c|^2 on the feature-set route), the winner is checked to be one
of them and the first of its duplicates; elsewhere it must be the brute force's lowest-index winner."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

import lik
from lik._dispatch import uses_kernels
from lik.ops.chamfer.kernel import uses_direct_route

from .common import LAYOUTS, PATHS, as_view, assert_matches, fuzz_settings, grads_of, run_on

POINT_KINDS = ["grid", "gaussian"]


@dataclass(frozen=True)
class CloudCase:
    n: int
    p1: int
    p2: int
    dim: int
    kind: str
    dtype: torch.dtype
    lengths: str | None  # None, or the integer dtype of x_lengths / y_lengths
    norm: int
    garbage: bool  # NaN / inf in padded points
    valid_nan: bool  # a NaN coordinate in one real point
    layouts: tuple[str, str]
    backward: str
    seed: int


@st.composite
def cloud_cases(draw, allow_nan=True):
    return CloudCase(
        n=draw(st.integers(0, 3)),
        p1=draw(st.integers(0, 7)),
        p2=draw(st.integers(0, 7)),
        dim=draw(st.sampled_from([1, 2, 3, 5, 8, 9, 12])),
        kind=draw(st.sampled_from(POINT_KINDS)),
        dtype=draw(st.sampled_from([torch.float32, torch.float16])),
        lengths=draw(st.sampled_from([None, "int64", "int32"])),
        norm=draw(st.sampled_from([1, 2])),
        garbage=draw(st.booleans()),
        valid_nan=allow_nan and draw(st.booleans()),
        layouts=tuple(draw(st.sampled_from(LAYOUTS)) for _ in range(2)),
        backward=draw(st.sampled_from(["fast", "deterministic"])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _clouds(case: CloudCase, gen: torch.Generator):
    def points(shape):
        if case.kind == "grid":
            return torch.randint(-2, 3, shape, generator=gen).double()
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    x, y = points((case.n, case.p1, case.dim)), points((case.n, case.p2, case.dim))
    if case.p2 > 1:  # duplicated points of y: exact ties whatever the data
        y[:, -1] = y[:, 0]
    xl = torch.randint(0, case.p1 + 1, (case.n,), generator=gen) if case.lengths else torch.full((case.n,), case.p1)
    yl = torch.randint(0, case.p2 + 1, (case.n,), generator=gen) if case.lengths else torch.full((case.n,), case.p2)
    x_valid = torch.arange(case.p1)[None] < xl[:, None]
    y_valid = torch.arange(case.p2)[None] < yl[:, None]
    if case.garbage:
        garbage = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30], dtype=torch.float64)
        for t, valid in ((x, x_valid), (y, y_valid)):
            fill = garbage[torch.randint(0, 4, t.shape, generator=gen)]
            t.copy_(torch.where(valid[..., None], t, fill))
    if case.valid_nan:
        for t, valid in ((x, x_valid), (y, y_valid)):
            real = valid.nonzero()
            if len(real) and case.dim and bool(torch.rand((), generator=gen) < 0.5):
                n, i = real[int(torch.randint(0, len(real), (), generator=gen))].tolist()
                t[n, i, int(torch.randint(0, case.dim, (), generator=gen))] = float("nan")
    return x.to(case.dtype), y.to(case.dtype), xl, yl, x_valid, y_valid


def _distances(a: torch.Tensor, b: torch.Tensor, norm: int) -> torch.Tensor:
    """float64 ``[Pa, Pb]`` distances from the coordinate differences."""
    diff = a[:, None, :] - b[None, :, :]
    return (diff * diff).sum(-1) if norm == 2 else diff.abs().sum(-1)


def brute_nearest(x, y, xl, yl, norm):
    """``(dist [N, P1], idx [N, P1], dmin, matrices)``: the lowest-index nearest valid ``y`` point of each valid
    ``x`` point (a NaN distance wins: the first), -1 and 0 for padded points and empty ``y`` clouds."""
    n, p1 = x.shape[:2]
    idx = torch.full((n, p1), -1, dtype=torch.int64)
    matrices = []
    for c in range(n):
        m = _distances(x[c, : xl[c]].double(), y[c, : yl[c]].double(), norm)
        matrices.append(m)
        for i in range(int(xl[c])):
            if int(yl[c]) == 0:
                continue
            row = m[i]
            nan = torch.isnan(row)
            idx[c, i] = int(nan.nonzero()[0]) if nan.any() else int((row == row.min()).nonzero()[0])
    return idx, matrices


def _gathered_distance(a, b, idx, norm):
    """Differentiable float64 distance of each ``a`` point to ``b[idx]`` (0 where ``idx`` is -1)."""
    safe = idx.clamp(min=0)
    near = torch.gather(b, 1, safe[..., None].expand(-1, -1, b.shape[2])) if b.shape[1] else torch.zeros_like(a)
    diff = torch.where((idx >= 0)[..., None], a - near, 0)
    return (diff * diff).sum(-1) if norm == 2 else diff.abs().sum(-1)


def _exact_route(case: CloudCase, path: str) -> bool:
    """Whether the route compares distances exactly for grid data (the reference, or the direct kernel route)."""
    return path == "reference" or uses_direct_route(case.dim, case.norm, torch.device("cpu"))


def _check_winners(case, path, x, y, xl, yl, idx, brute_idx, matrices):
    """``idx`` is a nearest neighbour under the contract's latitude and the first of its duplicates."""
    exact = case.kind == "grid" and _exact_route(case, path)
    for c in range(case.n):
        m = matrices[c]
        for i in range(case.p1):
            got, want = int(idx[c, i]), int(brute_idx[c, i])
            if i >= int(xl[c]) or int(yl[c]) == 0 or exact or torch.isnan(m[i]).any():
                assert got == want, f"cloud {c} point {i}: neighbour {got}, expected {want} (distances {m[i]})"
                continue
            assert 0 <= got < int(yl[c]), f"cloud {c} point {i}: neighbour {got} outside the {int(yl[c])} points"
            best = float(m[i].min())
            if case.kind == "grid" or path == "reference":
                slack = 1e-6 * (1 + best)
            elif uses_direct_route(case.dim, case.norm, torch.device("cpu")):
                slack = 2.0**-15 * best + 1e-6
            else:
                real = x[c, : int(xl[c])].double()
                centre = real[torch.isfinite(real).all(-1)].mean(0)  # (the NaN rows are checked above)
                slack = 1e-5 * (1 + best + float(((x[c, i].double() - centre) ** 2).sum()))
            assert float(m[i, got]) <= best + slack, (
                f"cloud {c} point {i}: neighbour {got} at {float(m[i, got])}, nearest {want} at {best}"
            )
            same = (y[c, :got].double() == y[c, got].double()).all(-1)
            assert not same.any(), f"cloud {c} point {i}: neighbour {got} has an earlier duplicate"


@pytest.mark.parametrize("path", PATHS)
@fuzz_settings(1.0)
@given(case=cloud_cases())
def test_nearest_neighbors_matches_brute_force(path, case):
    gen = torch.Generator().manual_seed(case.seed)
    x, y, xl, yl, x_valid, y_valid = _clouds(case, gen)
    lengths = {} if case.lengths is None else dict(x_lengths=xl.to(getattr(torch, case.lengths)),
                                                   y_lengths=yl.to(getattr(torch, case.lengths)))
    x_arg = as_view(x, case.layouts[0], requires_grad=True)
    y_arg = as_view(y, case.layouts[1], requires_grad=True)
    grad = torch.randn(case.n, case.p1, generator=gen)
    with run_on(path):
        assert uses_kernels(x_arg) == (path == "kernel")
        dist, idx = lik.nearest_neighbors(x_arg, y_arg, norm=case.norm, backward=case.backward, **lengths)
        gx, gy = grads_of(dist, (x_arg, y_arg), grad)

    brute_idx, matrices = brute_nearest(x, y, xl, yl, case.norm)
    assert idx.dtype == torch.int64 and dist.dtype == torch.float32
    assert tuple(dist.shape) == tuple(idx.shape) == (case.n, case.p1)
    _check_winners(case, path, x, y, xl, yl, idx, brute_idx, matrices)
    # The distance is the chosen point's, from its coordinates; its gradient that of the float64 distance.
    x64, y64 = x.double().requires_grad_(), y.double().requires_grad_()
    x_clean = torch.where(x_valid[..., None], x64, 0)
    y_clean = torch.where(y_valid[..., None], y64, 0)
    expected = _gathered_distance(x_clean, y_clean, idx, case.norm)
    assert_matches(dist, expected, "distances", exact=case.kind == "grid", rtol=1e-6)
    assert torch.all(gx[~x_valid] == 0) and torch.all(gy[~y_valid] == 0), "gradient reached a padded point"
    if torch.isnan(expected).any():
        event("gradients not compared: a NaN distance")
        return
    rgx, rgy = grads_of(expected, (x64, y64), grad)
    rtol = 1e-5 if case.dtype == torch.float32 else 2e-3
    assert_matches(gx, rgx, "grad x", exact=False, rtol=rtol)
    assert_matches(gy, rgy, "grad y", exact=False, rtol=rtol)


@dataclass(frozen=True)
class ChamferOptions:
    normals: int  # 0: none, else the normals' width C
    weights: bool
    batch_reduction: str | None
    point_reduction: str | None
    single_directional: bool
    abs_cosine: bool


@st.composite
def chamfer_options(draw):
    point_reduction = draw(st.sampled_from(["mean", "sum", "max", None]))
    return ChamferOptions(
        normals=0 if point_reduction == "max" else draw(st.sampled_from([0, 1, 3])),
        weights=draw(st.booleans()),
        batch_reduction=None if point_reduction is None else draw(st.sampled_from(["mean", "sum", None])),
        point_reduction=point_reduction,
        single_directional=draw(st.booleans()),
        abs_cosine=draw(st.booleans()),
    )


def brute_chamfer(x, y, xl, yl, xn, yn, w, opts: ChamferOptions, norm, idx_xy, idx_yx):
    """PyTorch3D's chamfer_distance written out in float64 from given winners (differentiable)."""
    n = x.shape[0]

    def valid(p, lengths):
        return torch.arange(p.shape[1])[None] < lengths[:, None]

    def one_way(a, b, al, bl, an, bn, idx):
        av = valid(a, al)
        a_clean = torch.where(av[..., None], a, 0)
        b_clean = torch.where(valid(b, bl)[..., None], b, 0)
        dist = _gathered_distance(a_clean, b_clean, idx, norm)
        term = None
        if an is not None:
            an_c = torch.where(av[..., None], an, 0)
            bn_c = torch.where(valid(b, bl)[..., None], bn, 0)
            safe = idx.clamp(min=0)
            near = torch.gather(bn_c, 1, safe[..., None].expand(-1, -1, bn.shape[2])) if b.shape[1] else an_c * 0
            near = torch.where((idx >= 0)[..., None], near, 0)
            dot = (an_c * near).sum(-1)
            norms = an_c.norm(dim=-1) * near.norm(dim=-1)
            cos = torch.where(norms > 0, dot / torch.where(norms > 0, norms, 1), 0)
            term = torch.where(av, 1 - (cos.abs() if opts.abs_cosine else cos), 0)
        if w is not None:
            dist = dist * w[:, None]
            term = term * w[:, None] if term is not None else None

        def reduce(v):
            if opts.point_reduction is None:
                return v
            if opts.point_reduction == "max":
                return v.max(1).values if v.shape[1] else v.sum(1)
            total = v.sum(1)
            return total / al.clamp(min=1) if opts.point_reduction == "mean" else total

        return reduce(dist), (reduce(term) if term is not None else None)

    cx, nx = one_way(x, y, xl, yl, xn, yn, idx_xy)
    if opts.single_directional:
        loss, loss_n = cx, nx
    else:
        cy, ny = one_way(y, x, yl, xl, yn, xn, idx_yx)
        if opts.point_reduction == "max":
            loss, loss_n = torch.maximum(cx, cy), None
        elif opts.point_reduction is None:
            return (cx, cy), ((nx, ny) if nx is not None else None)
        else:
            loss, loss_n = cx + cy, (nx + ny if nx is not None else None)
    if opts.batch_reduction is None:
        return loss, loss_n
    loss, loss_n = loss.sum(), (loss_n.sum() if loss_n is not None else None)
    if opts.batch_reduction == "mean":
        div = max(n, 1) if w is None else (w.sum() if float(w.detach().sum()) > 0 else 1)
        loss, loss_n = loss / div, (loss_n / div if loss_n is not None else None)
    return loss, loss_n


def _unambiguous(case, path, directions) -> bool:
    """No candidate at another position than the winner's (duplicates of it tie harmlessly: the first wins) lies
    within the route's latitude of the nearest. ``directions``: ``(matrices, targets, target lengths)``."""
    if case.kind == "grid" and _exact_route(case, path):
        return True
    for matrices, targets, lengths in directions:
        for c, m in enumerate(matrices):
            if m.numel() == 0:
                continue
            points = targets[c, : int(lengths[c])].double()
            close = m <= m.min(dim=1, keepdim=True).values * (1 + 1e-4) + 1e-4
            for row in close:
                if len(torch.unique(points[row], dim=0)) > 1:
                    return False
    return True


@pytest.mark.parametrize("path", PATHS)
@fuzz_settings(1.0)
@given(case=cloud_cases(allow_nan=False), opts=chamfer_options())
def test_chamfer_distance_matches_brute_force(path, case, opts):
    gen = torch.Generator().manual_seed(case.seed)
    x, y, xl, yl, x_valid, y_valid = _clouds(case, gen)
    xn = yn = None
    if opts.normals:
        xn = torch.randn(case.n, case.p1, opts.normals, generator=gen).to(case.dtype)
        yn = torch.randn(case.n, case.p2, opts.normals, generator=gen).to(case.dtype)
        if case.garbage:
            xn = torch.where(x_valid[..., None], xn, float("nan"))
            yn = torch.where(y_valid[..., None], yn, float("inf"))
    w = torch.rand(case.n, generator=gen) * (torch.rand(case.n, generator=gen) < 0.8) if opts.weights else None
    lengths = {} if case.lengths is None else dict(x_lengths=xl.to(getattr(torch, case.lengths)),
                                                   y_lengths=yl.to(getattr(torch, case.lengths)))
    leaves = dict(x=as_view(x, case.layouts[0], requires_grad=True), y=as_view(y, case.layouts[1], requires_grad=True))
    if xn is not None:
        leaves.update(x_normals=as_view(xn, "strided", requires_grad=True), y_normals=yn.clone().requires_grad_())
    if w is not None:
        leaves["weights"] = w.clone().requires_grad_()
    with run_on(path):
        assert uses_kernels(leaves["x"]) == (path == "kernel")
        loss, loss_n = lik.chamfer_distance(
            **leaves, **lengths, batch_reduction=opts.batch_reduction, point_reduction=opts.point_reduction,
            norm=case.norm, single_directional=opts.single_directional, abs_cosine=opts.abs_cosine,
            backward=case.backward,
        )
        outputs = [t for t in (loss if isinstance(loss, tuple) else (loss,))]
        outputs += [t for t in ((loss_n if isinstance(loss_n, tuple) else (loss_n,)) if loss_n is not None else ())]
        upstream = [torch.randn(t.shape, generator=gen) for t in outputs]
        flat = sum(((o.double() * u).sum() for o, u in zip(outputs, upstream)), torch.zeros((), dtype=torch.float64))
        grads = grads_of(flat, tuple(leaves.values()), torch.ones(()))

    idx_xy, m_xy = brute_nearest(x, y, xl, yl, case.norm)
    idx_yx, m_yx = brute_nearest(y, x, yl, xl, case.norm)
    refs = {k: v.detach().double().requires_grad_() for k, v in
            dict(x=x, y=y, x_normals=xn, y_normals=yn, weights=w).items() if v is not None}
    exp_loss, exp_n = brute_chamfer(refs["x"], refs["y"], xl, yl, refs.get("x_normals"), refs.get("y_normals"),
                                    refs.get("weights"), opts, case.norm, idx_xy, idx_yx)
    expected = [t for t in (exp_loss if isinstance(exp_loss, tuple) else (exp_loss,))]
    expected += [t for t in ((exp_n if isinstance(exp_n, tuple) else (exp_n,)) if exp_n is not None else ())]
    assert len(outputs) == len(expected), f"{len(outputs)} results, expected {len(expected)}"
    unambiguous = _unambiguous(case, path, [(m_xy, y, yl), (m_yx, x, xl)])
    for i, (o, e) in enumerate(zip(outputs, expected)):
        assert o.dtype == torch.float32
        # A near-tie swap changes a value by at most the latitude: the same check, at a looser tolerance.
        assert_matches(o, e, f"result {i}", exact=False, rtol=1e-5 if unambiguous else 1e-3)
    assert torch.all(grads[0][~x_valid] == 0) and torch.all(grads[1][~y_valid] == 0), "gradient reached padding"
    if not unambiguous:
        event("gradients not compared: a near-tie between distinct points")
        return
    flat_ref = sum(((e * u.double()).sum() for e, u in zip(expected, upstream)), torch.zeros((), dtype=torch.float64))
    ref_grads = grads_of(flat_ref, tuple(refs.values()), torch.ones((), dtype=torch.float64))
    rtol = 1e-5 if case.dtype == torch.float32 else 2e-3
    # The weights' gradient under the batch "mean" is c / sum(w) - sum(w c) / sum(w)**2: a difference of terms of
    # size |c| / sum(w), which float32 rounding leaves behind when they cancel.
    weight_scale = 0.0
    if w is not None and opts.batch_reduction == "mean":
        size = sum(float((e.detach().abs() * u.abs().double()).sum()) for e, u in zip(expected, upstream))
        weight_scale = size / max(float(w.sum()), 1e-6)
    # A normal's gradient through the cosine, a / (|a| |b|) - cos b / |b|**2, is a difference of terms of size
    # 1 / |b|, summed over the points that pair with it.
    normal_scale = 0.0
    if xn is not None:
        norms = torch.cat([xn[x_valid].double().norm(dim=-1), yn[y_valid].double().norm(dim=-1)])
        if norms.numel():
            largest_upstream = max((float(u.abs().max()) for u in upstream if u.numel()), default=0.0)
            normal_scale = largest_upstream * max(case.p1, case.p2) / float(norms.min())
    scales = dict(weights=weight_scale, x_normals=normal_scale, y_normals=normal_scale)
    for name, g, r in zip(refs, grads, ref_grads):
        assert g.dtype == leaves[name].dtype
        assert_matches(g, r, f"grad {name}", exact=False, rtol=rtol, scale=scales.get(name, 1.0))
