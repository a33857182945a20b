"""Contrastive training step cases: ``lik.contrastive_loss`` (MaxSim, cross-entropy and backward as one autograd
node) against the same step composed of a scorer and ``F.cross_entropy``, and against flash-maxsim's fused step.

A step is the loss and the gradients of ``Q`` and ``D`` (``torch.autograd.grad``; flash-maxsim's
``colbert_contrastive_step`` writes ``.grad`` itself, cleared before each step as ``optimizer.zero_grad()`` leaves
it), in-batch negatives with the diagonal labels, temperature 1, the fast backward, fp16, d = 128, L2-normalised
random data. Methods:

* ``lik``: :func:`lik.contrastive_loss`;
* ``lik-maxsim-ce``: ``lik.maxsim(backward="fast")`` + ``F.cross_entropy``;
* ``late-interaction-kernels``: its ``maxsim`` + ``F.cross_entropy``;
* ``flash-maxsim``: ``flash_maxsim.flash_maxsim_contrastive.colbert_contrastive_step`` (Lq <= 32 only: ColPali's
  row records its refusal);
* ``trivial-scorer`` (host cases only): a custom autograd Function of a few elementwise ops + ``F.cross_entropy``,
  the floor of a step's host time on this host (``TrivialScorer``, which benchmarks/host_path.py uses too).

Cases: ``contrastive/colbert-128``, ``contrastive/colbert-512`` (Nq = B, Lq 32, Ld 180) and
``contrastive/colpali-32`` (Nq = B = 32, Lq 1024, Ld 1024), timed on the device (``do_bench``:
:func:`contrastive_cases`); and ``host/contrastive-colbert-128`` (:func:`contrastive_host_cases`, for the host-time
table), the host's cost per step (:func:`lik.bench.cases.host_ms`: the calls issued without synchronising). In the
device cases every method's output ``(loss, dQ, dD)`` is checked against ``lik-maxsim-ce``'s in float.
The floor: the forward's products (``2 Nq B Lq Ld d`` FLOPs at the cuBLAS fp16 rate) or reading ``Q`` and ``D``
and writing their gradients once, whichever is longer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cases import Case, CaseMethod, floor_record

__all__ = ["contrastive_cases", "contrastive_host_cases", "main", "SHAPES", "TrivialScorer"]

# name -> (Nq = B, Lq, Ld); d = 128
SHAPES = {"colbert-128": (128, 32, 180), "colbert-512": (512, 32, 180), "colpali-32": (32, 1024, 1024)}
DIM = 128


class TrivialScorer(torch.autograd.Function):
    """The floor of a training step's host time: a differentiable ``[Nq, B]`` score of a few elementwise ops."""

    @staticmethod
    def forward(ctx, Q, D):
        ctx.shapes = (Q.shape, Q.dtype, D.shape, D.dtype)
        return Q[:, 0, 0].float()[:, None] * D[:, 0, 0].float()[None, :]

    @staticmethod
    def backward(ctx, grad):
        q_shape, q_dtype, d_shape, d_dtype = ctx.shapes
        return (
            torch.zeros(q_shape, dtype=q_dtype, device=grad.device),
            torch.zeros(d_shape, dtype=d_dtype, device=grad.device),
        )


def _inputs(shape: tuple[int, int, int]):
    def inputs(device: torch.device, smoke: bool) -> dict:
        gen = torch.Generator().manual_seed(0)
        b, lq, ld = (6, 4, 8) if smoke else shape
        dim = 16 if smoke else DIM
        dtype = torch.float32 if smoke else torch.float16
        Q = F.normalize(torch.randn(b, lq, dim, generator=gen), dim=-1).to(device=device, dtype=dtype)
        D = F.normalize(torch.randn(b, ld, dim, generator=gen), dim=-1).to(device=device, dtype=dtype)
        return dict(Q=Q.requires_grad_(), D=D.requires_grad_(), labels=torch.arange(b, device=device))

    return inputs


def _composed(score):
    """A step of ``score(Q, D)`` into ``F.cross_entropy``: ``(loss, dQ, dD)``."""

    def build(s):
        def step():
            loss = F.cross_entropy(score(s["Q"], s["D"]), s["labels"])
            return (loss, *torch.autograd.grad(loss, (s["Q"], s["D"])))

        return step

    return build


def _lik(s):
    from lik.ops.contrastive import contrastive_loss

    def step():
        loss = contrastive_loss(s["Q"], s["D"], backward="fast")
        return (loss, *torch.autograd.grad(loss, (s["Q"], s["D"])))

    return step


def _lik_maxsim(Q, D):
    import lik

    return lik.maxsim(Q, D, backward="fast")


def _late_interaction(Q, D):
    from late_interaction_kernels import maxsim

    return maxsim(Q, D)


