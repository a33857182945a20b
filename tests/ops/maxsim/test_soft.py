"""The soft reductions (``reduction="smooth"`` / ``"topk"``): the Triton kernels (interpreter, fp32) against the
float64 reference, the reference against hand-computed values, and the nasty cases (odd sizes, sizes 0 and 1,
garbage in padded positions, all-masked rows, NaN, ties, non-contiguous views, both mask modes)."""

from __future__ import annotations

import math

import pytest
import torch

import lik
from lik import _launch
from lik.config import override
from lik.config.maxsim import MaxSimSoftConfig
from lik.ops.maxsim.options import check_options
from lik.ops.maxsim.reference import maxsim_reference
from lik.ops.maxsim.soft import SoftMaxSimFunction, padded_layout
from lik.ops.maxsim.validation import MaxSimInputs

from .helpers import rand_problem

SOFT = [("smooth", {"tau": 0.1}), ("smooth", {"tau": 2.0}), ("topk", {"top_k": 3}), ("topk", {"top_k": 1})]
IDS = ["smooth0.1", "smooth2", "top3", "top1"]
# Other tau / top_k values take the kernel paths the first of each takes: slow duplicates.
SOFT_ALL = [pytest.param(*case, id=name, marks=[pytest.mark.slow] if i % 2 else [])
            for i, (case, name) in enumerate(zip(SOFT, IDS))]


def _grads(fn, Q, D, q_mask, d_mask, grad=None, dtype=None, **kw):
    Qg = (Q.detach() if dtype is None else Q.detach().to(dtype)).clone().requires_grad_()
    Dg = (D.detach() if dtype is None else D.detach().to(dtype)).clone().requires_grad_()
    scores = fn(Qg, Dg, q_mask, d_mask, **kw)
    g = torch.ones_like(scores) if grad is None else grad.to(scores.dtype)
    dq, dd = torch.autograd.grad(scores, (Qg, Dg), g, allow_unused=True)
    dq = torch.zeros_like(Qg) if dq is None else dq
    dd = torch.zeros_like(Dg) if dd is None else dd
    return scores.detach(), dq, dd


def _check(Q, D, q_mask, d_mask, *, atol=2e-5, grad=None, **kw):
    """Kernel (fp32) against reference (float64): scores and both gradients."""
    got = _grads(lik.maxsim, Q, D, q_mask, d_mask, grad, torch.float32, **kw)
    want = _grads(maxsim_reference, Q, D, q_mask, d_mask, grad, torch.float64, **kw)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g.double(), w, atol=atol, rtol=1e-4, equal_nan=True)
    return got, want


@pytest.mark.parametrize("reduction,kw", SOFT_ALL)
@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
def test_kernel_matches_reference_masked_garbage(reduction, kw, mask_mode):
    rng = torch.Generator().manual_seed(1)
    Q, D, q_mask, d_mask = rand_problem(rng, 2, 5, 3, 19, 12)
    d_mask[1] = False  # an all-masked document
    q_mask[1, :] = False  # a query with no valid token
    Q[~q_mask] = float("nan")
    D[~d_mask] = float("inf")
    D[0, ~d_mask[0]] = float("nan")
    grad = torch.randn(2, 3, generator=rng)
    (s, dq, dd), _ = _check(Q, D, q_mask, d_mask, grad=grad, mask_mode=mask_mode, reduction=reduction, **kw)
    assert torch.isfinite(s).all() and torch.isfinite(dq).all() and torch.isfinite(dd).all()
    assert (dq[~q_mask] == 0).all() and (dd[~d_mask] == 0).all()
    assert (s[1] == 0).all()  # the empty query
    if mask_mode == "exclude":
        assert (s[:, 1] == 0).all() and (dd[1] == 0).all()


@pytest.mark.parametrize("reduction,kw", SOFT[::2], ids=IDS[::2])
def test_per_query_documents_and_2d_query(reduction, kw):
    rng = torch.Generator().manual_seed(2)
    Q, D, q_mask, d_mask = rand_problem(rng, 2, 3, 2, 7, 8, per_query=True)
    _check(Q, D, q_mask, d_mask, reduction=reduction, **kw)
    Q2, D2, q2, d2 = rand_problem(rng, 1, 4, 3, 6, 8, squeeze=True, masks=False)
    (s, _, _), _ = _check(Q2, D2, q2, d2, reduction=reduction, **kw)
    assert s.shape == (3,)


