"""Pure-PyTorch MaxSim: the specification every kernel is tested against, and the CPU path.

``score[n, j] = sum_s max_t <Q[n, s], D[n or 0, j, t]>`` under the masking rules of docs/design.md. The
similarities are computed in chunks of documents so that no more than ``budget_bytes`` of them exist at once:
a CPU user scoring 10 000 ColPali pages never allocates ``[Nq, B, Lq, Ld]``. Autograd flows through it (the
gradient of ``torch.max`` goes to the first maximal index, the tie rule of the kernels), and masked or padded
positions get exactly zero gradient because they are replaced by zeros before any product is taken.

8-bit operands (with ``q_scale`` / ``d_scale``) follow the kernels' arithmetic step for step: the integer (or
float8) products summed exactly (in float64: ``|dot| <= 127^2 * 8192 < 2^53``), rounded once to float32, times
``d_scale[t]`` in float32; each query row's max over the tokens is then multiplied by ``q_scale[i]`` (NaN where
``q_scale[i] < 0``: ``lik.core.quantized``). int8 scores therefore equal the kernel's bit for bit up to
the fp32 order of the sum over query tokens; float8 ones differ also by the kernel's fp32 rounding of the running
dot product.
"""

from __future__ import annotations

import torch

from ...core.precision import accumulation_dtype
from .options import DEFAULT_OPTIONS, ScoreOptions, check_options, query_token_counts, reduce_similarities
from .validation import MaxSimInputs

__all__ = ["maxsim_reference", "maxsim_reference_canonical", "connected_zeros", "DEFAULT_BUDGET_BYTES"]

DEFAULT_BUDGET_BYTES = 256 * 1024 * 1024


def connected_zeros(shape, dtype: torch.dtype, *inputs: torch.Tensor) -> torch.Tensor:
    """Zeros of ``shape`` that autograd connects to ``inputs`` (their gradients come back as exact zeros).

    The connection is the sum of an empty slice of each input, so no value of an input takes part: ``x.sum() * 0``
    would turn an inf or NaN anywhere in ``x`` (masked padding included) into a NaN score.
    """
    out = torch.zeros(shape, dtype=dtype, device=inputs[0].device)
    for x in inputs:
        out = out + x[..., :0].sum().to(dtype)  # a view: nothing is copied or read
    return out


