"""The method registry: every implementation the benchmark times, as a builder of a score function.

A method's builder takes a :class:`~lik.bench.shapes.Shape` and returns ``score(Q, D) -> scores`` with
``Q`` of ``shape.q_shape`` and ``D [B, Ld, d]``, scores fp32 ``[B]`` (2-D ``Q``) or ``[Nq, B]``. For the
``train`` suite the same function must be differentiable; the runner wraps it in the step (cross-entropy on
the in-batch scores, then the gradients of ``Q`` and ``D``).

Peers are optional imports: a missing package, or a machine without CUDA, makes the method *unavailable*
(recorded with the reason), never an error.

8-bit methods (``storage`` "int8" / "fp8": lik's, flash-maxsim's int8x8 and late-interaction-kernels' fp8) score
a corpus stored quantized: their ``prepare(shape, Q, D)`` quantizes every input set once, outside the timing,
with the method's own quantizer, and the score function takes what it returns.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .shapes import EIGHT_BIT_CELLS, Shape

__all__ = [
    "Method",
    "METHODS",
    "CHUNK_SIZES",
    "einsum_maxsim",
    "chunked_einsum_maxsim",
    "peer_versions",
    "select_methods",
    "QUANTIZED_TOLERANCE",
]

ScoreFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Documents per chunk swept for the chunked eager method (only sizes below B are run).
CHUNK_SIZES = (16, 64, 256, 1024)

# ||scores - float64 scores of the float inputs|| / ||...|| above which an 8-bit method is marked "mismatch": the
# quantization error of L2-normalised random data stays below 1e-3 (int8) and 8e-3 (fp8) at the benchmark's
# shapes, a broken kernel is off by O(1).
QUANTIZED_TOLERANCE = {"int8": 1e-2, "fp8": 3e-2}

# Distribution names of the optional peers, for version records.
_PEER_DISTRIBUTIONS = ("flash-maxsim", "late-interaction-kernels", "chamferdist", "pykeops")


@dataclass(frozen=True)
class Method:
    """One implementation under test.

    Attributes:
        name: identifier in the JSON and the table.
        suites: the suites it runs in.
        build: ``build(shape) -> score(Q, D)``; imports happen here, at build time.
        module: optional package it needs (a peer); its absence makes the method unavailable.
        needs_cuda: unavailable on a machine without CUDA (peers, ``torch.compile``).
        sweep: name of the swept group it belongs to (the table shows the best of a sweep).
        applies: whether it runs at a given shape (the chunked sweep skips chunks >= B).
        storage: ``"int8"`` / ``"fp8"`` for methods that score a corpus stored in 8 bits (their floor counts 1 byte
            per element and the 8-bit matmul rate; their check allows the quantization error).
        prepare: ``prepare(shape, Q, D) -> operands`` run once per input set outside the timing (quantization);
            the score function is then called as ``score(*operands)``.
    """

    name: str
    suites: tuple[str, ...]
    build: Callable[[Shape], ScoreFn]
    module: str | None = None
    needs_cuda: bool = False
    sweep: str | None = None
    applies: Callable[[Shape], bool] = field(default=lambda shape: True)
    storage: str | None = None
    prepare: Callable[[Shape, torch.Tensor, torch.Tensor], tuple] | None = None

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Why the method cannot run here, or ``None`` when it can."""
        if self.needs_cuda and device.type != "cuda":
            return "needs a CUDA device"
        if self.storage == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            return "needs FP8 tensor cores (compute capability 8.9 or newer)"
        if self.module is not None:
            try:
                importlib.import_module(self.module)
            except Exception as exc:  # an ImportError, or a peer failing at import time
                return f"import {self.module} failed: {type(exc).__name__}: {exc}"
        return None