@pytest.mark.parametrize("reduction,kw", SOFT[::2], ids=IDS[::2])
def test_wide_embeddings_in_chunks_and_noncontiguous(reduction, kw):
    rng = torch.Generator().manual_seed(3)
    Q = torch.randn(2, 3, 40, generator=rng).transpose(0, 1)  # [3, 2, 40] view, non-contiguous
    D = torch.randn(13, 2, 40, generator=rng)[:, :, :].permute(1, 0, 2)  # [2, 13, 40]
    with override(maxsim_soft=MaxSimSoftConfig(block_m=16, block_n=16, block_k=16)):  # 3 feature chunks
        _check(Q, D, None, None, atol=5e-5, reduction=reduction, **kw)


@pytest.mark.parametrize("reduction,kw", SOFT[::2], ids=IDS[::2])
@pytest.mark.parametrize("shape", [(1, 0, 2, 3, 4), (1, 3, 2, 0, 4), (1, 3, 0, 5, 4), (0, 3, 2, 5, 4),
                                   (1, 1, 1, 1, 1)])
def test_sizes_zero_and_one(reduction, kw, shape):
    n_q, l_q, n_docs, l_d, dim = shape
    Q = torch.randn(n_q, l_q, dim)
    D = torch.randn(n_docs, l_d, dim)
    (s, dq, dd), _ = _check(Q, D, None, None, reduction=reduction, **kw)
    assert s.shape == (n_q, n_docs)
    if 0 in shape:
        assert (s == 0).all() and (dq == 0).all() and (dd == 0).all()


def test_topk_ties_choose_lower_tokens():
    # Integer embeddings: every product is exact, so the ties are exact on every path.
    Q = torch.tensor([[[1.0, 0.0]]])
    D = torch.tensor([[[2.0, 0.0], [1.0, 5.0], [2.0, 1.0], [2.0, 3.0], [0.0, 1.0]]])  # sims 2, 1, 2, 2, 0
    (s, dq, dd), _ = _check(Q, D, None, None, reduction="topk", top_k=2)
    assert s.item() == 2.0
    assert dd[0, :, 0].tolist() == [0.5, 0.0, 0.5, 0.0, 0.0]  # tokens 0 and 2, not 3
    # fewer tokens in the reduction than top_k: the mean of those there are (here the 3 valid ones: 2, 1, 0)
    d_mask = torch.tensor([[False, True, False, True, True]])
    (s, _, dd), _ = _check(Q, D, None, d_mask, reduction="topk", top_k=16)
    assert s.item() == pytest.approx((1 + 2 + 0) / 3)
    assert dd[0, :, 0].tolist() == pytest.approx([0.0, 1 / 3, 0.0, 1 / 3, 1 / 3])


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-12)).item()


def topk_on_exact_data(device, dtype, top_k, scorer, shape):
    """Top-k against the float64 reference on entries in {-3..3} / 8, where every similarity is a multiple of 1/64
    below 2^11 / 64: exact in half-precision products and in any fp32 (or fp16, or tensor-core) order of the sum,
    so ties are exact and every chosen token must be the reference's (lower token first). ``scorer``: ``"maxsim"``
    (the public call) or ``"half_kernels"`` (the autograd node on the inputs as given). ``shape``: ``(Nq, Lq, B,
    Ld, d)``."""
    n_q, l_q, n_docs, l_d, dim = shape
    rng = torch.Generator().manual_seed(3)
    Q = torch.randint(-3, 4, (n_q, l_q, dim), generator=rng).div(8)
    D = torch.randint(-3, 4, (n_docs, l_d, dim), generator=rng).div(8)
    q_mask = (torch.rand(n_q, l_q, generator=rng) > 0.25).to(device)
    d_mask = (torch.rand(n_docs, l_d, generator=rng) > 0.25).to(device)

    def half_kernels(Q, D, q_mask, d_mask, top_k):
        inputs = MaxSimInputs.build(Q, D, q_mask, d_mask)
        options = check_options("topk", top_k=top_k)
        return inputs.finish(SoftMaxSimFunction.apply(inputs.q, inputs.d, padded_layout(inputs), options, None))

    runs = []
    scored = half_kernels if scorer == "half_kernels" else lik.maxsim
    for fn, dt in ((scored, dtype), (maxsim_reference, torch.float64)):
        Qg, Dg = Q.to(device, dt).requires_grad_(), D.to(device, dt).requires_grad_()
        kw = {} if fn is half_kernels else {"reduction": "topk"}
        s = fn(Qg, Dg, q_mask, d_mask, top_k=top_k, **kw)
        g = torch.linspace(-1, 1, s.numel(), device=device).view(s.shape).to(s.dtype)
        runs.append((s, *torch.autograd.grad(s, (Qg, Dg), g)))
    (s, dq, dd), (s64, dq64, dd64) = runs
    torch.testing.assert_close(s.double(), s64, atol=1e-5, rtol=1e-6)  # (fp32 sums of exact values, over Lq)
    # The weights (grad / count) and the gradients are rounded to the input dtype: a few units of its roundoff;
    # a token chosen differently would move a whole gradient row (1e-2 or more of the norm at these sizes).
    unit = 2.0**-11 if dtype == torch.float16 else 2.0**-8
    assert _rel(dq, dq64) < 3 * unit and _rel(dd, dd64) < 3 * unit


