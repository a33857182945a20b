"""Exact top-k MaxSim search over a corpus resident on the queries' device.

The arguments are validated once, as :func:`lik.maxsim` validates them, into its canonical bundle; the corpus is then
scored in chunks of documents, each chunk a view of that bundle handed to MaxSim's internal scoring entry
(:func:`~lik.ops.maxsim.function.score_canonical`: fused kernels on CUDA, the memory-bounded reference on CPU), and
a running top-k is merged on the device after each chunk. Neither the similarities ``[Nq, B, Lq, Ld]`` nor the full
score matrix ``[Nq, B]`` is ever held: the working set is one chunk of scores plus the ``k`` best so far.
"""

from __future__ import annotations

import operator

import torch

from ..core.precision import accumulation_dtype
from ..ops.maxsim.function import score_canonical
from ..ops.maxsim.validation import MaxSimInputs
from .keys import MAX_ID, merge_keys
from .queries import assemble, buckets, ragged_queries

__all__ = ["search", "merge_top_k", "rank", "DEFAULT_BUDGET_BYTES", "BYTES_PER_CANDIDATE"]

DEFAULT_BUDGET_BYTES = 256 * 1024 * 1024

# Per (query, document) pair of a chunk: the fp32 score, the int64 candidate index, and the sort's keys,
# permutation and gathered copies (about four more 8-byte words), rounded up.
BYTES_PER_CANDIDATE = 64


def _as_int(value, name: str, expected: str) -> int:
    """``value`` as a Python int (any ``__index__`` type, never a bool), else a ``TypeError`` naming ``name``."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be {expected}, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}") from None


def _check_k(k, n_docs: int) -> int:
    k = _as_int(k, "k", "an integer")
    if k < 0 or k > n_docs:
        raise ValueError(f"k must be in [0, B] = [0, {n_docs}] (B = number of documents in D), got k={k}")
    return k


def _check_chunk_size(chunk_size, n_queries: int) -> int:
    if chunk_size is None:
        return max(1, DEFAULT_BUDGET_BYTES // (max(1, n_queries) * BYTES_PER_CANDIDATE))
    chunk_size = _as_int(chunk_size, "chunk_size", "a positive integer or None")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer or None, got chunk_size={chunk_size}")
    return chunk_size


def rank(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` best entries of each row of ``scores [Nq, n]`` (``k <= n``): descending score, NaN
    last, ties (``-0.0`` and ``0.0`` included) by lower position.

    float32 scores: one ``topk`` over distinct int64 keys (:mod:`lik.retrieval.keys`), no sort of the whole row.
    float64 scores (the reference path) take two stable sorts, by score with NaN as ``-inf``, then by "is NaN"."""
    if scores.dtype == torch.float32 and scores.shape[-1] < MAX_ID:
        return MAX_ID - (merge_keys(scores, 0, None, None, k) & MAX_ID)
    is_nan = scores.isnan()
    by_score = torch.where(is_nan, float("-inf"), scores).sort(dim=-1, descending=True, stable=True).indices
    nan_last = is_nan.gather(-1, by_score).to(torch.uint8).sort(dim=-1, stable=True).indices
    return by_score.gather(-1, nan_last)[:, :k]


