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

Example:
    >>> import lik.integrations.colpali as lik_colpali
    >>> lik_colpali.enable()         # processor.score_multi_vector and ColbertLoss now use lik
"""

from __future__ import annotations

import os
from itertools import repeat

import numpy as np
import torch

from ..ops.maxsim import maxsim, maxsim_packed
from . import _patching

__all__ = ["score_multi_vector", "maxsim_inbatch", "maxsim_kd", "enable", "disable", "enabled", "is_enabled"]

# score_multi_vector's bounds: the packed copy of a list of pages, and the per-token maxima of one call (bytes).
_PACK_BUDGET_BYTES = 256 * 1024 * 1024
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
    return maxsim(_check_3d("query", query), _check_3d("doc", doc))


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
    return maxsim(query, doc)


def _items(name: str, x) -> list[torch.Tensor] | torch.Tensor:
    """A ``[n, L, d]`` tensor as is, or a list's items once every one is a tensor (their shapes: :func:`_sizes`)."""
    if isinstance(x, torch.Tensor):
        if x.dim() != 3:
            raise ValueError(f"{name} must be a [n, L, d] tensor or a list of [L_i, d] tensors, got shape "
                             f"{list(x.shape)}")
        return x
    if isinstance(x, (list, tuple)):
        if not all(map(isinstance, x, repeat(torch.Tensor))):
            _name_bad_item(name, x)
        return list(x)
    raise TypeError(f"{name} must be a tensor or a list of tensors, got {type(x).__name__}")


def _sizes(name: str, items: list[torch.Tensor]) -> tuple[list[torch.Size], set[torch.Size]]:
    """Every item's size, checked to be ``[L_i, d]`` with one ``d``, and the set of distinct sizes.

    One C-level pass per property (a list holds ~1 000 pages: a Python loop per page, or ``len`` of a tensor,
    which is a Python method, costs host time); the loop naming the first bad item runs only when a check fails."""
    sizes = list(map(torch.Tensor.size, items))
    distinct = set(sizes)
    if not all(len(size) == 2 for size in distinct):
        _name_bad_item(name, items)
    widths = {size[1] for size in distinct}
    if len(widths) > 1:
        raise ValueError(f"{name}: every item must have the same embedding width, got {sorted(widths)}")
    return sizes, distinct


def _name_bad_item(name: str, items) -> None:
    for i, item in enumerate(items):
        if not isinstance(item, torch.Tensor) or item.dim() != 2:
            raise ValueError(f"{name}[{i}] must be a [L, d] tensor, got {getattr(item, 'shape', type(item).__name__)}")


def _lengths(checked: tuple[list[torch.Size], set[torch.Size]]) -> np.ndarray:
    """int64 ``[n]`` first dimensions of :func:`_sizes`' sizes (all equal: no per-item pass)."""
    sizes, distinct = checked
    if len(distinct) == 1:
        return np.full(len(sizes), next(iter(distinct))[0], dtype=np.int64)
    return np.fromiter((size[0] for size in sizes), dtype=np.int64, count=len(sizes))


def _join(name: str, tensors: list[torch.Tensor], items: list[torch.Tensor] | None = None) -> torch.Tensor:
    """``torch.cat(tensors)``; when the join fails, ``items`` (the caller's list, unchecked so far) get
    :func:`_sizes`' named checks, and a list spread over several devices is named."""
    try:
        return torch.cat(tensors)
    except RuntimeError as error:
        if items is not None:
            _sizes(name, items)
        devices = sorted({str(t.device) for t in tensors})
        if len(devices) > 1:
            raise ValueError(f"{name}: every item must be on one device, got {devices}") from error
        raise


# One zero row per (device, dtype, width), appended to every joined query list: a fill launch less per call.
_ZERO_ROWS: dict[tuple, torch.Tensor] = {}


def _zero_row(like: torch.Tensor) -> torch.Tensor:
    """A ``[1, d]`` zero row on ``like``'s device, in its dtype (``like``: ``[L, d]``); read, never written."""
    key = (like.device, like.dtype, like.shape[1])
    row = _ZERO_ROWS.get(key)
    if row is None:
        row = _ZERO_ROWS[key] = like.new_zeros(1, like.shape[1])
    return row


def _overlaps_host(device: torch.device) -> bool:
    """Whether a copy launched on ``device`` runs while the host goes on (an accelerator, not the CPU)."""
    return device.type != "cpu"


def _on_device(x: torch.Tensor, device: torch.device) -> bool:
    """Whether ``x.to(device)`` is ``x`` itself ("cuda" without an index is the current CUDA device)."""
    if x.device == device:
        return True
    return (device.type == "cuda" and device.index is None and x.device.type == "cuda"
            and x.device.index == torch.cuda.current_device())