@pytest.mark.parametrize("top_k", [3, 16])
def test_topk_half_kernels_on_exact_data_with_ties(top_k):
    """fp16 through the kernels (the interpreter has no bfloat16 arithmetic): ties across and within tiles."""
    topk_on_exact_data("cpu", torch.float16, top_k, "half_kernels", (2, 5, 3, 37, 16))


def test_reference_values_by_hand():
    Q = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    D = torch.tensor([[[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]]], dtype=torch.float64)  # rows: [1, 3, .5], [2, -1, .5]
    tau = 0.7
    want = sum(tau * math.log(sum(math.exp(v / tau) for v in row)) for row in ([1, 3, 0.5], [2, -1, 0.5]))
    assert maxsim_reference(Q, D, reduction="smooth", tau=tau).item() == pytest.approx(want)
    assert maxsim_reference(Q, D, reduction="topk", top_k=2).item() == pytest.approx((3 + 1) / 2 + (2 + 0.5) / 2)
    assert maxsim_reference(Q, D, reduction="topk", top_k=1).item() == maxsim_reference(Q, D).item()
    # "zero": a masked token is similarity 0 and takes part (here it lifts the first row's second-best to 0)
    d_mask = torch.tensor([[True, True, False]])
    assert maxsim_reference(Q, D, None, d_mask, reduction="topk", top_k=2).item() == pytest.approx(2 + 0.5)
    got = maxsim_reference(Q, D, None, d_mask, mask_mode="zero", reduction="topk", top_k=3).item()
    assert got == pytest.approx((3 + 1 + 0) / 3 + (2 - 1 + 0) / 3)
    # a small tau approaches the max
    assert maxsim_reference(Q, D, reduction="smooth", tau=1e-3).item() == pytest.approx(5.0, abs=1e-2)


@pytest.mark.parametrize("reduction,kw", SOFT[::2], ids=IDS[::2])
def test_nan_in_a_valid_token_makes_its_pairs_nan(reduction, kw):
    Q = torch.randn(2, 3, 4)
    D = torch.randn(3, 5, 4)
    D[1, 2, 0] = float("nan")
    s = lik.maxsim(Q, D, reduction=reduction, **kw)
    r = maxsim_reference(Q.double(), D.double(), reduction=reduction, **kw)
    assert s[:, 1].isnan().all() and r[:, 1].isnan().all()
    torch.testing.assert_close(s[:, [0, 2]].double(), r[:, [0, 2]], atol=2e-5, rtol=1e-4)


def test_backward_is_repeatable_bit_for_bit():
    rng = torch.Generator().manual_seed(4)
    Q, D, q_mask, d_mask = rand_problem(rng, 2, 3, 2, 9, 8)
    first = _grads(lik.maxsim, Q, D, q_mask, d_mask, reduction="smooth", tau=0.3)
    again = _grads(lik.maxsim, Q, D, q_mask, d_mask, reduction="smooth", tau=0.3)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
