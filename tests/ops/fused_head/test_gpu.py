"""GPU-only checks of maxsim_from_hidden (`pytest -m gpu` on the device): real compilation and tensor cores, fp16 /
bf16 parity with the unfused path, deterministic bits, no recompilation across batch sizes, peak memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lik
from lik.ops.fused_head import maxsim_from_hidden, maxsim_from_hidden_reference
from lik.ops.fused_head.forward import fused_head_forward
from lik.ops.fused_head.kernel import fused_head_forward_kernel
from lik.ops.fused_head.validation import FusedHeadInputs

from .helpers import ULP, check_winners, scored_documents, similarities, winner_scores

pytestmark = pytest.mark.gpu

CUDA = "cuda"
NAMES = ("Q", "H", "W", "b")


def _problem(n_q, l_q, n_docs, l_d, d_model, d_out, dtype, seed=0):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    Q = F.normalize(torch.randn(n_q, l_q, d_out, device=CUDA, generator=gen), dim=-1).to(dtype)
    H = torch.randn(n_docs, l_d, d_model, device=CUDA, generator=gen).to(dtype)
    W = (torch.randn(d_out, d_model, device=CUDA, generator=gen) / d_model**0.5).to(dtype)
    b = (0.1 * torch.randn(d_out, device=CUDA, generator=gen)).to(dtype)
    q_mask = torch.rand(n_q, l_q, device=CUDA, generator=gen) > 0.1
    d_mask = torch.rand(n_docs, l_d, device=CUDA, generator=gen) > 0.2
    H[~d_mask] = float("nan")  # garbage in masked positions
    return dict(Q=Q, H=H, W=W, b=b, q_mask=q_mask, d_mask=d_mask)


def _grads(fn, p, weights, dtype=None, **kw):
    leaves = {n: p[n].detach().to(dtype or p[n].dtype).clone().requires_grad_() for n in NAMES}
    scores = fn(leaves["Q"], leaves["H"], leaves["W"], leaves["b"], p["q_mask"], p["d_mask"], **kw)
    return scores, torch.autograd.grad((scores * weights).sum(), [leaves[n] for n in NAMES])


def _rel(a, e):
    return ((a.double() - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()


TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}


def _winners(p) -> torch.Tensor:
    """The forward's winners ``[Nq, B, Lq]`` (-1: no gradient), the ones the backward is given (the kernel has no
    atomics: the same inputs give the same winners)."""
    inputs = FusedHeadInputs.build(*(p[n] for n in NAMES), p["q_mask"], p["d_mask"])
    with torch.no_grad():
        return fused_head_forward(inputs, True)[1]


def winner_slack(dtype) -> float:
    """How far a correct winner may fall short of the max of the float64-emulated rows: the kernel's fp32 rows can
    round to the neighbour of the emulation's (one ulp, at most ULP * |p_i|), which moves a similarity of unit rows by
    at most ULP * sum |q_i p_i| <= ULP, for the winner and the max alike; 1e-4 covers the fp32 sums (768 deep)."""
    return 2 * ULP[dtype] + 1e-4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 32, 300, 257, 768, 128), (16, 32, 64, 180, 768, 128),
                                   (3, 7, 9, 65, 100, 40), (2, 32, 5, 300, 768, 256)])
@pytest.mark.parametrize("backward", ["fast", "deterministic"])
def test_matches_float64(dtype, shape, backward):
    """Scores against float64; winners and gradients against float64 at the kernel's winners.

    The kernel picks each winner on the projected rows rounded to the input dtype (kernel.py), float64's reference
    on exact rows: their argmax differ at near-ties (fp16: 1 in 1 500 to 7 500 of the (query token, document) pairs at
    these shapes, bf16: 1 in 250 to 450), and each moves a whole row of dQ (one document's term of its sum) by ~10 %
    of the largest. So the winners are checked to be maximal in the rows as the kernel rounds them (within
    winner_slack), and the gradients against the exact gradients at those winners."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        p = _problem(*shape, dtype)
        weights = torch.randn(shape[0], shape[2], device=CUDA)
        scores, got = _grads(maxsim_from_hidden, p, weights, backward=backward)
        winners = _winners(p)
    finally:
        torch.set_float32_matmul_precision(previous)
    ref_scores = maxsim_from_hidden_reference(*(p[n].double() for n in NAMES), p["q_mask"], p["d_mask"])
    assert _rel(scores, ref_scores) < TOL[dtype]
    sim = similarities(p["Q"], scored_documents(p["H"], p["W"], p["b"], p["d_mask"], dtype=dtype), p["d_mask"])
    flips = check_winners(sim, winners, p["q_mask"], winner_slack(dtype))
    leaves = {n: p[n].detach().double().requires_grad_() for n in NAMES}
    exact = winner_scores(*(leaves[n] for n in NAMES), p["q_mask"], p["d_mask"], winners)
    expected = torch.autograd.grad((exact * weights.double()).sum(), [leaves[n] for n in NAMES])
    for name, g, e in zip(NAMES, got, expected):
        assert g.dtype == dtype and torch.isfinite(g).all(), name
        assert _rel(g, e) < 5 * TOL[dtype], f"{name}: {_rel(g, e):.3g} ({flips} near-tie winners)"


def test_parity_with_the_unfused_path_fp16():
    p = _problem(16, 32, 1000, 240, 768, 128, torch.float16)
    with torch.no_grad():
        fused = maxsim_from_hidden(p["Q"], p["H"], p["W"], p["b"], p["q_mask"], p["d_mask"])
        H = torch.where(p["d_mask"][..., None], p["H"], 0)
        unfused = lik.maxsim(p["Q"], F.normalize(F.linear(H, p["W"], p["b"]), dim=-1), p["q_mask"], p["d_mask"])
    assert (fused - unfused).abs().max().item() < 2e-2  # fp16 rounding of the unfused projected rows (twice)


def test_deterministic_backward_is_bitwise_repeatable():
    p = _problem(32, 32, 32, 180, 768, 128, torch.float16)
    weights = torch.randn(32, 32, device=CUDA)
    first = _grads(maxsim_from_hidden, p, weights, backward="deterministic")[1]
    for _ in range(3):
        again = _grads(maxsim_from_hidden, p, weights, backward="deterministic")[1]
        assert all(torch.equal(a, c) for a, c in zip(first, again))


def test_packed_matches_padded():
    """The same documents packed and padded give the same bits: both launches take the same tiles (the heuristic
    reads d_model, d_out, the query rows and the dtype), each program projects its document in 128-token tiles from
    its first token (a row's projection depends on its hidden row and W only, in a fixed k order), and the padded
    tail is masked (-inf never wins). Garbage (NaN) only past each document's length, where it must not matter."""
    gen = torch.Generator(device=CUDA).manual_seed(1)
    p = _problem(4, 32, 50, 300, 768, 128, torch.float16)
    lengths = torch.randint(0, 301, (50,), device=CUDA, generator=gen)
    lengths[:6] = torch.tensor([0, 300, 1, 128, 129, 256], device=CUDA)  # empty, full, and tile edges
    d_mask = torch.arange(300, device=CUDA)[None] < lengths[:, None]
    H = torch.randn(50, 300, 768, device=CUDA, generator=gen).half()
    H[~d_mask] = float("nan")
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    with torch.no_grad():
        padded = maxsim_from_hidden(p["Q"], H, p["W"], p["b"], p["q_mask"], d_mask)
        packed = maxsim_from_hidden(p["Q"], H[d_mask], p["W"], p["b"], p["q_mask"], cu_seqlens=cu)
    assert torch.isfinite(padded).all() and (padded[:, 0] == 0).all()
    expected = maxsim_from_hidden_reference(p["Q"].double(), H.double(), p["W"].double(), p["b"].double(),
                                            p["q_mask"], d_mask)
    assert _rel(padded, expected) < TOL[torch.float16]
    torch.testing.assert_close(packed, padded, rtol=0, atol=0)


def _compiled_variants(kernel) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(c) for c in kernel.cache.values())


