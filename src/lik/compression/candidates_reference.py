"""The specification of :mod:`lik.compression.candidates`: PLAID's stages in float64, one query and one document
at a time, with no IVF (the probe reads the codes directly), so that it checks :func:`build_ivf` too."""

from __future__ import annotations

import math

import torch

__all__ = ["build_ivf_reference", "generate_candidates_reference"]


def build_ivf_reference(codes: torch.Tensor, cu_seqlens: torch.Tensor, num_centroids: int):
    """``(ivf_doc_ids int32 [P], ivf_offsets int64 [C + 1])`` by a loop over documents and their tokens.

    Example::

        >>> build_ivf_reference(torch.tensor([1, 1]), torch.tensor([0, 2]), 2)[1].tolist()
        [0, 0, 1]
    """
    lists = [set() for _ in range(num_centroids)]
    cu = cu_seqlens.tolist()
    for doc in range(len(cu) - 1):
        for code in codes[cu[doc] : cu[doc + 1]].tolist():
            lists[code].add(doc)
    ids = [doc for docs in lists for doc in sorted(docs)]
    offsets = [0]
    for docs in lists:
        offsets.append(offsets[-1] + len(docs))
    return torch.tensor(ids, dtype=torch.int32), torch.tensor(offsets, dtype=torch.int64)


def generate_candidates_reference(
    Q,
    q_mask,
    centroids,
    codes,
    cu_seqlens,
    *,
    n_probe: int,
    n_candidates: int,
    centroid_score_threshold: float | None = None,
) -> torch.Tensor:
    """int64 ``[Nq, n_candidates]`` (CPU): for each query, the documents having a token whose centroid is among
    some valid query token's ``n_probe`` best (float64 scores), ranked by ``sum over valid s of max over the
    document's kept tokens of S[s, code]`` (-inf without a kept token, NaN as -inf), ties to the lower document,
    ``-1`` padded.

    Example::

        >>> generate_candidates_reference(torch.ones(1, 1, 2), None, torch.eye(2), torch.tensor([1]),
        ...                               torch.tensor([0, 1]), n_probe=2, n_candidates=2).tolist()
        [[0, -1]]
    """
    Nq, Lq, _ = Q.shape
    mask = torch.ones(Nq, Lq, dtype=torch.bool) if q_mask is None else q_mask.cpu()
    cu, all_codes = cu_seqlens.tolist(), codes.tolist()
    c64 = centroids.double().cpu()
    out = torch.full((Nq, n_candidates), -1, dtype=torch.int64)
    for i in range(Nq):
        tokens = [s for s in range(Lq) if mask[i, s]]
        S = Q[i].double().cpu() @ c64.T  # [Lq, C]
        probed = set()
        for s in tokens:
            probed |= set(S[s].topk(min(n_probe, c64.shape[0])).indices.tolist())
        kept = None
        if centroid_score_threshold is not None and tokens:
            kept = {c for c in range(c64.shape[0]) if float(S[tokens, c].max()) >= centroid_score_threshold}
        ranked = []
        for doc in range(len(cu) - 1):
            doc_codes = all_codes[cu[doc] : cu[doc + 1]]
            if not probed.intersection(doc_codes):
                continue
            scored = doc_codes if kept is None else [c for c in doc_codes if c in kept]
            # torch's amax, unlike Python's max, propagates NaN whatever the order.
            score = float(S[tokens][:, scored].amax(1).sum()) if scored else -math.inf
            ranked.append((-math.inf if math.isnan(score) else score, doc))
        ranked.sort(key=lambda pair: (-pair[0], pair[1]))
        for r, (_, doc) in enumerate(ranked[:n_candidates]):
            out[i, r] = doc
    return out
