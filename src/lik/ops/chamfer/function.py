"""``lik.nearest_neighbors`` and ``lik.chamfer_distance`` (PyTorch3D's ``chamfer_distance`` contract).

The kernel (or, on CPU, the reference) only chooses each point's nearest neighbour. The distance is then
recomputed from the two points' coordinates in float32 (float64 for float64 inputs) by ordinary differentiable
PyTorch operations on ``[N, P, D]`` tensors, so memory stays O(P), the value is exact wherever the points lie, and
the backward is the chain rule through one gather: ``d dist / d x = 2 (x - y_nn)`` (``sign(x - y_nn)`` for
``norm=1``), scattered to the winners of ``y`` with atomics ("fast") or a sorted, atomic-free accumulation
("deterministic", also what ``torch.use_deterministic_algorithms(True)`` selects).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..._dispatch import resolve_backward, uses_kernels
from ...core.precision import accumulation_dtype
from .kernel import coordinate_major, nearest_indices, uses_direct_route
from .reference import nearest_neighbors_reference
from .validation import PointSets, check_point_sets, check_reductions, valid_points

__all__ = ["nearest_neighbors", "chamfer_distance"]


class _GatherRows(torch.autograd.Function):
    """``y [N, P2, C]``, ``idx int64 [N, P1]`` (valid indices) -> ``y[n, idx[n, i]]`` ``[N, P1, C]``, with a
    choice of scatter for the backward."""

    @staticmethod
    def forward(ctx, y, idx, deterministic):
        ctx.save_for_backward(idx)
        ctx.y_shape = y.shape
        ctx.deterministic = deterministic
        return torch.gather(y, 1, idx[..., None].expand(-1, -1, y.shape[2]))

    @staticmethod
    def backward(ctx, grad):
        (idx,) = ctx.saved_tensors
        n, p2, c = ctx.y_shape
        grad_y = grad.new_zeros((n, p2, c))
        if ctx.deterministic:
            # index_put_ with accumulate sorts the indices and sums each row in order: no atomics.
            clouds = torch.arange(n, device=idx.device)[:, None].expand_as(idx)
            grad_y.index_put_((clouds.reshape(-1), idx.reshape(-1)), grad.reshape(-1, c), accumulate=True)
        else:
            grad_y.scatter_add_(1, idx[..., None].expand(-1, -1, c), grad)
        return grad_y, None, None


class _Cloud:
    """What both directions of a call need of one side, computed once: validity, zero-padded coordinates in the
    accumulation dtype, NaN rows, and (kernels) the coordinate-major copy."""

    def __init__(self, points: torch.Tensor, lengths: torch.Tensor, kernels: bool, direct: bool):
        self.points = points
        self.lengths = lengths
        self.valid = valid_points(lengths, points.shape[1])
        # Padded points are replaced by zeros before any arithmetic: garbage there reaches no value and no gradient.
        self.clean = torch.where(self.valid[..., None], points, 0).to(accumulation_dtype(points.dtype))
        self.nan_rows = self.nonfinite_rows = None
        self.major = None
        if kernels:
            self.nan_rows = torch.isnan(points.detach()).any(-1) & self.valid
            self.nonfinite_rows = ~torch.isfinite(points.detach()).all(-1) & self.valid
            if direct:
                self.major = coordinate_major(points.detach())


def _settle(idx: torch.Tensor, a: _Cloud, b: _Cloud) -> torch.Tensor:
    """Kernel winners (int32, -1 unpaired) -> int64, with non-finite coordinates settled on the device and
    without a host sync, as the reference has them: a NaN in ``b`` makes every distance to that point NaN, so the
    first such point wins each row; a NaN or inf in the ``a`` point makes its whole row NaN or inf, a tie the
    first point wins."""
    idx = idx.long()
    if b.points.shape[1] == 0:
        return idx
    has_nan = b.nan_rows.any(1, keepdim=True)
    first_nan = b.nan_rows.to(torch.int8).argmax(1, keepdim=True)
    paired = idx >= 0
    idx = torch.where(paired & has_nan, first_nan, idx)
    return torch.where(paired & a.nonfinite_rows, 0, idx)


def _nearest(a: _Cloud, b: _Cloud, norm: int, kernels: bool) -> torch.Tensor:
    """int64 ``[N, P1]`` index of each valid ``a`` point's nearest ``b`` point; -1 for padded points and empty
    ``b`` clouds."""
    x, y = a.points.detach(), b.points.detach()
    if not kernels:
        return nearest_neighbors_reference(x, y, a.lengths, b.lengths, norm)[1]
    return _settle(nearest_indices(x, y, a.lengths, b.lengths, norm, a.major, b.major), a, b)


def _nearest_both_ways(a: _Cloud, b: _Cloud, norm: int, kernels: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Both directions' indices (``a`` to ``b``, ``b`` to ``a``); one pass over the pairs where the route has one."""
    if not kernels:
        return _nearest(a, b, norm, kernels), _nearest(b, a, norm, kernels)
    x, y = a.points.detach(), b.points.detach()
    idx_ab, idx_ba = nearest_indices(x, y, a.lengths, b.lengths, norm, a.major, b.major, both_ways=True)
    return _settle(idx_ab, a, b), _settle(idx_ba, b, a)