def test_topk_dd_deterministic_products_and_atomic_scatter_agree(mask_mode, monkeypatch):
    """Top-k's two dD forms: the products of ``backward="deterministic"`` (bitwise repeatable) and the fp32 atomic
    scatter of ``"fast"``, both against float64, with per-query documents and garbage in masked positions."""
    rng = torch.Generator().manual_seed(7)
    Q, D, q_mask, d_mask = rand_problem(rng, 2, 5, 3, 19, 12, per_query=True)
    D[~d_mask] = float("inf")
    grad = torch.randn(2, 3, generator=rng)
    kw = dict(mask_mode=mask_mode, reduction="topk", top_k=3)
    want = _grads(maxsim_reference, Q, D, q_mask, d_mask, grad, torch.float64, **kw)
    runs, kernels = {}, {}
    for b in ("deterministic", "fast"):
        names = []
        monkeypatch.setattr(_launch, "WATCH", lambda kernel, *_, names=names: names.append(kernel.fn.__name__))
        runs[b] = _grads(lik.maxsim, Q, D, q_mask, d_mask, grad, torch.float32, backward=b, **kw)
        kernels[b] = set(names)
    monkeypatch.setattr(_launch, "WATCH", None)
    assert "soft_bwd_dd_kernel" in kernels["deterministic"] and "soft_bwd_dd_kernel" not in kernels["fast"]
    for got in runs.values():
        for g, w in zip(got, want):
            torch.testing.assert_close(g.double(), w, atol=2e-5, rtol=1e-4)
    again = _grads(lik.maxsim, Q, D, q_mask, d_mask, grad, torch.float32, backward="deterministic", **kw)
    assert all(torch.equal(a, b) for a, b in zip(runs["deterministic"], again))