def merge_top_k(
    best_scores: torch.Tensor,
    best_ids: torch.Tensor,
    new_scores: torch.Tensor,
    new_ids: torch.Tensor,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold candidates ``[Nq, n]`` into a running top-k ``[Nq, m]``: the ``k`` best of both, in rank order.

    The running best must be in rank order already and every id in it must be lower than every id of the new
    candidates (true when a corpus is walked in id order, or per-rank results are concatenated in rank order):
    then :func:`rank` of the concatenation breaks ties by lower id. Runs on the tensors' device,
    with no host synchronisation.
    """
    candidates = torch.cat([best_scores, new_scores], dim=1)
    candidate_ids = torch.cat([best_ids, new_ids], dim=1)
    keep = rank(candidates, min(k, candidates.shape[1]))
    return candidates.gather(1, keep), candidate_ids.gather(1, keep)


@torch.no_grad()
def search(
    Q: torch.Tensor,
    D: torch.Tensor,
    k: int,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    mask_mode: str = "exclude",
    chunk_size: int | None = None,
    q_scale: torch.Tensor | None = None,
    d_scale: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k MaxSim search: the ``k`` documents of ``D`` with the highest :func:`lik.maxsim` score.

    Args:
        Q: queries, ``[Lq, d]`` or ``[Nq, Lq, d]``; float16, bfloat16, float32 (or float64: reference only). Queries
            of different lengths: a list of ``[Lq_i, d]`` tensors, or packed ``[sum Lq_i, d]`` with
            ``cu_seqlens_q``; they are scored in dense buckets of similar length (:mod:`lik.retrieval.queries`),
            with the results of one call per query, ``[Nq, k]``.
        D: the corpus, ``[B, Ld, d]``, same dtype and device as ``Q`` (CUDA: fused kernels; CPU: reference).
        k: number of results per query, ``0 <= k <= B``.
        q_mask: optional bool ``[Lq]`` / ``[Nq, Lq]``, True for real query tokens.
        d_mask: optional bool ``[B, Ld]``, True for real document tokens (padding False).
        mask_mode: ``"exclude"`` (default) or ``"zero"``, as in :func:`lik.maxsim`.
        chunk_size: documents scored at once; by default as many as keep the chunk's scores and merge buffers
            within 256 MB.
        q_scale, d_scale: an 8-bit corpus, as in :func:`lik.maxsim`: ``D`` int8 / float8_e4m3fn from
            :func:`lik.quantize` with its fp32 ``d_scale [B, Ld]``; ``Q`` of the same dtype with ``q_scale``, or
            float (quantized per token once, before the first chunk). Ragged 8-bit queries: ``q_scale`` a list
            of ``[Lq_i]`` (list ``Q``) or ``[sum Lq_i]`` (packed ``Q``).
        cu_seqlens_q: int32 / int64 ``[Nq + 1]`` offsets of packed queries ``Q [sum Lq_i, d]`` (from 0,
            non-decreasing, ending at ``Q.shape[0]``; read once on the host: a CPU tensor costs no sync).

    Returns:
        ``(scores, indices)``: float32 scores (float64 for float64 inputs) and int64 document indices into ``D``,
        ``[k]`` for 2-D ``Q`` and ``[Nq, k]`` for 3-D ``Q`` and ragged queries (a zero-length query scores 0).
        Rows are ordered by descending score, ties by lower document index, NaN scores last. The scores carry no
        gradient (rescore the hits with :func:`lik.maxsim` to train through them).

    Raises:
        ValueError / TypeError naming the argument: bad shapes, dtypes, devices or masks (as :func:`lik.maxsim`),
        ``D`` with a per-query ``[Nq, B, Ld, d]`` layout, ``k`` outside ``[0, B]``, ``chunk_size < 1``.

    Example:
        >>> Q = torch.nn.functional.normalize(torch.randn(4, 32, 128), dim=-1).half().cuda()
        >>> D = torch.nn.functional.normalize(torch.randn(10_000, 300, 128), dim=-1).half().cuda()
        >>> scores, indices = lik.search(Q, D, k=10)     # [4, 10] float32, [4, 10] int64
        >>> D_q, d_scale = lik.quantize(D, torch.int8)
        >>> scores, indices = lik.search(Q, D_q, k=10, d_scale=d_scale)
        >>> scores, indices = lik.search([Q[0, :20], Q[1], Q[2, :7]], D, k=10)   # [3, 10] each
    """
    ragged = ragged_queries(Q, cu_seqlens_q, q_scale)
    if ragged is None:
        bundles = [(None, MaxSimInputs.build(Q, D, q_mask, d_mask, mask_mode, allow_float64=True, q_scale=q_scale,
                                             d_scale=d_scale))]
        n_queries = bundles[0][1].q.shape[0]
    else:
        if q_mask is not None:
            raise ValueError("q_mask must be None for ragged queries (a list, or packed with cu_seqlens_q): they "
                             "have no padding")
        # One bundle per bucket of similar lengths, each validated here, at the edge, as lik.maxsim validates.
        bundles = [(bucket, MaxSimInputs.build(bucket.q, D, bucket.mask, d_mask, mask_mode, allow_float64=True,
                                               q_scale=bucket.scale, d_scale=d_scale))
                   for bucket in buckets(ragged)]
        n_queries = len(ragged.lengths)
    inputs = bundles[0][1]
    if inputs.per_query_documents:
        raise ValueError(
            f"D must be a shared corpus [B, Ld, d] for search, got shape {list(D.shape)}; "
            "score per-query candidate sets with lik.maxsim"
        )
    n_docs, device = inputs.d.shape[1], inputs.q.device
    k = _check_k(k, n_docs)
    chunk_size = _check_chunk_size(chunk_size, n_queries)
    finish = inputs.finish if ragged is None else (lambda t: t)

    score_dtype = accumulation_dtype(inputs.q.dtype)
    if k == 0 or n_queries == 0:
        empty_scores = torch.empty(n_queries, k, dtype=score_dtype, device=device)
        empty_indices = torch.empty(n_queries, k, dtype=torch.int64, device=device)
        return finish(empty_scores), finish(empty_indices)

    # float32 scores: the running top-k as one int64 key per candidate, merged by one topk per chunk
    # (lik.retrieval.keys); float64 (the reference) merges scores and indices.
    keyed = score_dtype == torch.float32 and n_docs < MAX_ID
    best = best_scores = best_indices = None
    for start in range(0, n_docs, chunk_size):
        stop = min(n_docs, start + chunk_size)
        parts = [(bucket, score_canonical(_documents(bundle, start, stop))) for bucket, bundle in bundles]
        chunk_scores = parts[0][1] if ragged is None else assemble(parts, n_queries, stop - start, score_dtype, device)
        if keyed:
            best = merge_keys(chunk_scores, start, None, best, k, decode=stop == n_docs)  # the last also decodes
            continue
        chunk_indices = torch.arange(start, stop, device=device).expand(n_queries, -1)
        if best_scores is None:
            best_scores, best_indices = chunk_scores[:, :0], chunk_indices[:, :0]
        best_scores, best_indices = merge_top_k(best_scores, best_indices, chunk_scores, chunk_indices, k)
    if keyed:
        best_scores, best_indices = best
    return finish(best_scores), finish(best_indices)


def _documents(inputs: MaxSimInputs, start: int, stop: int) -> MaxSimInputs:
    """Documents ``[start, stop)`` of a validated bundle: views, nothing checked again."""
    return MaxSimInputs(
        inputs.q, inputs.d[:, start:stop], inputs.q_mask,
        None if inputs.d_mask is None else inputs.d_mask[:, start:stop], inputs.mask_mode, False, False,
        inputs.q_scale, None if inputs.d_scale is None else inputs.d_scale[:, start:stop],
    )
