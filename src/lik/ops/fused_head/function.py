"""``lik.maxsim_from_hidden``: MaxSim against documents given as hidden states and a projection head, fused."""

from __future__ import annotations

import torch

from ..._dispatch import resolve_backward, uses_kernels
from .backward import fused_head_backward
from .forward import fused_head_forward
from .reference import fused_head_reference_canonical
from .validation import FusedHeadInputs

__all__ = ["maxsim_from_hidden", "FusedHeadFunction"]


class FusedHeadFunction(torch.autograd.Function):
    """Autograd over canonical inputs (``q [Nq, Lq, d_out]``, ``h`` padded ``[n_sets, B, Ld, d_model]`` or packed
    ``[T, d_model]``) -> fp32 ``[Nq, B]``; the forward saves the winners only, the backward recomputes the
    projection a chunk of documents at a time (:mod:`.backward`)."""

    @staticmethod
    def forward(ctx, q, h, w, b, q_mask, d_mask, cu_seqlens, mask_mode, normalize, per_query, deterministic):
        inputs = FusedHeadInputs(q, h, w, b, q_mask, d_mask, cu_seqlens, mask_mode, normalize, False, per_query)
        scores, argmax = fused_head_forward(inputs, True)
        ctx.save_for_backward(q, h, w, b, q_mask, d_mask, cu_seqlens, argmax)
        ctx.options = (mask_mode, normalize, per_query, deterministic)
        return scores

    @staticmethod
    def backward(ctx, grad_scores):
        q, h, w, b, q_mask, d_mask, cu_seqlens, argmax = ctx.saved_tensors
        mask_mode, normalize, per_query, deterministic = ctx.options
        inputs = FusedHeadInputs(q, h, w, b, q_mask, d_mask, cu_seqlens, mask_mode, normalize, False, per_query)
        grads = fused_head_backward(inputs, argmax, grad_scores.float(), tuple(ctx.needs_input_grad[:4]),
                                    deterministic)
        return (*grads, None, None, None, None, None, None, None)


def maxsim_from_hidden(
    Q: torch.Tensor,
    H: torch.Tensor,
    W: torch.Tensor,
    b: torch.Tensor | None = None,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    normalize: bool = True,
    mask_mode: str = "exclude",
    backward: str = "auto",
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """MaxSim against documents given as hidden states, with the projection head fused into the scoring.

    Equals ``lik.maxsim(Q, F.normalize(F.linear(H, W, b), dim=-1), q_mask, d_mask, mask_mode=mask_mode)``
    (``normalize=False``: without ``F.normalize``) without writing the projected documents to memory: each tile of
    hidden rows is projected on chip (fp32 accumulation), ``b`` added, the rows L2-normalised (F.normalize's
    ``eps = 1e-12``) and scored against every query before the next tile is read. The projection of a document is
    computed once however many queries score it.

    Args:
        Q: queries, already projected (and normalised): ``[Lq, d_out]`` or ``[Nq, Lq, d_out]``; float16, bfloat16
            or float32 (float64 runs the reference).
        H: document hidden states, ``[B, Ld, d_model]`` shared by all queries, ``[Nq, B, Ld, d_model]`` (one
            candidate set per query), or packed ``[T, d_model]`` with ``cu_seqlens``. Same dtype and device as
            ``Q``.
        W: the head's weight, ``[d_out, d_model]`` (``torch.nn.Linear.weight``); ``d_out`` at most 256.
        b: optional bias ``[d_out]``.
        q_mask: optional bool ``[Lq]`` / ``[Nq, Lq]``, True for real query tokens.
        d_mask: optional bool ``H.shape[:-1]``, True for real document tokens (None with packed ``H``).
        normalize: L2-normalise each projected document token (the ColBERT head); False scores ``H W^T + b``.
        mask_mode: ``"exclude"`` or ``"zero"``, as in :func:`lik.maxsim`.
        backward: ``"auto"``, ``"fast"`` or ``"deterministic"`` (bitwise repeatable), as in :func:`lik.maxsim`.
        cu_seqlens: int32 ``[B + 1]`` offsets of packed ``H`` (FlashAttention's convention).

    Returns:
        float32 scores, ``[B]`` for 2-D ``Q`` and ``[Nq, B]`` otherwise (float64 for float64 inputs). Gradients
        flow to ``Q``, ``H``, ``W`` and ``b`` in their dtype, in closed form with fp32 accumulation: the forward
        keeps only the winning token per (query token, document); the backward recomputes the projection a chunk
        of documents at a time (memory bounded by a chunk, never the projected corpus); masked tokens get 0.

    When to prefer the unfused path (``F.linear`` + ``F.normalize`` + :func:`lik.maxsim`): the fused forward
    reads ``H`` (``d_model`` wide) instead of projected rows (``d_out`` wide) and spends ``2 d_model d_out``
    FLOPs per document token. That pays when the projected documents would be written and read once per call
    (reranking hidden states: 1 to 16 queries), or when they would not fit in memory. When the same projected
    documents are scored many times (several calls on one batch, a corpus scored by query after query) project
    once and call :func:`lik.maxsim`; in in-batch training the backward recomputes the projection (one more
    ``H W^T`` per step) to save the projected activations, which the unfused path keeps instead.

    CUDA tensors run the Triton kernel; CPU tensors run :func:`lik.maxsim_from_hidden_reference`
    (memory-bounded), or the kernel through Triton's interpreter with ``TRITON_INTERPRET=1``.

    Example:
        >>> Q = torch.nn.functional.normalize(torch.randn(16, 32, 128), dim=-1).half().cuda()
        >>> H = torch.randn(1000, 300, 768).half().cuda()           # ModernBERT last hidden states
        >>> head = torch.nn.Linear(768, 128).half().cuda()
        >>> lik.maxsim_from_hidden(Q, H, head.weight, head.bias).shape   # torch.Size([16, 1000]), float32
    """
    deterministic = resolve_backward(backward)
    inputs = FusedHeadInputs.build(Q, H, W, b, q_mask, d_mask, normalize=normalize, mask_mode=mask_mode,
                                   cu_seqlens=cu_seqlens)
    if not uses_kernels(inputs.q):
        return inputs.finish(fused_head_reference_canonical(inputs))
    if inputs.requires_grad():
        scores = FusedHeadFunction.apply(inputs.q, inputs.h, inputs.w, inputs.b, inputs.q_mask, inputs.d_mask,
                                         inputs.cu_seqlens, mask_mode, normalize, inputs.per_query_documents,
                                         deterministic)
    else:
        scores = fused_head_forward(inputs, False)[0]
    return inputs.finish(scores)
