"""lik inside PyLate: drop-in scoring functions and a one-line switch.

Drop-ins (usable without PyLate installed), with PyLate's signatures and semantics:

* :func:`colbert_scores` ``(queries [Nq, Lq, d], documents [B, Ld, d], queries_mask, documents_mask) -> [Nq, B]``;
* :func:`colbert_kd_scores` ``(queries [Nq, Lq, d], documents [Nq, B, Ld, d], masks) -> [Nq, B]``;
* :func:`colbert_scores_pairwise` ``(queries, documents) -> [B]`` (tensors or ragged lists of ``[L_i, d]``);
* :class:`ColBERTScores` (the in-batch score matrix of the ``Contrastive`` losses, one fused call instead of one
  call per document group).

PyLate's conventions are kept: a mask entry of 0 / False makes that position's *similarity 0*, and it still takes
part in the max (``lik.maxsim(..., mask_mode="zero")``); inputs may be tensors, numpy arrays or lists.
Deliberate differences, all in the user's favour:

* scores are summed in fp32 and returned as float32 (float64 for float64 inputs); PyLate sums in the input dtype,
  which in bf16 loses ranking quality;
* what sits at a masked position never reaches the scores or the gradients (PyLate multiplies the similarity by
  the mask, so inf / NaN in padding poisons its result); masks are read as 0 / nonzero;
* a ragged list of embeddings is zero-padded (what PyLate's ``rank.rerank`` does) instead of failing in
  ``torch.stack``; a document with no token scores 0 instead of failing in ``max``;
* ``colbert_scores_pairwise`` rejects lists of different lengths instead of silently dropping the extra items.

:func:`enable` makes PyLate score with lik at every call site: PyLate's own scoring functions and
``ColBERTScores`` are switched in place, so ``pylate.scores.*``, the ``Contrastive`` / ``CachedContrastive`` /
``Distillation`` losses, ``rank.rerank``, ``retrieve.ColBERT``, the models' ``similarity`` / ``similarity_pairwise``
and the evaluators follow it, whenever they were built. An explicit PyLate ``backend=`` other than ``"auto"``
(argument or ``PYLATE_SCORES_BACKEND``) still selects PyLate's own backend. :func:`disable` undoes it for every
caller; ``with enabled():`` scopes it. Models pickled meanwhile name only PyLate's functions.

Example:
    >>> import lik.integrations.pylate as lik_pylate
    >>> lik_pylate.enable()          # PyLate training, reranking and retrieval now score with lik
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..ops.maxsim import maxsim_varlen, pack
from . import _patching
from ._scoring import score_dense

if TYPE_CHECKING:  # at run time, __getattr__ imports it (and PyLate) on first use
    from .pylate_index import Index

__all__ = [
    "colbert_scores",
    "colbert_kd_scores",
    "colbert_scores_pairwise",
    "ColBERTScores",
    "enable",
    "disable",
    "enabled",
    "is_enabled",
    "Index",
]


def __getattr__(name: str):
    # ``Index`` (lik's exact index as a PyLate index, in pylate_index.py) subclasses PyLate's own base class: PyLate
    # is imported when it is first used, never by importing this module.
    if name == "Index":
        from .pylate_index import Index

        return Index
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_BACKENDS = ("auto", "torch", "flash", "lik")


def _check_backend(backend: str | None) -> None:
    if backend is not None and (not isinstance(backend, str) or backend.lower() not in _BACKENDS):
        raise ValueError(f"backend must be one of {_BACKENDS} or None, got {backend!r}")


def _as_tensor(name: str, x) -> torch.Tensor:
    """PyLate's ``convert_to_tensor`` rules (tensor, numpy array, list of tensors / arrays / lists), except that
    a ragged list is zero-padded to its longest item instead of failing."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    if isinstance(x, (list, tuple)):
        if len(x) == 0:
            return torch.tensor([], dtype=torch.float32)
        if isinstance(x[0], np.ndarray):
            if any(np.iscomplexobj(item) for item in x):  # a cast to float32 would drop the imaginary part
                raise TypeError(f"{name} must hold real embeddings, got a complex array")
            items = [torch.from_numpy(np.asarray(item, dtype=np.float32)) for item in x]
        elif isinstance(x[0], torch.Tensor):
            items = list(x)
        elif isinstance(x[0], (list, tuple)):
            items = [torch.tensor(item, dtype=torch.float32) for item in x]
        else:
            return torch.tensor(x, dtype=torch.float32)
        if all(item.shape == items[0].shape for item in items):
            return torch.stack(items)
        return torch.nn.utils.rnn.pad_sequence(items, batch_first=True, padding_value=0)
    raise TypeError(f"{name} must be a torch.Tensor, a numpy array or a list, got {type(x).__name__}")