def test_topk_packed_dd_under_deterministic_algorithms():
    """The packed scorers follow ``torch.use_deterministic_algorithms``: the products form of top-k's dD."""
    rng = torch.Generator().manual_seed(8)
    d, cu_d, max_d = lik.pack([torch.randn(n, 6, generator=rng) for n in (7, 0, 17)])
    Q = torch.randn(2, 4, 6, generator=rng)
    weights = torch.randn(2, 3, generator=rng)
    was = torch.are_deterministic_algorithms_enabled()
    grads = []
    try:
        for deterministic, dtype in ((True, torch.float32), (False, torch.float32), (False, torch.float64)):
            torch.use_deterministic_algorithms(deterministic)
            Qg, dg = Q.to(dtype).requires_grad_(), d.to(dtype).requires_grad_()
            s = lik.maxsim_packed(Qg, dg, cu_d, reduction="topk", top_k=5)
            grads.append((s, *torch.autograd.grad(s, (Qg, dg), weights.to(dtype))))
    finally:
        torch.use_deterministic_algorithms(was)
    for got in grads[:2]:
        for g, w in zip(got, grads[2]):
            torch.testing.assert_close(g.double(), w, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("reduction,kw", SOFT[::2], ids=IDS[::2])
def test_packed_pairs_and_corpus(reduction, kw):
    rng = torch.Generator().manual_seed(5)
    q, cu_q, max_q = lik.pack([torch.randn(n, 6, generator=rng) for n in (3, 0, 5, 1)])
    d, cu_d, max_d = lik.pack([torch.randn(n, 6, generator=rng) for n in (7, 4, 0, 17)])
    for dtype in (torch.float32, torch.float64):  # kernels, then the reference
        qg, dg = q.to(dtype).requires_grad_(), d.to(dtype).requires_grad_()
        s = lik.maxsim_varlen(qg, dg, cu_q, cu_d, max_q, max_d, reduction=reduction, **kw)
        grads = torch.autograd.grad(s.sum(), (qg, dg))
        if dtype == torch.float32:
            got = (s, *grads)
    for g, w in zip(got, (s, *grads)):
        torch.testing.assert_close(g.double(), w, atol=2e-5, rtol=1e-4)
    Q = torch.randn(2, 4, 6, generator=rng)
    q_mask = torch.tensor([[True, False, True, True], [False] * 4])
    for dtype in (torch.float32, torch.float64):
        Qg, dg = Q.to(dtype).requires_grad_(), d.to(dtype).requires_grad_()
        s = lik.maxsim_packed(Qg, dg, cu_d, q_mask, reduction=reduction, **kw)
        grads = torch.autograd.grad(s.sum(), (Qg, dg))
        if dtype == torch.float32:
            got = (s, *grads)
    for g, w in zip(got, (s, *grads)):
        torch.testing.assert_close(g.double(), w, atol=2e-5, rtol=1e-4)
    assert (got[0][1] == 0).all() and (got[1][1] == 0).all() and (got[0][:, 2] == 0).all()


@pytest.mark.parametrize("kwargs,error,match", [
    ({"reduction": "mean"}, ValueError, "reduction"),
    ({"reduction": "smooth"}, TypeError, "tau"),
    ({"reduction": "smooth", "tau": 0.0}, ValueError, "tau"),
    ({"reduction": "smooth", "tau": float("nan")}, ValueError, "tau"),
    ({"reduction": "topk"}, TypeError, "top_k"),
    ({"reduction": "topk", "top_k": 17}, ValueError, "top_k"),
    ({"reduction": "topk", "top_k": 0}, ValueError, "top_k"),
    ({"reduction": "topk", "top_k": 2.0}, TypeError, "top_k"),
    ({"tau": 0.5}, ValueError, "tau"),
    ({"reduction": "smooth", "tau": 1.0, "top_k": 2}, ValueError, "top_k"),
    ({"normalize_by": "doc_tokens"}, ValueError, "normalize_by"),
    ({"save_d_as": torch.float16}, ValueError, "save_d_as"),
])
def test_bad_options_are_refused_by_name(kwargs, error, match):
    Q, D = torch.randn(3, 4), torch.randn(2, 5, 4)
    for fn in (lik.maxsim, maxsim_reference):
        if "save_d_as" in kwargs and fn is maxsim_reference:
            continue
        with pytest.raises(error, match=match):
            fn(Q, D, **kwargs)
    d, cu_d, _ = lik.pack([torch.randn(5, 4)])
    if "save_d_as" not in kwargs:
        with pytest.raises(error, match=match):
            lik.maxsim_packed(Q, d, cu_d, **kwargs)


def test_eight_bit_documents_refuse_soft_reductions():
    D_q, d_scale = lik.quantize(torch.randn(2, 5, 4), torch.int8)
    with pytest.raises(ValueError, match="float"):
        lik.maxsim(torch.randn(3, 4), D_q, d_scale=d_scale, reduction="smooth", tau=0.5)


@pytest.mark.parametrize("reduction,kw", SOFT[::2], ids=IDS[::2])
def test_dq_in_document_ranges(reduction, kw):
    rng = torch.Generator().manual_seed(6)
    Q, D, q_mask, d_mask = rand_problem(rng, 2, 3, 5, 7, 8)
    with override(maxsim_soft=MaxSimSoftConfig(block_m=16, block_n=16, block_k=16, dq_splits=2)):
        _check(Q, D, q_mask, d_mask, reduction=reduction, **kw)


@pytest.mark.parametrize("reduction,kw", SOFT[::2], ids=IDS[::2])
def test_long_queries_in_row_blocks(reduction, kw):
    """Queries of several row blocks (16 rows each here): one forward program per block, partial sums added; the
    backward's flat (query, row block) and (document, tile) loops; packed pairs of unequal long queries."""
    rng = torch.Generator().manual_seed(9)
    Q, D, q_mask, d_mask = rand_problem(rng, 2, 37, 3, 35, 8)
    q_mask[1, 16:] = False  # a query whose last blocks are all masked
    with override(maxsim_soft=MaxSimSoftConfig(block_m=16, block_n=16, block_k=16, dq_splits=2)):
        _check(Q, D, q_mask, d_mask, grad=torch.randn(2, 3, generator=rng), reduction=reduction, **kw)
        q, cu_q, max_q = lik.pack([torch.randn(n, 8, generator=rng) for n in (40, 3, 17)])
        d, cu_d, max_d = lik.pack([torch.randn(n, 8, generator=rng) for n in (20, 33, 0)])
        runs = []
        for dtype in (torch.float32, torch.float64):
            qg, dg = q.to(dtype).requires_grad_(), d.to(dtype).requires_grad_()
            s = lik.maxsim_varlen(qg, dg, cu_q, cu_d, max_q, max_d, reduction=reduction, **kw)
            runs.append((s, *torch.autograd.grad(s, (qg, dg), torch.tensor([1.0, -2.0, 0.5], dtype=dtype))))
    for g, w in zip(*runs):
        torch.testing.assert_close(g.double(), w, atol=2e-5, rtol=1e-4)
