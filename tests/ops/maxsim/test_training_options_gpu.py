"""GPU checks of the soft reductions, length normalisation and the int8-stored ``D``: real compilation, tensor-core
precision in fp16 / bf16, wide embeddings, no recompilation across batch sizes and lengths, and the bytes held
between forward and backward on the device."""

from __future__ import annotations

import pytest
import torch

import lik
from lik.core.soft import soft_bwd_dd_kernel, soft_bwd_dq_kernel, soft_fwd_kernel
from lik.ops.maxsim.reference import maxsim_reference

from .helpers import rand_problem
from .test_soft import topk_on_exact_data

pytestmark = pytest.mark.gpu

SOFT = [("smooth", {"tau": 0.05}), ("smooth", {"tau": 1.0}), ("topk", {"top_k": 4}), ("topk", {"top_k": 16})]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-12)).item()


def _both(Q, D, q_mask, d_mask, dtype, **kw):
    """lik in ``dtype`` and the float64 reference, both from the same ``dtype``-rounded inputs: from the unrounded
    fp32 ones, rounding moves similarities by ~1e-5 (fp16) to ~1e-4 (bf16), which flips argmax / top-k choices
    between near-equal tokens and moves whole gradient rows (rel. errors 0.05 on the device)."""
    out = []
    Q, D = Q.to(dtype), D.to(dtype)
    for fn, dt in ((lik.maxsim, dtype), (maxsim_reference, torch.float64)):
        Qg = Q.to("cuda", dt).requires_grad_()
        Dg = D.to("cuda", dt).requires_grad_()
        qm = None if q_mask is None else q_mask.cuda()
        dm = None if d_mask is None else d_mask.cuda()
        s = fn(Qg, Dg, qm, dm, **kw)
        g = torch.linspace(-1, 1, s.numel(), device="cuda").view(s.shape).to(s.dtype)
        out.append((s, *torch.autograd.grad(s, (Qg, Dg), g)))
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("reduction,kw", SOFT[:2])  # top-k's random-data cells: test_soft_topk_selection.py
@pytest.mark.parametrize("shape", [(16, 32, 16, 180, 128), (2, 300, 3, 1030, 128), (3, 7, 5, 33, 256),
                                   (2, 9, 3, 40, 1000)])
def test_soft_reductions_against_float64(dtype, reduction, kw, shape):
    rng = torch.Generator().manual_seed(0)
    Q, D, q_mask, d_mask = rand_problem(rng, *shape)
    got, want = _both(Q, D, q_mask, d_mask, dtype, reduction=reduction, **kw)
    tol = 2e-2 if dtype != torch.float32 else 2e-3
    for g, w in zip(got, want):
        assert _rel(g, w) < tol


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("top_k", [4, 16])
@pytest.mark.parametrize("scorer", ["maxsim", "half_kernels"])
def test_topk_on_exact_data_with_ties(dtype, top_k, scorer):
    """Exact similarities with many ties (``topk_on_exact_data``), through lik.maxsim (atomic dD) and through the
    autograd node directly (atomic-free dD)."""
    topk_on_exact_data("cuda", dtype, top_k, scorer, (6, 32, 9, 200, 128))


@pytest.mark.parametrize("reduction,kw", [("max", {}), SOFT[0]])
def test_normalized_and_packed_on_device(reduction, kw):
    rng = torch.Generator().manual_seed(1)
    Q, D, q_mask, d_mask = rand_problem(rng, 8, 32, 8, 100, 128)
    got, want = _both(Q, D, q_mask, d_mask, torch.float16, reduction=reduction, normalize_by="query_tokens", **kw)
    for g, w in zip(got, want):
        assert _rel(g, w) < 2e-2
    q, cu_q, max_q = lik.pack([torch.randn(n, 128) for n in (32, 1, 17, 0)])
    d, cu_d, max_d = lik.pack([torch.randn(n, 128) for n in (180, 300, 0, 7)])
    q, d, cu_q, cu_d = q.cuda().half(), d.cuda().half(), cu_q.cuda(), cu_d.cuda()
    s = lik.maxsim_varlen(q, d, cu_q, cu_d, max_q, max_d, reduction=reduction, normalize_by="query_tokens", **kw)
    r = lik.maxsim_varlen(q.double(), d.double(), cu_q, cu_d, reduction=reduction, normalize_by="query_tokens",
                          **kw)
    assert _rel(s, r) < 2e-2


def _variants(kernel) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(c) for c in kernel.cache.values())


def test_soft_kernels_do_not_recompile_for_new_batches_or_lengths():
    """B, Ld and Lq inside its power-of-two bucket (the query tile's rows) are runtime values."""
    kernels = [soft_fwd_kernel, soft_bwd_dq_kernel, soft_bwd_dd_kernel]

    def step(n_q, l_q, n_docs, l_d):
        Q, D, qm, dm = rand_problem(torch.Generator().manual_seed(2), n_q, l_q, n_docs, l_d, 128, dtype=torch.float16)
        Q, D = Q.cuda().requires_grad_(), D.cuda().requires_grad_()
        lik.maxsim(Q, D, qm.cuda(), dm.cuda(), reduction="smooth", tau=0.1).sum().backward()

    step(16, 32, 16, 180)
    before = [_variants(k) for k in kernels]
    for shape in [(3, 29, 17, 301), (40, 17, 100, 64), (1, 20, 1, 1)]:  # (Lq within its bucket, 17..32)
        step(*shape)
    assert [_variants(k) for k in kernels] == before


def test_int8_stored_documents_hold_fewer_bytes_until_the_backward():
    """ColBERT B 128: between forward and backward the int8 path holds int8 rows and fp32 scales instead of D."""
    Q = torch.nn.functional.normalize(torch.randn(128, 32, 128, device="cuda"), dim=-1).half().requires_grad_()
    leaf = torch.nn.functional.normalize(torch.randn(128, 180, 128, device="cuda"), dim=-1).half().requires_grad_()
    held = {}
    grads = {}
    for store in (None, torch.int8):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        D = leaf.clone()
        scores = lik.maxsim(Q, D, save_d_as=store)
        del D
        torch.cuda.synchronize()
        held[store] = torch.cuda.memory_allocated() - base
        grads[store] = torch.autograd.grad(scores, (Q, leaf), torch.ones_like(scores))
        del scores
    d_bytes = leaf.numel() * 2
    assert held[None] - held[torch.int8] >= d_bytes - (leaf.numel() + 4 * 128 * 180) - 4096
    assert torch.equal(grads[None][1], grads[torch.int8][1]) or _rel(grads[torch.int8][1], grads[None][1]) < 1e-3
    assert _rel(grads[torch.int8][0], grads[None][0]) < 1e-2
