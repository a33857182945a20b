"""Chamfer distance cases: forward + backward of both directions, lik against the libraries users pick instead.

Methods: ``lik`` (``lik.chamfer_distance``, PyTorch3D's contract and default reductions, with TF32 allowed:
``torch.set_float32_matmul_precision("high")`` around the call), ``lik-highest`` (the same at ``"highest"``:
TF32-split products of float32's accuracy; feature sets only, point clouds take exact differences either way),
``flash-maxsim`` (``flash_chamfer_train``, one cloud per call, so batches loop), ``chamferdist`` (its CUDA
extension), ``keops`` (pykeops ``LazyTensor`` arg-min reductions, then a differentiable gather, as a KeOps user
writes it) and ``cdist`` (``torch.cdist`` + min, where the ``[N, P, P]`` matrix fits). ``torch.rand`` float32
clouds.

The floor counts the FLOPs of one ``[P, P]`` product per cloud (``2 * D * N * P^2``: one pass over the pairs
serves both directions) at the cuBLAS TF32 rate (precision "high"), measured in the same run. Point clouds (D = 3)
are bound by instruction issue instead (benchmarks/NOTES.md), so their % of this floor is small by construction.
The check compares each loss and its gradients with a float64 brute-force loss of the same clouds: with TF32
products a few near-tied neighbours swap (each exact for the neighbour chosen), which moves the gradients of those
points, so TF32 cells may exceed the tolerance where ``lik-highest`` does not.
"""

from __future__ import annotations

import torch

from .cases import Case, CaseMethod, floor_record
from .measure import Timer

__all__ = ["chamfer_cases", "fp32_matmul_rate"]

# Flash-maxsim's flash_chamfer_train at N 1, P 100 000, D 128 on the H200 (27 ms): the TF32 bar is 1.5x it.

# (N, P, D, quick): the rows of the table of record.
SHAPES = ((1, 10_000, 3, True), (16, 10_000, 3, True), (1, 100_000, 3, True), (1, 10_000, 128, True),
          (1, 100_000, 128, True), (1, 1_000, 3, False), (1, 1_000_000, 3, False))
SMOKE = {(1, 10_000, 3): (1, 40, 3), (16, 10_000, 3): (3, 30, 3), (1, 10_000, 128): (1, 25, 16)}

_rate_cache: dict = {}


def fp32_matmul_rate(device: torch.device, precision: str | None = None) -> float:
    """FLOP/s of a 16384 x 128 x 16384 float32 product through cuBLAS at ``precision`` (None: the current
    ``torch.get_float32_matmul_precision()``), measured once per process and precision (the CPU's float32
    matmul on a smoke run)."""
    precision = precision or torch.get_float32_matmul_precision()
    if (device, precision) not in _rate_cache:
        timer = Timer(device, warmup_ms=10.0, rep_ms=50.0 if device.type == "cuda" else 5.0)
        m, k = (16384, 128) if device.type == "cuda" else (256, 16)
        a, b = torch.randn(m, k, device=device), torch.randn(k, m, device=device)
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(precision)
        try:
            _rate_cache[device, precision] = 2.0 * m * m * k / (timer.median_ms(lambda: a @ b) / 1e3)
        finally:
            torch.set_float32_matmul_precision(previous)
    return _rate_cache[device, precision]


def _inputs(n: int, p: int, d: int):
    def inputs(device: torch.device, smoke: bool) -> dict:
        nn, pp, dd = SMOKE.get((n, p, d), (1, 20, d if d <= 16 else 16)) if smoke else (n, p, d)
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.rand(nn, pp, dd, device=device, generator=gen)
        y = torch.rand(nn, pp, dd, device=device, generator=gen)
        return dict(x=x, y=y, xg=x.clone().requires_grad_(), yg=y.clone().requires_grad_(), n=nn, p=pp, d=dd)

    return inputs


