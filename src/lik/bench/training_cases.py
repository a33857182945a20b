"""Training-option cases: the soft reductions against the max, and ``D`` stored as int8 for the backward.

Both time one training step's scorer, forward + backward of the in-batch scores ``[B, B]`` of ``Q [B, Lq, d]``
against ``D [B, Ld, d]`` with a fixed upstream gradient, at the training shapes of docs/design.md (ColBERT B 128:
Lq 32, Ld 180; ColPali B 32: 1 024 x 1 024; d 128, fp16, L2-normalised):

* ``reductions``: ``lik.maxsim`` with ``reduction="max"`` (``lik``), ``"smooth"`` (tau 0.1: ``lik-smooth``) and
  ``"topk"`` (top_k 4: ``lik-topk``; ``lik-topk-deterministic``: its dD as products, not atomics), the bar being
  ``lik-smooth`` and ``lik-topk`` within 1.3x of ``lik``; eager PyTorch of the same reductions (``eager-smooth``,
  ``eager-topk``: the ``[B, B, Lq, Ld]`` similarities, then ``tau * logsumexp`` / ``topk``), and
  late-interaction-kernels 0.4.5's ``maxsim`` (its max; the release has no smooth MaxSim: its colpali-engine
  switch falls back to colpali-engine's PyTorch for ``use_smooth_max``).
* ``stored``: ``lik.maxsim`` keeping ``D`` as given (``lik``) or as int8 rows and fp32 scales
  (``save_d_as=torch.int8``: ``lik-int8``), against flash-maxsim's ``flash_maxsim_batched_train`` and
  ``flash_maxsim_int8_batched_train``. ``D`` is made inside the call from a leaf (a clone: the encoder's output),
  so a scorer that keeps only the int8 copy lets it go after the forward; the case's floor record carries
  ``saved_bytes``, what autograd keeps between forward and backward per method (``saved_tensors_hooks``: the
  bar asks ``lik-int8``'s to be at most 0.6x ``lik``'s, counting ``D``'s bytes for ``lik``).

The floor counts the similarity FLOPs once (``2 B^2 Lq Ld d``) at the run's fp16 matmul rate: a fused backward
recomputes or gathers, so the step's floor is at least that.
"""

from __future__ import annotations

import json
import sys

import torch

from .cases import Case, CaseMethod, floor_record

__all__ = ["training_cases", "reduction_cases", "stored_cases", "main"]

# (family, B, Lq, Ld, quick)
SHAPES = (("colbert", 128, 32, 180, True), ("colpali", 32, 1024, 1024, True))
SMOKE = (4, 5, 9, 16)  # B, Lq, Ld, d on the CPU
TAU, TOP_K = 0.1, 4


def _inputs(b: int, lq: int, ld: int):
    def inputs(device: torch.device, smoke: bool) -> dict:
        bb, qq, dd_len, dim = SMOKE if smoke else (b, lq, ld, 128)
        dtype = torch.float32 if smoke else torch.float16
        gen = torch.Generator(device=device).manual_seed(0)
        Q = torch.nn.functional.normalize(torch.randn(bb, qq, dim, device=device, generator=gen), dim=-1)
        D = torch.nn.functional.normalize(torch.randn(bb, dd_len, dim, device=device, generator=gen), dim=-1)
        grad = torch.randn(bb, bb, device=device, generator=gen)
        return dict(Q=Q.to(dtype).requires_grad_(), D=D.to(dtype).requires_grad_(), grad=grad, b=bb, lq=qq,
                    ld=dd_len, d=dim)

    return inputs


def _floor(s: dict, ceilings) -> dict:
    flops = 2.0 * s["b"] * s["b"] * s["lq"] * s["ld"] * s["d"]
    nbytes = 2.0 * 2 * s["b"] * (s["lq"] + s["ld"]) * s["d"]  # both sides read, both gradients written
    return floor_record(flops, nbytes, ceilings)


def _step(score):
    """A step: ``D`` made inside the call (a clone of the leaf), the scores, and the gradients to both leaves."""

    def build(s: dict):
        Q, D, grad = s["Q"], s["D"], s["grad"]

        def call():
            scores = score(Q, D.clone())
            return torch.autograd.grad(scores, (Q, D), grad.to(scores.dtype))

        return call

    return build


def _lik(**options):
    def score(Q, D):
        import lik

        return lik.maxsim(Q, D, **options)

    return score


def _eager(reduction: str):
    def score(Q, D):
        sim = torch.einsum("nsk,btk->nbst", Q, D).float()
        if reduction == "smooth":
            return (TAU * torch.logsumexp(sim / TAU, dim=-1)).sum(dim=-1)
        return sim.topk(min(TOP_K, sim.shape[-1]), dim=-1).values.mean(dim=-1).sum(dim=-1)

    return score


def _late_interaction(Q, D):
    from late_interaction_kernels import maxsim

    return maxsim(Q, D)


def _no_smooth(s: dict):
    raise NotImplementedError(
        "late-interaction-kernels 0.4.5 has no smooth MaxSim (its colpali-engine switch falls back to "
        "colpali-engine's PyTorch for use_smooth_max)"
    )


