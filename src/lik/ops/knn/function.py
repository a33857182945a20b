"""``lik.knn_points``: PyTorch3D's ``knn_points`` contract on lik's kernels, with its backward.

The kernel (or, where kernels do not run, the reference) lists each point's ``K`` nearest neighbours with their
distances, exact and sorted. The backward is the chain rule through the listed indices, computed in row chunks
(:func:`lik.ops.knn.gather.distances_backward`); the optional ``[N, P1, K, D]`` neighbours are a differentiable
gather. :mod:`lik._dispatch` routes each call: the reference (float64, CPU bfloat16, CPU without the
interpreter), the autograd Function (a gradient is wanted), the custom operator (inference under
``torch.compile``) or the direct launch (eager inference).
"""

from __future__ import annotations

from collections import namedtuple

import torch
from torch.autograd.function import once_differentiable

from ..._dispatch import kernel_op, resolve_backward, router, uses_kernels
from .gather import distances_backward, gather_neighbours
from .kernel import knn_forward
from .reference import knn_reference
from .validation import check_knn_inputs, valid_slots

__all__ = ["knn_points", "KNN"]

# PyTorch3D's result type, field for field.
KNN = namedtuple("KNN", "dists idx knn")


def _forward_fake(p1, p2, lengths1, lengths2, K, norm):
    shape = (p1.shape[0], p1.shape[1], K)
    return p1.new_empty(shape, dtype=torch.float32), p1.new_empty(shape, dtype=torch.int64)


@kernel_op("lik::knn_points_forward", fake=_forward_fake)
def _forward_kernels(p1: torch.Tensor, p2: torch.Tensor, lengths1: torch.Tensor, lengths2: torch.Tensor, K: int,
                     norm: int) -> tuple[torch.Tensor, torch.Tensor]:
    return knn_forward(p1, p2, lengths1, lengths2, K, norm)


class _KnnFunction(torch.autograd.Function):
    """``(dists, idx)`` of the kernels (``kernels``) or the reference; gradients reach ``p1`` and ``p2``."""

    @staticmethod
    def forward(ctx, p1, p2, lengths1, lengths2, K, norm, kernels, deterministic):
        if kernels:
            dists, idx = _forward_kernels(p1, p2, lengths1, lengths2, K, norm)
        else:
            dists, idx = knn_reference(p1, p2, lengths1, lengths2, K, norm)
        ctx.save_for_backward(p1, p2, lengths1, lengths2, idx)
        ctx.norm, ctx.deterministic = norm, deterministic
        ctx.mark_non_differentiable(idx)
        return dists, idx

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_dists, grad_idx):
        p1, p2, lengths1, lengths2, idx = ctx.saved_tensors
        need_p1, need_p2 = ctx.needs_input_grad[:2]
        valid = valid_slots(lengths1, lengths2, p1.shape[1], idx.shape[2])
        grad_p1, grad_p2 = distances_backward(grad_dists, p1, p2, idx, valid, ctx.norm, ctx.deterministic,
                                              need_p1, need_p2)
        return grad_p1, grad_p2, None, None, None, None, None, None


def _reference(p1, p2, lengths1, lengths2, K, norm, deterministic):
    return _KnnFunction.apply(p1, p2, lengths1, lengths2, K, norm, False, deterministic)


def _autograd(p1, p2, lengths1, lengths2, K, norm, deterministic):
    return _KnnFunction.apply(p1, p2, lengths1, lengths2, K, norm, True, deterministic)


def _compiled(p1, p2, lengths1, lengths2, K, norm, deterministic):
    return _forward_kernels.op(p1, p2, lengths1, lengths2, K, norm)


def _launch(p1, p2, lengths1, lengths2, K, norm, deterministic):
    return knn_forward(p1, p2, lengths1, lengths2, K, norm)


_route = router(reference=_reference, autograd=_autograd, compiled=_compiled, launch=_launch)


