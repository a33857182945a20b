"""The fused head's backward: closed-form gradients to ``Q``, ``H``, ``W`` and ``b`` from the forward's winners.

With ``U = H W^T + b`` (one row per document token), ``P = U / max(|U|, eps)`` (``P = U`` without normalisation),
``w[n, j] = dL/dscore[n, j]`` and ``t*[n, j, s]`` the winner saved by the forward (-1: no gradient):

* ``dQ[n, s] = sum_j w[n, j] P[j, t*]``: lik.maxsim's dQ gather (``maxsim_backward_dq``) over the recomputed rows;
* ``dP[j, t] = sum_{n, s: t* = t} w[n, j] Q[n, s]``: lik.maxsim's dD (the fp32 atomic scatter, or the sorted
  gather for ``backward="deterministic"``: no atomics, bitwise repeatable);
* ``dU = (dP - P <P, dP>) / |U|`` where ``|U| >= eps`` and ``dP / eps`` below it (F.normalize's clamp); ``dU = dP``
  without normalisation;
* ``dH = dU W``, ``dW = sum dU^T H``, ``db = sum dU``.

Documents are taken a chunk at a time (``budget_bytes`` of fp32 rows: the hidden rows, ``U``, ``P``, ``dP``, ``dU``
and ``dH`` of one chunk), the projection recomputed for the chunk in fp32 from the input-dtype rows, so memory is
bounded by a chunk, never the projected corpus. For fp16 / bf16 inputs the three products (``U``, ``dH``, ``dW``)
run in TF32 on a GPU: the hidden rows and ``W`` are exact in TF32, so ``U`` gets the forward's exact products summed
in fp32 at tensor-core speed (a true fp32 product costs several times more), and ``dU`` is rounded to TF32's 10-bit
mantissa, as fine as the half-precision gradient the unfused path multiplies. fp32 inputs follow
``torch.get_float32_matmul_precision()``. Every sum
is fp32 and in a fixed order (the chunks in turn, cuBLAS products, the sorted dD), so the deterministic backward
repeats bit for bit. Masked hidden rows are zeroed before the projection: garbage there reaches no gradient.
Packed hidden states read ``cu_seqlens`` on the host once (a synchronisation) and gather each chunk padded.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..maxsim.backward import maxsim_backward_dd, maxsim_backward_dq
from .reference import NORMALIZE_EPS, packed_bounds
from .validation import FusedHeadInputs

__all__ = ["fused_head_backward", "BACKWARD_BUDGET_BYTES"]

BACKWARD_BUDGET_BYTES = 256 * 1024 * 1024


def _chunks(inputs: FusedHeadInputs, budget_bytes: int):
    """``(docs, h [n_sets, c, L, d_model], mask or None, rows or None)`` per chunk of documents; packed chunks are
    padded gathers whose real rows ``rows[mask]`` are rows of the packed ``H``."""
    d_out, d_model = inputs.w.shape
    if inputs.packed:
        bounds, lengths = packed_bounds(inputs)
        per_token = 4 * (2 * d_model + 4 * d_out)
        first = 0
        while first < len(lengths):
            last, tokens = first + 1, lengths[first]
            while last < len(lengths) and (tokens + lengths[last]) * per_token <= budget_bytes:
                tokens += lengths[last]
                last += 1
            width = max(lengths[first:last])
            span = torch.arange(width, device=inputs.h.device)
            starts = torch.tensor(bounds[first:last], dtype=torch.long, device=inputs.h.device)
            length = torch.tensor(lengths[first:last], dtype=torch.long, device=inputs.h.device)
            mask = span[None, :] < length[:, None]
            rows = torch.where(mask, starts[:, None] + span[None, :], 0)
            h = inputs.h[rows.reshape(-1)].reshape(last - first, width, d_model) if width else (
                inputs.h.new_zeros((last - first, 0, d_model)))
            yield slice(first, last), h[None], mask[None], rows
            first = last
        return
    n_sets, n_docs, l_d, _ = inputs.h.shape
    per_doc = max(1, 4 * n_sets * l_d * (2 * d_model + 4 * d_out))
    step = max(1, min(n_docs, budget_bytes // per_doc))
    for first in range(0, n_docs, step):
        docs = slice(first, min(n_docs, first + step))
        yield docs, inputs.h[:, docs], None if inputs.d_mask is None else inputs.d_mask[:, docs], None


@contextlib.contextmanager
def _half_operands_in_tf32(dtype: torch.dtype, device: torch.device):
    """TF32 products inside the block for half-precision inputs on a GPU (their operands are exact in TF32)."""
    if device.type != "cuda" or dtype == torch.float32:
        yield
        return
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def fused_head_backward(inputs: FusedHeadInputs, argmax: torch.Tensor, grad: torch.Tensor, needs: tuple,
                        deterministic: bool, budget_bytes: int = BACKWARD_BUDGET_BYTES) -> tuple:
    """``(dq, dh, dw, db)`` for canonical inputs (each None unless ``needs`` asks for it), in the input dtype;
    ``grad`` is fp32 ``[Nq, B]``, ``argmax`` the forward's ``[Nq, B, Lq]``."""
    need_q, need_h, need_w, need_b = needs
    q, w = inputs.q, inputs.w
    dtype, device = q.dtype, q.device
    d_out, d_model = w.shape
    dq = torch.zeros(q.shape, dtype=torch.float32, device=device) if need_q else None
    dh = torch.zeros_like(inputs.h) if need_h else None
    dw = torch.zeros((d_out, d_model), dtype=torch.float32, device=device) if need_w else None
    db = torch.zeros((d_out,), dtype=torch.float32, device=device) if need_b and inputs.b is not None else None
    if q.shape[0] * q.shape[1] and inputs.n_docs:
        with _half_operands_in_tf32(dtype, device):
            for docs, h, mask, rows in _chunks(inputs, budget_bytes):
                if h.shape[2]:
                    _add_chunk(inputs, argmax[:, docs], grad[:, docs], h, mask, rows, docs, deterministic,
                               dq, dh, dw, db)
    return (None if dq is None else dq.to(dtype), dh, None if dw is None else dw.to(dtype),
            None if db is None else db.to(dtype))


