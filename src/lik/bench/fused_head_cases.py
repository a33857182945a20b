"""Fused projection head cases: MaxSim of documents given as hidden states (``d_model`` 768) and a head
(``d_out`` 128), lik's fused kernel against the unfused path and late-interaction-kernels' fused head.

Methods: ``lik`` (``lik.maxsim_from_hidden``, padded ``H`` with its mask), ``lik packed`` (the same on packed ``H``:
only real rows are stored), ``lik unfused`` (``F.linear`` + ``F.normalize`` + ``lik.maxsim``: the projected copy
of the documents is written and read back) and ``late-interaction-kernels`` (``fused_head.maxsim_from_hidden``).

* Reranking (inference): 1 and 16 queries of 32 tokens against B = 1 000 and 10 000 documents of 180 to 300 tokens
  (uniform, padded to 300), fp16. The floor counts the projection and the scoring FLOPs of the real tokens at the
  cuBLAS fp16 rate and the bytes of their hidden rows once (the fused kernel's minimum; the unfused path moves
  ``d_out / d_model`` more on top). The bars: lik >= 1.2x ``lik unfused`` and >= 1.3x late-interaction-kernels,
  with a peak memory below the unfused path's by at least the projected copy (``B x 300 x 128 x 2`` bytes).
* In-batch training (forward + backward of a contrastive loss, gradients to ``Q``, ``H``, ``W``, ``b``): ColBERT
  (B = 128, Lq 32, Ld 180) and ColPali (B = 32, 1024 x 1024), fp16. The bar: not slower than
  late-interaction-kernels' fused head.

The check compares with the unfused path in float32 (projection, normalisation and scores), so a ``rel_err``
measures fp16 rounding (about 1e-3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cases import Case, CaseMethod, floor_record

__all__ = ["fused_head_cases"]

D_MODEL, D_OUT = 768, 128
# (Nq, B, quick): reranking rows; queries of 32 tokens, documents of 180 to 300 tokens.
RERANK = ((1, 1_000, True), (16, 1_000, True), (1, 10_000, True), (16, 10_000, True))
# (name, B, Lq, Ld): in-batch training rows (B queries against B documents).
TRAINING = (("ColBERT", 128, 32, 180), ("ColPali", 32, 1024, 1024))


def _head(gen, device, d_model, d_out, dtype):
    W = (torch.randn(d_out, d_model, device=device, generator=gen) / d_model**0.5).to(dtype)
    b = (0.02 * torch.randn(d_out, device=device, generator=gen)).to(dtype)
    return W, b


def _rerank_inputs(n_q: int, n_docs: int):
    def inputs(device: torch.device, smoke: bool) -> dict:
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        nd, lo, hi, d_model, d_out = (8, 20, 40, 64, 32) if smoke else (n_docs, 180, 300, D_MODEL, D_OUT)
        gen = torch.Generator(device=device).manual_seed(0)
        Q = F.normalize(torch.randn(n_q, 32, d_out, device=device, generator=gen), dim=-1).to(dtype)
        H = torch.randn(nd, hi, d_model, device=device, generator=gen).to(dtype)
        lengths = torch.randint(lo, hi + 1, (nd,), device=device, generator=gen)
        d_mask = torch.arange(hi, device=device)[None, :] < lengths[:, None]
        W, b = _head(gen, device, d_model, d_out, dtype)
        cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        return dict(Q=Q, H=H, W=W, b=b, d_mask=d_mask, H_packed=H[d_mask], cu=cu, tokens=int(lengths.sum()))

    return inputs


def _rerank_floor(s: dict, ceilings) -> dict:
    n_q, l_q, d_out = s["Q"].shape
    d_model, tokens = s["W"].shape[1], s["tokens"]
    flops = 2.0 * tokens * d_model * d_out + 2.0 * n_q * l_q * tokens * d_out
    nbytes = s["H"].element_size() * (tokens * d_model + d_out * d_model + n_q * l_q * d_out)
    nbytes += 4.0 * n_q * s["H"].shape[0]  # the scores
    return floor_record(flops, nbytes, ceilings)


def _unfused_scores(Q, H, W, b, d_mask):
    import lik

    return lik.maxsim(Q, F.normalize(F.linear(H, W, b), dim=-1), d_mask=d_mask)


def _rerank_reference(s: dict) -> torch.Tensor:
    """Scores of the unfused path in float32, a chunk of documents at a time."""
    import lik

    Q, W, b = s["Q"].float(), s["W"].float(), s["b"].float()
    parts = []
    for start in range(0, s["H"].shape[0], 500):
        H, mask = s["H"][start:start + 500].float(), s["d_mask"][start:start + 500]
        parts.append(lik.maxsim(Q, F.normalize(F.linear(H, W, b), dim=-1), d_mask=mask))
    return torch.cat(parts, dim=1)


def _no_grad(fn):
    def build(s: dict):
        def call():
            with torch.no_grad():
                return fn(s)

        return call

    return build


def _lik(s):
    from lik.ops.fused_head import maxsim_from_hidden

    return maxsim_from_hidden(s["Q"], s["H"], s["W"], s["b"], d_mask=s["d_mask"])


def _lik_packed(s):
    from lik.ops.fused_head import maxsim_from_hidden

    return maxsim_from_hidden(s["Q"], s["H_packed"], s["W"], s["b"], cu_seqlens=s["cu"])


def _lik_unfused(s):
    return _unfused_scores(s["Q"], s["H"], s["W"], s["b"], s["d_mask"])


def _peer(s):
    from late_interaction_kernels.fused_head import maxsim_from_hidden

    return maxsim_from_hidden(s["Q"], s["H"], s["W"], s["b"], s["d_mask"])


def _training_inputs(n: int, l_q: int, l_d: int):
    def inputs(device: torch.device, smoke: bool) -> dict:
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        nn, lq, ld, d_model, d_out = (4, 8, 12, 64, 32) if smoke else (n, l_q, l_d, D_MODEL, D_OUT)
        gen = torch.Generator(device=device).manual_seed(0)
        Q = F.normalize(torch.randn(nn, lq, d_out, device=device, generator=gen), dim=-1).to(dtype)
        H = torch.randn(nn, ld, d_model, device=device, generator=gen).to(dtype)
        W, b = _head(gen, device, d_model, d_out, dtype)
        return dict(Q=Q, H=H, W=W, b=b, labels=torch.arange(nn, device=device))

    return inputs


def _training_floor(s: dict, ceilings) -> dict:
    """The fused step's minimum: the forward's projection and scoring, the backward's projection again plus dH and
    dW (three ``T x d_model x d_out`` products in all) and the scoring's gathers; bytes: ``H`` read twice and its
    gradient written."""
    n_q, l_q, d_out = s["Q"].shape
    n_docs, l_d, d_model = s["H"].shape
    tokens = n_docs * l_d
    flops = 4 * 2.0 * tokens * d_model * d_out + 2.0 * n_q * l_q * tokens * d_out
    nbytes = s["H"].element_size() * 3.0 * tokens * d_model
    return floor_record(flops, nbytes, ceilings)


def _step(scores_fn):
    def build(s: dict):
        leaves = [s[n].detach().clone().requires_grad_() for n in ("Q", "H", "W", "b")]

        def call():
            scores = scores_fn(*leaves)
            loss = F.cross_entropy(scores.float(), s["labels"])
            return (loss.detach(), *torch.autograd.grad(loss, leaves))

        return call

    return build


def _train_lik(Q, H, W, b):
    from lik.ops.fused_head import maxsim_from_hidden

    return maxsim_from_hidden(Q, H, W, b)


def _train_unfused(Q, H, W, b):
    return _unfused_scores(Q, H, W, b, None)


def _train_peer(Q, H, W, b):
    from late_interaction_kernels.fused_head import maxsim_from_hidden

    return maxsim_from_hidden(Q, H, W, b)


def _training_reference(s: dict) -> tuple:
    """Loss and gradients of the unfused path in float32."""
    leaves = [s[n].detach().float().requires_grad_() for n in ("Q", "H", "W", "b")]
    loss = F.cross_entropy(_unfused_scores(*leaves, None), s["labels"])
    return (loss.detach(), *torch.autograd.grad(loss, leaves))


def fused_head_cases() -> list[Case]:
    """The fused-head cases, in table order."""
    peer = dict(module="late_interaction_kernels.fused_head", needs_cuda=True)
    cases = []
    for n_q, n_docs, quick in RERANK:
        methods = {
            "lik": CaseMethod(_no_grad(_lik)),
            "lik packed": CaseMethod(_no_grad(_lik_packed)),
            "lik unfused": CaseMethod(_no_grad(_lik_unfused)),
            "late-interaction-kernels": CaseMethod(_no_grad(_peer), **peer),
        }
        size = f"{n_docs:,}".replace(",", " ")
        cases.append(Case("fused_head", f"fused_head/rerank/{n_q}x32/{n_docs}", f"rerank Nq {n_q}, B {size}",
                          _rerank_inputs(n_q, n_docs), methods, floor=_rerank_floor, reference=_rerank_reference,
                          tolerance=5e-3, quick=quick,
                          params={"n_q": n_q, "l_q": 32, "n_docs": n_docs, "l_d": "180-300", "d_model": D_MODEL,
                                  "d_out": D_OUT}))
    for name, n, l_q, l_d in TRAINING:
        methods = {
            "lik": CaseMethod(_step(_train_lik)),
            "lik unfused": CaseMethod(_step(_train_unfused)),
            "late-interaction-kernels": CaseMethod(_step(_train_peer), **peer),
        }
        cases.append(Case("fused_head", f"fused_head/train/{name}/{n}", f"train {name} B {n} ({l_q} x {l_d})",
                          _training_inputs(n, l_q, l_d), methods, floor=_training_floor,
                          reference=_training_reference, tolerance=2e-2, quick=True,
                          params={"n_q": n, "l_q": l_q, "n_docs": n, "l_d": l_d, "d_model": D_MODEL,
                                  "d_out": D_OUT}))
    return cases