def _join_early(pages: list[torch.Tensor], device: torch.device, max_pages: int) -> torch.Tensor | None:
    """The pages joined by one ``cat``, launched before their shapes are checked so that the copy (and the
    scoring, when every page is as long as the first) overlaps the per-page pass on the host.

    Only where the join will most likely be the one group scored: pages already on ``device``, first and last of
    one shape, all within the copy budget if every page had that shape, no more than one call's pages. ``None``
    otherwise, or when the ``cat`` fails (the checks then name the bad page)."""
    first, last = pages[0], pages[-1]
    if not _overlaps_host(device) or len(pages) > max_pages or first.dim() != 2 or first.shape != last.shape:
        return None
    if not _on_device(first, device):
        return None
    if len(pages) * (first.shape[0] + 1) * first.shape[1] * first.element_size() > _PACK_BUDGET_BYTES:
        return None
    try:
        return torch.cat(pages)
    except RuntimeError:
        return None


def _all_like_first(pages: list[torch.Tensor]) -> bool:
    """Whether every page of a list that ``torch.cat`` has just joined has the first page's shape, decided from
    element counts alone: the join has checked that all are 2-D of one width (a legacy empty 1-D tensor, which it
    skips, counts 0 elements), so equal counts mean equal lengths. A C-level pass over ints costs half of
    :func:`_sizes`' pass, which builds a ``torch.Size`` per page (~0.2 us each, 1 000 pages)."""
    count = pages[0].numel()
    return count > 0 and set(map(torch.Tensor.numel, pages)) == {count}