def maxsim_reference_canonical(
    inputs: MaxSimInputs, budget_bytes: int = DEFAULT_BUDGET_BYTES, options: ScoreOptions = DEFAULT_OPTIONS,
) -> torch.Tensor:
    """Reference on canonical (validated, 3-D / 4-D) inputs; returns ``[Nq, B]`` in the accumulation dtype.
    ``options``: the reduction and normalisation (:mod:`.options`); ``save_d_as`` does not apply here."""
    q, d = inputs.q, inputs.d
    n_q, l_q, _ = q.shape
    n_sets, n_docs, l_d, _ = d.shape
    acc = accumulation_dtype(q.dtype)
    if options.reduction != "max" and inputs.d_scale is not None:
        raise ValueError(f"reduction={options.reduction!r} scores float inputs only, got 8-bit D")
    if n_q == 0 or n_docs == 0 or l_q == 0 or l_d == 0:
        # No query token or no document token: every score is an empty sum (0), whatever the other side holds.
        if inputs.d_scale is not None:  # inference only: nothing to keep connected
            return torch.zeros(n_q, n_docs, dtype=torch.float32, device=q.device)
        return connected_zeros((n_q, n_docs), acc, q, d)

    q_valid = inputs.q_mask  # [Nq, Lq] bool or None
    d_valid = inputs.d_mask  # [n_sets, B, Ld] bool or None
    # Zeros in place of masked tokens: garbage (inf, NaN) there can reach neither the scores nor the gradients.
    quantized = inputs.d_scale is not None
    if quantized:
        # Exact sums of the 8-bit products in float64, rounded to float32 once (the kernels' int32 / fp32 sum).
        acc = torch.float64
        q_scale = inputs.q_scale if q_valid is None else torch.where(q_valid, inputs.q_scale, 0)
        # (float8 has no torch.where on the CPU: widen first)
        q_clean = q.to(acc) if q_valid is None else torch.where(q_valid[..., None], q.to(acc), 0)
    else:
        q_clean = q.to(acc) if q_valid is None else torch.where(q_valid[..., None], q, 0).to(acc)
    exclude = inputs.mask_mode == "exclude"

    per_doc_bytes = max(1, n_q * l_q * l_d * torch.finfo(acc).bits // 8)
    chunk = max(1, min(n_docs, budget_bytes // per_doc_bytes))
    out = []
    for start in range(0, n_docs, chunk):
        stop = min(n_docs, start + chunk)
        d_chunk = d[:, start:stop]  # [n_sets, b, Ld, dim]
        if quantized:
            d_chunk = d_chunk.to(acc)  # (float8 has no torch.where on the CPU)
        if d_valid is not None:
            d_chunk = torch.where(d_valid[:, start:stop, :, None], d_chunk, 0)
        d_chunk = d_chunk.to(acc)
        if n_sets == 1:
            sim = torch.einsum("nsk,btk->nbst", q_clean, d_chunk[0])
        else:
            sim = torch.einsum("nsk,nbtk->nbst", q_clean, d_chunk)
        if quantized:
            d_scale = inputs.d_scale[:, start:stop]  # [n_sets, b, Ld]
            if d_valid is not None:  # a masked token's products are 0 and so is its scale (garbage stays out)
                d_scale = torch.where(d_valid[:, start:stop], d_scale, 0)
            sim = sim.float() * d_scale[:, :, None, :]
        if exclude and d_valid is not None:
            valid = d_valid[:, start:stop, None, :]  # [n_sets, b, 1, Ld]
            sim = torch.where(valid, sim, float("-inf"))
        counted = None
        if exclude and d_valid is not None:
            counted = d_valid[:, start:stop, None, :]
            if options.reduction != "max":
                # A document with no token in the reduction: any finite row (it is masked out below), so that no
                # NaN gradient comes from reducing -inf alone.
                sim = torch.where(counted.any(dim=-1, keepdim=True), sim, 0)
        best = reduce_similarities(sim, counted, options)  # [Nq, b, Lq]
        if quantized:  # the query scale after the max; a negative one (a min, not a max) gives NaN
            best = best * torch.where(q_scale < 0, float("nan"), q_scale)[:, None, :]
        if exclude and d_valid is not None:
            has_token = d_valid[:, start:stop].any(dim=-1)[..., None]  # [n_sets, b, 1]
            best = torch.where(has_token, best, 0)
        if q_valid is not None:
            best = torch.where(q_valid[:, None, :], best, 0)
        out.append(best.sum(dim=-1))
    scores = torch.cat(out, dim=1).float() if quantized else torch.cat(out, dim=1)
    if options.normalized:
        scores = scores / query_token_counts(q_valid, n_q, l_q, q.device).to(scores.dtype)[:, None]
    return scores


def maxsim_reference(
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    mask_mode: str = "exclude",
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    q_scale: torch.Tensor | None = None,
    d_scale: torch.Tensor | None = None,
    reduction: str = "max",
    tau: float | None = None,
    top_k: int | None = None,
    normalize_by: str = "none",
) -> torch.Tensor:
    """MaxSim in plain PyTorch, with the semantics and shapes of :func:`lik.maxsim`.

    Args:
        Q: ``[Lq, d]`` or ``[Nq, Lq, d]``, float16 / bfloat16 / float32 / float64.
        D: ``[B, Ld, d]`` (shared by all queries) or ``[Nq, B, Ld, d]`` (one candidate set per query).
        q_mask: optional bool ``[Lq]`` / ``[Nq, Lq]``, True for real tokens.
        d_mask: optional bool ``[B, Ld]`` / ``[Nq, B, Ld]``.
        mask_mode: ``"exclude"`` or ``"zero"`` (see docs/design.md).
        budget_bytes: most bytes of similarities held at once.
        q_scale, d_scale: 8-bit inputs, as in :func:`lik.maxsim` (the same arithmetic: int8 scores equal the
            kernels' up to the fp32 order of the sum over query tokens).
        reduction, tau, top_k, normalize_by: as in :func:`lik.maxsim` (``"smooth"`` / ``"topk"`` float only).

    Returns:
        ``[B]`` for 2-D ``Q`` else ``[Nq, B]``; float32, or float64 for float64 inputs.

    Example:
        >>> Q, D = torch.randn(32, 128), torch.randn(10, 300, 128)
        >>> maxsim_reference(Q, D).shape
        torch.Size([10])
    """
    options = check_options(reduction, tau, top_k, normalize_by)
    inputs = MaxSimInputs.build(Q, D, q_mask, d_mask, mask_mode, allow_float64=True, q_scale=q_scale, d_scale=d_scale)
    return inputs.finish(maxsim_reference_canonical(inputs, budget_bytes, options))
