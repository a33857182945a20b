"""lik inside sentence-transformers (6.x): drop-in ``util.maxsim`` / ``util.maxsim_pairwise`` (and the MeanMaxSim
forms) and a one-line switch.

sentence-transformers' conventions are kept: a masked document token is *excluded* from the max
(``lik.maxsim(..., mask_mode="exclude")``), a masked query token adds 0; a ragged list is padded with a mask built
from its lengths; a padded 3-D tensor without a mask treats all-zero rows as padding; a document with no scoreable
token scores ``-1e9`` (sentence-transformers' sentinel, ranked below every real document, with the same warning);
scores are float32 on the documents' device; ``length_normalize=True`` divides by the real query-token count.
Deliberate differences: half-precision similarities are accumulated in fp32 before the max as well (the host takes
the max in the input dtype), masks are read as 0 / nonzero (a fractional query mask weight is not applied), and
``chunk_elements`` is accepted but not needed (lik holds no similarity tensor, so there is nothing to budget).

:func:`enable` switches sentence-transformers' own ``util.similarity.maxsim``, ``maxsim_pairwise``, ``mean_maxsim``
and ``mean_maxsim_pairwise`` to these (so ``util``, the multi-vector ``scoring`` functions and every loss, evaluator,
``SimilarityFunction`` and model built on them, whenever built); :func:`disable` switches them back for every
caller. Models pickled meanwhile name only sentence-transformers' functions.

Example:
    >>> import lik.integrations.sentence_transformers as lik_st
    >>> lik_st.enable()      # util.maxsim, MultiVectorEncoder.similarity and the multi-vector losses use lik
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from . import _patching
from ._scoring import score_dense

__all__ = ["maxsim", "maxsim_pairwise", "mean_maxsim", "mean_maxsim_pairwise", "enable", "disable", "enabled",
           "is_enabled", "EMPTY_DOCUMENT_SCORE"]

#: The score of a document with no scoreable token (sentence-transformers' ``_EMPTY_DOCUMENT_SCORE``).
EMPTY_DOCUMENT_SCORE = -1e9

_logger = logging.getLogger(__name__)
_warned_empty = False


def _to_tensor(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    return torch.as_tensor(np.asarray(x))


def _float(x: torch.Tensor) -> torch.Tensor:
    # Quantized (integer) embeddings are scored as float32, as sentence-transformers does.
    return x if x.is_floating_point() else x.float()


def _side(embeddings, mask, name: str):
    """One side of a call, as ``(padded [n, L, d], bool mask [n, L], device)`` (the host's front door)."""
    if isinstance(mask, (list, tuple)):
        mask = torch.nn.utils.rnn.pad_sequence([_to_tensor(m) for m in mask], batch_first=True)
    elif isinstance(mask, np.ndarray):
        mask = torch.from_numpy(mask)
    elif mask is not None and not isinstance(mask, torch.Tensor):
        raise TypeError(f"`{name}` must be a tensor, an ndarray, or a list of per-item masks, "
                        f"not {type(mask).__name__}.")
    if isinstance(embeddings, (np.ndarray, torch.Tensor)) and embeddings.ndim == 2:
        embeddings = embeddings[None]
        if mask is not None and mask.ndim == 1:
            mask = mask[None]
    if isinstance(embeddings, (list, tuple)):
        items = [_float(_to_tensor(item)) for item in embeddings]
        device = items[0].device if items else None
        if not items:
            return None, None, device
        lengths = torch.tensor([item.shape[0] for item in items])
        padded = torch.nn.utils.rnn.pad_sequence(items, batch_first=True, padding_value=0)
        derived = torch.arange(padded.shape[1])[None, :] < lengths[:, None]
        mask = derived.to(padded.device) if mask is None else mask
    else:
        padded = _float(_to_tensor(embeddings))
        if padded.dim() != 3:
            raise ValueError(f"{'a' if name == 'a_mask' else 'b'} must be [n, L, d], a list of [L_i, d] or one "
                             f"[L, d], got shape {list(padded.shape)}")
        device = padded.device if isinstance(embeddings, torch.Tensor) else None
        if len(padded) == 0:
            return padded, None, device
        if mask is None:
            mask = padded.any(dim=-1)
    if mask.shape[-1] != padded.shape[1]:
        raise ValueError(f"`{name}` covers {mask.shape[-1]} tokens, but the padded embeddings have "
                         f"{padded.shape[1]}.")
    mask = mask.to(padded.device)
    mask = mask if mask.dtype == torch.bool else mask != 0
    return padded, mask.expand(padded.shape[0], -1), device


def _fill_empty(scores: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """``scores`` with the documents flagged in ``empty`` (no scoreable token) set to :data:`EMPTY_DOCUMENT_SCORE`.

    The fill is unconditional; only the warning reads ``empty`` on the host, and only where that is free (a CPU
    tensor, eager): under ``torch.compile`` the read would be a data-dependent branch that breaks the graph, and
    on a GPU a synchronisation per call (sentence-transformers' own rule)."""
    global _warned_empty
    if (not _warned_empty and empty.device.type == "cpu" and not torch.compiler.is_compiling()
            and bool(empty.any())):
        _warned_empty = True
        _logger.warning("Encountered documents without any scoreable token during multi-vector similarity scoring; "
                        f"they score {EMPTY_DOCUMENT_SCORE:.0e}, below every real document.")
    return scores.masked_fill(empty, EMPTY_DOCUMENT_SCORE)


def _score(a, b, a_mask, b_mask, length_normalize, device, pairwise: bool) -> torch.Tensor:
    q, q_mask, a_device = _side(a, a_mask, "a_mask")
    d, d_mask, b_device = _side(b, b_mask, "b_mask")
    n_a = 0 if q is None else len(q)
    n_b = 0 if d is None else len(d)
    result_device = b_device or a_device or torch.device("cpu")
    if pairwise and n_a != n_b:
        raise ValueError(f"`a` and `b` must hold the same number of items to score as pairs, got {n_a} and {n_b}.")
    if n_a == 0 or n_b == 0:
        return torch.zeros((n_a,) if pairwise else (n_a, n_b), dtype=torch.float32, device=result_device)
    scoring_device = torch.device(device) if device is not None else result_device
    q, q_mask = q.to(scoring_device), q_mask.to(scoring_device)
    d, d_mask = d.to(scoring_device), d_mask.to(scoring_device)
    if q.dtype != d.dtype:
        dtype = torch.promote_types(q.dtype, d.dtype)
        q, d = q.to(dtype), d.to(dtype)
    if pairwise:
        scores = score_dense(q, d.unsqueeze(1), q_mask, d_mask.unsqueeze(1))[:, 0]
        empty = ~d_mask.any(dim=-1)
    else:
        scores = score_dense(q, d, q_mask, d_mask)
        empty = (~d_mask.any(dim=-1)).unsqueeze(0).expand_as(scores)
    scores = _fill_empty(scores.float(), empty).to(result_device)
    if length_normalize:
        counts = q_mask.sum(dim=-1).clamp(min=1).to(device=scores.device, dtype=scores.dtype)
        scores = scores / (counts if pairwise else counts.unsqueeze(1))
    return scores


def maxsim(
    a: list | np.ndarray | torch.Tensor,
    b: list | np.ndarray | torch.Tensor,
    a_mask: torch.Tensor | None = None,
    b_mask: torch.Tensor | None = None,
    chunk_elements: int | None = None,
    length_normalize: bool = False,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """sentence-transformers' ``util.maxsim`` on lik: ``res[i, j] = sum_s max_t <a[i, s], b[j, t]>``.

    Args:
        a: queries, ``[n_a, Lq, d]`` (zero rows are padding unless ``a_mask`` is given), a list of ``[Lq_i, d]``,
            or one ``[Lq, d]``.
        b: documents, the same forms.
        a_mask / b_mask: optional ``[n, L]`` (bool / 0-1), ``[L]`` beside a 2-D input, or a list of per-item masks;
            a masked document token is excluded from the max, a masked query token adds 0.
        chunk_elements: accepted for compatibility; lik needs no chunking.
        length_normalize: divide each score by the number of real query tokens (MeanMaxSim).
        device: where to score; the result stays on the documents' device.

    Returns:
        float32 ``[n_a, n_b]``; a document with no scoreable token scores ``-1e9``.

    Example:
        >>> maxsim([torch.randn(5, 64)], [torch.randn(30, 64), torch.randn(8, 64)]).shape
        torch.Size([1, 2])
    """
    return _score(a, b, a_mask, b_mask, length_normalize, device, pairwise=False)


def maxsim_pairwise(
    a: list | np.ndarray | torch.Tensor,
    b: list | np.ndarray | torch.Tensor,
    a_mask: torch.Tensor | None = None,
    b_mask: torch.Tensor | None = None,
    chunk_elements: int | None = None,
    length_normalize: bool = False,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """sentence-transformers' ``util.maxsim_pairwise`` on lik: ``res[i] = MaxSim(a[i], b[i])``, float32 ``[n]``
    (arguments as :func:`maxsim`; ``a`` and ``b`` must hold as many items).

    Example:
        >>> maxsim_pairwise(torch.randn(3, 5, 64), torch.randn(3, 30, 64)).shape
        torch.Size([3])
    """
    return _score(a, b, a_mask, b_mask, length_normalize, device, pairwise=True)


def mean_maxsim(a, b, a_mask=None, b_mask=None, chunk_elements=None, length_normalize: bool = True, device=None):
    """sentence-transformers' ``util.mean_maxsim``: :func:`maxsim` with ``length_normalize=True`` by default."""
    return maxsim(a, b, a_mask, b_mask, chunk_elements, length_normalize, device)


def mean_maxsim_pairwise(a, b, a_mask=None, b_mask=None, chunk_elements=None, length_normalize: bool = True,
                         device=None):
    """sentence-transformers' ``util.mean_maxsim_pairwise``: :func:`maxsim_pairwise`, length-normalised."""
    return maxsim_pairwise(a, b, a_mask, b_mask, chunk_elements, length_normalize, device)


# ---------------------------------------------------------------------------------------------------------------
# The switch
# ---------------------------------------------------------------------------------------------------------------

_SWITCH = _patching.Switch(__name__, "sentence-transformers 6", "sentence-transformers")

# sentence-transformers' MaxSim family, by name in ``util.similarity``, and lik's function for each.
_ROUTES = {"maxsim": maxsim, "maxsim_pairwise": maxsim_pairwise, "mean_maxsim": mean_maxsim,
           "mean_maxsim_pairwise": mean_maxsim_pairwise}


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect."""
    return _SWITCH.on


@_SWITCH.enabler
def enable() -> None:
    """Make sentence-transformers' multi-vector scoring run on lik, until :func:`disable`.

    Changes: ``util.similarity.maxsim``, ``maxsim_pairwise``, ``mean_maxsim`` and ``mean_maxsim_pairwise`` (those
    the installed version defines) run this module's functions. No name is rebound: the host's function objects
    themselves are switched, so every caller holding them follows the switch (``util.maxsim``, the multi-vector
    ``scoring`` functions, losses, evaluators, ``SimilarityFunction``, and models whatever their age, including
    models loaded from a pickle), and :func:`disable` returns every one of them to the stock code. A model pickled
    while the switch is on names sentence-transformers' functions only. Idempotent; all or nothing.

    Raises:
        ImportError: sentence-transformers (6.0 or newer) is not installed; the message gives the pip command.
    """
    (similarity,) = _SWITCH.import_host("sentence_transformers.util.similarity")
    if not hasattr(similarity, "maxsim"):
        raise _SWITCH.missing_host("this version has no util.similarity.maxsim (multi-vector scoring came in 6.0)")
    for name, ours in _ROUTES.items():
        if hasattr(similarity, name):
            _SWITCH.route(getattr(similarity, name), ours)


def disable() -> None:
    """Undo :func:`enable`: sentence-transformers' functions run their own code again, for every caller."""
    _SWITCH.restore()


def enabled():
    """Context manager: sentence-transformers scores with lik inside the block only."""
    return _SWITCH.scoped(enable)