def _directed(a: _Cloud, b: _Cloud, norm: int, deterministic: bool, kernels: bool, a_normals=None, b_normals=None,
              idx=None):
    """Distances ``[N, P1]`` from each ``a`` point to its nearest ``b`` point (0 at padded points and where ``b``
    is empty) and, with normals, the ``[N, P1]`` cosine similarity of the paired normals. ``idx``: the winners,
    when the caller found them already."""
    if idx is None:
        idx = _nearest(a, b, norm, kernels)
    paired = idx >= 0
    safe_idx = idx.clamp(min=0)
    if b.points.shape[1] == 0:
        b_near = torch.zeros_like(a.clean)
    else:
        b_near = _GatherRows.apply(b.clean, safe_idx, deterministic)
    diff = torch.where(paired[..., None], a.clean - b_near, 0)
    dist = (diff * diff).sum(-1) if norm == 2 else diff.abs().sum(-1)
    cosine = None
    if a_normals is not None:
        acc = a.clean.dtype
        an = torch.where(a.valid[..., None], a_normals, 0).to(acc)
        bn = torch.where(b.valid[..., None], b_normals, 0).to(acc)
        if b.points.shape[1] == 0:
            bn_near = torch.zeros_like(an)
        else:
            # As PyTorch3D's knn_gather: a point without a neighbour pairs with a zero normal.
            bn_near = torch.where(paired[..., None], _GatherRows.apply(bn, safe_idx, deterministic), 0)
        cosine = F.cosine_similarity(an, bn_near, dim=2, eps=1e-6)
    return dist, idx, cosine


def _clouds(sets: PointSets, norm: int) -> tuple[_Cloud, _Cloud, bool]:
    kernels = uses_kernels(sets.x)
    direct = kernels and uses_direct_route(sets.x.shape[2], norm, sets.x.device, sets.x.dtype)
    return _Cloud(sets.x, sets.x_lengths, kernels, direct), _Cloud(sets.y, sets.y_lengths, kernels, direct), kernels


