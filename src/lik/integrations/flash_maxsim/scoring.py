"""flash-maxsim's float scoring functions on lik (see :mod:`lik.integrations.flash_maxsim` for what differs)."""

from __future__ import annotations

import time

import torch

from ...ops.maxsim import maxsim, maxsim_packed, maxsim_varlen, pack
from ...precompile import warmup as _lik_warmup

__all__ = [
    "flash_maxsim",
    "flash_maxsim_batched",
    "flash_maxsim_batched_train",
    "flash_maxsim_train",
    "flash_maxsim_pairs",
    "flash_maxsim_pairs_dense",
    "flash_maxsim_persistent",
    "flash_maxsim_qreuse",
    "flash_maxsim_splitk",
    "flash_maxsim_varlen",
    "flash_maxsim_packed",
    "pack_pairs",
    "pack_docs",
    "warmup",
    "DEFAULT_SHAPES",
    "DEFAULT_TRAIN_SHAPES",
]

#: flash-maxsim's default warm-up shapes, ``(B, Lq, Ld, d)``.
DEFAULT_SHAPES = [
    (1024, 32, 180, 128), (1024, 32, 1024, 128), (512, 128, 1024, 128), (256, 512, 1024, 128),
    (128, 1024, 1024, 128), (128, 1024, 1024, 512), (128, 1024, 1024, 768), (128, 1024, 1024, 1024),
]
#: flash-maxsim's default training warm-up shapes, ``(B, Lq, Ld, d)``.
DEFAULT_TRAIN_SHAPES = [(128, 32, 180, 128), (64, 1024, 1024, 128)]


def _tensor(name: str, x, ndims: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in ndims:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndims))} dimensions, got shape {list(x.shape)}")
    return x


def _prefix_mask(name: str, lengths, count: int, width: int, device: torch.device) -> torch.Tensor | None:
    """``[count, width]`` bool mask of the valid prefixes given by ``lengths`` (``[count]`` ints)."""
    if lengths is None:
        return None
    lengths = torch.as_tensor(lengths, device=device)
    if lengths.dim() != 1 or lengths.shape[0] != count or lengths.dtype.is_floating_point:
        raise ValueError(f"{name} must be an integer tensor of shape [{count}], got {lengths.dtype} "
                         f"{list(lengths.shape)}")
    return torch.arange(width, device=device)[None, :] < lengths.to(device)[:, None]


def flash_maxsim(Q: torch.Tensor, D: torch.Tensor, doc_lengths=None, query_chunk_size: int = 128,
                 splitk: bool = False) -> torch.Tensor:
    """MaxSim of one query against documents (flash-maxsim's ``flash_maxsim``).

    Args:
        Q: ``[Lq, d]``.
        D: padded ``[B, Ld, d]`` (``doc_lengths``: optional ``[B]`` valid lengths) or packed ``[total_d, d]``
            (``doc_lengths``: required ``cu_seqlens`` ``[B + 1]``).
        query_chunk_size, splitk: accepted, no effect.

    Returns:
        float32 ``[B]``.

    Example:
        >>> flash_maxsim(torch.randn(32, 128), torch.randn(10, 300, 128)).shape
        torch.Size([10])
    """
    _tensor("Q", Q, (2,))
    _tensor("D", D, (2, 3))
    if D.dim() == 2:
        if doc_lengths is None:
            raise ValueError("packed D [total_d, d] needs doc_lengths as cu_seqlens [B + 1]")
        return flash_maxsim_packed(Q, D, doc_lengths)
    d_mask = _prefix_mask("doc_lengths", doc_lengths, D.shape[0], D.shape[1], D.device)
    return maxsim(Q, D, None, d_mask)


