"""GPU-only checks (`pytest -m gpu` on the device): real compilation, tensor cores, atomics, 64-bit offsets."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import lik
from lik import _config
from lik.ops.maxsim.backward import maxsim_bwd_dd_atomic_kernel, maxsim_bwd_dq_kernel
from lik.ops.maxsim.backward_sorted import maxsim_bwd_dd_sorted_kernel
from lik.ops.maxsim.forward_kernel import maxsim_fwd_kernel

from .helpers import rel_err

pytestmark = pytest.mark.gpu

CUDA = "cuda"


def _problem(n_q, l_q, n_docs, l_d, dim, dtype, *, per_query=False, seed=0):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    Q = torch.nn.functional.normalize(torch.randn(n_q, l_q, dim, device=CUDA, generator=gen), dim=-1)
    shape_d = ((n_q,) if per_query else ()) + (n_docs, l_d, dim)
    D = torch.nn.functional.normalize(torch.randn(shape_d, device=CUDA, generator=gen), dim=-1)
    q_mask = torch.rand(n_q, l_q, device=CUDA, generator=gen) > 0.2
    d_mask = torch.rand(shape_d[:-1], device=CUDA, generator=gen) > 0.2
    return Q.to(dtype), D.to(dtype), q_mask, d_mask


def _grads(Q, D, q_mask, d_mask, grad, **kw):
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
    s = lik.maxsim(Qg, Dg, q_mask, d_mask, **kw)
    dq, dd = torch.autograd.grad(s, (Qg, Dg), grad)
    return s, dq, dd


def _reference(Q, D, q_mask, d_mask, grad, mask_mode="exclude"):
    Q64, D64 = Q.double().requires_grad_(), D.double().requires_grad_()
    s = lik.maxsim_reference(Q64, D64, q_mask, d_mask, mask_mode=mask_mode)
    dq, dd = torch.autograd.grad(s, (Q64, D64), grad.double())
    return s, dq, dd


TOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 32, 50, 300, 128), (2, 300, 7, 1030, 128), (5, 7, 9, 65, 96),
                                   (300, 1, 9, 1030, 128)])  # the last: single-token queries, one row each
@pytest.mark.parametrize("backward", ["fast", "deterministic"])
@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
def test_kernels_match_float64(dtype, shape, backward, mask_mode):
    torch.backends.cuda.matmul.allow_tf32 = False
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        Q, D, qm, dm = _problem(*shape, dtype)
        grad = torch.randn(shape[0], shape[2], device=CUDA)
        s, dq, dd = _grads(Q, D, qm, dm, grad, mask_mode=mask_mode, backward=backward)
        rs, rdq, rdd = _reference(Q, D, qm, dm, grad, mask_mode)
    finally:
        torch.set_float32_matmul_precision(prev)
    assert dq.dtype == dtype and dd.dtype == dtype and s.dtype == torch.float32
    tol = TOL[dtype]
    assert rel_err(s, rs) < tol
    assert rel_err(dq, rdq) < tol
    assert rel_err(dd, rdd) < tol
    assert torch.all(dq[~qm] == 0) and torch.all(dd[~dm] == 0)


@pytest.mark.parametrize("backward", ["fast", "deterministic"])
def test_per_query_candidates(backward):
    Q, D, qm, dm = _problem(4, 32, 8, 180, 128, torch.float16, per_query=True)
    grad = torch.randn(4, 8, device=CUDA)
    s, dq, dd = _grads(Q, D, qm, dm, grad, backward=backward)
    rs, rdq, rdd = _reference(Q, D, qm, dm, grad)
    assert rel_err(s, rs) < 1e-3 and rel_err(dq, rdq) < 1e-3 and rel_err(dd, rdd) < 1e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("l_d", [1, 180, 300])
def test_persistent_programs_over_unmasked_documents(dtype, l_d):
    """Stacked queries against many unmasked documents: the persistent launch (several documents per program,
    ragged and one-token documents) in the inference and the training (winner-recording) forward."""
    Q, D, _, _ = _problem(8, 32, 700, l_d, 128, dtype)
    grad = torch.randn(8, 700, device=CUDA)
    s, dq, dd = _grads(Q, D, None, None, grad)
    rs, rdq, rdd = _reference(Q, D, None, None, grad)
    assert _config.maxsim_forward_config(
        q_len=32, n_queries=8, dim=128, dtype=dtype, per_query=False, device=Q.device, doc_len=l_d
    ).programs_per_sm > 0
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert rel_err(s, rs) < tol and rel_err(dq, rdq) < tol and rel_err(dd, rdd) < tol
    assert rel_err(lik.maxsim(Q, D), s) < 1e-6  # the inference launch (no winners, other tiles)


DD_ROUTES = {  # name -> (backward, config fields)
    "atomic": ("fast", {"fast_dd": "atomic"}),
    "atomic-chunked": ("fast", {"fast_dd": "atomic", "atomic_workspace_bytes": 200_000}),
    "sorted-fast": ("fast", {"fast_dd": "sorted"}),
    "sorted": ("deterministic", {"deterministic_dd": "sorted"}),
    "sorted-chunked": ("deterministic", {"sort_workspace_entries": 1000}),
    "sorted-16bit-keys": ("deterministic", {"sort_chunk_rows": 300}),
}


def _route_config(fields):
    base = _config.maxsim_backward_config(dim=128, dtype=torch.float16, device=torch.device(CUDA))
    return replace(base, **fields)


@pytest.mark.parametrize("route", sorted(DD_ROUTES))
@pytest.mark.parametrize("per_query", [False, True])
def test_every_dd_route_matches_float64(route, per_query):
    backward, fields = DD_ROUTES[route]
    Q, D, qm, dm = _problem(6, 40, 9, 130, 128, torch.float16, per_query=per_query, seed=3)
    grad = torch.randn(6, 9, device=CUDA)
    with _config.override(maxsim_backward=_route_config(fields)):
        s, dq, dd = _grads(Q, D, qm, dm, grad, backward=backward)
    rs, rdq, rdd = _reference(Q, D, qm, dm, grad)
    assert rel_err(dq, rdq) < 1e-3 and rel_err(dd, rdd) < 1e-3
    assert torch.all(dd[~dm] == 0)


def test_tf32_follows_matmul_precision():
    Q, D, _, _ = _problem(2, 64, 40, 256, 128, torch.float32)
    ref = lik.maxsim_reference(Q.double(), D.double())
    prev = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        exact = lik.maxsim(Q, D)
        torch.set_float32_matmul_precision("high")
        tf32 = lik.maxsim(Q, D)
    finally:
        torch.set_float32_matmul_precision(prev)
    assert rel_err(exact, ref) < 1e-6
    assert 1e-6 < rel_err(tf32, ref) < 2e-3  # TF32 products really were used


def test_deterministic_backward_is_bitwise_repeatable_under_contention():
    """Many queries whose maxima land on the same few document tokens: atomics would reorder sums."""
    Q, D, _, _ = _problem(64, 32, 16, 8, 128, torch.float16, seed=1)
    grad = torch.randn(64, 16, device=CUDA)
    runs = [_grads(Q, D, None, None, grad, backward="deterministic") for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    torch.use_deterministic_algorithms(True)
    try:
        auto = _grads(Q, D, None, None, grad)
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(runs[0], auto):
        assert torch.equal(a, b)
    # Sort chunks of a few documents: each row is still summed in one fixed order.
    with _config.override(maxsim_backward=_route_config({"sort_workspace_entries": 3 * 64 * 32})):
        chunked = [_grads(Q, D, None, None, grad, backward="deterministic") for _ in range(2)]
    assert torch.equal(chunked[0][2], chunked[1][2])
    assert rel_err(chunked[0][2], runs[0][2]) < 1e-5


def test_nan_and_empty_document_on_gpu():
    Q, D, _, _ = _problem(2, 32, 4, 64, 128, torch.float16)
    D[1, 10, 3] = float("nan")
    dm = torch.ones(4, 64, dtype=torch.bool, device=CUDA)
    dm[3] = False
    s = lik.maxsim(Q, D, None, dm)
    assert torch.isnan(s[:, 1]).all() and not torch.isnan(s[:, [0, 2, 3]]).any()
    assert torch.all(s[:, 3] == 0)


def _compiled_variants(kernel) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(c) for c in kernel.cache.values())


def test_no_recompile_when_batch_or_lengths_change():
    """B, Ld and Lq (inside its power-of-two bucket) are runtime values: forward and backward compile once."""
    kernels = [maxsim_fwd_kernel, maxsim_bwd_dq_kernel, maxsim_bwd_dd_atomic_kernel, maxsim_bwd_dd_sorted_kernel]

    def step(n_q, l_q, n_docs, l_d):
        Q, D, qm, dm = _problem(n_q, l_q, n_docs, l_d, 128, torch.float16)
        Q.requires_grad_()
        D.requires_grad_()
        for backward in ("fast", "deterministic"):
            lik.maxsim(Q, D, qm, dm, backward=backward).sum().backward()

    step(40, 30, 64, 300)
    before = [_compiled_variants(k) for k in kernels]
    for n_docs, l_q, l_d in [(17, 29, 301), (1000, 17, 64), (5, 32, 17), (1, 20, 1)]:
        step(40, l_q, n_docs, l_d)
    assert [_compiled_variants(k) for k in kernels] == before


def test_query_count_variants_are_bounded():
    """Stacking short queries depends on Nq only up to a full tile: at most log2(rows / 16) + 1 variants."""
    before = _compiled_variants(maxsim_fwd_kernel)
    for n_q in range(1, 70, 3):
        Q, D, _, _ = _problem(n_q, 32, 8, 40, 128, torch.float16)
        lik.maxsim(Q, D)
    assert _compiled_variants(maxsim_fwd_kernel) - before <= 4


def test_64bit_offsets_colpali_twenty_thousand_pages():
    """[20 000, 1024, 128] fp16 has 2.6e9 elements: offsets past 2**31 must not wrap."""
    n_docs, l_d, dim = 20_000, 1024, 128
    gen = torch.Generator(device=CUDA).manual_seed(5)
    D = torch.empty(n_docs, l_d, dim, device=CUDA, dtype=torch.float16)
    for start in range(0, n_docs, 2000):
        block = torch.randn(2000, l_d, dim, device=CUDA, generator=gen)
        D[start:start + 2000] = torch.nn.functional.normalize(block, dim=-1).half()
    assert D.numel() > 2**31
    Q = torch.nn.functional.normalize(torch.randn(1024, dim, device=CUDA, generator=gen), dim=-1).half()
    Q.requires_grad_()
    s = lik.maxsim(Q, D)
    spots = torch.tensor([0, 1, 9_999, 16_777, 19_998, 19_999], device=CUDA)
    ref = lik.maxsim_reference(Q.detach().double(), D[spots].double())
    assert rel_err(s[spots], ref) < 1e-3
    # The gradient gathers winners from the far end of D as well.
    grad = torch.zeros(n_docs, device=CUDA)
    grad[spots] = 1.0
    (dq,) = torch.autograd.grad(s, Q, grad)
    Q64 = Q.detach().double().requires_grad_()
    (rdq,) = torch.autograd.grad(lik.maxsim_reference(Q64, D[spots].double()).sum(), Q64)
    assert rel_err(dq, rdq) < 1e-3


@pytest.mark.parametrize("backward", ["fast", "deterministic"])
def test_training_step_is_cuda_graph_capturable(backward):
    """Forward + cross-entropy + backward in one CUDA graph: no host synchronisation anywhere in the step (the
    deterministic dD's sort and segment search included), and a replay gives the eager step's gradients."""
    Q, D, _, _ = _problem(16, 32, 16, 100, 128, torch.float16, seed=7)
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
    labels = torch.arange(16, device=CUDA)

    def step():
        Qg.grad = Dg.grad = None
        torch.nn.functional.cross_entropy(lik.maxsim(Qg, Dg, backward=backward), labels).backward()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: compile, allocator pools
            step()
    torch.cuda.current_stream().wait_stream(side)
    eager = (Qg.grad.clone(), Dg.grad.clone())
    graph = torch.cuda.CUDAGraph()
    Qg.grad = Dg.grad = None
    with torch.cuda.graph(graph):
        torch.nn.functional.cross_entropy(lik.maxsim(Qg, Dg, backward=backward), labels).backward()
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(Qg.grad, eager[0]) < 1e-3 and rel_err(Dg.grad, eager[1]) < 1e-3
    if backward == "deterministic":
        assert torch.equal(Qg.grad, eager[0]) and torch.equal(Dg.grad, eager[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("per_query", [False, True])
def test_torch_compile_inductor(dtype, per_query):
    """``torch.compile`` with inductor, fullgraph: a projection, MaxSim and a contrastive loss compile in one graph
    and match eager within rounding (inductor may pick its own projection kernel; dD adds with atomics)."""
    Q, D, q_mask, d_mask = _problem(8, 32, 8, 100, 128, dtype, per_query=per_query)
    proj = torch.nn.Linear(128, 128, bias=False).to(device=CUDA, dtype=dtype)
    target = torch.arange(8, device=CUDA)

    def loss_fn(q, d):
        scores = lik.maxsim(proj(q), d, q_mask, d_mask)
        return torch.nn.functional.cross_entropy(scores, target), scores

    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True)
    results = []
    for fn in (compiled, loss_fn):
        Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
        loss, scores = fn(Qg, Dg)
        results.append((scores.detach(), *torch.autograd.grad(loss, (Qg, Dg))))
    (s_c, dq_c, dd_c), (s_e, dq_e, dd_e) = results
    assert rel_err(s_c, s_e) <= 1e-3
    assert rel_err(dq_c, dq_e) <= 1e-2 and rel_err(dd_c, dd_e) <= 1e-2
    with torch.no_grad():
        assert rel_err(compiled(Q, D)[1], s_e) <= 1e-3


def test_torch_compile_inductor_packed():
    """``torch.compile`` with inductor, fullgraph, over the packed entry points (with their ``max_seqlen``
    hints): pairs and corpus, scores and gradients as eager within rounding."""
    gen = torch.Generator(device=CUDA).manual_seed(3)
    q, cu_q, max_q = lik.pack([torch.randn(n, 128, device=CUDA, generator=gen).half() for n in (32, 5, 17)])
    d, cu_d, max_d = lik.pack([torch.randn(n, 128, device=CUDA, generator=gen).half() for n in (300, 0, 77)])
    Q = torch.randn(4, 32, 128, device=CUDA, generator=gen).half()
    calls = [
        (lambda a, b: lik.maxsim_varlen(a, b, cu_q, cu_d, max_q, max_d) * 2.0, (q, d)),
        (lambda a, b: lik.maxsim_packed(a, b, cu_d, max_seqlen_d=max_d).softmax(-1), (Q, d)),
    ]
    for fn, inputs in calls:
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True)
        results = []
        for f in (compiled, fn):
            a, b = (x.clone().requires_grad_() for x in inputs)
            out = f(a, b)
            results.append((out.detach(), *torch.autograd.grad(out, (a, b), torch.ones_like(out))))
        for g, w in zip(*results):
            assert rel_err(g, w) <= 1e-2
