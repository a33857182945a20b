"""Measurement primitives: inputs, timing, peak memory and the machine's ceilings.

On CUDA, times are :func:`triton.testing.do_bench` medians (``return_mode="median"``): it runs a warm-up,
then times each call with device events after clearing the L2 cache. On a CPU (``--smoke``) a
``time.perf_counter`` loop takes the median instead, so the plumbing is testable without a GPU.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .roofline import Ceilings
from .shapes import Shape

__all__ = [
    "Timer",
    "InputSets",
    "make_inputs",
    "peak_memory_bytes",
    "measure_ceilings",
    "measure_storage_ceilings",
    "quantize_throughput",
    "free_memory",
    "is_oom",
    "median_rate",
    "matmul_rate",
    "eight_bit_matmuls",
]


@dataclass(frozen=True)
class Timer:
    """Median wall time of a callable: do_bench on CUDA, a perf_counter loop on the CPU.

    Attributes:
        device: where the work runs.
        warmup_ms: warm-up time before timing (milliseconds, do_bench's convention).
        rep_ms: total timed time (milliseconds); at least 3 runs on the CPU.
    """

    device: torch.device
    warmup_ms: float = 25.0
    rep_ms: float = 100.0

    def median_ms(self, fn: Callable[[], object]) -> float:
        """Median milliseconds of one call of ``fn``."""
        if self.device.type == "cuda":
            import triton.testing

            return float(
                triton.testing.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")
            )
        fn()
        times = []
        deadline = time.perf_counter() + self.rep_ms / 1e3
        while len(times) < 3 or time.perf_counter() < deadline:
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)


class InputSets:
    """Several copies of a shape's inputs, handed out in turn, so that timing never re-reads a warm cache.

    One set when the inputs are larger than the rotation budget (several times the L2 cache); otherwise
    enough copies to exceed it, at most ``max_sets``.
    """

    def __init__(self, sets: list[tuple[torch.Tensor, torch.Tensor]]):
        self.sets = sets
        self._next = 0

    def __len__(self) -> int:
        return len(self.sets)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(Q, D)`` in rotation."""
        pair = self.sets[self._next]
        self._next = (self._next + 1) % len(self.sets)
        return pair


def _normalised(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    x = torch.randn(shape, device=device, dtype=torch.float32, generator=gen)
    return torch.nn.functional.normalize(x, dim=-1).to(dtype)


def make_inputs(
    shape: Shape,
    dtype: torch.dtype,
    device: torch.device,
    *,
    seed: int = 0,
    rotate_bytes: int = 0,
    max_sets: int = 8,
    requires_grad: bool = False,
) -> InputSets:
    """L2-normalised random ``(Q, D)`` for ``shape``, rotated when one set is smaller than ``rotate_bytes``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    per_set = (math.prod(shape.q_shape) + math.prod(shape.d_shape)) * torch.finfo(dtype).bits // 8
    count = max(1, min(max_sets, math.ceil(rotate_bytes / max(per_set, 1))))
    sets = []
    for _ in range(count):
        q = _normalised(shape.q_shape, dtype, device, gen).requires_grad_(requires_grad)
        d = _normalised(shape.d_shape, dtype, device, gen).requires_grad_(requires_grad)
        sets.append((q, d))
    return InputSets(sets)


def free_memory(device: torch.device) -> None:
    """Collect garbage and return cached blocks to the driver (so one method's cache cannot hurt the next)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` means the device ran out of memory."""
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def peak_memory_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """Peak bytes allocated by one call of ``fn`` above what was allocated before it (``None`` on CPU).

    A fresh measurement: caches are emptied and the peak counter reset first. The result of ``fn`` is held
    until after the peak is read, so the outputs are part of the figure.
    """
    if device.type != "cuda":
        return None
    free_memory(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    return int(peak)


def measure_ceilings(timer: Timer, *, copy_bytes: int, matmul_n: int) -> tuple[Ceilings, dict]:
    """Measure the machine's bandwidth (device copy, read + write) and fp16 matmul rate in this process.

    On the CPU (``--smoke``) the matmul is float32, as half-precision matmuls there are not a ceiling
    anyone hits. Returns the ceilings and a record of how they were measured.
    """
    device = timer.device
    gen = torch.Generator(device=device).manual_seed(1)
    src = torch.randn(copy_bytes // 2, device=device, dtype=torch.float16, generator=gen)
    dst = torch.empty_like(src)
    copy_ms = timer.median_ms(lambda dst=dst, src=src: dst.copy_(src))
    del src, dst

    mm_dtype = torch.float16 if device.type == "cuda" else torch.float32
    a = torch.randn(matmul_n, matmul_n, device=device, dtype=mm_dtype, generator=gen)
    b = torch.randn(matmul_n, matmul_n, device=device, dtype=mm_dtype, generator=gen)
    mm_ms = timer.median_ms(lambda a=a, b=b: a @ b)
    del a, b
    free_memory(device)

    ceilings = Ceilings(
        bandwidth_bytes_per_s=2 * copy_bytes / (copy_ms / 1e3),
        matmul_flops_per_s=2 * matmul_n**3 / (mm_ms / 1e3),
    )
    record = {
        "copy": {"bytes_each_way": copy_bytes, "median_ms": copy_ms},
        "matmul": {"m_n_k": matmul_n, "dtype": str(mm_dtype).removeprefix("torch."), "median_ms": mm_ms},
    }
    return ceilings, record


def median_rate(timer: Timer, fn: Callable[[], object], amount: float) -> tuple[float, float]:
    """``(amount per second, median ms)`` of one call of ``fn`` (``amount``: its bytes or FLOPs)."""
    ms = timer.median_ms(fn)
    return amount / (ms / 1e3), ms


def matmul_rate(timer: Timer, dtype_name: str, n: int, device: torch.device) -> dict:
    """The rate of a square ``n x n x n`` cuBLAS product of ``dtype_name`` (``fp16``, ``bf16``, ``fp32-tf32``,
    ``fp32``, ``int8``: ``torch._int_mm``, ``fp8``: ``torch._scaled_mm``): ``{"what", "median_ms", "TFLOPps"}``."""
    gen = torch.Generator(device=device).manual_seed(2)
    flops = 2.0 * n**3
    if dtype_name in ("fp16", "bf16", "fp32-tf32", "fp32"):
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(dtype_name, torch.float32)
        a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
        b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high" if dtype_name == "fp32-tf32" else "highest")
        try:
            rate, ms = median_rate(timer, lambda: a @ b, flops)
        finally:
            torch.set_float32_matmul_precision(previous)
    elif dtype_name == "int8":
        a = torch.randint(-127, 128, (n, n), device=device, dtype=torch.int8, generator=gen)
        b = torch.randint(-127, 128, (n, n), device=device, dtype=torch.int8, generator=gen).t()
        rate, ms = median_rate(timer, lambda: torch._int_mm(a, b), flops)
    else:  # fp8 e4m3, per-tensor scales, fp16 output
        a = torch.randn(n, n, device=device, generator=gen).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device, generator=gen).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        rate, ms = median_rate(
            timer, lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float16), flops)
    return {"what": f"{n}^3 a @ b", "median_ms": ms, "TFLOPps": rate / 1e12}


def eight_bit_matmuls(device: torch.device) -> list[str]:
    """The 8-bit products ``device`` has (``int8``, ``fp8``): none off CUDA, ``fp8`` from compute capability 8.9."""
    if device.type != "cuda":
        return []
    names = ["int8"] if hasattr(torch, "_int_mm") else []
    if hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(device) >= (8, 9):
        names.append("fp8")
    return names


def measure_storage_ceilings(timer: Timer, ceilings: Ceilings, storages: set[str], *, matmul_n: int
                             ) -> tuple[dict[str, Ceilings], dict]:
    """The ceilings of 8-bit methods' floors: the same copy bandwidth, the matmul rate of ``int8``
    (``torch._int_mm``) / ``fp8`` (``torch._scaled_mm``) where the GPU has it. On a CPU, or where a type has no
    product, the run's own ceilings stand in (recorded as such)."""
    out, record = {}, {}
    available = set(eight_bit_matmuls(timer.device))
    for storage in sorted(storages):
        if storage in available:
            measured = matmul_rate(timer, storage, matmul_n, timer.device)
            out[storage] = Ceilings(ceilings.bandwidth_bytes_per_s, measured["TFLOPps"] * 1e12)
            record[storage] = measured
        else:
            out[storage] = ceilings
            record[storage] = "not measured: the run's matmul rate stands in"
        free_memory(timer.device)
    return out, record


def quantize_throughput(timer: Timer, ceilings: Ceilings, *, rows: int, dim: int = 128) -> list[dict]:
    """``lik.quantize`` of ``rows x dim`` fp16 rows into int8 and fp8 (where the device has float8) against the
    copy floor of its bytes: read the fp16 rows, write the 8-bit rows and one fp32 scale per row."""
    import lik

    device = timer.device
    x = torch.nn.functional.normalize(
        torch.randn(rows, dim, device=device, generator=torch.Generator(device=device).manual_seed(3)), dim=-1
    ).half()
    moved = rows * dim * 2 + rows * dim + rows * 4
    records = []
    types = [("int8", torch.int8)]
    if device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9):
        types.append(("fp8", torch.float8_e4m3fn))
    for tag, dtype in types:
        ms = timer.median_ms(lambda x=x, dtype=dtype: lik.quantize(x, dtype))
        floor_ms = 1e3 * moved / ceilings.bandwidth_bytes_per_s
        records.append({"what": f"lik.quantize fp16 [{rows}, {dim}] -> {tag}", "median_ms": ms,
                        "floor_ms": floor_ms, "pct_of_floor": 100.0 * floor_ms / ms, "bytes": moved})
    del x
    free_memory(device)
    return records
