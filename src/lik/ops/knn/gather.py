"""What :func:`lik.knn_points` does with the neighbours once they are chosen, in PyTorch, memory-bounded: their exact
distances, the list re-sorted by them, the backward of the distances, and the ``[N, P1, K, D]`` neighbours.

Every function takes the ``valid`` mask of :func:`lik.ops.knn.validation.valid_slots` (a slot holds a neighbour)
and never lets a masked slot's values or padded coordinates (which may hold anything) reach a result."""

from __future__ import annotations

import torch

from ...core.precision import accumulation_dtype
from .reference import pair_distances

__all__ = ["exact_distances", "sort_neighbours", "distances_backward", "gather_neighbours", "BUDGET_BYTES"]

# Bytes of gathered neighbours ([N, rows, K, D] in the accumulation dtype, a few temporaries) per chunk.
BUDGET_BYTES = 256 * 1024 * 1024


def _row_chunks(n: int, p1_size: int, k: int, dim: int, item: int, budget: int):
    """Row ranges of ``p1`` whose ``[N, rows, K, D]`` working set (about three copies) fits ``budget``."""
    rows = max(1, budget // max(1, 3 * n * k * max(dim, 1) * item))
    return [(start, min(p1_size, start + rows)) for start in range(0, p1_size, rows)]


def _neighbours(p2: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``p2 [N, P2, D]``, ``idx int64 [N, R, K]`` in ``[0, P2)`` -> ``[N, R, K, D]`` (differentiable)."""
    clouds = torch.arange(p2.shape[0], device=p2.device)[:, None, None]
    return p2[clouds, idx]


@torch.no_grad()
def exact_distances(p1: torch.Tensor, p2: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor, norm: int,
                    budget_bytes: int = BUDGET_BYTES) -> torch.Tensor:
    """Distances ``[N, P1, K]`` (float32; float64 for float64 inputs) from each point to its listed neighbours,
    from the coordinates' differences; 0 where ``valid`` is False."""
    n, p1_size, k = idx.shape
    acc = accumulation_dtype(p1.dtype)
    out = torch.zeros((n, p1_size, k), dtype=acc, device=p1.device)
    if p2.shape[1] == 0:
        return out
    safe = torch.where(valid, idx, 0)
    for start, stop in _row_chunks(n, p1_size, k, p1.shape[2], torch.finfo(acc).bits // 8, budget_bytes):
        near = _neighbours(p2, safe[:, start:stop]).to(acc)
        dist = pair_distances(p1[:, start:stop, None, :].to(acc), near, norm)
        out[:, start:stop] = torch.where(valid[:, start:stop], dist, 0)
    return out


def sort_neighbours(dists: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor):
    """Each row's neighbours in ascending distance, the lower index first among equals, NaN after every number,
    the empty slots last. ``dists`` float32 (non-negative or NaN), ``idx`` int64 ``[N, P1, K]``."""
    bits = torch.where(torch.isnan(dists), 0x7FC00000, dists.view(torch.int32)).to(torch.int64)
    keys = torch.where(valid, (bits << 32) | idx, torch.iinfo(torch.int64).max)
    order = keys.argsort(dim=-1)
    return dists.gather(-1, order), idx.gather(-1, order)


@torch.no_grad()
def distances_backward(grad: torch.Tensor, p1: torch.Tensor, p2: torch.Tensor, idx: torch.Tensor,
                       valid: torch.Tensor, norm: int, deterministic: bool, need_p1: bool, need_p2: bool,
                       budget_bytes: int = BUDGET_BYTES):
    """Gradients of ``dists [N, P1, K]`` with respect to ``p1`` and ``p2`` (None where not needed), in their dtype.

    ``d dist / d p1 = 2 (p1 - p2[idx])`` (``sign(p1 - p2[idx])`` for ``norm=1``), and the opposite for the
    neighbour, summed over the slots that list it: atomics (``index_add_``) or, ``deterministic``, a sorted
    accumulation (``index_put_`` with ``accumulate=True``), chunk by chunk in a fixed order."""
    n, p1_size, k = idx.shape
    dim = p1.shape[2]
    acc = accumulation_dtype(p1.dtype)
    grad_p1 = torch.zeros((n, p1_size, dim), dtype=acc, device=p1.device) if need_p1 else None
    grad_p2 = torch.zeros((n, p2.shape[1], dim), dtype=acc, device=p2.device) if need_p2 else None
    if p2.shape[1] and n and p1_size and dim:
        safe = torch.where(valid, idx, 0)
        flat_p2 = grad_p2.view(-1, dim) if need_p2 else None
        base = (torch.arange(n, device=idx.device) * p2.shape[1])[:, None, None]
        for start, stop in _row_chunks(n, p1_size, k, dim, torch.finfo(acc).bits // 8, budget_bytes):
            ok = valid[:, start:stop, :, None]
            near = _neighbours(p2, safe[:, start:stop]).to(acc)
            diff = p1[:, start:stop, None, :].to(acc) - near
            slope = 2 * diff if norm == 2 else torch.sign(diff)
            # A select, not a product: a masked slot may pair padding holding inf or NaN.
            term = torch.where(ok, grad[:, start:stop, :, None].to(acc) * slope, 0)
            if need_p1:
                grad_p1[:, start:stop] = term.sum(2)
            if need_p2:
                rows = (base + safe[:, start:stop]).reshape(-1)
                if deterministic:
                    flat_p2.index_put_((rows,), -term.reshape(-1, dim), accumulate=True)
                else:
                    flat_p2.index_add_(0, rows, -term.reshape(-1, dim))
    return (grad_p1.to(p1.dtype) if need_p1 else None, grad_p2.to(p2.dtype) if need_p2 else None)


def gather_neighbours(p2: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[N, P1, K, D]`` neighbour coordinates in ``p2``'s dtype (differentiable), zeros where ``valid`` is False."""
    n, p1_size, k = idx.shape
    if p2.shape[1] == 0:
        return p2.new_zeros((n, p1_size, k, p2.shape[2])) + p2.sum() * 0
    near = _neighbours(p2, torch.where(valid, idx, 0))
    return torch.where(valid[..., None], near, 0)
