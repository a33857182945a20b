"""The cross-entropy step of :func:`lik.contrastive_loss`: one small kernel from the MaxSim scores to the loss and
the scores' gradient.

With ``x = scores / temperature`` (``[Nq, B]``, fp32) and ``y`` each query's label (the diagonal without labels),
one launch computes every row's logsumexp (an online max and sum over column tiles), the loss
``mean_i(lse_i - x[i, y_i])`` and, for the backward, ``G = (softmax(x) - onehot(y)) / (Nq * temperature)``: the
gradient of the loss with respect to the scores, which MaxSim's backward launches take as they are.

The loss is summed in a fixed order (per lane over row blocks, then across lanes), so it is bitwise repeatable.
A small problem (ColBERT B 128: 16 384 scores) is one program, which writes the loss itself; a large one spreads
row blocks over programs, each writing its partial sum of ``loss_i / Nq``, added by one ``sum`` on the host side
(deterministic too). A label outside ``[0, B)`` (a CUDA tensor is not read on the host: that would synchronise)
makes its row's loss and gradient NaN.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ... import _device
from ..._device import cdiv, next_power_of_2
from ..._launch import launch
from ..._replay import made

__all__ = ["contrastive_ce_kernel", "cross_entropy_config", "launch_cross_entropy", "SINGLE_PROGRAM_SCORES"]


@triton.jit(do_not_specialize=["n_q", "n_docs", "n_programs", "stride_label"])
def contrastive_ce_kernel(
    scores_ptr,
    labels_ptr,
    grad_ptr,
    loss_ptr,
    n_q,
    n_docs,
    n_programs,
    stride_label,
    inv_temperature,
    grad_scale,
    loss_scale,
    HAS_LABELS: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    pid = tl.program_id(0)
    cols0 = tl.arange(0, BLOCK_B)
    total = tl.zeros([BLOCK_R], tl.float32)
    for first in range(pid * BLOCK_R, n_q, n_programs * BLOCK_R):
        rows = first + tl.arange(0, BLOCK_R)
        row_ok = rows < n_q
        # Rows past the last read the last row again (real scores, no -inf rows to guard); nothing of theirs is kept.
        rows = tl.minimum(rows, n_q - 1)
        row_ptr = scores_ptr + rows.to(tl.int64) * n_docs
        if HAS_LABELS:
            label = tl.load(labels_ptr + rows.to(tl.int64) * stride_label)
        else:
            label = rows.to(tl.int64)
        label_ok = (label >= 0) & (label < n_docs)
        run_max = tl.full([BLOCK_R], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK_R], tl.float32)
        target = tl.zeros([BLOCK_R], tl.float32)
        for start in range(0, n_docs, BLOCK_B):
            cols = start + cols0
            ok = (cols < n_docs)[None, :]
            x = tl.load(row_ptr[:, None] + cols[None, :], mask=ok, other=float("-inf")) * inv_temperature
            new_max = tl.maximum(run_max, tl.max(x, axis=1))
            # (a row that is -inf so far rescales by 0, not by exp(-inf + inf) = NaN)
            base = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - base) + tl.sum(tl.exp(x - base[:, None]), axis=1)
            run_max = new_max
            target += tl.sum(tl.where(cols[None, :] == label[:, None], x, 0.0), axis=1)
        # A NaN score reaches the sum (exp(NaN) is NaN) whatever the max made of it: its row's loss is NaN.
        lse = run_max + tl.log(run_sum)
        row_loss = tl.where(label_ok, lse - target, float("nan"))
        total += tl.where(row_ok, row_loss, 0.0)
        if WRITE_GRAD:
            grad_row_ptr = grad_ptr + rows.to(tl.int64) * n_docs
            for start in range(0, n_docs, BLOCK_B):
                cols = start + cols0
                col_ok = (cols < n_docs)[None, :]
                x = tl.load(row_ptr[:, None] + cols[None, :], mask=col_ok, other=0.0) * inv_temperature
                hit = tl.where(cols[None, :] == label[:, None], 1.0, 0.0)
                g = (tl.exp(x - lse[:, None]) - hit) * grad_scale
                g = tl.where(label_ok[:, None], g, float("nan"))
                tl.store(grad_row_ptr[:, None] + cols[None, :], g, mask=row_ok[:, None] & col_ok)
    tl.store(loss_ptr + pid, tl.sum(total, axis=0) * loss_scale)


# One program up to this many scores (ColBERT B 128 is 16 384): a single launch, no partial sums to add. Past it,
# row blocks spread over programs, so the step's extra device time stays a few microseconds at B 512.
SINGLE_PROGRAM_SCORES = 1 << 15
# At most this many programs: each walks its row blocks in a grid-stride loop.
MAX_PROGRAMS = 1024


@functools.lru_cache(maxsize=256)
def cross_entropy_config(n_q: int, n_docs: int, interpret: bool) -> tuple[int, int, int, int]:
    """``(block_r, block_b, programs, num_warps)`` for ``[n_q, n_docs]`` scores: column tiles of up to 1 024 and
    4 096 scores per tile; under the interpreter small tiles, so the CPU tests walk several row blocks, column
    tiles and programs."""
    if interpret:
        block_b = min(8, next_power_of_2(n_docs))
        block_r = 2
        return block_r, block_b, min(cdiv(n_q, block_r), 2 if n_q * n_docs > 24 else 1), 1
    block_b = max(16, min(1024, next_power_of_2(n_docs)))
    block_r = max(1, min(next_power_of_2(n_q), 4096 // block_b))
    programs = 1 if n_q * n_docs <= SINGLE_PROGRAM_SCORES else min(cdiv(n_q, block_r), MAX_PROGRAMS)
    return block_r, block_b, programs, 4 if block_r * block_b <= 2048 else 8


def launch_cross_entropy(
    scores: torch.Tensor,
    labels: torch.Tensor | None,
    temperature: float,
    *,
    write_grad: bool = True,
    config: tuple[int, int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(loss, grad)`` of contiguous fp32 ``scores [Nq, B]`` (``Nq >= 1``, ``B >= 1``): the 0-dim fp32 mean
    cross-entropy of ``scores / temperature`` against ``labels`` (int64 ``[Nq]``, any stride; None: the diagonal),
    and, when ``write_grad``, ``grad [Nq, B]`` fp32 = ``(softmax - onehot) / (Nq * temperature)``, else None.

    ``config``: ``(block_r, block_b, programs, num_warps)`` in place of :func:`cross_entropy_config` (tests).

    Example:
        >>> loss, grad = launch_cross_entropy(torch.randn(4, 6, device="cuda"), None, 0.05)
    """
    n_q, n_docs = scores.shape
    block_r, block_b, programs, num_warps = config or cross_entropy_config(n_q, n_docs, _device.interpreting())
    device = scores.device
    # Every element of each buffer is written by the kernel: no fill launch.
    grad = made(torch.empty((n_q, n_docs), dtype=torch.float32, device=device)) if write_grad else None
    out = made(torch.empty(() if programs == 1 else (programs,), dtype=torch.float32, device=device))
    launch(
        contrastive_ce_kernel,
        (programs,),
        scores,
        scores if labels is None else labels,
        scores if grad is None else grad,
        out,
        n_q,
        n_docs,
        programs,
        0 if labels is None else labels.stride(0),
        1.0 / temperature,
        1.0 / (n_q * temperature),
        1.0 / n_q,
        HAS_LABELS=labels is not None,
        WRITE_GRAD=write_grad,
        BLOCK_R=block_r,
        BLOCK_B=block_b,
        num_warps=num_warps,
    )
    return (out if programs == 1 else out.sum()), grad