def _flash(s):
    from flash_maxsim.flash_maxsim_contrastive import colbert_contrastive_step

    Q, D = s["Q"], s["D"]

    def step():
        Q.grad = D.grad = None  # the peer accumulates into .grad: each step starts from none, as after zero_grad()
        loss = colbert_contrastive_step(Q, D)
        return loss, Q.grad, D.grad

    return step


def _methods(host: bool) -> dict[str, CaseMethod]:
    methods = {
        "lik": CaseMethod(_lik),
        "lik-maxsim-ce": CaseMethod(_composed(_lik_maxsim)),
        "late-interaction-kernels": CaseMethod(
            _composed(_late_interaction), module="late_interaction_kernels", needs_cuda=True
        ),
        "flash-maxsim": CaseMethod(_flash, module="flash_maxsim.flash_maxsim_contrastive", needs_cuda=True),
    }
    if host:
        methods["trivial-scorer"] = CaseMethod(_composed(TrivialScorer.apply))
    return methods


def _floor(s: dict, ceilings) -> dict:
    Q, D = s["Q"], s["D"]
    (n_q, l_q, dim), (n_docs, l_d, _) = Q.shape, D.shape
    nbytes = 2 * (Q.numel() + D.numel()) * Q.element_size()  # read once, gradient written once
    return floor_record(2.0 * n_q * n_docs * l_q * l_d * dim, nbytes, ceilings)


def _reference(s: dict):
    """``lik-maxsim-ce``'s step in float: the loss and both gradients."""
    loss, dq, dd = _composed(_lik_maxsim)(s)()
    return loss.float(), dq.float(), dd.float()


def contrastive_cases() -> list[Case]:
    """The device-time cases of the contrastive-step table (op ``contrastive``), one per shape."""
    return [
        Case(
            "contrastive",
            f"contrastive/{name}",
            f"{label}, Nq = B = {b} (Lq {lq}, Ld {ld}), fp16",
            _inputs((b, lq, ld)),
            _methods(False),
            floor=_floor,
            reference=_reference,
            tolerance=1e-2,
            quick=name == "colbert-128",
            params={"B": b, "Lq": lq, "Ld": ld, "d": DIM},
        )
        for name, label, (b, lq, ld) in (
            ("colbert-128", "ColBERT", SHAPES["colbert-128"]),
            ("colbert-512", "ColBERT", SHAPES["colbert-512"]),
            ("colpali-32", "ColPali", SHAPES["colpali-32"]),
        )
    ]


def contrastive_host_cases() -> list[Case]:
    """The host-time case (op ``host``, times in host microseconds per step): ColBERT B 128 beside the trivial
    scorer, the floor of a step's host time on the same host."""
    return [
        Case(
            "host",
            "host/contrastive-colbert-128",
            "contrastive step (loss + gradients), ColBERT B 128 (32 x 180)",
            _inputs(SHAPES["colbert-128"]),
            _methods(True),
            host_time=True,
            params={"B": 128, "Lq": 32, "Ld": 180, "d": DIM},
        )
    ]


def main(rounds: int = 4) -> list[dict]:
    """Run every case on the current CUDA device (CPU at smoke size without one) and print each method's time and
    lik's ratios: the bars are ``lik`` >= 1.5x ``late-interaction-kernels`` and >= 1.2x ``flash-maxsim`` at ColBERT
    B 128, not slower than ``lik-maxsim-ce`` elsewhere, and host time within 100 us of ``trivial-scorer``'s.

    ``python -m lik.bench.contrastive_cases`` (``lik bench --ops contrastive`` once the table is registered)."""
    from .cases import run_case
    from .measure import Timer, measure_ceilings

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    timer = Timer(device) if cuda else Timer(device, warmup_ms=0, rep_ms=1)
    ceilings, _ = measure_ceilings(timer, copy_bytes=1 << 30 if cuda else 1 << 20, matmul_n=8192 if cuda else 64)
    entries = []
    for case in contrastive_cases() + contrastive_host_cases():
        print(case.label)
        entry = run_case(case, device=device, timer=timer, ceilings=ceilings, rounds=rounds, smoke=not cuda, log=print)
        times = {name: cell["median_ms"] for name, cell in entry["cells"].items() if "median_ms" in cell}
        if "lik" in times:
            unit, scale = ("us", 1e3) if case.host_time else ("ms", 1.0)
            ratios = ", ".join(f"{name} / lik = {t / times['lik']:.2f}x" for name, t in times.items() if name != "lik")
            print(f"  lik {times['lik'] * scale:.4g} {unit}; {ratios}")
            if case.host_time and "trivial-scorer" in times:
                above = (times["lik"] - times["trivial-scorer"]) * 1e3
                print(f"  lik host time above the trivial scorer's: {above:.0f} us")
        entries.append(entry)
    return entries


if __name__ == "__main__":
    main()
