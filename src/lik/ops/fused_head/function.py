"""``lik.maxsim_from_hidden``: MaxSim against documents given as hidden states and a projection head, fused.

The route (:mod:`lik._dispatch`): the reference on CPU without the interpreter and for float64; eager inference
launches the forward directly; training goes through :class:`FusedHeadFunction`, whose forward and backward reach
the kernels through the custom operators ``lik::fused_head_forward`` / ``lik::fused_head_backward`` (shape-only
fake implementations), so ``torch.compile`` keeps a model with the head in one graph.
"""

from __future__ import annotations

import torch

from ..._dispatch import kernel_op, resolve_backward, router, uses_kernels
from .backward import fused_head_backward
from .forward import fused_head_forward
from .reference import fused_head_reference_canonical
from .validation import FusedHeadInputs

__all__ = ["maxsim_from_hidden", "FusedHeadFunction"]


def _n_docs(h, cu_seqlens) -> int:
    return h.shape[1] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _forward_fake(q, h, w, b, q_mask, d_mask, cu_seqlens, mask_mode, normalize, per_query, store_argmax):
    n_q, l_q, _ = q.shape
    n_docs = _n_docs(h, cu_seqlens)
    scores = q.new_empty((n_q, n_docs), dtype=torch.float32)
    return scores, q.new_empty((n_q, n_docs, l_q) if store_argmax else (0,), dtype=torch.int32)


@kernel_op("lik::fused_head_forward", fake=_forward_fake)
def _forward(q: torch.Tensor, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, q_mask: torch.Tensor | None,
             d_mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None, mask_mode: str, normalize: bool,
             per_query: bool, store_argmax: bool) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = FusedHeadInputs(q, h, w, b, q_mask, d_mask, cu_seqlens, mask_mode, normalize, False, per_query)
    scores, argmax = fused_head_forward(inputs, store_argmax)
    # (contiguous: an operator's outputs have the fake's strides; the copies are [Nq, B] and [Nq, B, Lq])
    if argmax is None:
        return scores.contiguous(), q.new_empty((0,), dtype=torch.int32)
    return scores.contiguous(), argmax.contiguous()


def _backward_fake(grad, argmax, q, h, w, b, q_mask, d_mask, cu_seqlens, mask_mode, normalize, per_query,
                   deterministic, need_q, need_h, need_w, need_b):
    def like(x, needed):
        return x.new_empty(x.shape) if needed and x is not None else q.new_empty((0,))

    return like(q, need_q), like(h, need_h), like(w, need_w), like(b, need_b)


@kernel_op("lik::fused_head_backward", fake=_backward_fake)
def _backward(grad: torch.Tensor, argmax: torch.Tensor, q: torch.Tensor, h: torch.Tensor, w: torch.Tensor,
              b: torch.Tensor | None, q_mask: torch.Tensor | None, d_mask: torch.Tensor | None,
              cu_seqlens: torch.Tensor | None, mask_mode: str, normalize: bool, per_query: bool, deterministic: bool,
              need_q: bool, need_h: bool, need_w: bool, need_b: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    inputs = FusedHeadInputs(q, h, w, b, q_mask, d_mask, cu_seqlens, mask_mode, normalize, False, per_query)
    grads = fused_head_backward(inputs, argmax, grad, (need_q, need_h, need_w, need_b), deterministic)
    # An operator returns tensors only: a 0-element placeholder for a gradient not asked for.
    return tuple(q.new_empty((0,)) if g is None else g for g in grads)


class FusedHeadFunction(torch.autograd.Function):
    """Autograd over canonical inputs (``q [Nq, Lq, d_out]``, ``h`` padded ``[n_sets, B, Ld, d_model]`` or packed
    ``[T, d_model]``) -> fp32 ``[Nq, B]``; the forward saves the winners only, the backward recomputes the
    projection a chunk of documents at a time (:mod:`.backward`)."""

    @staticmethod
    def forward(ctx, q, h, w, b, q_mask, d_mask, cu_seqlens, mask_mode, normalize, per_query, deterministic):
        scores, argmax = _forward(q, h, w, b, q_mask, d_mask, cu_seqlens, mask_mode, normalize, per_query, True)
        ctx.save_for_backward(q, h, w, b, q_mask, d_mask, cu_seqlens, argmax)
        ctx.options = (mask_mode, normalize, per_query, deterministic)
        return scores

    @staticmethod
    def backward(ctx, grad_scores):
        q, h, w, b, q_mask, d_mask, cu_seqlens, argmax = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[:4])
        needs = needs[:3] + (needs[3] and b is not None,)
        grads = _backward(grad_scores.float().contiguous(), argmax, q, h, w, b, q_mask, d_mask, cu_seqlens,
                          *ctx.options, *needs)
        return (*(g if need else None for g, need in zip(grads, needs)), None, None, None, None, None, None, None)


# The four paths of a validated call, each taking the canonical inputs and the backward choice.
def _reference(inputs: FusedHeadInputs, deterministic: bool) -> torch.Tensor:
    return fused_head_reference_canonical(inputs)


def _autograd(inputs: FusedHeadInputs, deterministic: bool) -> torch.Tensor:
    return FusedHeadFunction.apply(inputs.q, inputs.h, inputs.w, inputs.b, inputs.q_mask, inputs.d_mask,
                                   inputs.cu_seqlens, inputs.mask_mode, inputs.normalize,
                                   inputs.per_query_documents, deterministic)


def _compiled(inputs: FusedHeadInputs, deterministic: bool) -> torch.Tensor:
    return _forward.op(inputs.q, inputs.h, inputs.w, inputs.b, inputs.q_mask, inputs.d_mask, inputs.cu_seqlens,
                       inputs.mask_mode, inputs.normalize, inputs.per_query_documents, False)[0]


def _inference(inputs: FusedHeadInputs, deterministic: bool) -> torch.Tensor:
    return fused_head_forward(inputs, False)[0]


_route = router(reference=_reference, autograd=_autograd, compiled=_compiled, launch=_inference)


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
    computed once however many queries score it. The normalised rows are rounded once to the input dtype before the
    product with ``Q`` (the unfused path in half precision rounds twice: ``F.linear``'s output, then
    ``F.normalize``'s), so at a near-tie (two tokens within an ulp of the dtype) the winner, and with it the
    gradient, can differ from a float64 evaluation's.

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
    (memory-bounded), or the kernel through Triton's interpreter with ``TRITON_INTERPRET=1``. Under
    ``torch.compile`` the kernels are custom operators (``lik::fused_head_forward`` / ``_backward``): one graph.

    Example:
        >>> Q = torch.nn.functional.normalize(torch.randn(16, 32, 128), dim=-1).half().cuda()
        >>> H = torch.randn(1000, 300, 768).half().cuda()           # ModernBERT last hidden states
        >>> head = torch.nn.Linear(768, 128).half().cuda()
        >>> lik.maxsim_from_hidden(Q, H, head.weight, head.bias).shape   # torch.Size([16, 1000]), float32
    """
    deterministic = resolve_backward(backward)
    inputs = FusedHeadInputs.build(Q, H, W, b, q_mask, d_mask, normalize=normalize, mask_mode=mask_mode,
                                   cu_seqlens=cu_seqlens)
    return inputs.finish(_route(uses_kernels(inputs.q), inputs.requires_grad(), inputs, deterministic))
