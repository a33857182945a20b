"""PLAID's candidate generation (ColBERTv2's search engine, as colbert-ai and fast-plaid run it), in torch ops.

A compressed corpus keeps one centroid id per token (``codes``). Candidates for a query come from three stages:

1. **Centroid scores**: ``S = Q @ centroids.T``, one product per block of queries.
2. **IVF probe**: every valid query token's ``n_probe`` best centroids; the query's candidates are the union of
   the documents having a token assigned to any of them (the IVF of :func:`build_ivf`).
3. **Centroid interaction**: each candidate's approximate score is MaxSim with every document token replaced by its
   centroid, ``sum_s max_t S[s, codes[t]]``, read from ``S`` through the codes (no residual is decoded). With
   ``centroid_score_threshold`` a centroid whose best score over the query's tokens is below it is dropped from
   every document first (colbert-ai's ``centroid_score_threshold``). The best ``n_candidates`` are kept.

colbert-ai and fast-plaid run stage 3 twice (ColBERT: pruned then full centroid scores, keeping ``ndocs`` then
``ndocs / 4``); here it runs once and the caller scores what it keeps exactly.
"""

from __future__ import annotations

import torch

from .. import _device
from .interaction import centroid_interaction, centroid_interaction_torch

__all__ = ["build_ivf", "generate_candidates", "BLOCK_BYTES"]

# Bound of each stage's temporaries (centroid scores of a query block, expanded (query, cell, doc) entries, gathered
# token scores): big enough that 256 queries take a few blocks against 2**18 centroids, small next to an H200.
BLOCK_BYTES = 1 << 30
# Bytes per expanded (query, cell, document) entry while the union is made: its key, the sort's copy and indices.
_ENTRY_BYTES = 32


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_index_tensor(name: str, t, device=None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} (with the other inputs), got {t.device}")
    return t


class _ValueChecks:
    """Checks that read the data: their flags are stacked and read with one synchronisation, then the first
    failing one raises (a GPU call pays one round trip for all of them)."""

    def __init__(self, enabled: bool = True):
        # Disabled: no check reads the data at all (not even without synchronising).
        self.enabled, self.flags, self.errors = enabled, [], []

    def add(self, flag: torch.Tensor, error: Exception) -> None:
        self.flags.append(flag.reshape(()))
        self.errors.append(error)

    def run(self) -> None:
        bad = torch.stack(self.flags).tolist() if self.flags else []
        for failed, error in zip(bad, self.errors):
            if failed:
                raise error


def _check_offsets(name: str, offsets: torch.Tensor, total: int, what: str, checks: _ValueChecks) -> torch.Tensor:
    """int64 offsets, to rise from 0 to ``total`` (checked by ``checks``)."""
    if offsets.numel() < 1:
        raise ValueError(f"{name} must have at least one entry (offsets [{what} + 1])")
    offsets = offsets.long()
    if not checks.enabled:
        return offsets
    bad = (offsets[0] != 0) | (offsets[-1] != total) | (offsets.diff() < 0).any()
    checks.add(bad, ValueError(f"{name} must rise from 0 to {total} without decreasing"))
    return offsets


def _check_range(name: str, t: torch.Tensor, upper: int, what: str, checks: _ValueChecks) -> None:
    if t.numel() and checks.enabled:
        checks.add((t.min() < 0) | (t.max() >= upper), ValueError(f"{name} must lie in [0, {upper}) ({what})"))


def _check_corpus(codes, cu_seqlens, num_centroids: int, checks: _ValueChecks, device=None):
    codes = _check_index_tensor("codes", codes, device)
    cu_seqlens = _check_index_tensor("cu_seqlens", cu_seqlens, codes.device)
    cu = _check_offsets("cu_seqlens", cu_seqlens, codes.numel(), "N", checks)
    _check_range("codes", codes, num_centroids, "the centroids", checks)
    return codes, cu


def _doc_blocks(cu: torch.Tensor, max_tokens: int) -> list[tuple[int, int]]:
    """Consecutive document ranges of at most ``max_tokens`` tokens each (a longer document alone)."""
    host = cu.cpu()
    n, blocks, start = host.numel() - 1, [], 0
    while start < n:
        stop = int(torch.searchsorted(host, host[start] + max_tokens, right=True)) - 1
        stop = min(max(stop, start + 1), n)
        blocks.append((start, stop))
        start = stop
    return blocks


