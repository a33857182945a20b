"""Length normalisation (``normalize_by="query_tokens"``) and the int8 copy of ``D`` kept for the backward
(``save_d_as=torch.int8``): values and gradients against the float64 reference, one autograd node per call, the
bytes saved between forward and backward, and the documented error of ``dQ``."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import lik
from lik import _config
from lik.ops.maxsim.reference import maxsim_reference

from .helpers import rand_problem


def _run(fn, Q, D, q_mask, d_mask, grad, dtype, **kw):
    Qg = Q.detach().to(dtype).clone().requires_grad_()
    Dg = D.detach().to(dtype).clone().requires_grad_()
    scores = fn(Qg, Dg, q_mask, d_mask, **kw)
    dq, dd = torch.autograd.grad(scores, (Qg, Dg), grad.to(scores.dtype))
    return scores, dq, dd


@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
@pytest.mark.parametrize("reduction,kw", [("max", {}), ("smooth", {"tau": 0.5}), ("topk", {"top_k": 2})])
def test_normalized_scores_and_gradients(mask_mode, reduction, kw):
    rng = torch.Generator().manual_seed(6)
    Q, D, q_mask, d_mask = rand_problem(rng, 3, 5, 2, 9, 8)
    q_mask[0] = False  # no valid token: scores 0 (not 0 / 0)
    q_mask[1] = True
    Q[~q_mask] = float("nan")
    grad = torch.randn(3, 2, generator=rng)
    opts = dict(mask_mode=mask_mode, reduction=reduction, **kw)
    got = _run(lik.maxsim, Q, D, q_mask, d_mask, grad, torch.float32, normalize_by="query_tokens", **opts)
    want = _run(maxsim_reference, Q, D, q_mask, d_mask, grad, torch.float64, normalize_by="query_tokens", **opts)
    # one autograd node: no multiply of the scores after the scorer's own
    assert "Mul" not in type(got[0].grad_fn).__name__ and "Div" not in type(got[0].grad_fn).__name__
    for g, w in zip(got, want):
        torch.testing.assert_close(g.detach().double(), w.detach(), atol=2e-5, rtol=1e-4)
    plain = maxsim_reference(Q.double(), D.double(), q_mask, d_mask, **opts)
    counts = torch.tensor([1.0, 5.0, float(q_mask[2].sum())], dtype=torch.float64)[:, None]
    torch.testing.assert_close(want[0].detach(), plain / counts)
    assert (got[0][0] == 0).all() and (got[1][0] == 0).all()


def test_normalized_2d_query_without_mask_divides_by_its_length():
    Q, D = torch.randn(7, 4), torch.randn(3, 6, 4)
    torch.testing.assert_close(lik.maxsim(Q, D, normalize_by="query_tokens"), lik.maxsim(Q, D) / 7)


@pytest.mark.parametrize("reduction,kw", [("max", {}), ("smooth", {"tau": 0.5})])
def test_normalized_packed(reduction, kw):
    rng = torch.Generator().manual_seed(7)
    q, cu_q, max_q = lik.pack([torch.randn(n, 6, generator=rng) for n in (3, 0, 4)])
    d, cu_d, max_d = lik.pack([torch.randn(n, 6, generator=rng) for n in (5, 2, 6)])
    out = []
    for dtype in (torch.float32, torch.float64):
        qg, dg = q.to(dtype).requires_grad_(), d.to(dtype).requires_grad_()
        s = lik.maxsim_varlen(qg, dg, cu_q, cu_d, max_q, max_d, reduction=reduction, normalize_by="query_tokens", **kw)
        out.append((s, *torch.autograd.grad(s, (qg, dg), torch.arange(3.0, dtype=dtype) + 1)))
    for g, w in zip(*out):
        torch.testing.assert_close(g.detach().double(), w.detach(), atol=2e-5, rtol=1e-4)
    plain = lik.maxsim_varlen(q.double(), d.double(), cu_q, cu_d, reduction=reduction, **kw)
    torch.testing.assert_close(out[1][0].detach(), plain / torch.tensor([3.0, 1.0, 4.0], dtype=torch.float64))
    Q = torch.randn(2, 3, 6, generator=rng)
    q_mask = torch.tensor([[True, False, True], [True, True, True]])
    got = lik.maxsim_packed(Q, d, cu_d, q_mask, reduction=reduction, normalize_by="query_tokens", **kw)
    want = lik.maxsim_packed(Q.double(), d.double(), cu_d, q_mask, reduction=reduction, **kw)
    torch.testing.assert_close(got.double(), want / torch.tensor([[2.0], [3.0]], dtype=torch.float64), atol=2e-5,
                               rtol=1e-4)


def _saved(fn):
    """Run ``fn`` (a forward) and return the tensors autograd saved for the backward, and its result."""
    saved = []

    def pack(x):
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = fn()
    return saved, out


@pytest.mark.parametrize("reduction,kw", [("max", {}), ("topk", {"top_k": 2})])
def test_int8_stored_documents_bytes_and_gradients(reduction, kw):
    rng = torch.Generator().manual_seed(8)
    Q, D, q_mask, d_mask = rand_problem(rng, 2, 4, 3, 10, 64)
    grad = torch.randn(2, 3, generator=rng)
    leaves = {}

    def forward(store):
        Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
        leaves[store] = (Qg, Dg)
        return lik.maxsim(Qg, Dg, q_mask, d_mask, reduction=reduction, save_d_as=store, **kw)

    saved_fp, s_fp = _saved(lambda: forward(None))
    saved_q, s_q = _saved(lambda: forward(torch.int8))
    assert torch.equal(s_fp, s_q)  # the forward is exact: it scores D as passed

    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    # D itself is not kept: its int8 rows (1 byte each) and one fp32 scale per token take its place
    assert not any(t.dtype == D.dtype and t.shape == D.shape for t in saved_q)
    tokens = D.numel() // D.shape[-1]
    assert nbytes(saved_fp) - nbytes(saved_q) == D.numel() * 4 - (D.numel() + 4 * tokens)
    dq_fp, dd_fp = torch.autograd.grad(s_fp, leaves[None], grad)
    dq_q, dd_q = torch.autograd.grad(s_q, leaves[torch.int8], grad)
    if reduction == "max":
        assert torch.equal(dd_q, dd_fp)  # dD needs only Q and the winners
    else:
        torch.testing.assert_close(dd_q, dd_fp)
    # dQ sums rows of the dequantized copy: each entry off by at most half a step, amax(row) / 254, per use
    step = D.abs().amax(dim=-1).max() / 254
    per_query = grad.abs().sum(dim=1)[:, None, None] * q_mask.sum(dim=1).clamp(max=1)[:, None, None]
    err = (dq_q - dq_fp).abs()
    assert (err <= per_query * step * 1.001 + 1e-6).all()
    assert err.max() > 0  # (the stored copy is what dQ used)


@pytest.mark.parametrize("reduction,kw,normalize_by", [("max", {}, "none"), ("max", {}, "query_tokens"),
                                                      ("smooth", {"tau": 0.5}, "none"), ("topk", {"top_k": 2}, "none")])
def test_int8_stored_documents_free_d_after_the_forward(reduction, kw, normalize_by):
    """Nothing of the call (saved tensors, the node's attributes, a cache) keeps ``D``'s storage alive once the caller
    drops it: between forward and backward only the int8 rows and scales remain. The plain call, which saves
    ``D``, shows the check sees a held ``D``."""
    if not _config.interpreting():
        pytest.skip("the kernels' path (TRITON_INTERPRET=1); CPU tensors otherwise run the reference")
    rng = torch.Generator().manual_seed(12)
    Q, D, q_mask, d_mask = rand_problem(rng, 2, 4, 3, 10, 16)
    Q.requires_grad_()
    leaf = D.clone().requires_grad_()
    alive = {}
    for store in (None, torch.int8):
        D = leaf.clone()  # (a tensor of the graph that only the call could keep: the caller drops it below)
        held = StorageWeakRef(D.untyped_storage())
        scores = lik.maxsim(Q, D, q_mask, d_mask, reduction=reduction, normalize_by=normalize_by, save_d_as=store,
                            **kw)
        del D
        gc.collect()  # (garbage cycles of Triton's interpreter hold its launches' arguments; a GPU launch has none)
        alive[store] = not held.expired()
        dq, dd = torch.autograd.grad(scores.sum(), (Q, leaf))  # (the backward still runs from what was kept)
        assert torch.isfinite(dq).all() and torch.isfinite(dd).all() and dd.abs().sum() > 0
    assert alive == {None: True, torch.int8: False}


def test_int8_stored_documents_smooth_recomputes_from_the_stored_copy():
    rng = torch.Generator().manual_seed(9)
    Q, D, q_mask, d_mask = rand_problem(rng, 2, 3, 2, 8, 32)
    exact = _run(lik.maxsim, Q, D, q_mask, d_mask, torch.ones(2, 2), torch.float32, reduction="smooth", tau=0.5)
    stored = _run(lik.maxsim, Q, D, q_mask, d_mask, torch.ones(2, 2), torch.float32, reduction="smooth", tau=0.5,
                  save_d_as=torch.int8)
    assert torch.equal(exact[0], stored[0])
    for a, b in zip(exact[1:], stored[1:]):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=0)


def test_int8_stored_documents_refusals_and_reference():
    D_q, d_scale = lik.quantize(torch.randn(2, 5, 4), torch.int8)
    with pytest.raises(ValueError, match="save_d_as"):
        lik.maxsim(torch.randn(3, 4), D_q, d_scale=d_scale, save_d_as=torch.int8)
    # float64 runs the reference, where there is nothing to store: the same scores as without
    Q, D = torch.randn(3, 4, dtype=torch.float64), torch.randn(2, 5, 4, dtype=torch.float64)
    assert torch.equal(lik.maxsim(Q, D, save_d_as=torch.int8), lik.maxsim(Q, D))


@pytest.mark.parametrize("layout", ["per_query", "squeeze"])
def test_int8_stored_documents_layouts(layout):
    rng = torch.Generator().manual_seed(10)
    Q, D, q_mask, d_mask = rand_problem(rng, 2, 3, 2, 6, 16, per_query=layout == "per_query",
                                        squeeze=layout == "squeeze")
    grad = torch.randn(2 if layout == "squeeze" else (2, 2), generator=rng)
    exact = _run(lik.maxsim, Q, D, q_mask, d_mask, grad, torch.float32, backward="deterministic")
    stored = _run(lik.maxsim, Q, D, q_mask, d_mask, grad, torch.float32, backward="deterministic",
                  save_d_as=torch.int8)
    assert torch.equal(exact[0], stored[0]) and torch.equal(exact[2], stored[2])
    torch.testing.assert_close(exact[1], stored[1], atol=grad.abs().sum().item() / 254, rtol=0)


# (the smooth call is a graph break running the eager path: a slow duplicate)
@pytest.mark.parametrize("reduction,kw", [("max", {}), pytest.param("smooth", {"tau": 0.5}, marks=pytest.mark.slow)])
def test_under_torch_compile(reduction, kw):
    rng = torch.Generator().manual_seed(11)
    Q, D, q_mask, _ = rand_problem(rng, 2, 3, 3, 5, 8)
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
    fn = torch.compile(lambda Q, D: lik.maxsim(Q, D, q_mask, reduction=reduction, normalize_by="query_tokens", **kw),
                       backend="aot_eager")
    s = fn(Qg, Dg)
    grads = torch.autograd.grad(s.sum(), (Qg, Dg))
    want = _run(maxsim_reference, Q, D, q_mask, None, torch.ones(2, 3), torch.float64, reduction=reduction,
                normalize_by="query_tokens", **kw)
    for g, w in zip((s, *grads), want):
        torch.testing.assert_close(g.detach().double(), w.detach(), atol=2e-5, rtol=1e-4)
