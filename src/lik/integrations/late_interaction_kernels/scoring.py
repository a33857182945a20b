"""late-interaction-kernels' core scoring on lik: ``maxsim``, ``maxsim_pairs``, ``maxsim_varlen``, ``retrieve`` and
``MaxSimScorer`` (see :mod:`lik.integrations.late_interaction_kernels` for what differs)."""

from __future__ import annotations

import operator

import torch

from ...ops.maxsim import maxsim as _lik_maxsim
from ...ops.maxsim import maxsim_packed
from ...retrieval import search

__all__ = ["maxsim", "maxsim_pairs", "maxsim_varlen", "retrieve", "MaxSimScorer"]

_BACKWARDS = {None: "auto", "auto": "auto", "unified": "fast", "lowmem": "deterministic"}


def _backward(backward) -> str:
    if not isinstance(backward, (str, type(None))) or backward not in _BACKWARDS:
        raise ValueError(f"backward= must be one of ('auto', 'unified', 'lowmem') or None, got {backward!r}")
    return _BACKWARDS[backward]


# Rows normalised per float32 chunk for inputs that need no gradient (a corpus in retrieve): bounded extra memory.
_NORMALIZE_CHUNK_ROWS = 1 << 16


def _normalized(x: torch.Tensor, normalize: bool) -> torch.Tensor:
    """``x`` L2-normalised per token. Half-precision rows are normalised in float32 and rounded once to their dtype,
    as a fused (or ``torch.compile``-d) normalisation rounds them, so eager and compiled scores agree."""
    if not normalize:
        return x
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float16, torch.bfloat16) or x.dim() == 0:
        return torch.nn.functional.normalize(x, p=2, dim=-1, eps=1e-12)
    if x.requires_grad and torch.is_grad_enabled():
        return torch.nn.functional.normalize(x.float(), p=2, dim=-1, eps=1e-12).to(x.dtype)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    for start in range(0, rows.shape[0], _NORMALIZE_CHUNK_ROWS):
        chunk = rows[start:start + _NORMALIZE_CHUNK_ROWS]
        out[start:start + _NORMALIZE_CHUNK_ROWS] = torch.nn.functional.normalize(chunk.float(), p=2, dim=-1,
                                                                                  eps=1e-12)
    return out.view(x.shape)


def _check_pair(Q, D) -> None:
    if not isinstance(Q, torch.Tensor) or not isinstance(D, torch.Tensor):
        raise TypeError(f"Q and D must be torch.Tensors, got {type(Q).__name__} and {type(D).__name__}")
    if Q.device != D.device:
        raise ValueError(f"Q and D must be on the same device; got Q.device={Q.device} vs D.device={D.device}.")


def _check_candidate_sets(Q: torch.Tensor, D: torch.Tensor, q_mask, d_mask) -> None:
    """The per-query layout ``D [Nq, K, Ld, d]``, with the peer's wording of its errors."""
    if Q.dim() != 3:
        raise ValueError(f"D [Nq, K, Ld, d] (one candidate set per query) needs Q to be [Nq, Lq, d]; got "
                         f"Q.shape={tuple(Q.shape)}")
    if Q.shape[0] != D.shape[0]:
        raise ValueError(f"D [Nq, K, Ld, d] needs D.shape[0] == Q.shape[0]; got Q.shape[0]={Q.shape[0]} vs "
                         f"D.shape[0]={D.shape[0]}.")
    if q_mask is not None and tuple(q_mask.shape) != tuple(Q.shape[:2]):
        raise ValueError(f"q_mask must be [Nq, Lq] = {list(Q.shape[:2])}; got {list(q_mask.shape)}.")
    if d_mask is not None and tuple(d_mask.shape) != tuple(D.shape[:3]):
        raise ValueError(f"d_mask must be [Nq, K, Ld] = {list(D.shape[:3])}; got {list(d_mask.shape)}.")


