"""Floors: the least time a shape can take on a machine, from its FLOPs, its bytes and measured ceilings.

``floor = max(FLOPs / matmul rate, minimal bytes / copy bandwidth)`` (docs/design.md, "How performance is judged").

* FLOPs of the forward: ``2 * Nq * B * Lq * Ld * d`` (the similarity products; the max and the sum are free
  next to them). The training step adds the backward's two gathers over the argmax, ``2 * Nq * B * Lq * d``
  each for ``dQ`` and ``dD``; they are counted at the matmul rate, which can only lower the floor.
* Minimal bytes of the forward: ``Q`` and ``D`` read once, the fp32 scores written once. The training step
  reads ``Q`` and ``D`` once, writes ``dQ`` and ``dD`` once (input dtype), and writes then reads the fp32
  ``[B, B]`` scores (the loss needs them; their gradient comes back).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .shapes import Shape

__all__ = ["Ceilings", "Floor", "flop_count", "min_bytes", "floor"]


@dataclass(frozen=True)
class Ceilings:
    """Ceilings measured on the machine: bytes/s of a device copy (read + write) and FLOP/s of a matmul."""

    bandwidth_bytes_per_s: float
    matmul_flops_per_s: float

    def as_dict(self) -> dict:
        """JSON-friendly form, in GB/s and TFLOP/s as well as raw units."""
        return {
            **asdict(self),
            "bandwidth_GBps": self.bandwidth_bytes_per_s / 1e9,
            "matmul_TFLOPps": self.matmul_flops_per_s / 1e12,
        }


@dataclass(frozen=True)
class Floor:
    """The two times of a shape and the larger of them (all in milliseconds)."""

    flops: float
    bytes: float
    compute_ms: float
    memory_ms: float

    @property
    def ms(self) -> float:
        """The floor: the larger of the compute and memory times."""
        return max(self.compute_ms, self.memory_ms)

    @property
    def bound(self) -> str:
        """``"compute"`` or ``"memory"``: which term sets the floor."""
        return "compute" if self.compute_ms >= self.memory_ms else "memory"

    def as_dict(self) -> dict:
        """JSON-friendly form."""
        return {**asdict(self), "floor_ms": self.ms, "bound": self.bound}


def flop_count(shape: Shape) -> float:
    """Floating-point operations of one call (forward, or forward + backward gathers for ``train``)."""
    pairs = shape.nq * shape.b
    flops = 2.0 * pairs * shape.lq * shape.ld * shape.d
    if shape.suite == "train":
        flops += 2 * (2.0 * pairs * shape.lq * shape.d)
    return flops


def min_bytes(shape: Shape, itemsize: int) -> float:
    """Fewest bytes one call must move through device memory, for inputs of ``itemsize`` bytes per element."""
    q = shape.nq * shape.lq * shape.d * itemsize
    docs = shape.b * shape.ld * shape.d * itemsize
    scores = shape.score_count * 4
    if shape.suite == "train":
        return 2.0 * (q + docs) + 2.0 * scores
    return float(q + docs + scores)


def floor(shape: Shape, itemsize: int, ceilings: Ceilings) -> Floor:
    """The floor of ``shape`` on a machine with ``ceilings``."""
    flops = flop_count(shape)
    nbytes = min_bytes(shape, itemsize)
    return Floor(
        flops=flops,
        bytes=nbytes,
        compute_ms=1e3 * flops / ceilings.matmul_flops_per_s,
        memory_ms=1e3 * nbytes / ceilings.bandwidth_bytes_per_s,
    )
