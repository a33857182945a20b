"""Search of a compressed (PLAID) :class:`lik.Index`: an exhaustive scan or candidate generation, both scored by
MaxSim against the residual codes decoded on chip.

* Exhaustive: every live document of every chunk is scored (:func:`residual_scorer` plugged into
  :func:`lik.index.search.search_buckets`, which also does the chunking, filters, removed documents and merges).
* Candidates: per chunk, :mod:`lik.compression.candidates` probes the ``n_probe`` centroids nearest each query
  token in an inverted file (IVF: centroid -> documents holding a token of it) and prunes by centroid
  interaction down to ``candidates`` documents per query (per chunk: a GPU-resident index is one chunk, a
  streamed one has a chunk per ``chunk_tokens``); for each group of about ``SCORED_PAIRS / candidates``
  queries the union of their candidates is gathered into a packed sub-corpus, scored once, and each query keeps
  the scores of its own candidates (a whole batch of 256 at once would score 256 times the pairs it needs).

The IVF is not stored: it is rebuilt from the codes, per chunk, by the first candidate search of an index state
and kept until ``add`` / ``remove`` / ``compact`` makes a new state (on the device for a GPU-resident index, in
host memory for a streamed one). It costs one sort of the codes (milliseconds per million tokens on a GPU) and at
most 4 bytes a token, and it can never disagree with the shards (a loaded, compacted or appended index has the IVF
of exactly its codes).

Automatic mode (``n_probe=None, candidates=None``): exhaustive while the process holds at most
:data:`EXHAUSTIVE_TOKENS` tokens, candidates beyond (``n_probe`` :data:`DEFAULT_N_PROBE`, ``candidates``
``max(k, DEFAULT_CANDIDATES)``); passing either argument asks for candidate generation.
"""

from __future__ import annotations

import importlib

import torch

from ..ops.residual import score_residual_packed
from ..retrieval.exact import merge_top_k
from .building import as_int
from .placement import StreamedSource

__all__ = [
    "EXHAUSTIVE_TOKENS",
    "DEFAULT_N_PROBE",
    "DEFAULT_CANDIDATES",
    "SCORED_PAIRS",
    "score_residual",
    "residual_scorer",
    "search_mode",
    "search_candidates",
]

# A scan decodes every token once per query batch: 32 Mi tokens at 2 bits are 1.1 GB of codes and residuals, a
# few tens of ms on an H200; beyond that the probe's cost (a product with the centroids) wins.
EXHAUSTIVE_TOKENS = 1 << 25
DEFAULT_N_PROBE = 8  # fast-plaid's default
DEFAULT_CANDIDATES = 4096  # fast-plaid's default count of fully scored documents
# Candidate (query, document) pairs a scoring group covers: 8 queries of 4 096 candidates score the union of their
# candidates (at most 32 Ki documents) in one call; all 256 of a batch at once would score 256 times their pairs.
SCORED_PAIRS = 1 << 15


def score_residual(Q, q_mask, codes, residuals, codec, cu_seqlens) -> torch.Tensor:
    """fp32 ``[Nq, N]``: MaxSim of queries ``Q [Nq, Lq, d]`` (bool ``q_mask [Nq, Lq]`` or ``None``) against the
    packed compressed documents (int32 ``codes [T]``, uint8 ``residuals [T, d * nbits / 8]``, ``cu_seqlens
    [N + 1]`` int32) of ``codec`` on ``Q``'s device, without autograd or checks (a stored index's chunks are
    known good: codes were range-checked at load). The one call of the residual scorer in lik.Index."""
    with torch.no_grad():
        return score_residual_packed(Q, q_mask, codes, residuals, codec, cu_seqlens).float()


def residual_scorer(codec):
    """A ``scorer`` for :func:`lik.index.search.search_buckets` over compressed chunks (``tokens`` = residuals,
    ``scale`` = codes)."""

    def score(bucket, residuals, cu_seqlens, codes):
        return score_residual(bucket.q, bucket.mask, codes, residuals, codec, cu_seqlens)

    return score


def search_mode(n_probe, candidates, k: int, tokens_held: int, num_centroids: int) -> tuple[int, int] | None:
    """``None`` for an exhaustive scan, else ``(n_probe, candidates)``, checked (one-line errors)."""
    if n_probe is None and candidates is None:
        if tokens_held <= EXHAUSTIVE_TOKENS:
            return None
    n_probe = DEFAULT_N_PROBE if n_probe is None else as_int(n_probe, "n_probe")
    if n_probe < 1:
        raise ValueError(f"n_probe must be positive, got {n_probe}")
    candidates = max(k, DEFAULT_CANDIDATES) if candidates is None else as_int(candidates, "candidates")
    if candidates < max(k, 1):
        raise ValueError(f"candidates must be at least k ({k}) and positive, got {candidates}")
    return min(n_probe, num_centroids), candidates


def _candidates_module():
    """:mod:`lik.compression.candidates` (imported on first use, so an exhaustive search never needs it)."""
    try:
        return importlib.import_module("lik.compression.candidates")
    except ImportError as error:
        raise ValueError(
            "n_probe / candidates: candidate generation needs lik.compression.candidates, which this "
            "lik lacks; search with n_probe=None, candidates=None (exhaustive)"
        ) from error


