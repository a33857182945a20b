"""lik inside colpali-engine: drop-in ``score_multi_vector``, the MaxSim of its ``ColbertLoss`` family, and a
one-line switch.

colpali-engine has no masks: embeddings are zero-padded (per block of ``batch_size`` items in
``score_multi_vector``), and a zero token's similarity, 0, takes part in the max like any other. The drop-ins keep
that exactly, including its consequence that a page shorter than the longest page of its block of
``batch_size`` competes against one zero token while the longest does not: lik lets that zero similarity take part
in the row maxima of exactly the pages colpali-engine pads. Deliberate differences: the sums run in fp32
(colpali-engine sums bfloat16 embeddings in bfloat16 and casts the result to float32 afterwards), and nothing of size
``[queries, pages, Lq, Ld]`` is ever materialised. Gradients agree with colpali-engine's except at exact ties,
which only zero padding produces (a zero query row ties across every document token): ``amax`` splits the gradient
among tied tokens, lik gives it to the first; the padding mask of the model that produced the embeddings stops
both.

* :func:`score_multi_vector` ``(qs, ps, batch_size=128, device=None) -> float32 [n_queries, n_pages]`` on the
  CPU, as ``BaseVisualRetrieverProcessor.score_multi_vector``;
* :func:`maxsim_inbatch` ``(query [Bq, Lq, d], doc [Bd, Ld, d]) -> [Bq, Bd]`` and
  :func:`maxsim_kd` ``(query [B, Lq, d], doc [B, N, Ld, d]) -> [B, N]`` as ``colpali_engine.utils.maxsim``,
  differentiable (float32 results).

:func:`enable` routes colpali-engine's scoring through them: ``score_multi_vector`` of every processor, and the
``maxsim_inbatch`` / ``maxsim_kd`` calls of ``ColbertLoss``, ``ColbertNegativeCELoss``,
``ColbertPairwiseCELoss``, ``ColbertPairwiseNegativeCELoss`` and ``ColbertSigmoidLoss``; ``normalize_scores``
is applied by the losses as before, to lik's scores. Not routed: losses built with ``use_smooth_max=True`` (a
log-sum-exp over the token similarities, which needs them all: colpali-engine keeps its einsum there, with or
without the switch), and the positive-pair scores of the two ``*NegativeCELoss`` classes (a ``[B, Lq, Ld]``
einsum colpali-engine computes inline). ``COLPALI_SCORES_BACKEND=torch`` still forces colpali-engine's own path.

:func:`enable` imports colpali-engine's package, as the user's own code does. colpali-engine 0.3.18's package imports
its model zoo and through it torchvision, so without a torchvision that loads beside the installed torch the switch
raises an ImportError naming it: modules loaded around the failing package would be ones the user's code cannot
import either.

How :func:`score_multi_vector` reads colpali-engine's lists (checks, joins, lengths, packed groups, the query rows)
is in :mod:`lik.integrations.colpali_pages`; each group of pages is scored through the internal entries, unchecked.

Example:
    >>> import lik.integrations.colpali as lik_colpali
    >>> lik_colpali.enable()         # processor.score_multi_vector and ColbertLoss now use lik
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..ops.maxsim.function import score_canonical
from ..ops.maxsim.packed_function import PackedQuery, score_packed
from ..ops.maxsim.validation import MaxSimInputs
from . import _patching
from ._scoring import score_dense
from .colpali_pages import (
    QueryRows,
    all_like_first,
    as_items,
    join_early,
    join_pages,
    needs_zero_token,
    page_groups,
    page_lengths,
)

__all__ = ["score_multi_vector", "maxsim_inbatch", "maxsim_kd", "enable", "disable", "enabled", "is_enabled"]

# score_multi_vector's bound on the per-token maxima of one call (bytes; its packed copies: colpali_pages).
_ROW_SCORES_BUDGET_BYTES = 256 * 1024 * 1024


def _auto_device() -> str:
    """colpali-engine's ``get_torch_device("auto")``: the first CUDA GPU, else MPS, else the CPU."""
    if torch.cuda.is_available():
        return "cuda:0"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def _check_3d(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{name} must be [B, L, d], got shape {list(x.shape)}")
    return x


def maxsim_inbatch(query: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """colpali-engine's in-batch MaxSim on lik: ``[Bq, Bd]`` float32 scores of zero-padded ``query [Bq, Lq, d]``
    and ``doc [Bd, Ld, d]`` (a zero token's similarity, 0, takes part in the max, as in colpali-engine).

    Example:
        >>> maxsim_inbatch(torch.randn(4, 20, 128), torch.randn(6, 1030, 128)).shape
        torch.Size([4, 6])
    """
    return score_dense(_check_3d("query", query), _check_3d("doc", doc))


def maxsim_kd(query: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """colpali-engine's per-query candidate MaxSim on lik: ``[B, N]`` float32 from ``query [B, Lq, d]`` and
    ``doc [B, N, Ld, d]`` (zero-padded).

    Example:
        >>> maxsim_kd(torch.randn(4, 20, 128), torch.randn(4, 3, 700, 128)).shape
        torch.Size([4, 3])
    """
    _check_3d("query", query)
    if not isinstance(doc, torch.Tensor) or doc.dim() != 4:
        raise ValueError(f"doc must be a [B, N, Ld, d] tensor, got {getattr(doc, 'shape', type(doc).__name__)}")
    return score_dense(query, doc)


def score_multi_vector(
    qs: torch.Tensor | list[torch.Tensor],
    ps: torch.Tensor | list[torch.Tensor],
    batch_size: int = 128,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """colpali-engine's ``score_multi_vector`` on lik: late-interaction scores of every query against every page.

    Query tokens are scored as rows, without padding (ragged queries cost only their own tokens): the kernel
    gives each token's maximum over a page, and the tokens of each query are summed afterwards in fp32.

    Args:
        qs: query embeddings, a list of ``[Lq_i, d]`` tensors or one zero-padded ``[n_queries, Lq, d]`` tensor.
        ps: page embeddings, a list of ``[Ld_j, d]`` tensors or one zero-padded ``[n_pages, Ld, d]`` tensor;
            same dtype as ``qs`` (bfloat16, float16, float32).
        batch_size: the block size whose zero padding colpali-engine's scores reflect (see the module doc); it
            does not bound memory here: a list of pages is copied into packed chunks of at most 256 MiB, a
            padded tensor is read in place, and the per-token maxima are bounded to 256 MiB per chunk of pages.
        device: where to score; default: the first CUDA GPU, else MPS, else the CPU (colpali-engine's rule).

    Returns:
        float32 ``[n_queries, n_pages]`` on the CPU (sums in fp32).

    Raises:
        ValueError: no queries or no pages ("No queries provided" / "No passages provided", as colpali-engine).

    Example:
        >>> qs = [torch.randn(20, 128, dtype=torch.bfloat16) for _ in range(3)]
        >>> ps = [torch.randn(1030, 128, dtype=torch.bfloat16) for _ in range(10)]
        >>> score_multi_vector(qs, ps).shape
        torch.Size([3, 10])
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    device = torch.device(device or _auto_device())
    queries = as_items("qs", qs)
    pages = as_items("ps", ps)
    if len(queries) == 0:
        raise ValueError("No queries provided")
    if len(pages) == 0:
        raise ValueError("No passages provided")
    # Before any page copy: the gather index's host-to-device copy waits for the work already queued.
    q = QueryRows(queries, device)
    # Pages per kernel call so that the per-row maxima (and the gathered sums) stay bounded.
    bytes_per_page = 4 * (q.rows.shape[0] + q.n_queries * q.length)
    pages_per_call = max(1, _ROW_SCORES_BUDGET_BYTES // max(1, bytes_per_page))

    # The rows are checked once (QueryRows: dtype and width) and each group of pages in score(), so every
    # group goes to the internal entries with nothing checked again: score_canonical for a dense batch, score_packed
    # (which replays a group shape it launched before) for packed pages.
    packed_rows = PackedQuery(q.rows, None, None)

    def score(docs, cu=None, zero_token=None):
        """Per-query sums over ``docs`` (padded ``[n, L, d]``, or packed with int32 offsets ``cu`` from 0, on the
        scoring device); ``zero_token``: a bool ``[n]`` mask of the pages colpali-engine's padding gives a zero
        token, whose similarity with each query row (0, or NaN for a row holding inf or NaN) then takes part in
        their row maxima."""
        if docs.dtype != q.rows.dtype:
            raise TypeError(f"ps has dtype {docs.dtype} but qs has {q.rows.dtype}: pass both in one dtype")
        if docs.shape[-1] != q.rows.shape[-1]:
            raise ValueError(f"ps has embedding width {docs.shape[-1]} but the queries have {q.rows.shape[-1]}")
        if q.rows.shape[0] == 0:  # a padded tensor of empty queries: each scores 0
            return torch.zeros(q.n_queries, docs.shape[0] if cu is None else cu.shape[0] - 1, device=device)
        if cu is None:
            rows = score_canonical(MaxSimInputs(q.rows, docs.unsqueeze(0), None, None, "exclude", False, False))
        else:
            rows = score_packed(packed_rows, docs, cu)
        if zero_token is not None:
            rows = torch.where(zero_token, torch.maximum(rows, q.zero_similarity()), rows)
        return q.sums(rows)

    scores = []
    with torch.no_grad():
        if isinstance(pages, torch.Tensor):
            # One padded tensor, read in place: every block's longest page is its width, so nothing is added.
            pages = pages.to(device)
            for start in range(0, pages.shape[0], pages_per_call):
                scores.append(score(pages[start:start + pages_per_call]))
        else:
            joined = join_early(pages, device, pages_per_call)
            early_scores = None
            if joined is not None and joined.shape[0] == len(pages) * pages[0].shape[0]:
                # Scored too before the shape pass, on the guess that every page is as long as the first (the
                # usual ColPali case): the kernel then runs while the host checks, and its result is kept only
                # if the pass below proves the guess.
                early_scores = score(joined.view(len(pages), *pages[0].shape))
                if all_like_first(pages):
                    # One group of equal pages, no zero token (the join's bounds are the groups'): the guess held.
                    return early_scores.cpu().float()
            lengths, width = page_lengths(pages)
            padded = needs_zero_token(lengths, batch_size)
            row_bytes = pages[0].shape[1] * pages[0].element_size()
            groups = list(page_groups(lengths, row_bytes, pages_per_call))
            if len(groups) > 1:
                joined = early_scores = None  # the early copy guessed one group wrong (a page is longer): dropped
            # (An early join has proved every page as wide as the first: the lengths read with that width hold.)
            for start, stop in groups:
                group = pages[start:stop]
                group_lengths = lengths[start:stop]
                flagged = padded[start:stop]
                docs = joined if joined is not None else join_pages(group, width)
                if not flagged.any() and group_lengths.min() == group_lengths.max():
                    if early_scores is not None:  # one group of pages all as long as the first: the guess held
                        scores.append(early_scores)
                        continue
                    # Equal pages: one dense [n, L, d] batch for the padded kernels.
                    scores.append(score(docs.to(device).view(len(group), int(group_lengths[0]), docs.shape[1])))
                    continue
                # Ragged pages: packed as they are; the zero token of the pages colpali-engine pads joins their
                # row maxima afterwards (no zero row copied in per page).
                cu = np.zeros(len(group) + 1, dtype=np.int64)
                np.cumsum(group_lengths, out=cu[1:])
                zero_token = torch.from_numpy(flagged).to(device, non_blocking=True) if flagged.any() else None
                offsets = torch.from_numpy(cu.astype(np.int32)).to(device, non_blocking=True)
                scores.append(score(docs.to(device), offsets, zero_token))
    return (scores[0] if len(scores) == 1 else torch.cat(scores, dim=1)).cpu().float()


# ---------------------------------------------------------------------------------------------------------------
# The switch
# ---------------------------------------------------------------------------------------------------------------

_SWITCH = _patching.Switch(__name__, "colpali-engine", "colpali")


def _forced_stock(args: tuple = (), kwargs: dict | None = None) -> bool:
    """``COLPALI_SCORES_BACKEND=torch`` keeps colpali-engine's own path."""
    return os.environ.get("COLPALI_SCORES_BACKEND", "auto").lower() == "torch"


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect."""
    return _SWITCH.on


@_SWITCH.enabler
def enable() -> None:
    """Make colpali-engine score with lik, until :func:`disable`.

    Changes: colpali-engine's own ``utils.maxsim.maxsim_inbatch`` / ``maxsim_kd`` (the processors' scoring and the
    ``Colbert*Loss`` classes call them) and ``BaseVisualRetrieverProcessor.score_multi_vector`` run lik, unless
    ``COLPALI_SCORES_BACKEND=torch``. No name is rebound: the function objects themselves are switched, so every
    holder follows the switch and :func:`disable` returns every one of them to colpali-engine's code; a pickle
    names colpali-engine's functions only. Losses with ``use_smooth_max=True`` keep colpali-engine's log-sum-exp
    path (see the module doc). Idempotent; all or nothing.

    Raises:
        ImportError: colpali-engine, or a package it imports (torchvision), cannot be imported; the message names
        the missing module and gives the pip command.
    """
    maxsim_module, processing = _SWITCH.import_host("colpali_engine.utils.maxsim",
                                                    "colpali_engine.utils.processing_utils")
    _SWITCH.route(maxsim_module.maxsim_inbatch, maxsim_inbatch, _forced_stock)
    _SWITCH.route(maxsim_module.maxsim_kd, maxsim_kd, _forced_stock)
    stock_score = processing.BaseVisualRetrieverProcessor.__dict__["score_multi_vector"].__func__
    _SWITCH.route(stock_score, score_multi_vector, _forced_stock)


def disable() -> None:
    """Undo :func:`enable`: colpali-engine's functions run their own code again, for every caller."""
    _SWITCH.restore()


def enabled():
    """Context manager: colpali-engine scores with lik inside the block only."""
    return _SWITCH.scoped(enable)