def einsum_maxsim(Q: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """MaxSim the way PyTorch users write it: the full similarity tensor in the input dtype, max, fp32 sum."""
    if Q.dim() == 2:
        sim = torch.einsum("sh,bth->bst", Q, D)
    else:
        sim = torch.einsum("nsh,bth->nbst", Q, D)
    return sim.max(dim=-1).values.sum(dim=-1, dtype=torch.float32)


def chunked_einsum_maxsim(chunk: int) -> ScoreFn:
    """The usual production workaround: :func:`einsum_maxsim` over ``chunk`` documents at a time."""

    def score(Q: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
        parts = [einsum_maxsim(Q, D[start : start + chunk]) for start in range(0, D.shape[0], chunk)]
        return torch.cat(parts, dim=-1)

    return score


def _eight_bit_cell(shape: Shape) -> bool:
    """Where the 8-bit methods run: the cells of the 8-bit table (and the CPU smoke shape)."""
    return shape.name in EIGHT_BIT_CELLS or (shape.suite == "forward" and shape.family == "smoke")


def _late_interaction_kernels_runs(shape: Shape) -> bool:
    # late-interaction-kernels 0.4.5 hit an illegal memory access at textual d >= 768 (H100), which leaves the
    # process's CUDA context unusable: not run there.
    return not (shape.suite == "width" and shape.ld <= 512 and shape.d >= 768)


def _lik(backward: str) -> Callable[[Shape], ScoreFn]:
    def build(shape: Shape) -> ScoreFn:
        import lik

        return lambda Q, D: lik.maxsim(Q, D, backward=backward)

    return build


def _flash_maxsim(shape: Shape) -> ScoreFn:
    # flash_maxsim(Q [Lq, d], D [B, Ld, d]) -> [B]; flash_maxsim_batched(Q [Nq, Lq, d], D) -> [Nq, B];
    # training: flash_maxsim_batched_train(Q, D, shared_docs=True) with autograd.
    import flash_maxsim

    if shape.suite == "train":
        return lambda Q, D: flash_maxsim.flash_maxsim_batched_train(Q, D, shared_docs=True)
    if shape.suite == "forward":
        return flash_maxsim.flash_maxsim
    return flash_maxsim.flash_maxsim_batched


def _late_interaction_kernels(shape: Shape) -> ScoreFn:
    # maxsim(Q [Lq, d] or [Nq, Lq, d], D [B, Ld, d]) -> [B] / [Nq, B]; autograd when inputs require grad,
    # backward="auto" (its default) picks between its atomic "unified" and its "lowmem" backward.
    import late_interaction_kernels

    return late_interaction_kernels.maxsim


def _lik_8bit_method(tag: str, dtype: torch.dtype) -> Method:
    """lik scoring 8-bit ``Q`` and ``D`` quantized by ``lik.quantize``."""

    def prepare(shape: Shape, Q: torch.Tensor, D: torch.Tensor) -> tuple:
        import lik

        D_q, d_scale = lik.quantize(D, dtype)
        Q_q, q_scale = lik.quantize(Q, dtype)
        return Q_q, D_q, q_scale, d_scale

    def build(shape: Shape) -> Callable:
        import lik

        return lambda Q_q, D_q, q_scale, d_scale: lik.maxsim(Q_q, D_q, q_scale=q_scale, d_scale=d_scale)

    return Method(f"lik-{tag}", ("forward",), build, storage=tag, prepare=prepare, applies=_eight_bit_cell)


def _flash_maxsim_int8x8_prepare(shape: Shape, Q: torch.Tensor, D: torch.Tensor) -> tuple:
    # Its own quantizers: per-token int8 with fp16 scales; the float query is passed too (its signature's first).
    import flash_maxsim

    D_i, d_scale = flash_maxsim.quantize_int8_symmetric(D)
    Q_i, q_scale = flash_maxsim.quantize_query_int8(Q)
    return Q, D_i, d_scale, Q_i, q_scale


def _flash_maxsim_int8x8(shape: Shape) -> Callable:
    # flash_maxsim_int8x8(Q [Lq, d], D_int8 [B, Ld, d], d_scales, Q_int8, q_scales) -> [B]: 2-D queries only.
    import flash_maxsim

    return flash_maxsim.flash_maxsim_int8x8


def _late_interaction_fp8_prepare(shape: Shape, Q: torch.Tensor, D: torch.Tensor) -> tuple:
    from late_interaction_kernels import fp8

    return (*fp8.quantize_fp8_per_token(Q), *fp8.quantize_fp8_per_token(D))


def _late_interaction_fp8(shape: Shape) -> Callable:
    # maxsim_inference_fp8(Q_fp8, D_fp8, scale_Q=, scale_D=) with per-token fp32 scales; fp8 tensor cores (sm 89+).
    from late_interaction_kernels import fp8

    return lambda Q_f, q_scale, D_f, d_scale: fp8.maxsim_inference_fp8(Q_f, D_f, scale_Q=q_scale, scale_D=d_scale)


def _compiled(shape: Shape) -> ScoreFn:
    # One static-shape graph per benchmark shape; the limit on recompilations of one function is raised so
    # that a long run never falls back to eager silently.
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, limit, max(getattr(config, limit), 256))
    return torch.compile(einsum_maxsim, dynamic=False)


def _chunk_method(chunk: int) -> Method:
    return Method(
        name=f"eager-chunked-{chunk}",
        suites=("forward", "multi"),
        build=lambda shape: chunked_einsum_maxsim(chunk),
        sweep="eager-chunked",
        applies=lambda shape: chunk < shape.b,
    )


SCORING = ("forward", "multi", "width")  # the suites that score without a gradient
ALL = ("forward", "multi", "train", "width")

METHODS: tuple[Method, ...] = (
    Method("lik", SCORING, _lik("auto")),
    Method("lik-fast", ("train",), _lik("fast")),
    Method("lik-deterministic", ("train",), _lik("deterministic")),
    Method("flash-maxsim", ALL, _flash_maxsim, module="flash_maxsim", needs_cuda=True),
    Method(
        "late-interaction-kernels", ALL, _late_interaction_kernels,
        module="late_interaction_kernels", needs_cuda=True, applies=_late_interaction_kernels_runs,
    ),
    *(_lik_8bit_method(tag, dtype) for tag, dtype in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn))),
    Method("flash-maxsim-int8x8", ("forward",), _flash_maxsim_int8x8, module="flash_maxsim", needs_cuda=True,
           storage="int8", prepare=_flash_maxsim_int8x8_prepare, applies=_eight_bit_cell),
    Method("late-interaction-kernels-fp8", ("forward",), _late_interaction_fp8,
           module="late_interaction_kernels", needs_cuda=True, storage="fp8", prepare=_late_interaction_fp8_prepare,
           applies=_eight_bit_cell),
    Method("eager", ("forward", "multi", "train"), lambda shape: einsum_maxsim),
    *(_chunk_method(c) for c in CHUNK_SIZES),
    # Scores only: compiling the training step's backward graph takes longer than the rest of its cells together.
    Method("compile", ("forward", "multi"), _compiled, needs_cuda=True),
)


def select_methods(names: list[str] | None, *, quick: bool = False) -> list[Method]:
    """Methods whose name or sweep is in ``names`` (all methods when ``names`` is None; with ``quick``, all but the
    swept ones), in registry order."""
    if names is None:
        return [m for m in METHODS if not (quick and m.sweep)]
    known = {m.name for m in METHODS} | {m.sweep for m in METHODS if m.sweep}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {sorted(known)}")
    return [m for m in METHODS if m.name in names or m.sweep in names]


def peer_versions() -> dict[str, str | None]:
    """Installed versions of the optional peers (``None`` where not installed)."""
    versions: dict[str, str | None] = {}
    for dist in _PEER_DISTRIBUTIONS:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return versions
