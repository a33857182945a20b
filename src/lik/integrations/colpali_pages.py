"""How :func:`lik.integrations.colpali.score_multi_vector` turns colpali-engine's lists of query and page embeddings
into the kernels' inputs, with as little host work per item as a list of ~1 000 pages allows (docs/design.md,
"Host time"): the checks that name a bad item, the joins of a list into one tensor, the lengths read from element
counts, the pages that colpali-engine's block padding gives a zero token, the packed groups of pages, and the
queries as rows (:class:`QueryRows`).

Every function takes lists as colpali-engine passes them (``[L_i, d]`` tensors); errors name the argument (``qs`` /
``ps``) and the item.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np
import torch

from ..ops.maxsim.validation import KERNEL_DTYPES, check_real, check_width

__all__ = [
    "PACK_BUDGET_BYTES",
    "as_items",
    "checked_sizes",
    "name_bad_item",
    "lengths_of",
    "join",
    "zero_row",
    "ZERO_ROWS",
    "overlaps_host",
    "on_device",
    "join_early",
    "all_like_first",
    "needs_zero_token",
    "page_groups",
    "page_lengths",
    "counted_lengths",
    "join_pages",
    "QueryRows",
    "check_rows",
]

#: The packed copy of a list of pages is made in groups of at most this many bytes.
PACK_BUDGET_BYTES = 256 * 1024 * 1024


def as_items(name: str, x) -> list[torch.Tensor] | torch.Tensor:
    """A ``[n, L, d]`` tensor as is, or a list's items once every one is a tensor (their shapes:
    :func:`checked_sizes`)."""
    if isinstance(x, torch.Tensor):
        if x.dim() != 3:
            raise ValueError(
                f"{name} must be a [n, L, d] tensor or a list of [L_i, d] tensors, got shape {list(x.shape)}"
            )
        return x
    if isinstance(x, (list, tuple)):
        if not all(map(isinstance, x, repeat(torch.Tensor))):
            name_bad_item(name, x)
        return list(x)
    raise TypeError(f"{name} must be a tensor or a list of tensors, got {type(x).__name__}")


def checked_sizes(name: str, items: list[torch.Tensor]) -> tuple[list[torch.Size], set[torch.Size]]:
    """Every item's size, checked to be ``[L_i, d]`` with one ``d``, and the set of distinct sizes.

    One C-level pass per property (a list holds ~1 000 pages: a Python loop per page, or ``len`` of a tensor,
    which is a Python method, costs host time); the loop naming the first bad item runs only when a check fails."""
    sizes = list(map(torch.Tensor.size, items))
    distinct = set(sizes)
    if not all(len(size) == 2 for size in distinct):
        name_bad_item(name, items)
    widths = {size[1] for size in distinct}
    if len(widths) > 1:
        raise ValueError(f"{name}: every item must have the same embedding width, got {sorted(widths)}")
    return sizes, distinct


def name_bad_item(name: str, items) -> None:
    for i, item in enumerate(items):
        if not isinstance(item, torch.Tensor) or item.dim() != 2:
            raise ValueError(f"{name}[{i}] must be a [L, d] tensor, got {getattr(item, 'shape', type(item).__name__)}")


def lengths_of(checked: tuple[list[torch.Size], set[torch.Size]]) -> np.ndarray:
    """int64 ``[n]`` first dimensions of :func:`checked_sizes`' sizes (all equal: no per-item pass)."""
    sizes, distinct = checked
    if len(distinct) == 1:
        return np.full(len(sizes), next(iter(distinct))[0], dtype=np.int64)
    return np.fromiter((size[0] for size in sizes), dtype=np.int64, count=len(sizes))


def join(name: str, tensors: list[torch.Tensor], items: list[torch.Tensor] | None = None) -> torch.Tensor:
    """``torch.cat(tensors)``; when the join fails, ``items`` (the caller's list, unchecked so far) get
    :func:`checked_sizes`' named checks, and a list spread over several devices is named."""
    try:
        return torch.cat(tensors)
    except RuntimeError as error:
        if items is not None:
            checked_sizes(name, items)
        devices = sorted({str(t.device) for t in tensors})
        if len(devices) > 1:
            raise ValueError(f"{name}: every item must be on one device, got {devices}") from error
        raise


# One zero row per (device, dtype, width), appended to every joined query list: a fill launch less per call.
ZERO_ROWS: dict[tuple, torch.Tensor] = {}


def zero_row(like: torch.Tensor) -> torch.Tensor:
    """A ``[1, d]`` zero row on ``like``'s device, in its dtype (``like``: ``[L, d]``); read, never written."""
    key = (like.device, like.dtype, like.shape[1])
    row = ZERO_ROWS.get(key)
    if row is None:
        row = ZERO_ROWS[key] = like.new_zeros(1, like.shape[1])
    return row


def overlaps_host(device: torch.device) -> bool:
    """Whether a copy launched on ``device`` runs while the host goes on (an accelerator, not the CPU)."""
    return device.type != "cpu"


def on_device(x: torch.Tensor, device: torch.device) -> bool:
    """Whether ``x.to(device)`` is ``x`` itself ("cuda" without an index is the current CUDA device)."""
    if x.device == device:
        return True
    return (
        device.type == "cuda"
        and device.index is None
        and x.device.type == "cuda"
        and x.device.index == torch.cuda.current_device()
    )