def _floor(s: dict, ceilings) -> dict:
    flops = 2.0 * s["d"] * s["n"] * s["p"] * s["p"]
    nbytes = 4.0 * 2 * 2 * s["n"] * s["p"] * s["d"]  # both clouds read, both gradients written
    return floor_record(flops, nbytes, ceilings, flops_per_s=fp32_matmul_rate(s["x"].device, "high"))


def _reference(s: dict) -> tuple[torch.Tensor, ...]:
    """The float64 loss of both directions (mean over points, mean over the batch) and its gradients."""
    x, y = s["x"].double().requires_grad_(), s["y"].double().requires_grad_()
    loss = _brute_force_loss(x, y)
    return (loss.detach(), *torch.autograd.grad(loss, (x, y)))


def _brute_force_loss(x: torch.Tensor, y: torch.Tensor, block: int = 2048) -> torch.Tensor:
    """Chamfer loss by exact nearest neighbours, in blocks of rows (memory O(block * P))."""

    def nearest(a, b):  # [N, Pa]: squared distance of each point of a to its nearest point of b
        parts = []
        for start in range(0, a.shape[1], block):
            rows = a[:, start:start + block]
            with torch.no_grad():
                index = torch.cdist(rows, b).argmin(dim=2)
            near = torch.gather(b, 1, index[..., None].expand(-1, -1, b.shape[2]))
            parts.append(((rows - near) ** 2).sum(-1))
        return torch.cat(parts, dim=1)

    return nearest(x, y).mean(1).mean() + nearest(y, x).mean(1).mean()


def _step(loss_fn):
    def build(s: dict):
        xg, yg = s["xg"], s["yg"]

        def call():
            loss = loss_fn(xg, yg)
            gx, gy = torch.autograd.grad(loss, (xg, yg))
            return loss.detach(), gx, gy

        return call

    return build


def _at_precision(precision: str, x, y):
    import lik

    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        return lik.chamfer_distance(x, y)[0]
    finally:
        torch.set_float32_matmul_precision(previous)


def _lik(x, y):
    return _at_precision("high", x, y)  # TF32 allowed, as the tables of flash-maxsim's TF32 kernel compare


def _lik_highest(x, y):
    return _at_precision("highest", x, y)


def _flash(x, y):
    from flash_maxsim import flash_chamfer_train

    return sum(flash_chamfer_train(x[i], y[i]) for i in range(x.shape[0])) / x.shape[0]


def _chamferdist(x, y):
    from chamferdist import ChamferDistance

    # Its "mean" point and batch reductions equal PyTorch3D's default.
    return ChamferDistance()(x, y, bidirectional=True, point_reduction="mean", batch_reduction="mean")


def _keops(x, y):
    from pykeops.torch import LazyTensor

    xi, yj = LazyTensor(x.detach()[:, :, None, :]), LazyTensor(y.detach()[:, None, :, :])
    dist = ((xi - yj) ** 2).sum(-1)
    ix = dist.argmin(dim=2).long().view(x.shape[0], -1)
    iy = dist.argmin(dim=1).long().view(y.shape[0], -1)
    near_y = torch.gather(y, 1, ix[..., None].expand(-1, -1, x.shape[2]))
    near_x = torch.gather(x, 1, iy[..., None].expand(-1, -1, x.shape[2]))
    return ((x - near_y) ** 2).sum(-1).mean(1).mean() + ((y - near_x) ** 2).sum(-1).mean(1).mean()


def _cdist(x, y):
    dist = torch.cdist(x, y) ** 2
    return dist.min(2).values.mean(1).mean() + dist.min(1).values.mean(1).mean()


