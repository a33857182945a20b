"""Packed variable-length MaxSim: ragged pair lists and ragged corpora with no padding (the public functions).

Two entry points share the one forward kernel of every layout (:mod:`lik.ops.maxsim.forward`; the documents
come from ``cu_seqlens`` through :func:`lik.core.segments.document_span`):

* :func:`maxsim_varlen` scores ``N`` pairs ``(query i, document i)`` of packed queries ``q [Tq, dim]`` and packed
  documents ``d [Td, dim]`` (a program owns one pair and one chunk of its query rows: :mod:`.pairs`);
* :func:`maxsim_packed` scores dense queries ``[Nq, Lq, dim]`` against every document of a packed corpus (a
  program owns a block of query-row groups, short queries stacked as in the padded layout, and one document; in
  inference of up to 128 stacked fp16 / bf16 rows, a persistent program walks every few documents instead).

No padding is read, computed or stored, and no length is specialised on. The saved argmax holds *absolute* rows
of the packed ``d``. ``cu_seqlens`` offsets read by the kernels are clamped to the packed tensors, so inputs
whose values were not checked (hints given) may give wrong numbers but never an out-of-bounds access.
Launchers: :mod:`.packed_forward`, :mod:`.packed_backward` (the padded backward's kernels on views of the packed
tensors); autograd and ``torch.compile``: :mod:`.packed_function`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ...core.forward_kernel import maxsim_fwd_kernel
from .function import resolve_backward, scorer_uses_kernels
from .options import ScoreOptions, check_options
from .packed_function import MaxSimPackedFunction, packed_route
from .packing import PackedInputs
from .reference_varlen import packed_reference
from .soft import apply_soft, inverse_counts, packed_layout

__all__ = [
    "maxsim_varlen",
    "maxsim_packed",
    "MaxSimPackedFunction",
    "maxsim_varlen_fwd_kernel",
]

# The packed layouts run the padded forward kernel (``LAYOUT`` flag); the old name stays for callers.
maxsim_varlen_fwd_kernel = maxsim_fwd_kernel


def _needs_grad(inputs: PackedInputs) -> bool:
    if inputs.d_scale is not None:  # 8-bit: inference only (validated)
        return False
    return torch.is_grad_enabled() and (inputs.q.requires_grad or inputs.d.requires_grad)


def maxsim_varlen(
    q: torch.Tensor,
    d: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_d: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_d: int | None = None,
    *,
    backward: str = "auto",
    q_scale: torch.Tensor | None = None,
    d_scale: torch.Tensor | None = None,
    reduction: str = "max",
    tau: float | None = None,
    top_k: int | None = None,
    normalize_by: str = "none",
) -> torch.Tensor:
    """MaxSim of ``N`` packed ``(query i, document i)`` pairs (FlashAttention varlen layout), no padding.

    ``score[i] = sum_{s in query i} max_{t in document i} <q[s], d[t]>``; an empty query or document scores 0.

    Args:
        q: packed query tokens ``[total_q_tokens, dim]``; float16, bfloat16 or float32 (float64 runs the
            reference). Non-contiguous views work.
        d: packed document tokens ``[total_d_tokens, dim]``, same dtype and device.
        cu_seqlens_q, cu_seqlens_d: int32 ``[N + 1]`` offsets (int64 accepted): start at 0, non-decreasing, end
            at the row count (:func:`lik.pack` builds them).
        max_seqlen_q, max_seqlen_d: the longest query / document, as returned by :func:`lik.pack`. With both
            given no host synchronisation happens and the ``cu_seqlens`` values are not checked (bad values give
            wrong scores, never an out-of-bounds access); otherwise they are read once (one sync) and checked.
            A ``max_seqlen_q`` below the truth is still exact, only slower (it sizes the launch grid).
        backward: ``"auto"`` (deterministic when ``torch.are_deterministic_algorithms_enabled()``), ``"fast"``
            (fp32 atomics for the document gradient) or ``"deterministic"`` (bitwise repeatable).
        q_scale, d_scale: 8-bit inputs (inference only), as in :func:`lik.maxsim`: ``d`` int8 / float8_e4m3fn
            with fp32 ``d_scale [total_d_tokens]``; ``q`` of the same dtype with ``q_scale [total_q_tokens]``, or
            float (quantized per token to ``d``'s dtype).
        reduction, tau, top_k, normalize_by: as in :func:`lik.maxsim` (``normalize_by="query_tokens"``
            divides each score by its query's token count). With ``reduction`` ``"smooth"`` or ``"topk"`` the
            ``max_seqlen`` hints, when given, must be at least the true longest lengths (they size the backward's
            grids); omitted, they are read from ``cu_seqlens`` (one synchronisation).

    Returns:
        float32 ``[N]`` (float64 for float64 inputs). Gradients flow to ``q`` and ``d`` in their dtype.

    Masks do not apply: a packed sequence has no padding (``mask_mode`` is moot; every token is real).

    Example:
        >>> q, cu_q, max_q = lik.pack([torch.randn(32, 128), torch.randn(20, 128)])
        >>> d, cu_d, max_d = lik.pack([torch.randn(300, 128), torch.randn(57, 128)])
        >>> lik.maxsim_varlen(q.cuda().half(), d.cuda().half(), cu_q.cuda(), cu_d.cuda(), max_q, max_d).shape
        torch.Size([2])
    """
    options = _options(reduction, tau, top_k, normalize_by)
    deterministic = resolve_backward(backward)
    kernels = scorer_uses_kernels(q, d)
    inputs = PackedInputs.build_pairs(
        q, d, cu_seqlens_q, cu_seqlens_d, max_seqlen_q, max_seqlen_d, read_values=not kernels, allow_float64=True,
        q_scale=q_scale, d_scale=d_scale,
    )
    if options is not None:
        return _with_options(kernels, inputs, deterministic, options, max_seqlen_d)
    return packed_route(kernels, _needs_grad(inputs), inputs, deterministic)


def maxsim_packed(
    Q: torch.Tensor,
    d: torch.Tensor,
    cu_seqlens_d: torch.Tensor,
    q_mask: torch.Tensor | None = None,
    max_seqlen_d: int | None = None,
    *,
    backward: str = "auto",
    q_scale: torch.Tensor | None = None,
    d_scale: torch.Tensor | None = None,
    reduction: str = "max",
    tau: float | None = None,
    top_k: int | None = None,
    normalize_by: str = "none",
) -> torch.Tensor:
    """MaxSim of dense queries against every document of a packed (ragged, unpadded) corpus.

    Args:
        Q: ``[Lq, dim]`` or ``[Nq, Lq, dim]``; float16, bfloat16 or float32 (float64 runs the reference).
        d: packed document tokens ``[total_d_tokens, dim]``, same dtype and device.
        cu_seqlens_d: int32 ``[B + 1]`` offsets (int64 accepted): start at 0, non-decreasing, end at the row count.
        q_mask: optional bool ``[Lq]`` / ``[Nq, Lq]`` (True: real token); a masked query token adds 0
            (``mask_mode="exclude"``; documents need no mask, they have no padding).
        max_seqlen_d: the longest document (from :func:`lik.pack`). Given, no host synchronisation happens and
            the ``cu_seqlens_d`` values are not checked (bad values give wrong scores, never an out-of-bounds
            access); omitted, they are read once and checked.
        backward: ``"auto"``, ``"fast"`` or ``"deterministic"``, as in :func:`lik.maxsim`.
        q_scale, d_scale: 8-bit inputs (inference only), as in :func:`lik.maxsim`: ``d`` int8 / float8_e4m3fn
            with fp32 ``d_scale [total_d_tokens]``; ``Q`` of the same dtype with ``q_scale`` (``Q.shape[:-1]``),
            or float (quantized per token to ``d``'s dtype).
        reduction, tau, top_k, normalize_by: as in :func:`lik.maxsim` (``normalize_by="query_tokens"``
            divides each score by its query's token count). With ``reduction`` ``"smooth"`` or ``"topk"`` the
            ``max_seqlen`` hints, when given, must be at least the true longest lengths (they size the backward's
            grids); omitted, they are read from ``cu_seqlens`` (one synchronisation).

    Returns:
        float32 ``[B]`` for 2-D ``Q``, ``[Nq, B]`` for 3-D (float64 for float64 inputs); an empty document
        scores 0. Gradients flow to ``Q`` and ``d`` in their dtype.

    Example:
        >>> docs = [torch.randn(n, 128) for n in (300, 57, 512)]
        >>> d, cu_d, max_d = lik.pack(docs)
        >>> Q = torch.randn(32, 128)
        >>> lik.maxsim_packed(Q.cuda().half(), d.cuda().half(), cu_d.cuda(), max_seqlen_d=max_d).shape
        torch.Size([3])
    """
    options = _options(reduction, tau, top_k, normalize_by)
    deterministic = resolve_backward(backward)
    kernels = scorer_uses_kernels(Q, d)
    inputs = PackedInputs.build_corpus(
        Q, d, cu_seqlens_d, q_mask, max_seqlen_d, read_values=not kernels, allow_float64=True,
        q_scale=q_scale, d_scale=d_scale,
    )
    if options is not None:
        return inputs.finish(_with_options(kernels, inputs, deterministic, options, max_seqlen_d))
    return inputs.finish(packed_route(kernels, _needs_grad(inputs), inputs, deterministic))


def _options(reduction, tau, top_k, normalize_by) -> ScoreOptions | None:
    """The checked options, or None for the plain max (its path is unchanged)."""
    if reduction == "max" and normalize_by == "none" and tau is None and top_k is None:
        return None
    return check_options(reduction, tau, top_k, normalize_by)


def _inverse_counts(inputs: PackedInputs) -> torch.Tensor:
    """One over each query's token count: ``[N]`` for pairs (from ``cu_seqlens_q``), ``[Nq, 1]`` for a corpus."""
    if inputs.pairs:
        cu = inputs.cu_q.to(torch.int64)
        return 1.0 / (cu[1:] - cu[:-1]).clamp(min=1).to(torch.float32)
    return inverse_counts(inputs.q_mask, inputs.q.shape[0], inputs.q.shape[1], inputs.q.device)


def _with_options(kernels: bool, inputs: PackedInputs, deterministic: bool, options: ScoreOptions,
                  max_seqlen_d: int | None) -> torch.Tensor:
    """A packed call with a soft reduction or length normalisation: the reference, the soft kernels' autograd
    node, or the max's (normalised inside its node)."""
    if inputs.d_scale is not None and options.reduction != "max":
        raise ValueError(f"d is {inputs.d.dtype}: reduction={options.reduction!r} takes float d only")
    if not kernels:
        return packed_reference(inputs, options)
    scale = _inverse_counts(inputs) if options.normalized else None
    if options.reduction != "max":
        if inputs.pairs and not inputs.values_checked:  # (the dQ grid needs the true longest query)
            cu = inputs.cu_q.to(torch.int64)
            inputs = replace(inputs, max_seqlen_q=int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0)
        lay = packed_layout(inputs, max_seqlen_d)
        return apply_soft(inputs.q, inputs.d, lay, options, None if scale is None else (
            scale[:, None] if inputs.pairs else scale), deterministic)
    needs_grad = _needs_grad(inputs)
    if needs_grad and not torch.compiler.is_compiling():
        return MaxSimPackedFunction.apply(inputs.q, inputs.d, inputs.cu_q, inputs.cu_d, inputs.q_mask,
                                          inputs.max_seqlen_q, deterministic, scale)
    scores = packed_route(kernels, needs_grad, inputs, deterministic)
    return scores if scale is None else scores * scale