def test_no_recompilation_across_batch_sizes():
    """B and Ld are runtime values: a new batch of documents compiles nothing."""
    p = _problem(2, 32, 3, 40, 768, 128, torch.float16)
    with torch.no_grad():
        maxsim_from_hidden(p["Q"], p["H"], p["W"], p["b"], p["q_mask"], p["d_mask"])
        before = _compiled_variants(fused_head_forward_kernel)
        for n_docs, l_d in ((7, 41), (100, 300), (1, 1), (1000, 17)):
            q = _problem(2, 32, n_docs, l_d, 768, 128, torch.float16)
            maxsim_from_hidden(q["Q"], q["H"], q["W"], q["b"], q["q_mask"], q["d_mask"])
    assert _compiled_variants(fused_head_forward_kernel) == before


def test_peak_memory_has_no_projected_copy():
    p = _problem(16, 32, 2000, 300, 768, 128, torch.float16)
    projected_bytes = 2000 * 300 * 128 * 2
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        maxsim_from_hidden(p["Q"], p["H"], p["W"], p["b"], p["q_mask"], p["d_mask"])
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < projected_bytes / 4


def test_inductor_training_step():
    """torch.compile with inductor: the kernels are custom operators, the step is one graph with eager's values."""
    torch._dynamo.reset()
    p = _problem(8, 32, 16, 180, 768, 128, torch.bfloat16)
    weights = torch.randn(8, 16, device=CUDA)

    def step(Q, H, W, b):
        return (maxsim_from_hidden(Q, H, W, b, p["q_mask"], p["d_mask"], backward="deterministic") * weights).sum()

    leaves = [p[n].detach().clone().requires_grad_() for n in NAMES]
    eager = [p[n].detach().clone().requires_grad_() for n in NAMES]
    got = torch.compile(step, fullgraph=True)(*leaves)
    expected = step(*eager)
    torch.testing.assert_close(got, expected)
    for g, e in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(expected, eager)):
        torch.testing.assert_close(g, e)