def maxsim(Q: torch.Tensor, D: torch.Tensor, q_mask: torch.Tensor | None = None,
           d_mask: torch.Tensor | None = None, *, normalize: bool = False, backward: str | None = None
           ) -> torch.Tensor:
    """Differentiable MaxSim (late-interaction-kernels' ``maxsim``).

    Args:
        Q: ``[Nq, Lq, d]`` or ``[Lq, d]``.
        D: ``[Ld, d]`` (one document), ``[Nd, Ld, d]`` (every query with every document) or ``[Nq, K, Ld, d]``
            (each query with its own ``K`` candidates).
        q_mask, d_mask: optional bool masks shaped like the token axes of ``Q`` / ``D``.
        normalize: L2-normalise ``Q`` and ``D`` per token first.
        backward: ``None`` / ``"auto"``, ``"unified"`` (fast) or ``"lowmem"`` (deterministic).

    Returns:
        float32: a scalar (2-D ``Q`` and ``D``), ``[Nq]`` (3-D ``Q``, 2-D ``D``), ``[Nd]`` (2-D ``Q``), ``[Nq, Nd]``
        or ``[Nq, K]``.

    Example:
        >>> maxsim(torch.randn(4, 32, 128), torch.randn(10, 300, 128)).shape
        torch.Size([4, 10])
    """
    mode = _backward(backward)
    _check_pair(Q, D)
    if D.dim() == 4:
        _check_candidate_sets(Q, D, q_mask, d_mask)
        return _lik_maxsim(_normalized(Q, normalize), _normalized(D, normalize), q_mask, d_mask, backward=mode)
    Q, D = _normalized(Q, normalize), _normalized(D, normalize)
    single_doc = D.dim() == 2
    if single_doc:
        D = D.unsqueeze(0)
        d_mask = None if d_mask is None else d_mask.unsqueeze(0)
    scores = _lik_maxsim(Q, D, q_mask, d_mask, backward=mode)
    return scores[..., 0] if single_doc else scores


def maxsim_pairs(Q: torch.Tensor, D: torch.Tensor, q_mask: torch.Tensor | None = None,
                 d_mask: torch.Tensor | None = None, *, normalize: bool = False, backward: str | None = None
                 ) -> torch.Tensor:
    """Paired MaxSim (late-interaction-kernels' ``maxsim_pairs``): ``Q [B, Lq, d]``, ``D [B, Ld, d]`` ->
    float32 ``[B]``, ``scores[i] = MaxSim(Q[i], D[i])``.

    Example:
        >>> maxsim_pairs(torch.randn(4, 32, 128), torch.randn(4, 300, 128)).shape
        torch.Size([4])
    """
    if not isinstance(Q, torch.Tensor) or not isinstance(D, torch.Tensor) or Q.dim() != 3 or D.dim() != 3:
        raise ValueError(f"maxsim_pairs needs both Q and D to be [B, L, d]; got Q.shape="
                         f"{tuple(getattr(Q, 'shape', ()))}, D.shape={tuple(getattr(D, 'shape', ()))}.")
    if Q.shape[0] != D.shape[0]:
        raise ValueError(f"maxsim_pairs needs Q.shape[0] == D.shape[0]; got {Q.shape[0]} vs {D.shape[0]}.")
    d_mask = None if d_mask is None else d_mask.unsqueeze(1)
    return maxsim(Q, D.unsqueeze(1), q_mask, d_mask, normalize=normalize, backward=backward)[:, 0]