def _flash(int8: bool):
    def score(Q, D):
        if int8:
            from flash_maxsim import flash_maxsim_int8_batched_train as train
        else:
            from flash_maxsim import flash_maxsim_batched_train as train
        return train(Q, D)

    return score


def _saved_bytes(s: dict, methods: dict) -> dict:
    """Bytes autograd keeps between forward and backward, per method (a tensor counted once, ``D``'s clone
    included: it is what an encoder's output costs while the scorer holds it)."""
    out = {}
    for name, score in methods.items():
        seen: dict[int, int] = {}

        def pack(x, seen=seen):
            seen[x.data_ptr()] = max(seen.get(x.data_ptr(), 0), x.numel() * x.element_size())
            return x

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                scores = score(s["Q"], s["D"].clone())
            out[name] = sum(seen.values())
            del scores
        except Exception as exc:  # a missing peer: no figure
            out[name] = f"{type(exc).__name__}: {exc}"[:120]
    return out


def reduction_cases() -> list[Case]:
    """Max, smooth and top-k at the training shapes."""
    cases = []
    for family, b, lq, ld, quick in SHAPES:
        methods = {
            "lik": CaseMethod(_step(_lik())),
            "lik-smooth": CaseMethod(_step(_lik(reduction="smooth", tau=TAU))),
            "lik-topk": CaseMethod(_step(_lik(reduction="topk", top_k=TOP_K))),
            # (top-k's dD as products, not fp32 atomics: which is faster depends on the shape and on collisions)
            "lik-topk-deterministic": CaseMethod(_step(_lik(reduction="topk", top_k=TOP_K, backward="deterministic"))),
            "late-interaction-kernels": CaseMethod(_step(_late_interaction), module="late_interaction_kernels",
                                                   needs_cuda=True),
            "late-interaction-kernels-smooth": CaseMethod(_no_smooth, module="late_interaction_kernels",
                                                          needs_cuda=True),
            "eager-smooth": CaseMethod(_step(_eager("smooth"))),
            "eager-topk": CaseMethod(_step(_eager("topk"))),
        }
        cases.append(Case("reductions", f"reductions/{family}-{b}", f"{family} B {b} (Lq {lq}, Ld {ld})",
                          _inputs(b, lq, ld), methods, floor=_floor, quick=quick,
                          params={"b": b, "lq": lq, "ld": ld, "tau": TAU, "top_k": TOP_K}))
    return cases


def stored_cases() -> list[Case]:
    """``D`` kept as given or as int8 between forward and backward, lik against flash-maxsim."""
    cases = []
    for family, b, lq, ld, quick in SHAPES:
        scores = {"lik": _lik(), "lik-int8": _lik(save_d_as=torch.int8), "flash-maxsim": _flash(False),
                  "flash-maxsim-int8": _flash(True)}
        methods = {
            name: CaseMethod(_step(score), module="flash_maxsim" if name.startswith("flash") else None,
                             needs_cuda=name.startswith("flash"))
            for name, score in scores.items()
        }

        def floor(s, ceilings, scores=scores):
            return {**_floor(s, ceilings), "saved_bytes": _saved_bytes(s, scores)}

        cases.append(Case("stored", f"stored/{family}-{b}", f"{family} B {b} (Lq {lq}, Ld {ld})", _inputs(b, lq, ld),
                          methods, floor=floor, quick=quick, params={"b": b, "lq": lq, "ld": ld}))
    return cases


def training_cases() -> list[Case]:
    """Every training-option case, in table order."""
    return reduction_cases() + stored_cases()


def main(argv: list[str]) -> None:
    """``python -m lik.bench.training_cases [--smoke] [--out FILE]``: every case through :func:`~.cases.run_case`
    (4 interleaved rounds on CUDA), a line per method with its ratio to ``lik`` and its peak memory, the saved bytes
    of the ``stored`` cases, and the entries as JSON in ``FILE`` (default ``training_cases.json``)."""
    from .cases import run_case
    from .measure import Timer, measure_ceilings

    smoke = "--smoke" in argv
    device = torch.device("cpu" if smoke else "cuda")
    timer = Timer(device, warmup_ms=2.0 if smoke else 25.0, rep_ms=2.0 if smoke else 100.0)
    ceilings, _ = measure_ceilings(timer, copy_bytes=2**20 if smoke else 2**30, matmul_n=256 if smoke else 8192)
    entries = []
    for case in training_cases():
        print(case.name, flush=True)
        entry = run_case(case, device=device, timer=timer, ceilings=ceilings, rounds=2 if smoke else 4, smoke=smoke,
                         log=print)
        entries.append(entry)
        base = entry["cells"].get("lik", {}).get("median_ms")
        for name, cell in entry["cells"].items():
            if "median_ms" in cell:
                ratio = f"  {cell['median_ms'] / base:.2f}x lik" if base else ""
                print(f"    {name:32s} {cell['median_ms']:9.4f} ms  peak {cell.get('peak_MB')} MB{ratio}", flush=True)
        if (entry.get("floor") or {}).get("saved_bytes"):
            print("    saved bytes:", entry["floor"]["saved_bytes"], flush=True)
    out = argv[argv.index("--out") + 1] if "--out" in argv else "training_cases.json"
    with open(out, "w") as f:
        json.dump(entries, f, indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1:])