def _add_chunk(inputs: FusedHeadInputs, argmax, grad, h, mask, rows, docs, deterministic: bool, dq, dh, dw, db):
    """Add one chunk of documents' gradients into the fp32 ``dq``, ``dw``, ``db`` and write its rows of ``dh``."""
    q, w, b = inputs.q, inputs.w, inputs.b
    d_out, d_model = w.shape
    w32 = w.float()
    h32 = h.float()
    if mask is not None:
        h32 = torch.where(mask[..., None], h32, 0)
    u = F.linear(h32, w32, None if b is None else b.float())
    if inputs.normalize:
        norm = torch.linalg.vector_norm(u, dim=-1, keepdim=True)
        denom = norm.clamp_min(NORMALIZE_EPS)
        p = u / denom
    else:
        p = u
    if dq is not None:
        dq += maxsim_backward_dq(grad, p, argmax, q.shape, torch.float32)
    if dh is None and dw is None and db is None:
        return
    dp = maxsim_backward_dd(grad, q, argmax, p.shape, torch.float32, deterministic=deterministic,
                            per_query=inputs.per_query_documents)
    if inputs.normalize:
        radial = (p * dp).sum(-1, keepdim=True)
        du = torch.where(norm >= NORMALIZE_EPS, (dp - p * radial) / denom, dp / NORMALIZE_EPS)
    else:
        du = dp
    if mask is not None:  # rows that were never scored take no gradient (and no 0 * garbage)
        du = torch.where(mask[..., None], du, 0)
    flat_du = du.reshape(-1, d_out)
    if dh is not None:
        dh_chunk = (flat_du @ w32).reshape(h.shape)
        if rows is None:
            dh[:, docs] = dh_chunk.to(dh.dtype)
        else:
            dh[rows[mask[0]]] = dh_chunk[0][mask[0]].to(dh.dtype)
    if dw is not None:
        dw += flat_du.t() @ h32.reshape(-1, d_model)
    if db is not None:
        db += flat_du.sum(0)
