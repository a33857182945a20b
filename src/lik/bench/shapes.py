"""The MaxSim shape registry: every MaxSim problem size the benchmark knows, grouped into suites.

A :class:`Shape` is one MaxSim problem. ``suite`` says how it is run:

* ``forward``: one 2-D query ``[Lq, d]`` against ``B`` documents ``[B, Ld, d]`` (reranking), scores only;
* ``multi``: ``Nq`` queries ``[Nq, Lq, d]`` against one shared corpus ``[B, Ld, d]``, scores only;
* ``train``: in-batch contrastive step, ``Q [B, Lq, d]`` against ``D [B, Ld, d]``: the ``[B, B]`` scores,
  cross-entropy against the diagonal, and the gradients of ``Q`` and ``D``;
* ``width``: as ``forward``, at embedding widths other than 128.

The canonical sizes are those of docs/design.md ("How performance is judged") plus larger training batches and
the width cells; ``quick`` marks the subset that ``--quick`` runs. ``--smoke`` runs :data:`SMOKE_SHAPES`, tiny
versions of each suite that run on a CPU in well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Shape", "SUITES", "CANONICAL_SHAPES", "SMOKE_SHAPES", "FAMILIES", "EIGHT_BIT_CELLS", "WIDTHS", "select_shapes",
]

SUITES = ("forward", "multi", "train", "width")

# family -> (Lq, Ld): the canonical MaxSim geometries of docs/design.md, all at d = 128.
FAMILIES = {
    "textual": (32, 300),
    "long-doc": (32, 1024),
    "medium": (128, 1024),
    "visual": (512, 1024),
    "colpali": (1024, 1024),
    "colbert-train": (32, 180),
    "colpali-train": (1024, 1024),
}

# The forward cells where the 8-bit methods run (the 8-bit table): the memory-bound cells at scale and the
# compute-bound ones, plus textual B = 1 000 (the small call).
EIGHT_BIT_CELLS = frozenset({
    "forward/textual/B1000", "forward/visual/B1000", "forward/colpali/B1000", "forward/textual/B10000",
    "forward/long-doc/B10000", "forward/visual/B10000", "forward/colpali/B10000",
})

# Embedding widths of the width suite: a compute-bound cell (one 1024-token query against 256 documents of 1024
# tokens) and a memory-bound one (textual, B = 10 000) at each.
WIDTHS = (256, 384, 768, 2048)


@dataclass(frozen=True)
class Shape:
    """One benchmark problem.

    Attributes:
        suite: ``"forward"``, ``"multi"``, ``"train"`` or ``"width"`` (see the module docstring).
        family: geometry name, a key of :data:`FAMILIES` (or ``"smoke"``).
        nq: number of queries (1 where the query is 2-D; ``b`` for ``train``).
        lq, ld, b, d: query length, document length, number of documents, embedding width.
        quick: part of the ``--quick`` subset.
    """

    suite: str
    family: str
    nq: int
    lq: int
    ld: int
    b: int
    d: int = 128
    quick: bool = True

    @property
    def name(self) -> str:
        """Stable identifier used in the JSON, e.g. ``forward/textual/B1000``, ``multi/colpali/Nq32xB128`` or
        ``width/colpali/B256/d768``."""
        size = f"B{self.b}" if self.suite != "multi" else f"Nq{self.nq}xB{self.b}"
        width = f"/d{self.d}" if self.suite == "width" else ""
        return f"{self.suite}/{self.family}/{size}{width}"

    @property
    def label(self) -> str:
        """The row label of the tables, e.g. ``textual 32x300, B 1 000`` or ``textual 32x300, Nq 32 x B 1 024``."""
        b = f"{self.b:,}".replace(",", " ")
        geometry = f"{self.family} {self.lq}x{self.ld}"
        if self.suite == "multi":
            return f"{geometry}, Nq {self.nq} x B {b}"
        if self.suite == "width":
            return f"{geometry}, B {b}, d {self.d}"
        return f"{geometry}, B {b}"

    @property
    def two_d_query(self) -> bool:
        """Whether the query is one ``[Lq, d]`` tensor (scores ``[B]``) rather than ``[Nq, Lq, d]``."""
        return self.suite in ("forward", "width")

    @property
    def q_shape(self) -> tuple[int, ...]:
        """Shape of the query tensor: 2-D for ``forward`` and ``width``, 3-D otherwise."""
        if self.two_d_query:
            return (self.lq, self.d)
        return (self.nq, self.lq, self.d)

    @property
    def d_shape(self) -> tuple[int, int, int]:
        """Shape of the (shared) document tensor ``[B, Ld, d]``."""
        return (self.b, self.ld, self.d)

    @property
    def score_count(self) -> int:
        """Number of fp32 scores produced (``Nq * B``)."""
        return self.nq * self.b


def _forward(family: str, b: int, quick: bool) -> Shape:
    lq, ld = FAMILIES[family]
    return Shape("forward", family, 1, lq, ld, b, quick=quick)


def _multi(family: str, b: int) -> Shape:
    lq, ld = FAMILIES[family]
    return Shape("multi", family, 32, lq, ld, b)


def _train(family: str, b: int, quick: bool) -> Shape:
    lq, ld = FAMILIES[family]
    return Shape("train", family, b, lq, ld, b, quick=quick)


CANONICAL_SHAPES: tuple[Shape, ...] = (
    # Single-query reranking at B = 1 000 and 10 000 (medium B = 10 000 only in the full run).
    *(_forward(f, 1000, True) for f in ("textual", "long-doc", "medium", "visual", "colpali")),
    *(_forward(f, 10000, f != "medium") for f in ("textual", "long-doc", "medium", "visual", "colpali")),
    # 32 queries against a shared corpus.
    _multi("textual", 1024),
    _multi("long-doc", 1024),
    _multi("colpali", 128),
    # In-batch training: the canonical batches 128 / 512 and 32 / 64, and 2048 / 128 for scale.
    _train("colbert-train", 128, True),
    _train("colbert-train", 512, True),
    _train("colbert-train", 2048, False),
    _train("colpali-train", 32, True),
    _train("colpali-train", 64, True),
    _train("colpali-train", 128, False),
    # Any width: compute-bound (Lq = Ld = 1024, B = 256) and memory-bound (textual, B = 10 000).
    *(Shape("width", "colpali", 1, 1024, 1024, 256, d) for d in WIDTHS),
    *(Shape("width", "textual", 1, 32, 300, 10000, d) for d in WIDTHS),
)

SMOKE_SHAPES: tuple[Shape, ...] = (
    Shape("forward", "smoke", 1, 8, 24, 40, d=32),
    Shape("multi", "smoke", 3, 8, 24, 20, d=32),
    Shape("train", "smoke", 6, 8, 12, 6, d=32),
    Shape("width", "smoke", 1, 8, 24, 10, d=40),
)


def select_shapes(suites: list[str], *, quick: bool = False, smoke: bool = False) -> list[Shape]:
    """The shapes of the requested suites, in registry order (``quick`` keeps the quick subset)."""
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        raise ValueError(f"unknown suite(s) {unknown}; choose from {SUITES}")
    pool = SMOKE_SHAPES if smoke else CANONICAL_SHAPES
    return [s for s in pool if s.suite in suites and (s.quick or not quick)]