def join_early(pages: list[torch.Tensor], device: torch.device, max_pages: int) -> torch.Tensor | None:
    """The pages joined by one ``cat``, launched before their shapes are checked so that the copy (and the
    scoring, when every page is as long as the first) overlaps the per-page pass on the host.

    Only where the join will most likely be the one group scored: pages already on ``device``, first and last of
    one shape, all within the copy budget if every page had that shape, no more than one call's pages. ``None``
    otherwise, or when the ``cat`` fails (the checks then name the bad page)."""
    first, last = pages[0], pages[-1]
    if not overlaps_host(device) or len(pages) > max_pages or first.dim() != 2 or first.shape != last.shape:
        return None
    if not on_device(first, device):
        return None
    if len(pages) * (first.shape[0] + 1) * first.shape[1] * first.element_size() > PACK_BUDGET_BYTES:
        return None
    try:
        return torch.cat(pages)
    except RuntimeError:
        return None


def all_like_first(pages: list[torch.Tensor]) -> bool:
    """Whether every page of a list that ``torch.cat`` has just joined has the first page's shape, decided from
    element counts alone: the join has checked that all are 2-D of one width (a legacy empty 1-D tensor, which it
    skips, counts 0 elements), so equal counts mean equal lengths. A C-level pass over ints costs half of
    :func:`checked_sizes`' pass, which builds a ``torch.Size`` per page (~0.2 us each, 1 000 pages)."""
    count = pages[0].numel()
    return count > 0 and set(map(torch.Tensor.numel, pages)) == {count}


def needs_zero_token(lengths: np.ndarray, batch_size: int) -> np.ndarray:
    """Which pages colpali-engine's per-block padding gives at least one zero token (a longer page shares their
    block of ``batch_size``): bool ``[n_pages]``."""
    if len(lengths) == 0 or lengths[0] == lengths.min() == lengths.max():
        return np.zeros(len(lengths), dtype=bool)
    n_blocks = -(-len(lengths) // batch_size)
    blocks = np.full(n_blocks * batch_size, -1, dtype=np.int64)
    blocks[: len(lengths)] = lengths
    longest = np.repeat(blocks.reshape(n_blocks, batch_size).max(axis=1), batch_size)[: len(lengths)]
    return lengths < longest


def page_groups(lengths: np.ndarray, row_bytes: int, max_pages: int):
    """``(start, stop)`` runs of pages copied and scored together: at most ``PACK_BUDGET_BYTES`` packed (counting
    one spare row per page) and at most ``max_pages`` pages; a page larger than the budget goes alone."""
    ends = np.cumsum((lengths + 1) * row_bytes)
    start = 0
    while start < len(lengths):
        before = ends[start - 1] if start else 0
        stop = int(np.searchsorted(ends, before + PACK_BUDGET_BYTES, side="right"))
        stop = max(start + 1, min(stop, start + max_pages))
        yield start, stop
        start = stop


def page_lengths(pages: list[torch.Tensor]) -> tuple[np.ndarray, int]:
    """int64 ``[n]`` page lengths and the width they were read with (0: read from each page's ``torch.Size``).

    When the first page is 2-D and not zero-wide, each length is the page's element count over its width: one
    C-level pass over ints, where a ``torch.Size`` per page cost twice that host time. A page of other dimensions
    or of another width gets a wrong length here, so every join of pages (which refuses other dimensions) is checked
    against that width (:func:`join_pages`) before its lengths are used."""
    width = pages[0].shape[1] if pages[0].dim() == 2 else 0
    if width:
        lengths = counted_lengths(pages, width)
        # A page of other dimensions fails the join, except a legacy empty 1-D tensor, which ``cat`` skips: only
        # the empty pages need their dimensions read here.
        if all(pages[i].dim() == 2 for i in np.flatnonzero(lengths == 0).tolist()):
            return lengths, width
    return lengths_of(checked_sizes("ps", pages)), 0


def counted_lengths(items: list[torch.Tensor], width: int) -> np.ndarray:
    """int64 ``[n]`` element counts of ``items`` over ``width`` (their lengths when all are ``[L_i, width]``)."""
    return np.fromiter(map(torch.Tensor.numel, items), dtype=np.int64, count=len(items)) // width


def join_pages(pages: list[torch.Tensor], width: int) -> torch.Tensor:
    """The pages joined by one ``cat`` (which checks that all are 2-D of one width), and of ``width`` when their
    lengths were read with it (``width`` 0: nothing to check); a page of another width is named."""
    joined = join("ps", pages, pages)
    if width and joined.shape[1] != width:
        raise ValueError(f"ps: every item must have the same embedding width, got {sorted({width, joined.shape[1]})}")
    return joined


class QueryRows:
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
            self.rows = check_rows(queries.to(device).reshape(n * length, 1, dim))
            self.n_queries, self.length, self.lengths = n, length, None
            self.zero = None
            return
        if set(map(torch.Tensor.dim, queries)) != {2}:  # (a legacy empty 1-D tensor would pass the join)
            name_bad_item("qs", queries)
        joined = join("qs", [*queries, zero_row(queries[0])], queries)
        if joined.shape[1]:
            self.lengths = counted_lengths(queries, joined.shape[1])
        else:  # zero-width rows: their element counts say nothing of their lengths
            self.lengths = lengths_of(checked_sizes("qs", queries))
        self.rows = check_rows(joined.to(device).unsqueeze(1))
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


_ROW_DTYPES = KERNEL_DTYPES + (torch.float64,)


def check_rows(rows: torch.Tensor) -> torch.Tensor:
    """The one check of the query rows ``[rows, 1, d]`` every group of pages is scored against: a float dtype the
    scorers take (float64 runs the reference) and a supported width; the groups then reach the internal scoring
    entries unchecked. Returns ``rows``."""
    if rows.dtype not in _ROW_DTYPES:
        check_real("qs", rows)
        raise TypeError(f"qs must have dtype in {[str(t) for t in _ROW_DTYPES]}, got {rows.dtype}")
    check_width("qs", rows)
    return rows