def _batched(Q, D, doc_lengths, shared_docs, query_lengths):
    _tensor("Q", Q, (3,))
    if shared_docs:
        _tensor("D", D, (3,))
        d_mask = _prefix_mask("doc_lengths", doc_lengths, D.shape[0], D.shape[1], D.device)
    else:
        _tensor("D", D, (4,))
        if D.shape[0] != Q.shape[0]:
            raise ValueError(f"D is [Nq, B, Ld, d] with Nq={D.shape[0]} but Q has Nq={Q.shape[0]}")
        n_q, n_docs, doc_len = D.shape[:3]
        d_mask = _prefix_mask("doc_lengths", doc_lengths, n_q * n_docs, doc_len, D.device)
        d_mask = None if d_mask is None else d_mask.view(n_q, n_docs, doc_len)
    q_mask = _prefix_mask("query_lengths", query_lengths, Q.shape[0], Q.shape[1], Q.device)
    return maxsim(Q, D, q_mask, d_mask)


def flash_maxsim_batched(Q: torch.Tensor, D: torch.Tensor, doc_lengths=None, shared_docs: bool = True,
                         query_lengths=None, pad_lq: bool = True, query_chunk_size: int = 128) -> torch.Tensor:
    """Batched MaxSim (flash-maxsim's ``flash_maxsim_batched``): ``Q [Nq, Lq, d]`` against ``D [B, Ld, d]``
    (``shared_docs=True``) or ``D [Nq, B, Ld, d]`` (``shared_docs=False``) -> float32 ``[Nq, B]``.

    ``doc_lengths``: optional ``[B]`` (``[Nq * B]`` when not shared) valid lengths; ``query_lengths``: optional
    ``[Nq]``. ``pad_lq``, ``query_chunk_size``: accepted, no effect. Runs without autograd (as flash-maxsim's);
    use :func:`flash_maxsim_batched_train` for gradients.

    Example:
        >>> flash_maxsim_batched(torch.randn(4, 32, 128), torch.randn(10, 300, 128)).shape
        torch.Size([4, 10])
    """
    with torch.no_grad():
        return _batched(Q, D, doc_lengths, shared_docs, query_lengths)