def _needs_zero_token(lengths: np.ndarray, batch_size: int) -> np.ndarray:
    """Which pages colpali-engine's per-block padding gives at least one zero token (a longer page shares their
    block of ``batch_size``): bool ``[n_pages]``."""
    if len(lengths) == 0 or lengths[0] == lengths.min() == lengths.max():
        return np.zeros(len(lengths), dtype=bool)
    n_blocks = -(-len(lengths) // batch_size)
    blocks = np.full(n_blocks * batch_size, -1, dtype=np.int64)
    blocks[:len(lengths)] = lengths
    longest = np.repeat(blocks.reshape(n_blocks, batch_size).max(axis=1), batch_size)[:len(lengths)]
    return lengths < longest


def _page_groups(lengths: np.ndarray, row_bytes: int, max_pages: int):
    """``(start, stop)`` runs of pages copied and scored together: at most ``_PACK_BUDGET_BYTES`` packed (counting
    one spare row per page) and at most ``max_pages`` pages; a page larger than the budget goes alone."""
    ends = np.cumsum((lengths + 1) * row_bytes)
    start = 0
    while start < len(lengths):
        before = ends[start - 1] if start else 0
        stop = int(np.searchsorted(ends, before + _PACK_BUDGET_BYTES, side="right"))
        stop = max(start + 1, min(stop, start + max_pages))
        yield start, stop
        start = stop


def _page_lengths(pages: list[torch.Tensor]) -> tuple[np.ndarray, int]:
    """int64 ``[n]`` page lengths and the width they were read with (0: read from each page's ``torch.Size``).

    When the first page is 2-D and not zero-wide, each length is the page's element count over its width: one
    C-level pass over ints, where a ``torch.Size`` per page cost twice that host time. A page of other dimensions
    or of another width gets a wrong length here, so every join of pages (which refuses other dimensions) is checked
    against that width (:func:`_join_pages`) before its lengths are used."""
    width = pages[0].shape[1] if pages[0].dim() == 2 else 0
    if width:
        lengths = _counted_lengths(pages, width)
        # A page of other dimensions fails the join, except a legacy empty 1-D tensor, which ``cat`` skips: only
        # the empty pages need their dimensions read here.
        if all(pages[i].dim() == 2 for i in np.flatnonzero(lengths == 0).tolist()):
            return lengths, width
    return _lengths(_sizes("ps", pages)), 0


def _counted_lengths(items: list[torch.Tensor], width: int) -> np.ndarray:
    """int64 ``[n]`` element counts of ``items`` over ``width`` (their lengths when all are ``[L_i, width]``)."""
    return np.fromiter(map(torch.Tensor.numel, items), dtype=np.int64, count=len(items)) // width


def _join_pages(pages: list[torch.Tensor], width: int) -> torch.Tensor:
    """The pages joined by one ``cat`` (which checks that all are 2-D of one width), and of ``width`` when their
    lengths were read with it (``width`` 0: nothing to check); a page of another width is named."""
    joined = _join("ps", pages, pages)
    if width and joined.shape[1] != width:
        raise ValueError(f"ps: every item must have the same embedding width, got {sorted({width, joined.shape[1]})}")
    return joined


class _QueryRows:
    """Every query token as one row ``[rows, 1, d]`` on ``device`` (no padding), and how the per-row maxima
    ``[rows, B]`` become per-query sums.

    A zero-padded tensor keeps its padding rows (a zero token adds exactly what it adds in colpali-engine). A
    list gets one zero row after its tokens, and the sums gather each query's rows padded to the longest query
    with that zero row: exactly the padding colpali-engine adds, summed in a fixed order (no atomics). The gather
    index is built on the host at the first sum, once the first kernel is queued (the host work overlaps it).

    A list is joined before its shapes are read: the ``cat`` checks that every item is 2-D of one width (a
    failed join names the bad item), so each length is its element count over the width, one C-level pass over
    ints where a ``torch.Size`` per query cost more host time before the first kernel."""

    def __init__(self, queries, device):
        if isinstance(queries, torch.Tensor):
            n, length, dim = queries.shape
            self.rows = queries.to(device).reshape(n * length, 1, dim)
            self.n_queries, self.length, self.lengths = n, length, None
            self.zero = None
            return
        if set(map(torch.Tensor.dim, queries)) != {2}:  # (a legacy empty 1-D tensor would pass the join)
            _name_bad_item("qs", queries)
        joined = _join("qs", [*queries, _zero_row(queries[0])], queries)
        if joined.shape[1]:
            self.lengths = _counted_lengths(queries, joined.shape[1])
        else:  # zero-width rows: their element counts say nothing of their lengths
            self.lengths = _lengths(_sizes("qs", queries))
        self.rows = joined.to(device).unsqueeze(1)
        self.n_queries, self.length = len(queries), int(self.lengths.max())
        self.gather = self.zero = None

    def zero_similarity(self) -> torch.Tensor:
        """``[rows, 1]`` fp32: each row's similarity with a zero token, as colpali-engine's padding computes it (0,
        or NaN where the row holds inf or NaN)."""
        if self.zero is None:
            self.zero = (self.rows[:, 0] * 0).sum(dim=-1, keepdim=True, dtype=torch.float32)
        return self.zero

    def _gather_index(self) -> torch.Tensor:
        lengths, n_tokens = self.lengths, self.rows.shape[0] - 1
        gather = np.full((self.n_queries, self.length), n_tokens, dtype=np.int64)  # the zero row
        query = np.repeat(np.arange(self.n_queries), lengths)
        position = np.arange(n_tokens) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        gather[query, position] = np.arange(n_tokens)
        return torch.from_numpy(gather).to(self.rows.device, non_blocking=True)

    def sums(self, row_scores: torch.Tensor) -> torch.Tensor:
        """``[rows, B]`` per-row maxima -> ``[n_queries, B]`` per-query sums (fp32)."""
        if self.lengths is None:
            return row_scores.view(self.n_queries, self.length, -1).sum(dim=1)
        if self.gather is None:
            self.gather = self._gather_index()
        return row_scores[self.gather].sum(dim=1)


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
    queries = _items("qs", qs)
    pages = _items("ps", ps)
    if len(queries) == 0:
        raise ValueError("No queries provided")
    if len(pages) == 0:
        raise ValueError("No passages provided")
    # Before any page copy: the gather index's host-to-device copy waits for the work already queued.
    q = _QueryRows(queries, device)
    # Pages per kernel call so that the per-row maxima (and the gathered sums) stay bounded.
    bytes_per_page = 4 * (q.rows.shape[0] + q.n_queries * q.length)
    pages_per_call = max(1, _ROW_SCORES_BUDGET_BYTES // max(1, bytes_per_page))

    def score(docs, cu=None, longest=None, zero_token=None):
        """Per-query sums over ``docs`` (padded ``[n, L, d]``, or packed with offsets ``cu``); ``zero_token``: a bool
        ``[n]`` mask of the pages colpali-engine's padding gives a zero token, whose similarity with each query row
        (0, or NaN for a row holding inf or NaN) then takes part in their row maxima."""
        if docs.dtype != q.rows.dtype:
            raise TypeError(f"ps has dtype {docs.dtype} but qs has {q.rows.dtype}: pass both in one dtype")
        if docs.shape[-1] != q.rows.shape[-1]:
            raise ValueError(f"ps has embedding width {docs.shape[-1]} but the queries have {q.rows.shape[-1]}")
        if q.rows.shape[0] == 0:  # a padded tensor of empty queries: each scores 0
            return torch.zeros(q.n_queries, docs.shape[0] if cu is None else cu.shape[0] - 1, device=device)
        rows = maxsim(q.rows, docs) if cu is None else maxsim_packed(q.rows, docs, cu, max_seqlen_d=longest)
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
            joined = _join_early(pages, device, pages_per_call)
            early_scores = None
            if joined is not None and joined.shape[0] == len(pages) * pages[0].shape[0]:
                # Scored too before the shape pass, on the guess that every page is as long as the first (the
                # usual ColPali case): the kernel then runs while the host checks, and its result is kept only
                # if the pass below proves the guess.
                early_scores = score(joined.view(len(pages), *pages[0].shape))
                if _all_like_first(pages):
                    # One group of equal pages, no zero token (the join's bounds are the groups'): the guess held.
                    return early_scores.cpu().float()
            lengths, width = _page_lengths(pages)
            padded = _needs_zero_token(lengths, batch_size)
            row_bytes = pages[0].shape[1] * pages[0].element_size()
            groups = list(_page_groups(lengths, row_bytes, pages_per_call))
            if len(groups) > 1:
                joined = early_scores = None  # the early copy guessed one group wrong (a page is longer): dropped
            # (An early join has proved every page as wide as the first: the lengths read with that width hold.)
            for start, stop in groups:
                group = pages[start:stop]
                group_lengths = lengths[start:stop]
                flagged = padded[start:stop]
                docs = joined if joined is not None else _join_pages(group, width)
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
                scores.append(score(docs.to(device), offsets, int(group_lengths.max()), zero_token))
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
