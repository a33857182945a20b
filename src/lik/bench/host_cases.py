"""Host time of small calls: what the host spends issuing one call when the GPU keeps up.

Each cell times ``calls`` calls in a row without synchronising (:func:`lik.bench.cases.host_ms`); at these sizes
the kernels finish faster than the host issues them, so the wall time per call is the host's cost (the Python
path, the argument checks, the launches). The cells:

* ``lik.maxsim`` inference of one 32 x 128 query against 10 documents of 100 tokens (fp16), beside the peers'
  ``flash_maxsim`` / ``maxsim``;
* the ColBERT B 128 in-batch training step (32 x 180, scores, cross-entropy, ``autograd.grad``), lik's fast
  backward beside the peers' training paths;
* ``lik.ms_deform_attn`` forward + backward at decoder scale (N 4, 300 queries, fp32), beside the PyTorch path
  and the original CUDA op (when ``LIK_ORIGINAL_MSDA_SRC`` is set).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cases import Case, CaseMethod
from .msda_cases import DECODER, ORIGINAL_SRC, SMOKE, detr_core, load_original_op, make_problem

__all__ = ["host_cases"]


def _normalised(shape, device, dtype, gen):
    return F.normalize(torch.randn(shape, generator=gen), dim=-1).to(device=device, dtype=dtype)


def _maxsim_inputs(device: torch.device, smoke: bool) -> dict:
    gen = torch.Generator().manual_seed(0)
    dtype = torch.float32 if smoke else torch.float16
    dim = 16 if smoke else 128
    return dict(Q=_normalised((32, dim), device, dtype, gen), D=_normalised((10, 100, dim), device, dtype, gen))


def _maxsim_methods() -> dict[str, CaseMethod]:
    def lik_call(s):
        import lik

        return lambda: lik.maxsim(s["Q"], s["D"])

    def flash(s):
        from flash_maxsim import flash_maxsim

        return lambda: flash_maxsim(s["Q"], s["D"])

    def late_interaction(s):
        from late_interaction_kernels import maxsim

        return lambda: maxsim(s["Q"], s["D"])

    return {"lik": CaseMethod(lik_call),
            "flash-maxsim": CaseMethod(flash, module="flash_maxsim", needs_cuda=True),
            "late-interaction-kernels": CaseMethod(late_interaction, module="late_interaction_kernels",
                                                   needs_cuda=True)}


def _train_inputs(device: torch.device, smoke: bool) -> dict:
    gen = torch.Generator().manual_seed(0)
    dtype = torch.float32 if smoke else torch.float16
    b, lq, ld, dim = (6, 4, 8, 16) if smoke else (128, 32, 180, 128)
    Q = _normalised((b, lq, dim), device, dtype, gen).requires_grad_()
    D = _normalised((b, ld, dim), device, dtype, gen).requires_grad_()
    return dict(Q=Q, D=D, labels=torch.arange(b, device=device))


def _train_step(score):
    def build(s):
        def step():
            loss = F.cross_entropy(score(s["Q"], s["D"]), s["labels"])
            return torch.autograd.grad(loss, (s["Q"], s["D"]))

        return step

    return build


def _lik_fast(Q, D):
    import lik

    return lik.maxsim(Q, D, backward="fast")


def _flash_train(Q, D):
    from flash_maxsim import flash_maxsim_batched_train

    return flash_maxsim_batched_train(Q, D, shared_docs=True)


def _late_interaction_train(Q, D):
    from late_interaction_kernels import maxsim

    return maxsim(Q, D)


def _msda_inputs(device: torch.device, smoke: bool) -> dict:
    if smoke:
        p = make_problem(SMOKE, "realistic", torch.float32, device=device, heads=2, dim=4, points=2)
    else:
        p = make_problem(DECODER, "realistic", torch.float32, device=device)
    p["leaves"] = [p[k].detach().clone().requires_grad_() for k in ("value", "loc", "weights")]
    return p


def _msda_step(fn):
    def build(p):
        def step():
            out = fn(p, *p["leaves"])
            return torch.autograd.grad(out, p["leaves"], p["grad"])

        return step

    return build


def _msda_lik(p, v, loc, w):
    import lik

    return lik.ms_deform_attn(v, p["shapes"], p["starts"], loc, w)


def _msda_original(p, v, loc, w):
    import os

    return load_original_op(os.environ[ORIGINAL_SRC]).apply(v, p["shapes"], p["starts"], loc, w, 64)


def host_cases() -> list[Case]:
    """The host-time cases, in table order."""
    train = {
        "lik": CaseMethod(_train_step(_lik_fast)),
        "flash-maxsim": CaseMethod(_train_step(_flash_train), module="flash_maxsim", needs_cuda=True),
        "late-interaction-kernels": CaseMethod(_train_step(_late_interaction_train),
                                               module="late_interaction_kernels", needs_cuda=True),
    }
    msda = {
        "lik": CaseMethod(_msda_step(_msda_lik)),
        "cuda-op": CaseMethod(_msda_step(_msda_original), needs_cuda=True, env=ORIGINAL_SRC),
        "pytorch": CaseMethod(_msda_step(lambda p, v, loc, w: detr_core(v, p["hw"], loc, w))),
    }
    return [
        Case("host", "host/maxsim-small", "lik.maxsim, 32 x 128 query, 10 x 100 documents", _maxsim_inputs,
             _maxsim_methods(), host_time=True),
        Case("host", "host/colbert-train-step", "ColBERT training step, B 128 (32 x 180)", _train_inputs, train,
             host_time=True),
        Case("host", "host/msda-decoder-step", "ms_deform_attn forward + backward, decoder (N 4, 300 queries)",
             _msda_inputs, msda, host_time=True),
    ]