def _ivf(source, number: int, chunk, num_centroids: int, module):
    """The chunk's IVF, built on first use and kept with the source (one per index state): on the device for a
    resident index, in host memory for a streamed one (copied to the device with its chunk)."""
    cache = source.__dict__.setdefault("ivf", {})
    if number not in cache:
        ivf = module.build_ivf(chunk.scale, chunk.cu_seqlens, num_centroids)
        cache[number] = tuple(t.cpu() for t in ivf) if isinstance(source, StreamedSource) else ivf
    return tuple(t.to(chunk.scale.device) for t in cache[number])


def _gather(chunk, docs: torch.Tensor):
    """The packed sub-corpus of documents ``docs`` (sorted chunk positions, int64 on the device): residuals,
    codes, int32 cu_seqlens."""
    cu = chunk.cu_seqlens.to(torch.int64)
    starts, lengths = cu[docs], cu[docs + 1] - cu[docs]
    sub_cu = torch.zeros(docs.numel() + 1, dtype=torch.int64, device=docs.device)
    sub_cu[1:] = lengths.cumsum(0)
    rows = torch.repeat_interleave(starts - sub_cu[:-1], lengths) + torch.arange(int(sub_cu[-1]), device=docs.device)
    return chunk.tokens[rows], chunk.scale[rows], sub_cu.to(torch.int32)


@torch.no_grad()
def search_candidates(
    queries, n_queries: int, source, selection, k: int, codec, n_probe: int, n_candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` by candidate generation over the selected chunks (as :func:`lik.index.search.search_buckets`
    takes them): ``(scores fp32 [Nq, k], positions int64 [Nq, k])``; where fewer than ``k`` documents were
    candidates, the rest is score ``-inf``, position ``-1``."""
    module = _candidates_module()
    device = source.device
    scores_out = torch.full((n_queries, k), float("-inf"), device=device)
    ids_out = torch.full((n_queries, k), -1, dtype=torch.int64, device=device)
    if k == 0 or n_queries == 0:
        return scores_out, ids_out
    numbers = [n for n, _ in selection]
    locals_ = [None if local is None else local.to(device) for _, local in selection]
    queries = [b._replace(q=b.q.to(device), mask=None if b.mask is None else b.mask.to(device)) for b in queries]
    best = [
        (torch.empty(len(b.rows), 0, device=device), torch.empty(len(b.rows), 0, dtype=torch.int64, device=device))
        for b in queries
    ]
    centroids = codec.centroids.to(device)
    big = torch.iinfo(torch.int64).max
    for chunk, number, local in zip(source.chunks(numbers), numbers, locals_):
        ivf_ids, ivf_offsets = _ivf(source, number, chunk, codec.num_centroids, module)
        keep = None
        if local is not None:
            keep = torch.zeros(chunk.num_docs, dtype=torch.bool, device=device)
            keep[local] = True
        for slot, bucket in enumerate(queries):
            found = module.generate_candidates(
                bucket.q,
                bucket.mask,
                centroids,
                ivf_ids,
                ivf_offsets,
                chunk.scale,
                chunk.cu_seqlens,
                n_probe=n_probe,
                n_candidates=n_candidates,
                check_values=False,  # the index's own chunks: codes were range-checked when they were made
            )
            found = found.to(device, torch.int64)
            valid = found >= 0
            if keep is not None:
                valid &= keep[found.clamp(min=0)]
            # Each row in increasing position, so that merge_top_k's rank breaks ties to the lower id.
            found = torch.where(valid, found, big).sort(dim=1).values
            valid = found != big
            own = torch.full(found.shape, float("-inf"), device=device)
            # A group of queries scores the union of its candidates, each query every document of it: groups of
            # about SCORED_PAIRS // candidates queries keep that union's waste (its size times the group's) bounded.
            group = max(1, SCORED_PAIRS // max(n_candidates, 1))
            for g0 in range(0, found.shape[0], group):
                f, v = found[g0 : g0 + group], valid[g0 : g0 + group]
                docs = torch.unique(f[v])
                if docs.numel() == 0:
                    continue
                residuals, codes, sub_cu = _gather(chunk, docs)
                mask = None if bucket.mask is None else bucket.mask[g0 : g0 + group]
                scored = score_residual(bucket.q[g0 : g0 + group], mask, codes, residuals, codec, sub_cu)
                mine = scored.gather(1, torch.searchsorted(docs, torch.where(v, f, docs[0])))
                own[g0 : g0 + group] = torch.where(v, mine, float("-inf"))
            ids = torch.where(valid, found + chunk.first_id, -1)
            best[slot] = merge_top_k(*best[slot], own, ids, k)
    for bucket, (scores, ids) in zip(queries, best):
        rows = torch.as_tensor(bucket.rows, device=device)
        scores_out[rows, : scores.shape[1]] = scores
        ids_out[rows, : ids.shape[1]] = torch.where(torch.isneginf(scores), -1, ids)
    return scores_out, ids_out