def _as_mask(name: str, mask) -> torch.Tensor | None:
    """PyLate masks are float 0/1, int or bool; 0 / False is padding."""
    if mask is None:
        return None
    mask = _as_tensor(name, mask)
    return mask if mask.dtype == torch.bool else mask != 0


def _check_dim(name: str, x: torch.Tensor, ndim: int, shape_text: str) -> None:
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {shape_text}, got shape {list(x.shape)}")


def _autocast_dtypes(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast as PyLate's einsum would under autocast, so a mixed-precision training step scores the same dtype."""
    device_type = q.device.type
    if q.is_floating_point() and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return q.to(dtype), d.to(dtype)
    if q.dtype != d.dtype and q.is_floating_point() and d.is_floating_point():
        dtype = torch.promote_types(q.dtype, d.dtype)
        return q.to(dtype), d.to(dtype)
    return q, d


def colbert_scores(
    queries_embeddings: list | np.ndarray | torch.Tensor,
    documents_embeddings: list | np.ndarray | torch.Tensor,
    queries_mask: torch.Tensor | None = None,
    documents_mask: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """PyLate's ``colbert_scores`` on lik: ``scores[i, j] = sum_s max_t <Q[i, s], D[j, t]>``.

    Args:
        queries_embeddings: ``[Nq, Lq, d]`` (tensor, numpy array or list of ``[Lq_i, d]``; ragged lists are
            zero-padded); float16 / bfloat16 / float32 / float64.
        documents_embeddings: ``[B, Ld, d]``, same forms.
        queries_mask: optional ``[Nq, Lq]`` (bool / int / float 0-1): 0 makes the token's similarities 0.
        documents_mask: optional ``[B, Ld]``: 0 makes that token's similarity 0 (it still takes part in the max).
        backend: accepted for PyLate compatibility and not used (lik always scores).

    Returns:
        float32 ``[Nq, B]`` (float64 for float64 inputs), differentiable.

    Example:
        >>> Q, D = torch.randn(4, 32, 128), torch.randn(10, 180, 128)
        >>> colbert_scores(Q, D).shape
        torch.Size([4, 10])
    """
    _check_backend(backend)
    q = _as_tensor("queries_embeddings", queries_embeddings)
    d = _as_tensor("documents_embeddings", documents_embeddings)
    _check_dim("queries_embeddings", q, 3, "[Nq, Lq, d]")
    _check_dim("documents_embeddings", d, 3, "[B, Ld, d]")
    q, d = _autocast_dtypes(q, d)
    return score_dense(q, d, _as_mask("queries_mask", queries_mask), _as_mask("documents_mask", documents_mask),
                       mask_mode="zero")


def colbert_kd_scores(
    queries_embeddings: list | np.ndarray | torch.Tensor,
    documents_embeddings: list | np.ndarray | torch.Tensor,
    queries_mask: torch.Tensor | None = None,
    documents_mask: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """PyLate's ``colbert_kd_scores`` on lik: each query against its own candidates (distillation).

    Args:
        queries_embeddings: ``[Nq, Lq, d]``.
        documents_embeddings: ``[Nq, B, Ld, d]`` (the candidates of each query).
        queries_mask: optional ``[Nq, Lq]``; documents_mask: optional ``[Nq, B, Ld]`` (PyLate's zero convention).
        backend: accepted for PyLate compatibility and not used.

    Returns:
        float32 ``[Nq, B]``, differentiable.

    Example:
        >>> colbert_kd_scores(torch.randn(4, 32, 64), torch.randn(4, 8, 100, 64)).shape
        torch.Size([4, 8])
    """
    _check_backend(backend)
    q = _as_tensor("queries_embeddings", queries_embeddings)
    d = _as_tensor("documents_embeddings", documents_embeddings)
    _check_dim("queries_embeddings", q, 3, "[Nq, Lq, d]")
    _check_dim("documents_embeddings", d, 4, "[Nq, B, Ld, d]")
    q, d = _autocast_dtypes(q, d)
    return score_dense(q, d, _as_mask("queries_mask", queries_mask), _as_mask("documents_mask", documents_mask),
                       mask_mode="zero")


def _items(name: str, x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        _check_dim(name, x, 3, "[B, L, d] or a list of [L_i, d]")
        return list(x.unbind(0))
    if isinstance(x, np.ndarray):
        return _items(name, torch.from_numpy(x))
    if isinstance(x, (list, tuple)):
        items = [_as_tensor(name, item) for item in x]
        for item in items:
            _check_dim(name, item, 2, "a list of [L_i, d]")
        return items
    raise TypeError(f"{name} must be a torch.Tensor, a numpy array or a list, got {type(x).__name__}")


def colbert_scores_pairwise(
    queries_embeddings: list | np.ndarray | torch.Tensor,
    documents_embeddings: list | np.ndarray | torch.Tensor,
    backend: str | None = None,
) -> torch.Tensor:
    """PyLate's ``colbert_scores_pairwise`` on lik: ``scores[i] = MaxSim(queries[i], documents[i])``.

    Args:
        queries_embeddings: ``[B, Lq, d]`` or a list of ``B`` ``[Lq_i, d]`` (no padding is added: ragged pairs run
            packed, so every token of every pair counts, as in PyLate's per-pair loop).
        documents_embeddings: ``[B, Ld, d]`` or a list of ``B`` ``[Ld_i, d]``.
        backend: accepted for PyLate compatibility and not used.

    Returns:
        float32 ``[B]`` (float64 for float64 inputs), differentiable; a pair with an empty document scores 0.

    Example:
        >>> qs = [torch.randn(5, 16), torch.randn(7, 16)]
        >>> ds = [torch.randn(30, 16), torch.randn(2, 16)]
        >>> colbert_scores_pairwise(qs, ds).shape
        torch.Size([2])
    """
    _check_backend(backend)
    if isinstance(queries_embeddings, torch.Tensor) and isinstance(documents_embeddings, torch.Tensor):
        _check_dim("queries_embeddings", queries_embeddings, 3, "[B, Lq, d]")
        _check_dim("documents_embeddings", documents_embeddings, 3, "[B, Ld, d]")
        if queries_embeddings.shape[0] != documents_embeddings.shape[0]:
            raise ValueError(f"queries_embeddings has {queries_embeddings.shape[0]} items but documents_embeddings "
                             f"has {documents_embeddings.shape[0]}: pairs need the same count")
        q, d = _autocast_dtypes(queries_embeddings, documents_embeddings)
        return score_dense(q, d.unsqueeze(1))[:, 0]
    queries = _items("queries_embeddings", queries_embeddings)
    documents = _items("documents_embeddings", documents_embeddings)
    if len(queries) != len(documents):
        raise ValueError(f"queries_embeddings has {len(queries)} items but documents_embeddings has "
                         f"{len(documents)}: pairs need the same count")
    if not queries:
        return torch.zeros(0, dtype=torch.float32)
    q, cu_q, max_q = pack(queries)
    d, cu_d, max_d = pack(documents)
    q, d = _autocast_dtypes(q, d)
    return maxsim_varlen(q, d, cu_q, cu_d, max_q, max_d)


class ColBERTScores:
    """PyLate's ``ColBERTScores`` on lik: queries ``[Qq, Lq, d]`` against stacked document groups
    ``[Qd, N, Ld, d]`` -> ``[Qq, Qd * N]``, query-major (``scores[i, j * N + k]`` is query ``i`` against slot
    ``k`` of group ``j``). One fused call scores every group; nothing of size ``[Qq, Qd, Lq, Ld]`` exists.

    Example:
        >>> ColBERTScores()(torch.randn(8, 32, 64), torch.randn(8, 2, 100, 64)).shape
        torch.Size([8, 16])
    """

    def __call__(
        self,
        queries_embeddings: list | np.ndarray | torch.Tensor,
        documents_embeddings: list | np.ndarray | torch.Tensor,
        queries_mask: torch.Tensor | None = None,
        documents_mask: torch.Tensor | None = None,
        backend: str | None = None,
    ) -> torch.Tensor:
        _check_backend(backend)
        q = _as_tensor("queries_embeddings", queries_embeddings)
        d = _as_tensor("documents_embeddings", documents_embeddings)
        _check_dim("queries_embeddings", q, 3, "[Qq, Lq, d]")
        _check_dim("documents_embeddings", d, 4, "[Qd, N, Ld, d]")
        groups, slots, doc_len, dim = d.shape
        d_mask = _as_mask("documents_mask", documents_mask)
        if d_mask is not None:
            if tuple(d_mask.shape) != (groups, slots, doc_len):
                raise ValueError(f"documents_mask must have shape {[groups, slots, doc_len]}, "
                                 f"got {list(d_mask.shape)}")
            d_mask = d_mask.reshape(groups * slots, doc_len)
        q, d = _autocast_dtypes(q, d)
        return score_dense(q, d.reshape(groups * slots, doc_len, dim), _as_mask("queries_mask", queries_mask),
                           d_mask, mask_mode="zero")


# ---------------------------------------------------------------------------------------------------------------
# The switch
# ---------------------------------------------------------------------------------------------------------------

_SWITCH = _patching.Switch(__name__, "PyLate", "pylate")


def _explicit_backend(backend: str | None) -> bool:
    """True when the caller named one of PyLate's own backends (argument, else ``PYLATE_SCORES_BACKEND``)."""
    if backend is None:
        backend = os.environ.get("PYLATE_SCORES_BACKEND", "auto")
    return not isinstance(backend, str) or backend.lower() != "auto"


def _names_pylate_backend(position: int):
    """``keep_stock`` for a PyLate function whose ``backend`` argument is at ``position``: PyLate's own code runs
    when the call names one of its backends."""

    def keep_stock(args: tuple, kwargs: dict) -> bool:
        return _explicit_backend(kwargs.get("backend", args[position] if len(args) > position else None))

    return keep_stock


_FUSED = ColBERTScores()


def _colbert_scores_call(self, *args, **kwargs) -> torch.Tensor:
    """``pylate.scores.ColBERTScores.__call__`` while the switch is on: one fused lik call."""
    return _FUSED(*args, **kwargs)


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect."""
    return _SWITCH.on


@_SWITCH.enabler
def enable() -> None:
    """Make PyLate score with lik everywhere it scores, until :func:`disable`.

    Changes: PyLate's own ``colbert_scores``, ``colbert_kd_scores``, ``colbert_scores_pairwise`` and
    ``ColBERTScores.__call__`` run lik unless the call names a PyLate backend explicitly. No name is rebound: the
    function objects themselves are switched, so every holder follows the switch (``pylate.scores``,
    ``rank.rerank``, ``retrieve.ColBERT``, the evaluators, the ``Contrastive`` / ``CachedContrastive`` /
    ``Distillation`` losses and ``ColBERT`` models whenever built, models loaded from a pickle), and
    :func:`disable` returns every one of them to PyLate's code. A user-supplied ``score_metric`` is left alone;
    a model pickled while the switch is on names PyLate's functions only. Idempotent; all or nothing.

    Raises:
        ImportError: PyLate is not installed; the message gives the pip command.
    """
    (scores,) = _SWITCH.import_host("pylate.scores.colbert")
    _SWITCH.route(scores.colbert_scores, colbert_scores, _names_pylate_backend(4))
    _SWITCH.route(scores.colbert_kd_scores, colbert_kd_scores, _names_pylate_backend(4))
    _SWITCH.route(scores.colbert_scores_pairwise, colbert_scores_pairwise, _names_pylate_backend(2))
    _SWITCH.route(scores.ColBERTScores.__call__, _colbert_scores_call, _names_pylate_backend(5))


def disable() -> None:
    """Undo :func:`enable`: PyLate's functions run their own code again, for every caller."""
    _SWITCH.restore()


def enabled():
    """Context manager: ``with lik.integrations.pylate.enabled(): ...`` scores with lik inside the block only."""
    return _SWITCH.scoped(enable)