def nearest_neighbors(
    x: torch.Tensor,
    y: torch.Tensor,
    x_lengths: torch.Tensor | None = None,
    y_lengths: torch.Tensor | None = None,
    norm: int = 2,
    *,
    backward: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest neighbour in ``y`` of every point of ``x`` (k = 1), cloud by cloud, without the distance matrix.

    Args:
        x: ``[N, P1, D]`` points (float16, bfloat16, float32; float64 runs the reference).
        y: ``[N, P2, D]`` points, same dtype and device.
        x_lengths, y_lengths: optional integer ``[N]``: cloud ``n`` holds its first ``lengths[n]`` points; the
            rest is padding, never read into a result or a gradient.
        norm: 2 (squared Euclidean distance, as PyTorch3D's ``knn_points``) or 1 (sum of absolute differences).
        backward: "auto", "fast" or "deterministic" (atomic-free, bitwise repeatable).

    Returns:
        ``(distances, indices)``: float32 ``[N, P1]`` (float64 for float64 inputs), differentiable with respect
        to ``x`` and ``y``, and int64 ``[N, P1]``. Ties go to the lowest index; a NaN coordinate in a valid point
        makes the distances it touches NaN. Padded points, and points whose ``y`` cloud is empty, get distance 0
        and index -1.

    Precision (kernels): point clouds (``D <= 8``) and ``norm=1`` compare exact distances, with candidates
    within about ``2**-17`` relative of the nearest ordered by index rather than by value. Wider ``norm=2``
    feature sets choose the neighbour with tensor-core products ``|x-c|^2 + |y-c|^2 - 2 (x-c).(y-c)`` (``c``: the
    mean of the valid finite ``x`` points, in Chamfer's one pass those of the larger cloud; half-precision inputs
    are not centred, ``c = 0``), as ``torch.get_float32_matmul_precision()`` says for float32: "highest"
    TF32-split products (about float32's accuracy), "high" / "medium" one TF32 product; float16 / bfloat16
    inputs multiply in their own dtype. The
    winner's distance is then recomputed exactly in float32 from the two points, so the distance and its
    gradient are exact for the neighbour returned; only which of near-tied candidates wins can differ from
    float64: the returned ``d_w`` exceeds the true nearest ``d_n`` by at most ``e_w + e_n + 2**-16 d_n``, where
    a candidate's estimate error ``e_j`` is at most, with ``a = |x - c|``, ``b = |y_j - c|``:
    "highest" ``(6 D + 102) 2**-24 (a^2 + b^2)`` (worst case; about ``1e-7 a^2`` measured);
    "high" / "medium" ``2**-9 (1 + D 2**-13) a b + (D + 4) 2**-24 (a^2 + b^2)``;
    float16 / bfloat16 ``(2 D + 4) 2**-24 (a^2 + b^2)``.

    Example:
        >>> x = torch.tensor([[[0.0, 0.0], [5.0, 5.0]]])
        >>> y = torch.tensor([[[4.0, 4.0], [1.0, 0.0], [1.0, 0.0]]])
        >>> lik.nearest_neighbors(x, y)
        (tensor([[1., 2.]]), tensor([[1, 0]]))
    """
    sets = check_point_sets(x, y, x_lengths, y_lengths)
    check_reductions(None, None, norm, False)
    deterministic = resolve_backward(backward)
    a, b, kernels = _clouds(sets, norm)
    dist, idx, _ = _directed(a, b, norm, deterministic, kernels)
    return dist, idx


def _check_normals(name: str, normals, points: torch.Tensor):
    if not isinstance(normals, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(normals).__name__}")
    if normals.dim() != 3 or tuple(normals.shape[:2]) != tuple(points.shape[:2]):
        raise ValueError(f"{name} must have shape ({points.shape[0]}, {points.shape[1]}, C), "
                         f"got {tuple(normals.shape)}")
    if not normals.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor, got {normals.dtype}")
    if normals.device != points.device:
        raise ValueError(f"{name} is on {normals.device}, the points on {points.device}")


def _point_reduce(values: torch.Tensor, lengths: torch.Tensor, point_reduction):
    if point_reduction is None:
        return values
    if point_reduction == "max":
        if values.shape[1] == 0:
            return values.new_zeros(values.shape[0]) + values.sum(1)
        return values.max(1).values
    total = values.sum(1)
    if point_reduction == "mean":
        total = total / lengths.clamp(min=1).to(total.dtype)
    return total


def chamfer_distance(
    x: torch.Tensor,
    y: torch.Tensor,
    x_lengths: torch.Tensor | None = None,
    y_lengths: torch.Tensor | None = None,
    x_normals: torch.Tensor | None = None,
    y_normals: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    batch_reduction: str | None = "mean",
    point_reduction: str | None = "mean",
    norm: int = 2,
    single_directional: bool = False,
    abs_cosine: bool = True,
    *,
    backward: str = "auto",
):
    """Chamfer distance between point clouds, PyTorch3D's ``pytorch3d.loss.chamfer_distance`` without its
    ``[N, P1, P2]`` memory.

    Args:
        x: ``[N, P1, D]`` points; y: ``[N, P2, D]`` points (same dtype and device; float16, bfloat16, float32,
            float64). Any ``D``.
        x_lengths, y_lengths: optional integer ``[N]``: the number of real points of each cloud; padding is never
            read into a result or a gradient, whatever it holds.
        x_normals, y_normals: optional ``[N, P1, C]`` / ``[N, P2, C]`` normals (both or neither); give the second
            result, the cosine term ``1 - |cos|`` (``1 - cos`` with ``abs_cosine=False``) between each point's
            normal and its nearest neighbour's.
        weights: optional non-negative ``[N]`` weights of the clouds.
        batch_reduction: "mean" (by N, or by the weights' sum), "sum" or None.
        point_reduction: "mean" (by each cloud's length), "sum", "max" (Hausdorff; no normals) or None (then
            ``batch_reduction`` must be None and per-point terms come back).
        norm: 2 (squared Euclidean) or 1 (L1).
        single_directional: only ``x``-to-``y`` distances.
        backward: "auto", "fast" or "deterministic" (atomic-free, bitwise repeatable).

    Returns:
        ``(distance, normals_distance)``, float32 (float64 for float64 inputs), as PyTorch3D: reduced tensors, or
        with ``point_reduction=None`` a pair of ``[N, P1]`` and ``[N, P2]`` terms (one ``[N, P1]`` tensor if
        ``single_directional``); ``normals_distance`` is None without normals. Autograd reaches ``x``, ``y``, the
        normals and ``weights``.

    Precision: as :func:`nearest_neighbors` (``torch.get_float32_matmul_precision()`` picks the products that
    choose each point's neighbour; its distance and gradient are exact for the neighbour chosen).

    Differences from PyTorch3D: giving only one of ``x_normals`` / ``y_normals`` raises instead of being ignored;
    ``Pointclouds`` objects are not accepted (pass ``points_padded()`` and ``num_points_per_cloud()``).

    Example:
        >>> x = torch.rand(2, 1000, 3, device="cuda", requires_grad=True)
        >>> y = torch.rand(2, 800, 3, device="cuda")
        >>> loss, _ = lik.chamfer_distance(x, y)
        >>> loss.backward()
    """
    has_normals = x_normals is not None or y_normals is not None
    check_reductions(batch_reduction, point_reduction, norm, has_normals)
    if (x_normals is None) != (y_normals is None):
        raise ValueError("x_normals and y_normals must be given together (PyTorch3D ignores a lone one)")
    sets = check_point_sets(x, y, x_lengths, y_lengths)
    if has_normals:
        _check_normals("x_normals", x_normals, x)
        _check_normals("y_normals", y_normals, y)
        if x_normals.shape[2] != y_normals.shape[2]:
            raise ValueError(f"x_normals has C = {x_normals.shape[2]}, y_normals C = {y_normals.shape[2]}")
    n = x.shape[0]
    acc = accumulation_dtype(x.dtype)
    if weights is not None:
        if not isinstance(weights, torch.Tensor):
            raise TypeError(f"weights must be a torch.Tensor of shape ({n},), got {type(weights).__name__}")
        if tuple(weights.shape) != (n,):
            raise ValueError(f"weights must have shape ({n},), got {tuple(weights.shape)}")
        if weights.device != x.device:
            raise ValueError(f"weights is on {weights.device}, the points on {x.device}")
        if n and bool((weights < 0).any()):
            raise ValueError("weights cannot be negative")
    deterministic = resolve_backward(backward)

    x_cloud, y_cloud, kernels = _clouds(sets, norm)

    idx_xy = idx_yx = None
    if not single_directional:
        idx_xy, idx_yx = _nearest_both_ways(x_cloud, y_cloud, norm, kernels)

    def one_way(a: _Cloud, b: _Cloud, a_normals, b_normals, idx):
        dist, _, cosine = _directed(a, b, norm, deterministic, kernels, a_normals, b_normals, idx)
        term_n = None
        if cosine is not None:
            term_n = torch.where(a.valid, 1 - (cosine.abs() if abs_cosine else cosine), 0)
        if weights is not None:
            w = weights.to(acc)[:, None]
            dist = dist * w
            term_n = term_n * w if term_n is not None else None
        dist = _point_reduce(dist, a.lengths, point_reduction)
        if term_n is not None:
            term_n = _point_reduce(term_n, a.lengths, point_reduction)
        return dist, term_n

    cham_x, norm_x = one_way(x_cloud, y_cloud, x_normals, y_normals, idx_xy)
    if single_directional:
        loss, loss_normals = cham_x, norm_x
    else:
        cham_y, norm_y = one_way(y_cloud, x_cloud, y_normals, x_normals, idx_yx)
        if point_reduction == "max":
            loss, loss_normals = torch.maximum(cham_x, cham_y), None
        elif point_reduction is None:
            loss = (cham_x, cham_y)
            loss_normals = (norm_x, norm_y) if norm_x is not None else None
        else:
            loss = cham_x + cham_y
            loss_normals = norm_x + norm_y if norm_x is not None else None
    if batch_reduction is None:
        return loss, loss_normals
    loss = loss.sum()
    loss_normals = loss_normals.sum() if loss_normals is not None else None
    if batch_reduction == "mean":
        if weights is None:
            div = max(n, 1)
        else:
            total = weights.sum()
            div = total if bool(total > 0) else 1
        loss = loss / div
        loss_normals = loss_normals / div if loss_normals is not None else None
    return loss, loss_normals