def chamfer_cases() -> list[Case]:
    """The Chamfer cases, in table order."""
    cases = []
    for n, p, d, quick in SHAPES:
        methods = {
            "lik": CaseMethod(_step(_lik)),
            "lik-highest": CaseMethod(_step(_lik_highest)),
            "flash-maxsim": CaseMethod(_step(_flash), module="flash_maxsim", needs_cuda=True),
            "chamferdist": CaseMethod(_step(_chamferdist), module="chamferdist", needs_cuda=True),
            "keops": CaseMethod(_step(_keops), module="pykeops", needs_cuda=True),
        }
        if n * p * p * 4 * 3 < 24 * 2**30:  # the [N, P, P] distances and their gradient fit
            methods["cdist"] = CaseMethod(_step(_cdist))
        if d <= 8:  # point clouds compare exact differences whatever the matmul precision
            methods.pop("lik-highest")
        if d > 3 and p >= 100_000:  # chamferdist's generic-D kernel took ~14 s a call there (H100)
            methods.pop("chamferdist")
        if p >= 1_000_000:
            methods = {k: v for k, v in methods.items() if k in ("lik", "lik-highest", "flash-maxsim")}
        size = f"{p:,}".replace(",", " ")
        cases.append(Case("chamfer", f"chamfer/{n}x{p}x{d}", f"N {n}, P {size}, D {d}", _inputs(n, p, d), methods,
                          floor=_floor, reference=None if p >= 1_000_000 else _reference, tolerance=1e-4,
                          quick=quick, params={"n": n, "p": p, "d": d}))
    return cases


# Candidate launches of the dot route for ``sweep``: (block_m, block_n, num_warps, num_stages, one_pass).
DOT_TILES = ((128, 64, 8, 3, True), (128, 64, 8, 2, True), (128, 128, 8, 2, True), (64, 64, 4, 3, True),
             (64, 128, 4, 3, True), (256, 64, 8, 2, True), (128, 64, 8, 3, False))


def sweep(p: int = 100_000, d: int = 128, dtypes=("fp32-high", "fp16", "bf16"), device: str = "cuda") -> list[dict]:
    """Forward + backward of ``lik.chamfer_distance`` (N 1, ``p`` points each side, ``torch.rand``) under each
    candidate dot-route launch against the heuristic's, and flash-maxsim's ``flash_chamfer_train`` where it
    imports: the data behind :func:`lik.config.nearest_config`. One JSON line per launch."""
    import json

    import triton.testing

    import lik
    from lik.config import NearestConfig, override

    rows = []
    device = torch.device(device)
    for name in dtypes:
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(name, torch.float32)
        torch.set_float32_matmul_precision("high" if name == "fp32-high" else "highest")
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.rand(1, p, d, device=device, generator=gen).to(dtype).requires_grad_()
        y = torch.rand(1, p, d, device=device, generator=gen).to(dtype).requires_grad_()
        launches = {"heuristic": None}
        launches.update({f"{bm}x{bn}/{w}w/{s}s" + ("" if one else "/two-pass"): NearestConfig(
            "dot", "tf32", block_m=bm, block_n=bn, num_warps=w, num_stages=s, one_pass=one)
            for bm, bn, w, s, one in DOT_TILES})
        for label, cfg in launches.items():
            def step(cfg=cfg):
                with override(**({} if cfg is None else {"nearest": cfg})):
                    return torch.autograd.grad(lik.chamfer_distance(x, y)[0], (x, y))

            try:
                ms = triton.testing.do_bench(step, warmup=5, rep=100, return_mode="median")
            except Exception as exc:  # noqa: BLE001 (a launch that fails is reported, the sweep goes on)
                ms = f"{type(exc).__name__}: {exc}"[:160]
            rows.append(dict(dtype=name, p=p, d=d, launch=label, ms=ms))
            print(json.dumps(rows[-1]), flush=True)
        if name == "fp32-high":
            try:
                ms = triton.testing.do_bench(lambda: torch.autograd.grad(_flash(x, y), (x, y)), warmup=5, rep=100,
                                             return_mode="median")
            except Exception as exc:  # noqa: BLE001 (flash-maxsim may be absent)
                ms = f"{type(exc).__name__}: {exc}"[:160]
            rows.append(dict(dtype=name, p=p, d=d, launch="flash-maxsim", ms=ms))
            print(json.dumps(rows[-1]), flush=True)
    torch.set_float32_matmul_precision("high")
    return rows


if __name__ == "__main__":
    sweep()