def knn_points(
    p1: torch.Tensor,
    p2: torch.Tensor,
    lengths1: torch.Tensor | None = None,
    lengths2: torch.Tensor | None = None,
    norm: int = 2,
    K: int = 1,
    version: int = -1,
    return_nn: bool = False,
    return_sorted: bool = True,
    *,
    backward: str = "auto",
) -> KNN:
    """The ``K`` nearest points of ``p2`` to each point of ``p1``, cloud by cloud, without the distance matrix
    (PyTorch3D's ``pytorch3d.ops.knn_points``, same arguments in the same order, float16 and bfloat16 included).

    Args:
        p1: ``[N, P1, D]`` points (float16, bfloat16, float32; float64 runs the reference). Any strides.
        p2: ``[N, P2, D]`` points, same dtype and device.
        lengths1, lengths2: optional integer ``[N]`` in ``[0, P1]`` / ``[0, P2]``: cloud ``n`` holds its first
            ``lengths[n]`` points; the rest is padding, never read into a result or a gradient.
        norm: 2 (squared Euclidean distance) or 1 (sum of absolute differences).
        K: neighbours per point, 1 to 32. ``K`` may exceed a cloud's length (the extra slots are padding).
        version: accepted for compatibility and ignored (PyTorch3D's choice of CUDA kernel).
        return_nn: also return the neighbours' coordinates.
        return_sorted: accepted; the neighbours always come sorted (PyTorch3D's unsorted order is any order).
        backward: "auto", "fast" or "deterministic" (atomic-free, bitwise repeatable; "auto" follows
            ``torch.use_deterministic_algorithms``).

    Returns:
        ``KNN(dists, idx, knn)``: ``dists`` float32 ``[N, P1, K]`` (float64 for float64 inputs), the distances in
        ascending order, differentiable with respect to ``p1`` and ``p2``; ``idx`` int64 ``[N, P1, K]``;
        ``knn`` ``[N, P1, K, D]`` in ``p2``'s dtype (differentiable) if ``return_nn`` else None. Equal distances
        list the lower index first; a NaN distance (a NaN coordinate in a valid point) orders after every
        number. As PyTorch3D, slots past ``lengths2[n]`` and rows past ``lengths1[n]`` hold distance 0 and index 0,
        and receive no gradient; their ``knn`` rows are zeros (PyTorch3D repeats ``p2[n, 0]`` in the padded rows).

    Precision: distances are computed in float32 from the coordinates' differences (the half-precision inputs
    converted exactly), so each listed distance, and its gradient, is exact for the neighbour listed. Point clouds
    (``D <= 8``) and ``norm=1`` also choose the neighbours that way. Wider ``norm=2`` feature sets choose them
    with tensor-core products ``|x-c|^2 + |y-c|^2 - 2 (x-c).(y-c)`` (``c``: the mean of the valid finite ``p1``
    points; half-precision inputs are not centred, ``c = 0``), as ``lik.nearest_neighbors`` does: float32 under
    ``torch.get_float32_matmul_precision()`` "highest" with TF32-split products (about float32's accuracy),
    "high" / "medium" with one TF32 product, float16 / bfloat16 in their own dtype; then the chosen neighbours'
    distances are recomputed exactly and re-sorted. Only candidates near the ``K``-th distance can differ from
    float64's list: the ``k``-th listed distance exceeds the true ``k``-th smallest by at most ``2 max_j e_j``
    over the candidates involved, where, with ``a = |x - c|``, ``b = |y_j - c|``, ``e_j`` is at most
    "highest" ``(6 D + 102) 2**-24 (a^2 + b^2)``; "high" / "medium" ``2**-9 (1 + D 2**-13) a b +
    (D + 4) 2**-24 (a^2 + b^2)``; float16 / bfloat16 ``(2 D + 4) 2**-24 (a^2 + b^2)``.

    Example:
        >>> p1 = torch.tensor([[[0.0, 0.0], [5.0, 5.0]]])
        >>> p2 = torch.tensor([[[4.0, 4.0], [1.0, 0.0], [1.0, 0.0]]])
        >>> out = lik.knn_points(p1, p2, K=2, return_nn=True)
        >>> out.dists, out.idx
        (tensor([[[ 1.,  1.], [ 2., 41.]]]), tensor([[[1, 2], [0, 1]]]))
        >>> out.knn.shape
        torch.Size([1, 2, 2, 2])
    """
    inputs = check_knn_inputs(p1, p2, lengths1, lengths2, norm, K, version, return_nn, return_sorted)
    deterministic = resolve_backward(backward)
    kernels = uses_kernels(p1)
    needs_grad = torch.is_grad_enabled() and (p1.requires_grad or p2.requires_grad)
    dists, idx = _route(kernels, needs_grad, p1, p2, inputs.lengths1, inputs.lengths2, K, norm, deterministic)
    knn = None
    if return_nn:
        knn = gather_neighbours(p2, idx, valid_slots(inputs.lengths1, inputs.lengths2, p1.shape[1], K))
    return KNN(dists, idx, knn)
