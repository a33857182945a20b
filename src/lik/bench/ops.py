"""The operators the benchmark reports: one table (and one plot) per operator, in BENCHMARKS.md's order.

An :class:`Op` says which entries of a run belong to it and which method columns its table shows: lik's methods
first (with % of the floor), then the peers (the libraries users would pick instead: ``lik vs faster peer``
divides by the fastest of them), then the references (eager PyTorch and the like). The dense MaxSim operators
(``forward``, ``8bit``, ``train``, ``width``) are views of the MaxSim shapes (:mod:`lik.bench.cells`); the others
are lists of :class:`~lik.bench.cases.Case`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .cases import Case

__all__ = ["Op", "OPS", "OP_NAMES", "select_ops", "op_entries", "label", "DISPLAY"]


@dataclass(frozen=True)
class Op:
    """One table of BENCHMARKS.md.

    Attributes:
        name: identifier (``--ops``, plot file name).
        title: the table's heading.
        lik: lik's method columns (time and % of floor).
        peers: the peer libraries' columns.
        others: reference columns (eager PyTorch, padded einsum, ...).
        suites: MaxSim suites whose shapes this table shows (dense MaxSim operators).
        cases: the operator's cases (the other operators).
        floor: what the floor is, for the table's header line.
        weight: its share of a run's time budget.
        host: times are host microseconds per call, not device milliseconds.
    """

    name: str
    title: str
    lik: tuple[str, ...]
    peers: tuple[str, ...] = ()
    others: tuple[str, ...] = ()
    suites: tuple[str, ...] = ()
    cases: Callable[[], list[Case]] | None = None
    floor: str = ""
    weight: float = 1.0
    host: bool = False


def _packed():
    from .packed_cases import packed_cases

    return packed_cases()


def _index():
    from .index_cases import index_cases

    return index_cases()


def _msda():
    from .msda_cases import msda_cases

    return msda_cases()


def _chamfer():
    from .chamfer_cases import chamfer_cases

    return chamfer_cases()


def _host():
    from .contrastive_cases import contrastive_host_cases
    from .host_cases import host_cases

    return host_cases() + contrastive_host_cases()


def _packed_stream():
    from .packed_stream_cases import packed_stream_cases

    return packed_stream_cases()


def _reductions():
    from .training_cases import reduction_cases

    return reduction_cases()


def _stored():
    from .training_cases import stored_cases

    return stored_cases()


def _contrastive():
    from .contrastive_cases import contrastive_cases

    return contrastive_cases()


def _fused_head():
    from .fused_head_cases import fused_head_cases

    return fused_head_cases()


MAXSIM_FLOOR = "max(FLOPs / cuBLAS fp16 rate, bytes / copy bandwidth), both measured in the run"
PEERS = ("flash-maxsim", "late-interaction-kernels")

OPS: tuple[Op, ...] = (
    Op("forward", "MaxSim forward (inference), canonical shapes", ("lik",), PEERS,
       ("eager", "eager-chunked", "compile"),
       suites=("forward", "multi"), floor=MAXSIM_FLOOR, weight=6.0),
    Op("8bit", "8-bit corpora (int8 / fp8)", ("lik-int8", "lik-fp8"),
       ("flash-maxsim-int8x8", "late-interaction-kernels-fp8"),
       ("lik",), suites=("forward",), floor="1-byte operands at the cuBLAS int8 / fp8 rate, bytes / copy bandwidth",
       weight=2.0),
    Op("train", "MaxSim training step (forward + cross-entropy + backward)", ("lik-fast", "lik-deterministic"), PEERS,
       ("eager",), suites=("train",), floor=MAXSIM_FLOOR, weight=2.0),
    Op("width", "MaxSim at any embedding width", ("lik",), PEERS, suites=("width",), floor=MAXSIM_FLOOR, weight=1.0),
    Op("packed", "Packed (variable-length) MaxSim", ("lik",), PEERS, ("einsum-padded",), cases=_packed,
       floor="the real (unpadded) tokens' FLOPs and bytes, as for dense MaxSim", weight=0.5),
    Op("packed-stream", "Packed corpora at search scale: the token stream against the document loop",
       ("lik", "lik-stream", "lik-loop"), cases=_packed_stream,
       floor="the real tokens' FLOPs / cuBLAS fp16 rate (int8 / fp8: its own rate), their bytes / copy bandwidth",
       weight=1.0),
    Op("index", "lik.Index search", ("lik",), cases=_index,
       floor="gpu: one maxsim_packed call over the resident corpus; host: a pinned host-to-device copy of it",
       weight=1.0),
    Op("reductions", "Soft maxima in training (max, smooth, top-k; forward + cross-entropy + backward)",
       ("lik", "lik-smooth", "lik-topk", "lik-topk-deterministic"),
       ("late-interaction-kernels", "late-interaction-kernels-smooth"),
       ("eager-smooth", "eager-topk"), cases=_reductions, floor=MAXSIM_FLOOR, weight=1.0),
    Op("stored", "Documents stored as int8 between forward and backward (training step)", ("lik", "lik-int8"),
       ("flash-maxsim", "flash-maxsim-int8"), cases=_stored, floor=MAXSIM_FLOOR, weight=1.0),
    Op("contrastive", "Contrastive training step (MaxSim + cross-entropy + backward)", ("lik",), PEERS,
       ("lik-maxsim-ce",), cases=_contrastive,
       floor="forward FLOPs / cuBLAS fp16 rate, or Q and D read and their gradients written once", weight=1.0),
    Op("fused_head", "Fused projection head (hidden states -> projection -> normalise -> MaxSim)",
       ("lik", "lik packed"), ("late-interaction-kernels",), ("lik unfused",), cases=_fused_head,
       floor="projection + scoring FLOPs of the real tokens / cuBLAS fp16 rate, their hidden rows once / copy "
       "bandwidth (training: three projections, H read twice, dH written)", weight=1.0),
    Op("msda", "Multi-scale deformable attention", ("lik",), ("cuda-op",), ("pytorch",), cases=_msda,
       floor="minimal bytes (inputs read once, outputs written once) / copy bandwidth", weight=1.0),
    Op("chamfer", "Chamfer distance (forward + backward, both directions)", ("lik",),
       ("flash-maxsim", "chamferdist", "keops"), ("lik-highest", "cdist"), cases=_chamfer,
       floor="one product's FLOPs (2 D N P^2: one pass serves both directions) / cuBLAS rate at the run's float32 "
       "matmul precision (TF32)", weight=1.5),
    Op("host", "Host time of small calls", ("lik",), ("flash-maxsim", "late-interaction-kernels", "cuda-op"),
       ("pytorch", "lik-maxsim-ce", "trivial-scorer"), cases=_host, weight=0.5, host=True),
)
OP_NAMES = tuple(op.name for op in OPS)

# Column headers of the tables.
DISPLAY = {
    "lik": "lik", "lik-fast": "lik fast", "lik-deterministic": "lik deterministic", "lik-int8": "lik int8",
    "lik-fp8": "lik fp8", "eager": "eager einsum", "eager-chunked": "eager, chunked (best)", "compile": "torch.compile",
    "flash-maxsim-int8x8": "flash-maxsim int8x8", "late-interaction-kernels-fp8": "late-interaction-kernels fp8",
    "einsum-padded": "einsum, padded", "cuda-op": "original CUDA op", "pytorch": "PyTorch (grid_sample)",
    "cdist": "cdist + min", "lik-maxsim-ce": "lik.maxsim + cross-entropy",
    "trivial-scorer": "trivial scorer + cross-entropy", "lik-stream": "lik, token stream forced",
    "lik-loop": "lik, document loop forced", "lik-smooth": "lik smooth", "lik-topk": "lik top-k",
    "lik-topk-deterministic": "lik top-k (deterministic dD)",
    "late-interaction-kernels-smooth": "late-interaction-kernels smooth", "eager-smooth": "eager smooth",
    "eager-topk": "eager top-k", "flash-maxsim-int8": "flash-maxsim int8 training",
    "lik-highest": "lik, \"highest\" precision",
}


def select_ops(names: str | None) -> list[Op]:
    """The operators named in a comma-separated list (all for ``None`` or ``"all"``), in table order."""
    if names in (None, "all"):
        return list(OPS)
    wanted = [n for n in names.split(",") if n]
    unknown = [n for n in wanted if n not in OP_NAMES]
    if unknown:
        raise ValueError(f"unknown op(s) {unknown}; choose from {list(OP_NAMES)}")
    return [op for op in OPS if op.name in wanted]


def op_entries(results: dict, op: Op) -> list[dict]:
    """The entries of a run that ``op``'s table shows (MaxSim shapes of its suites; its cases)."""
    if op.cases is not None:
        return [e for e in results.get("cases", []) if e.get("op") == op.name]
    entries = [e for e in results.get("shapes", []) if e["shape"]["suite"] in op.suites]
    if op.name == "8bit":
        return [e for e in entries if any(name in e["cells"] for name in op.lik + op.peers)]
    if op.name == "forward":  # the table of float methods: an 8-bit-only run has no row here
        return [e for e in entries if any(name in e["cells"] for name in op.lik + op.peers + op.others)]
    return entries


def label(entry: dict) -> str:
    """The row label of an entry (recorded since schema 2; made from the shape for older JSON)."""
    if "label" in entry:
        return entry["label"]
    if "shape" in entry:
        from .shapes import Shape

        return Shape(**entry["shape"]).label
    return entry["name"]