def maxsim_varlen(Q_packed: torch.Tensor, D_packed: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  cu_seqlens_d: torch.Tensor, max_seqlen_q: int | None = None, max_seqlen_d: int | None = None
                  ) -> torch.Tensor:
    """Packed queries against packed documents, every query with every document (late-interaction-kernels'
    ``maxsim_varlen``): ``Q_packed [sum Lq_i, d]``, ``D_packed [sum Ld_j, d]``, int32 offsets ``[Nq + 1]`` /
    ``[Nd + 1]`` -> float32 ``[Nq, Nd]``, differentiable. (lik's own :func:`lik.maxsim_varlen` scores *pairs*;
    this is the peer's cross product.)

    Example:
        >>> q, cu_q, _ = lik.pack([torch.randn(5, 64), torch.randn(7, 64)])
        >>> d, cu_d, _ = lik.pack([torch.randn(30, 64), torch.randn(9, 64), torch.randn(0, 64)])
        >>> maxsim_varlen(q, d, cu_q, cu_d).shape
        torch.Size([2, 3])
    """
    for name, x in (("Q_packed", Q_packed), ("D_packed", D_packed)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"{name} must be a [total_tokens, d] tensor")
    if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() < 1:
        raise ValueError("cu_seqlens_q must be a 1-D tensor [Nq + 1]")
    # Queries are few and short: unpack them into a padded batch with a mask, and stream the packed corpus.
    cu_q = cu_seqlens_q.to(device="cpu", dtype=torch.int64)
    lengths = (cu_q[1:] - cu_q[:-1]).tolist()
    if any(n < 0 for n in lengths) or int(cu_q[0]) != 0 or int(cu_q[-1]) != Q_packed.shape[0]:
        raise ValueError(f"cu_seqlens_q must start at 0, not decrease and end at Q_packed's {Q_packed.shape[0]} "
                         f"rows, got {cu_q.tolist()}")
    width = max([0, *lengths])
    positions = torch.arange(width)
    mask = positions[None, :] < torch.tensor(lengths, dtype=torch.int64)[:, None]
    rows = (cu_q[:-1, None] + positions[None, :]).clamp(max=max(Q_packed.shape[0] - 1, 0))
    if Q_packed.shape[0] == 0:
        queries = Q_packed.new_zeros(len(lengths), width, Q_packed.shape[1])
    else:
        queries = Q_packed[rows.to(Q_packed.device)] * mask.to(Q_packed.device)[..., None].to(Q_packed.dtype)
    return maxsim_packed(queries, D_packed, cu_seqlens_d, mask.to(Q_packed.device), max_seqlen_d)