def _expand_ranges(starts: torch.Tensor, sizes: torch.Tensor, total: int) -> torch.Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, sizes)])`` without a loop (``total = sizes.sum()``)."""
    before = sizes.cumsum(0) - sizes
    return torch.repeat_interleave(starts - before, sizes, output_size=total) + torch.arange(total, device=sizes.device)


def build_ivf(codes: torch.Tensor, cu_seqlens: torch.Tensor, num_centroids: int):
    """The inverted file of a compressed corpus: for each centroid, the documents having a token assigned to it.

    Args:
        codes: int32 / int64 ``[T]``, each token's centroid in ``[0, num_centroids)``.
        cu_seqlens: int32 / int64 ``[N + 1]`` document offsets into ``codes`` (0 to ``T``, non-decreasing; empty
            documents allowed and never listed).
        num_centroids: ``C``, at least 0 (0 only for an empty corpus).

    Returns:
        ``(ivf_doc_ids int32 [P], ivf_offsets int64 [C + 1])``: centroid ``c``'s documents are
        ``ivf_doc_ids[ivf_offsets[c]:ivf_offsets[c + 1]]``, local positions ``0 .. N - 1``, sorted and unique.

    One ``(centroid, document)`` key per token, made unique by a sort, in blocks of documents (temporaries about
    ``32 * T`` bytes per block of at most ``BLOCK_BYTES / 32`` tokens), then one stable sort by centroid.

    Example::

        >>> ids, offsets = build_ivf(torch.tensor([2, 0, 2, 1], dtype=torch.int32), torch.tensor([0, 3, 3, 4]), 3)
        >>> ids.tolist(), offsets.tolist()
        ([0, 2, 0], [0, 1, 2, 3])
    """
    if not _is_int(num_centroids) or num_centroids < 0:
        raise ValueError(f"num_centroids must be a non-negative int, got {num_centroids!r}")
    checks = _ValueChecks()
    codes, cu = _check_corpus(codes, cu_seqlens, num_centroids, checks)
    checks.run()
    device = codes.device
    offsets = torch.zeros(num_centroids + 1, dtype=torch.int64, device=device)
    lengths = cu.diff()
    cents, docs = [], []
    for d0, d1 in _doc_blocks(cu, max(1, BLOCK_BYTES // _ENTRY_BYTES)) if codes.numel() else []:
        t0, t1, n = int(cu[d0]), int(cu[d1]), d1 - d0
        local = torch.repeat_interleave(torch.arange(n, device=device), lengths[d0:d1], output_size=t1 - t0)
        keys = torch.unique(codes[t0:t1].long() * n + local)  # sorted: by centroid, then document
        cents.append((keys // n).to(torch.int32))
        docs.append((keys % n + d0).to(torch.int32))
    if not cents:
        return torch.empty(0, dtype=torch.int32, device=device), offsets
    cent, doc = torch.cat(cents), torch.cat(docs)
    if len(cents) > 1:  # blocks come in document order, so a stable sort by centroid keeps each list sorted
        order = torch.sort(cent, stable=True).indices
        cent, doc = cent[order], doc[order]
    offsets[1:] = torch.bincount(cent, minlength=num_centroids).cumsum(0)
    return doc, offsets


def _centroid_scores(Q: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """fp32 ``[nq, C, Lq]``: ``S`` stored centroid-major, so that a token's scores for every query token are one
    contiguous row. Half inputs multiply in their dtype on a GPU (tensor cores, fp32 accumulation)."""
    half = Q.dtype == centroids.dtype and Q.dtype in (torch.float16, torch.bfloat16)
    if not (half and Q.is_cuda):
        Q, centroids = Q.float(), centroids.float()
    return torch.matmul(centroids.unsqueeze(0), Q.transpose(1, 2)).float()


def _rank(scores, pair_q, pair_doc, nq: int, n_candidates: int, out: torch.Tensor) -> None:
    """Write each query's best ``n_candidates`` documents into ``out`` ``[nq, n_candidates]``: descending score,
    ties (and NaN, ranked as -inf) to the lower document. Pairs arrive sorted by (query, document)."""
    scores = torch.nan_to_num(scores, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    order = torch.sort(scores, descending=True, stable=True).indices
    order = order[torch.sort(pair_q[order], stable=True).indices]
    q, doc = pair_q[order], pair_doc[order]
    starts = torch.bincount(q, minlength=nq).cumsum(0)
    rank = torch.arange(q.numel(), device=q.device) - (starts - torch.bincount(q, minlength=nq))[q]
    kept = rank < n_candidates
    out[q[kept], rank[kept]] = doc[kept]


def _check_queries(Q, q_mask, centroids):
    if not isinstance(Q, torch.Tensor) or not Q.dtype.is_floating_point:
        raise TypeError(f"Q must be a floating torch.Tensor, got {getattr(Q, 'dtype', type(Q).__name__)}")
    if Q.dim() != 3:
        raise ValueError(f"Q must be 3-D [Nq, Lq, d], got shape {tuple(Q.shape)}")
    if not isinstance(centroids, torch.Tensor) or not centroids.dtype.is_floating_point:
        raise TypeError("centroids must be a floating torch.Tensor")
    if centroids.dim() != 2 or centroids.shape[1] != Q.shape[2]:
        raise ValueError(f"centroids must be [C, {Q.shape[2]}] (Q's d), got shape {tuple(centroids.shape)}")
    if centroids.device != Q.device:
        raise ValueError(f"centroids must be on Q's device {Q.device}, got {centroids.device}")
    if q_mask is None:
        return torch.ones(Q.shape[:2], dtype=torch.bool, device=Q.device)
    if not isinstance(q_mask, torch.Tensor) or q_mask.dtype != torch.bool:
        raise TypeError("q_mask must be a bool tensor [Nq, Lq] or None")
    if q_mask.shape != Q.shape[:2] or q_mask.device != Q.device:
        raise ValueError(f"q_mask must be [Nq, Lq] = {list(Q.shape[:2])} on Q's device, got {list(q_mask.shape)}")
    return q_mask


def generate_candidates(
    Q,
    q_mask,
    centroids,
    ivf_doc_ids,
    ivf_offsets,
    codes,
    cu_seqlens,
    *,
    n_probe: int,
    n_candidates: int,
    centroid_score_threshold: float | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """PLAID's candidates: IVF probe, then centroid-interaction pruning (see the module docstring).

    Args:
        Q: float ``[Nq, Lq, d]`` queries (fp16 / bf16 / fp32).
        q_mask: bool ``[Nq, Lq]``, True for a real query token, or None. A masked token probes nothing and adds
            nothing; a query without a valid token gets no candidate.
        centroids: float ``[C, d]``, the codec's centroids.
        ivf_doc_ids, ivf_offsets: the corpus's IVF, from :func:`build_ivf` over ``codes`` and ``cu_seqlens``.
        codes: int32 / int64 ``[T]``, each token's centroid; cu_seqlens: int32 / int64 ``[N + 1]`` offsets.
        n_probe: centroids probed per query token, ``>= 1`` (more than ``C`` probes every centroid).
        n_candidates: documents returned per query, ``>= 0``.
        centroid_score_threshold: optional; centroids whose best score over the query's valid tokens is below it
            are left out of the approximate scores (a candidate with no other token ranks after every one that
            has one). colbert-ai uses 0.5 for k = 10, 0.45 for k = 100, 0.4 for k = 1000.
        check_values: False skips the checks that read the corpus's values (codes in range, offsets rising, IVF
            ids in range: a pass over every code, a few ms at a billion tokens, on each call); for a caller whose
            corpus is known good, such as :class:`lik.Index`'s own chunks. Shapes, dtypes and arguments are
            always checked.

    Returns:
        int64 ``[Nq, n_candidates]`` local document positions on ``Q``'s device: best approximate score first,
        ties to the lower position, NaN scores last, ``-1`` after a query's last candidate. Documents without
        tokens are never candidates. With ``n_probe >= C`` and ``n_candidates >= N`` every document with a token
        is returned for every query that has a valid token.

    Memory: every block of temporaries stays near ``BLOCK_BYTES`` (1 GiB): the centroid scores of a block of
    ``max(1, BLOCK_BYTES // (12 * Lq * C))`` queries, the (query, probed cell, document) entries of a group of
    those queries (32 bytes each, up to ``BLOCK_BYTES``; a single query past that runs alone, at most
    ``Lq * n_probe`` cells' lists). On a GPU stage 3 is one kernel (:mod:`lik.compression.interaction`) that
    keeps each pair's running max in registers; the CPU gathers ``12 * Lq`` bytes per candidate token, in blocks.
    So 256 queries of 32 tokens against 2**18 centroids and a billion tokens need a few GiB, not the 34 GiB of
    all centroid scores at once.

    Example::

        >>> centroids = torch.eye(4)
        >>> codes, cu = torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32), torch.tensor([0, 2, 3, 5])
        >>> ids, offsets = build_ivf(codes, cu, 4)
        >>> Q = torch.tensor([[[0.0, 0.0, 0.0, 1.0]]])
        >>> generate_candidates(Q, None, centroids, ids, offsets, codes, cu, n_probe=1, n_candidates=2).tolist()
        [[2, -1]]
    """
    valid = _check_queries(Q, q_mask, centroids)
    device, C = Q.device, centroids.shape[0]
    checks = _ValueChecks(bool(check_values))
    codes, cu = _check_corpus(codes, cu_seqlens, C, checks, device)
    ivf_doc_ids = _check_index_tensor("ivf_doc_ids", ivf_doc_ids, device)
    ivf_offsets = _check_index_tensor("ivf_offsets", ivf_offsets, device)
    if ivf_offsets.numel() != C + 1:
        raise ValueError(
            f"ivf_offsets must have C + 1 = {C + 1} entries (one list per centroid), got {ivf_offsets.numel()}"
        )
    ivf_offsets = _check_offsets("ivf_offsets", ivf_offsets, ivf_doc_ids.numel(), "C", checks)
    n_docs = cu.numel() - 1
    _check_range("ivf_doc_ids", ivf_doc_ids, n_docs, "the documents of cu_seqlens", checks)
    if not _is_int(n_probe) or n_probe < 1:
        raise ValueError(f"n_probe must be a positive int, got {n_probe!r}")
    if not _is_int(n_candidates) or n_candidates < 0:
        raise ValueError(f"n_candidates must be a non-negative int, got {n_candidates!r}")
    threshold = centroid_score_threshold
    if threshold is not None and (
        isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold != threshold
    ):
        raise ValueError(f"centroid_score_threshold must be a number or None, got {threshold!r}")
    checks.run()  # the one synchronisation of the checks, after every check that needs none

    Nq, Lq, _ = Q.shape
    out = torch.full((Nq, n_candidates), -1, dtype=torch.int64, device=device)
    if 0 in (Nq, Lq, n_candidates, codes.numel()):
        return out
    n_probe = min(n_probe, C)
    sizes_all = ivf_offsets.diff()
    max_entries = max(1, BLOCK_BYTES // _ENTRY_BYTES)
    block = max(1, BLOCK_BYTES // (12 * Lq * C))  # the scores, the threshold's masked copy, the top-k
    for q0 in range(0, Nq, block):
        v = valid[q0 : q0 + block]
        nq = v.shape[0]
        # Zeroed masked tokens keep NaN / inf padding out of the scores, the probe and the threshold.
        St = _centroid_scores(Q[q0 : q0 + block].masked_fill(~v.unsqueeze(2), 0), centroids)
        keep = None
        if threshold is not None:
            keep = St.masked_fill(~v.unsqueeze(1), float("-inf")).amax(2) >= threshold  # [nq, C]
        # Stage 2: each valid token's best cells, one key per (query, cell), unique.
        cells = St.topk(n_probe, dim=1).indices  # [nq, n_probe, Lq]
        qs = torch.arange(nq, device=device).view(nq, 1, 1)
        keys = torch.where(v.unsqueeze(1), qs * C + cells, nq * C)
        keys = torch.unique(keys.flatten())
        keys = keys[keys < nq * C]
        cell_q, cell = keys // C, keys % C
        sizes = sizes_all[cell]
        per_query = torch.zeros(nq, dtype=torch.int64, device=device).index_add_(0, cell_q, sizes).tolist()
        g0 = 0
        while g0 < nq:  # groups of queries whose entries fit the budget
            g1, entries = g0 + 1, per_query[g0]
            while g1 < nq and entries + per_query[g1] <= max_entries:
                entries += per_query[g1]
                g1 += 1
            lo, hi = torch.searchsorted(cell_q, torch.tensor([g0, g1], device=device)).tolist()
            if entries:
                s = sizes[lo:hi]
                doc = ivf_doc_ids[_expand_ranges(ivf_offsets[cell[lo:hi]], s, entries)].long()
                owner = torch.repeat_interleave(cell_q[lo:hi], s, output_size=entries)
                pairs = torch.unique(owner * n_docs + doc)  # the union per query, sorted by (query, document)
                pair_q, pair_doc = pairs // n_docs, pairs % n_docs
                # Stage 3: centroid interaction, then each query's best.
                if St.is_cuda or _device.interpreting():
                    scores = centroid_interaction(St, v, keep, pair_q, pair_doc, codes, cu)
                else:
                    scores = centroid_interaction_torch(St, v, keep, pair_q, pair_doc, codes, cu, BLOCK_BYTES)
                _rank(scores, pair_q - g0, pair_doc, g1 - g0, n_candidates, out[q0 + g0 : q0 + g1])
            g0 = g1
    return out
