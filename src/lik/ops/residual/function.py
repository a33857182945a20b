"""``lik.maxsim_residual``: MaxSim of queries against a ColBERTv2-compressed packed corpus, decoded on chip, with
the gradient to the queries."""

from __future__ import annotations

import torch

from lik._dispatch import uses_kernels

from .kernel import MAX_KERNEL_DIM, residual_forward
from .reference import decode_tokens, maxsim_residual_reference
from .scan import residual_scores
from .validation import ResidualInputs, check_residual_inputs

__all__ = ["maxsim_residual", "ResidualMaxSimFunction"]

# Winner rows decoded at once in the backward (bounds its [rows, d] fp32 temporary).
_BACKWARD_ROWS = 1 << 18


def _grad_q(grad: torch.Tensor, winners: torch.Tensor, inputs: ResidualInputs) -> torch.Tensor:
    """``dQ[n, s] = sum_b grad[n, b] * decoded(winners[n, s, b])``: only the winning tokens are decoded (in torch,
    ``Nq * Lq * B`` rows at most, in bounded runs); a winner of -1 (masked query token, empty document) adds 0."""
    n_q, l_q, n_docs = winners.shape
    dim = inputs.q.shape[-1]
    dq = torch.zeros(n_q * l_q, dim, dtype=torch.float32, device=grad.device)
    flat = winners.reshape(n_q * l_q, n_docs)
    weights = grad.to(torch.float32).unsqueeze(1).expand(n_q, l_q, n_docs).reshape(n_q * l_q, n_docs)
    step = max(1, _BACKWARD_ROWS // max(n_docs, 1))
    for lo in range(0, n_q * l_q, step):
        rows = flat[lo : lo + step]
        hit = rows >= 0
        picked = rows.clamp(min=0).reshape(-1)
        decoded = decode_tokens(inputs.codec, inputs.codes[picked], inputs.residuals[picked], torch.float32)
        w = torch.where(hit, weights[lo : lo + step], 0.0)
        dq[lo : lo + step] = torch.einsum("rb,rbd->rd", w, decoded.view(rows.shape[0], n_docs, dim))
    return dq.view(n_q, l_q, dim).to(inputs.q.dtype)


class ResidualMaxSimFunction(torch.autograd.Function):
    """Kernel forward saving each (query token, document)'s winning row; backward gathers and decodes the winners.
    ``codes`` / ``residuals`` / the codec get no gradient."""

    @staticmethod
    def forward(ctx, q, inputs: ResidualInputs):
        scores, winners = residual_forward(
            q, inputs.q_mask, inputs.codes, inputs.residuals, inputs.codec, inputs.cu, track_argmax=True
        )
        ctx.inputs = inputs
        ctx.save_for_backward(winners)
        return scores

    @staticmethod
    def backward(ctx, grad):
        (winners,) = ctx.saved_tensors
        return _grad_q(grad, winners, ctx.inputs), None


def maxsim_residual(Q, codes, residuals, codec, cu_seqlens, *, q_mask=None) -> torch.Tensor:
    """MaxSim of queries against a packed corpus of ColBERTv2 residual codes, decoded on chip (no decompressed
    copy of the corpus exists); equal to ``lik.maxsim_packed(Q, codec.decompress(codes, residuals, Q.dtype),
    cu_seqlens, q_mask=q_mask)`` up to fp32 rounding.

    Args:
        Q: ``[Lq, d]`` or ``[Nq, Lq, d]``; float16, bfloat16 or float32 (float64 runs the reference, decoding in
            float64). Any strides.
        codes: int32 / int64 ``[T]``, centroid ids in ``[0, K)``.
        residuals: uint8 ``[T, d * nbits // 8]``, packed as ColBERT packs them (:mod:`lik.compression.packing`).
        codec: a :class:`lik.compression.ResidualCodec` (centroids ``[K, d]``, ``bucket_weights [2**nbits]``,
            nbits 1, 2 or 4) on ``Q``'s device; ``d`` a multiple of 8.
        cu_seqlens: int32 (int64 accepted) ``[B + 1]`` offsets of the documents in the ``T`` tokens (0 first, ``T``
            last, non-decreasing; read once on the host, as are the codes' range).
        q_mask: optional bool ``Q.shape[:-1]``, True for a real query token (a masked one adds 0).

    Returns:
        float32 ``[B]`` for a 2-D ``Q``, ``[Nq, B]`` for 3-D (float64 for float64 ``Q``). A document is decoded as
        ``normalize(centroid[code] + bucket_weights[bucket])`` in fp32, then takes ``Q``'s dtype for the product
        (fp32 follows ``torch.get_float32_matmul_precision()``). Semantics of :func:`lik.maxsim_packed`: an empty
        document scores 0, ties go to the lowest token, NaN in a valid query token gives NaN. The gradient flows to
        ``Q`` only: the forward keeps each (query token, document)'s winning row, the backward decodes only those.
        Without a gradient the scan is :func:`lik.ops.residual.score_residual_packed`'s (the token stream with
        the residual loader, or its bounded-scratch fallback for many query rows: :mod:`lik.config.residual`).

    Example::

        >>> tokens = torch.nn.functional.normalize(torch.randn(1000, 128), dim=-1)
        >>> cu = torch.tensor([0, 300, 357, 1000], dtype=torch.int32)
        >>> codec = lik.compression.train_codec(tokens, cu, 2)
        >>> codes, residuals = codec.compress(tokens)
        >>> lik.maxsim_residual(torch.randn(4, 32, 128), codes, residuals, codec, cu).shape
        torch.Size([4, 3])
    """
    inputs = check_residual_inputs(Q, codes, residuals, codec, cu_seqlens, q_mask)
    q = inputs.q
    if not uses_kernels(q) or q.shape[-1] > MAX_KERNEL_DIM:
        return inputs.finish(maxsim_residual_reference(inputs))
    if q.requires_grad and torch.is_grad_enabled():
        return inputs.finish(ResidualMaxSimFunction.apply(q, inputs))
    return inputs.finish(residual_scores(inputs))