def retrieve(Q: torch.Tensor, D: torch.Tensor, top_k: int, q_mask: torch.Tensor | None = None,
             d_mask: torch.Tensor | None = None, *, normalize: bool = True, chunk: int | None = None,
             largest: bool = True, sorted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``top_k`` late-interaction retrieval (late-interaction-kernels' ``retrieve``), inference only.

    Args:
        Q: ``[Nq, Lq, d]`` or ``[Lq, d]``; D: ``[Nd, Ld, d]`` or ``[Ld, d]``.
        top_k: results per query, clamped to ``Nd``; must be positive.
        q_mask, d_mask: optional bool masks. normalize: L2-normalise first (default True, as the peer).
        chunk: documents scored at once (memory bound); None: lik's own budget.
        largest: the highest scores (True) or the lowest. sorted: accepted; results are always sorted.

    Returns:
        ``(scores float32 [Nq, k], indices int64 [Nq, k])`` (``[k]`` for 2-D ``Q``).

    Example:
        >>> scores, ids = retrieve(torch.randn(2, 32, 128), torch.randn(1000, 180, 128), top_k=10)
    """
    return top_documents(Q, D, top_k, q_mask, d_mask, normalize=normalize, chunk=chunk, largest=largest,
                         k_name="top_k")


def top_documents(Q, D, k, q_mask=None, d_mask=None, *, normalize: bool, chunk: int | None, largest: bool,
                  k_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best (``largest``) or worst documents per query, sorted, ties by lower index, NaN last; ``k``
    (named ``k_name`` in errors) must be positive and is clamped to the number of documents."""
    k = operator.index(k)
    if k <= 0:
        raise ValueError(f"{k_name} must be positive, got {k}")
    _check_pair(Q, D)
    with torch.no_grad():
        Q, D = _normalized(Q, normalize), _normalized(D, normalize)
        if D.dim() == 2:
            D = D.unsqueeze(0)
            d_mask = None if d_mask is None else d_mask.unsqueeze(0)
        k = min(k, D.shape[0])
        if largest:
            return search(Q, D, k, q_mask, d_mask, chunk_size=chunk)
        scores = _lik_maxsim(Q, D, q_mask, d_mask)
        # Lowest first, NaN last, ties by lower index: two stable sorts.
        order = torch.where(scores.isnan(), float("inf"), scores).sort(dim=-1, stable=True).indices
        order = order.gather(-1, scores.isnan().gather(-1, order).to(torch.uint8).sort(dim=-1, stable=True).indices)
        order = order[..., :k]
        return scores.gather(-1, order), order


class MaxSimScorer(torch.nn.Module):
    """Stateless MaxSim module (late-interaction-kernels' ``MaxSimScorer``).

    Args:
        normalize: L2-normalise ``Q`` and ``D`` per token first (default True, ColBERT's convention).
        backward: ``"auto"``, ``"unified"`` (lik's fast backward) or ``"lowmem"`` (its deterministic one).
        mask_pad_token: the padding token id :meth:`forward_with_ids` derives masks from.

    ``scorer(Q, D, q_mask, d_mask)`` is :func:`maxsim` (autograd follows the caller's grad mode);
    :meth:`score` runs without autograd; :meth:`retrieve` is :func:`retrieve`.

    Example:
        >>> scorer = MaxSimScorer()
        >>> scorer(torch.randn(4, 32, 128), torch.randn(10, 300, 128)).shape
        torch.Size([4, 10])
    """

    def __init__(self, *, normalize: bool = True, backward: str = "auto", mask_pad_token: int | None = None):
        super().__init__()
        if backward not in ("auto", "unified", "lowmem"):
            raise ValueError(f"backward= must be one of ('auto', 'unified', 'lowmem'), got {backward!r}")
        self.normalize = normalize
        self.backward = backward
        self.mask_pad_token = mask_pad_token

    def extra_repr(self) -> str:
        return f"normalize={self.normalize}, backward={self.backward!r}, mask_pad_token={self.mask_pad_token!r}"

    def forward(self, Q: torch.Tensor, D: torch.Tensor, q_mask: torch.Tensor | None = None,
                d_mask: torch.Tensor | None = None) -> torch.Tensor:
        """MaxSim scores (``[Nq, Nd]`` for 3-D inputs), differentiable."""
        return maxsim(Q, D, q_mask, d_mask, normalize=self.normalize, backward=self.backward)

    def score(self, Q: torch.Tensor, D: torch.Tensor, q_mask: torch.Tensor | None = None,
              d_mask: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`forward` without autograd."""
        with torch.no_grad():
            return self.forward(Q, D, q_mask, d_mask)

    def retrieve(self, Q: torch.Tensor, D: torch.Tensor, top_k: int, q_mask: torch.Tensor | None = None,
                 d_mask: torch.Tensor | None = None, *, chunk: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`retrieve` with this scorer's ``normalize``."""
        return retrieve(Q, D, top_k, q_mask, d_mask, normalize=self.normalize, chunk=chunk)

    def forward_with_ids(self, Q: torch.Tensor, D: torch.Tensor, q_ids: torch.Tensor, d_ids: torch.Tensor
                         ) -> torch.Tensor:
        """:meth:`forward` with masks ``q_ids != mask_pad_token`` and ``d_ids != mask_pad_token``."""
        if self.mask_pad_token is None:
            raise ValueError("forward_with_ids needs mask_pad_token: MaxSimScorer(mask_pad_token=<pad id>)")
        return self.forward(Q, D, q_ids != self.mask_pad_token, d_ids != self.mask_pad_token)