def flash_maxsim_batched_train(Q: torch.Tensor, D: torch.Tensor, shared_docs: bool = True,
                               doc_lengths: torch.Tensor | None = None,
                               query_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`flash_maxsim_batched` with autograd (flash-maxsim's ``flash_maxsim_batched_train``): float32
    ``[Nq, B]``; gradients flow to ``Q`` and ``D`` in their dtype, padding gets 0.

    Example:
        >>> Q = torch.randn(8, 32, 128, requires_grad=True)
        >>> flash_maxsim_batched_train(Q, torch.randn(8, 180, 128)).sum().backward()
    """
    return _batched(Q, D, doc_lengths, shared_docs, query_lengths)


def flash_maxsim_train(Q: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """:func:`flash_maxsim` with autograd (flash-maxsim's ``flash_maxsim_train``): ``Q [Lq, d]``, ``D [B, Ld, d]``
    -> float32 ``[B]``; gradients flow to ``Q`` and ``D`` in their dtype.

    Example:
        >>> Q = torch.randn(16, 128, requires_grad=True)
        >>> flash_maxsim_train(Q, torch.randn(10, 64, 128)).sum().backward()
    """
    _tensor("Q", Q, (2,))
    _tensor("D", D, (3,))
    return maxsim(Q, D)


def flash_maxsim_pairs_dense(Q: torch.Tensor, D: torch.Tensor, q_lengths=None, doc_lengths=None) -> torch.Tensor:
    """Equal-length pairs (flash-maxsim's ``flash_maxsim_pairs_dense``): ``Q [B, Lq, d]``, ``D [B, Ld, d]`` ->
    float32 ``[B]``, ``scores[i] = MaxSim(Q[i], D[i])``; ``q_lengths`` / ``doc_lengths``: optional ``[B]`` valid
    prefixes.

    Example:
        >>> flash_maxsim_pairs_dense(torch.randn(4, 32, 128), torch.randn(4, 180, 128)).shape
        torch.Size([4])
    """
    _tensor("Q", Q, (3,))
    _tensor("D", D, (3,))
    if Q.shape[0] != D.shape[0]:
        raise ValueError(f"Q and D must hold as many pairs: Q has {Q.shape[0]}, D has {D.shape[0]}")
    q_mask = _prefix_mask("q_lengths", q_lengths, Q.shape[0], Q.shape[1], Q.device)
    d_mask = _prefix_mask("doc_lengths", doc_lengths, D.shape[0], D.shape[1], D.device)
    # Pair i is query i against the one-document candidate set D[i]: lik's per-query layout, K = 1.
    d_mask = None if d_mask is None else d_mask[:, None]
    return maxsim(Q, D[:, None], q_mask, d_mask)[:, 0]


def flash_maxsim_pairs(q_embs, d_embs) -> torch.Tensor:
    """MaxSim of (query i, document i) pairs (flash-maxsim's ``flash_maxsim_pairs``) -> float32 ``[N]``:
    tensors ``[N, Lq, d]`` / ``[N, Ld, d]``, or lists of ``[Lq_i, d]`` / ``[Ld_i, d]`` tensors (packed when their
    lengths differ).

    Example:
        >>> flash_maxsim_pairs([torch.randn(5, 64), torch.randn(7, 64)], [torch.randn(9, 64), torch.randn(3, 64)]).shape
        torch.Size([2])
    """
    if isinstance(q_embs, torch.Tensor) and isinstance(d_embs, torch.Tensor):
        return flash_maxsim_pairs_dense(q_embs, d_embs)
    if not isinstance(q_embs, (list, tuple)) or len(q_embs) == 0:
        raise ValueError("q_embs must be a [N, Lq, d] tensor or a non-empty list of [Lq_i, d] tensors")
    if not isinstance(d_embs, (list, tuple)) or len(d_embs) != len(q_embs):
        raise ValueError(f"d_embs must be a list of as many tensors as q_embs ({len(q_embs)})")
    if len({tuple(q.shape) for q in q_embs}) == 1 and len({tuple(d.shape) for d in d_embs}) == 1:
        return flash_maxsim_pairs_dense(torch.stack(list(q_embs)), torch.stack(list(d_embs)))
    return flash_maxsim_varlen(*pack_pairs(q_embs, d_embs))


def flash_maxsim_persistent(Q: torch.Tensor, D: torch.Tensor, doc_lengths=None, grid_factor: int = 2
                            ) -> torch.Tensor:
    """flash-maxsim's persistent-grid variant of :func:`flash_maxsim`: the same scores (``grid_factor``: accepted,
    no effect; lik's launcher picks its grid)."""
    return flash_maxsim(Q, D, doc_lengths)


def flash_maxsim_qreuse(Q: torch.Tensor, D: torch.Tensor, doc_lengths=None) -> torch.Tensor:
    """flash-maxsim's query-reuse variant of :func:`flash_maxsim`: the same scores."""
    return flash_maxsim(Q, D, doc_lengths)


def flash_maxsim_splitk(Q: torch.Tensor, D: torch.Tensor, doc_lengths=None, num_splits: int = 4) -> torch.Tensor:
    """flash-maxsim's split-K variant of :func:`flash_maxsim`: the same scores (``num_splits``: accepted, no
    effect)."""
    return flash_maxsim(Q, D, doc_lengths)


def flash_maxsim_varlen(Q_packed: torch.Tensor, D_packed: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_d: torch.Tensor, max_seqlen_q: int, max_seqlen_d: int) -> torch.Tensor:
    """MaxSim of ``N`` packed (query i, document i) pairs (flash-maxsim's ``flash_maxsim_varlen``) -> float32
    ``[N]``, differentiable.

    Example:
        >>> Qp, Dp, cu_q, cu_d, max_q, max_d = pack_pairs([torch.randn(5, 64)], [torch.randn(9, 64)])
        >>> flash_maxsim_varlen(Qp, Dp, cu_q, cu_d, max_q, max_d).shape
        torch.Size([1])
    """
    _tensor("Q_packed", Q_packed, (2,))
    _tensor("D_packed", D_packed, (2,))
    return maxsim_varlen(Q_packed, D_packed, cu_seqlens_q, cu_seqlens_d, max_seqlen_q, max_seqlen_d)


def flash_maxsim_packed(Q: torch.Tensor, D_packed: torch.Tensor, cu_seqlens_d: torch.Tensor,
                        max_seqlen_d: int | None = None, query_chunk_size: int = 128) -> torch.Tensor:
    """One query ``[Lq, d]`` against a packed corpus (flash-maxsim's ``flash_maxsim_packed``) -> float32 ``[B]``.

    Example:
        >>> D, cu, max_d = pack_docs([torch.randn(300, 128), torch.randn(57, 128)])
        >>> flash_maxsim_packed(torch.randn(32, 128), D, cu, max_d).shape
        torch.Size([2])
    """
    _tensor("Q", Q, (2,))
    _tensor("D_packed", D_packed, (2,))
    return maxsim_packed(Q, D_packed, cu_seqlens_d, max_seqlen_d=max_seqlen_d)


def pack_docs(d_embs: list):
    """``(D_packed [total_d, d], cu_seqlens_d int32 [B + 1], max_seqlen_d)`` from ``[Ld_i, d]`` tensors."""
    if not isinstance(d_embs, (list, tuple)) or len(d_embs) == 0:
        raise ValueError("d_embs must be a non-empty list of [Ld_i, d] tensors")
    return pack(list(d_embs))


def pack_pairs(q_embs: list, d_embs: list):
    """``(Q_packed, D_packed, cu_seqlens_q, cu_seqlens_d, max_lq, max_ld)`` from paired lists of tensors."""
    if not isinstance(q_embs, (list, tuple)) or len(q_embs) == 0:
        raise ValueError("q_embs must be a non-empty list of [Lq_i, d] tensors")
    if not isinstance(d_embs, (list, tuple)) or len(d_embs) != len(q_embs):
        raise ValueError(f"d_embs must be a list of as many tensors as q_embs ({len(q_embs)})")
    q, cu_q, max_q = pack(list(q_embs))
    d, cu_d, max_d = pack(list(d_embs))
    return q, d, cu_q, cu_d, max_q, max_d


def warmup(shapes=None, train_shapes=None, device=None, verbose: bool = False) -> dict:
    """Compile lik's kernels for flash-maxsim-style shapes ``(B, Lq, Ld, d)`` (``B`` queries of ``Lq`` tokens;
    ``Ld`` is a runtime value for lik, so it does not add variants) -> ``{"fwd_shapes", "bwd_shapes",
    "wall_seconds"}`` as flash-maxsim's ``warmup``. Half precision, no masks, as flash-maxsim warms."""
    shapes = DEFAULT_SHAPES if shapes is None else shapes
    train_shapes = DEFAULT_TRAIN_SHAPES if train_shapes is None else train_shapes
    start = time.perf_counter()
    fwd = bwd = 0
    for batch, q_len, _, dim in shapes:
        if verbose:
            print(f"  warmup fwd: B={batch} Lq={q_len} d={dim}", flush=True)
        _lik_warmup([(batch, q_len, dim)], dtype=torch.float16, device=device, masks=False)
        fwd += 1
    for batch, q_len, _, dim in train_shapes:
        if verbose:
            print(f"  warmup bwd: B={batch} Lq={q_len} d={dim}", flush=True)
        _lik_warmup([(batch, q_len, dim)], dtype=torch.float16, device=device, masks=False, training=True)
        bwd += 1
    # Unrounded: a warm-up of already compiled variants takes milliseconds, and 0 would read as "nothing ran".
    return {"fwd_shapes": fwd, "bwd_shapes": bwd, "wall_seconds": time.perf_counter() - start}
