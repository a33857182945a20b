"""Any embedding width ``d`` from 1 to 8192, on every MaxSim path; ``d`` above 8192 is refused by name.

Widths up to 256 keep the query block on chip; wider ones stream the query and the document tile through the
tensor cores in feature chunks (a ragged last chunk when ``d`` is not a multiple of the chunk). Each width is
checked against the float64 reference, scores and both gradients, through Triton's interpreter on CPU (which has
no shared-memory limit) and, with ``-m gpu``, compiled for the device in fp16 / bf16 / fp32, where the launch
configuration must fit the device's shared memory.
"""

from __future__ import annotations

import pytest
import torch

import lik
from lik import _config

from .helpers import check_against_reference, rand_problem, rel_err

WIDTHS = (1, 3, 96, 200, 384, 768, 1000, 1024, 2048, 4096, 8192)
WIDE = tuple(d for d in WIDTHS if d > _config.MAX_RESIDENT_DIM)


def _packed_reference(q_list, d_list, grad):
    """float64 scores of pairs and the gradients of ``sum(scores * grad)`` per sequence."""
    qs = [q.detach().double().requires_grad_() for q in q_list]
    ds = [d.detach().double().requires_grad_() for d in d_list]
    scores = torch.stack([
        (q @ d.T).max(dim=1).values.sum() if len(q) and len(d) else q.new_zeros(())
        for q, d in zip(qs, ds)
    ])
    (scores * grad.double()).sum().backward()
    zeros = [torch.zeros_like(x) for x in qs + ds]
    grads = [x.grad if x.grad is not None else z for x, z in zip(qs + ds, zeros)]
    return scores.detach(), torch.cat(grads[:len(qs)]), torch.cat(grads[len(qs):])


@pytest.mark.parametrize("dim", WIDTHS)
def test_padded_kernels_match_float64_at_every_width(dim):
    rng = torch.Generator().manual_seed(dim)
    mode = ("exclude", "zero")[dim % 2]
    # Shared documents with masks (Ld not a multiple of a tile, stacked queries), fast backward.
    Q, D, qm, dm = rand_problem(rng, 3, 9, 2, 21, dim)
    check_against_reference(Q, D, qm, dm, torch.randn(3, 2, generator=rng), mask_mode=mode, backward="fast")
    # One candidate set per query, no masks, deterministic backward.
    Q, D, _, _ = rand_problem(rng, 2, 5, 2, 17, dim, per_query=True, masks=False)
    check_against_reference(Q, D, None, None, torch.randn(2, 2, generator=rng), backward="deterministic")
    # 2-D query, inference.
    Q, D, _, _ = rand_problem(rng, 1, 4, 3, 19, dim, squeeze=True, masks=False)
    with torch.no_grad():
        assert rel_err(lik.maxsim(Q, D), lik.maxsim(Q.double(), D.double())) < 2e-6


@pytest.mark.parametrize("dim", (3, 200, 1000, 8192))
def test_packed_kernels_match_float64_at_every_width(dim):
    rng = torch.Generator().manual_seed(dim)
    q_list = [torch.randn(n, dim, generator=rng) for n in (4, 0, 7)]
    d_list = [torch.randn(n, dim, generator=rng) for n in (19, 5, 0)]
    q, cu_q, max_q = lik.pack(q_list)
    d, cu_d, max_d = lik.pack(d_list)
    grad = torch.randn(3, generator=rng)
    ref, ref_dq, ref_dd = _packed_reference(q_list, d_list, grad)
    for backward in ("fast", "deterministic"):
        qg, dg = q.clone().requires_grad_(), d.clone().requires_grad_()
        scores = lik.maxsim_varlen(qg, dg, cu_q, cu_d, max_q, max_d, backward=backward)
        dq, dd = torch.autograd.grad(scores, (qg, dg), grad)
        assert rel_err(scores, ref) < 2e-6 and rel_err(dq, ref_dq) < 2e-6 and rel_err(dd, ref_dd) < 2e-6
    # Dense queries against the packed corpus: the padded problem's scores.
    Q = torch.randn(2, 6, dim, generator=rng)
    padded = torch.zeros(3, max_d, dim)
    d_mask = torch.zeros(3, max_d, dtype=torch.bool)
    for i, x in enumerate(d_list):
        padded[i, :len(x)], d_mask[i, :len(x)] = x, True
    expected = lik.maxsim(Q.double(), padded.double(), d_mask=d_mask)
    assert rel_err(lik.maxsim_packed(Q, d, cu_d, max_seqlen_d=max_d), expected) < 2e-6


@pytest.mark.parametrize("dim", (384, 1000))
def test_search_at_wide_widths(dim):
    rng = torch.Generator().manual_seed(dim)
    Q, D, _, _ = rand_problem(rng, 2, 5, 9, 13, dim, masks=False)
    scores, indices = lik.search(Q, D, k=3, chunk_size=4)
    full = lik.maxsim(Q.double(), D.double())
    top = full.topk(3, dim=-1)
    assert torch.equal(indices, top.indices)
    assert rel_err(scores, top.values) < 2e-6


def test_width_above_8192_is_refused_by_name():
    Q, D = torch.randn(2, 8193), torch.randn(3, 4, 8193)
    d, cu, max_len = lik.pack([torch.randn(4, 8193)])
    calls = {
        "maxsim": lambda: lik.maxsim(Q, D),
        "maxsim_varlen": lambda: lik.maxsim_varlen(d, d, cu, cu, max_len, max_len),
        "maxsim_packed": lambda: lik.maxsim_packed(Q, d, cu, max_seqlen_d=max_len),
        "search": lambda: lik.search(Q, D, k=1),
    }
    for call in calls.values():
        with pytest.raises(ValueError, match=r"d = 8193"):
            call()
    lik.maxsim(torch.randn(2, 8192), torch.randn(1, 3, 8192))  # the limit itself is accepted


@pytest.mark.parametrize("dim", WIDE)
def test_wide_widths_stream_the_query_in_chunks(dim):
    """Past MAX_RESIDENT_DIM the features come in cdiv(d, BLOCK_K) chunks: no power-of-two padding of d."""
    cfg = _config.maxsim_forward_config(
        q_len=1024, n_queries=1, dim=dim, dtype=torch.float16, per_query=False, device=torch.device("cpu")
    )
    block_k, num_k = _config.feature_chunks(dim, cfg.block_k)
    assert num_k == -(-dim // block_k) > 1


# ---------------------------------------------------------------------------------------------------------------
# GPU: every width compiled for the device, fp16 / bf16 / fp32, forward and both backwards.
# ---------------------------------------------------------------------------------------------------------------

GPU_TOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}


@pytest.fixture
def true_fp32():
    """fp32 inputs multiply in full precision (no TF32) for the duration of a test."""
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(prev)


def _cuda_problem(gen, shape_q, shape_d, dtype, masks):
    Q = torch.nn.functional.normalize(torch.randn(shape_q, device="cuda", generator=gen), dim=-1).to(dtype)
    D = torch.nn.functional.normalize(torch.randn(shape_d, device="cuda", generator=gen), dim=-1).to(dtype)
    if not masks:
        return Q, D, None, None
    q_mask = torch.rand(shape_q[:-1], device="cuda", generator=gen) > 0.2
    d_mask = torch.rand(shape_d[:-1], device="cuda", generator=gen) > 0.2
    return Q, D, q_mask, d_mask


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", WIDTHS)
def test_gpu_every_width_matches_float64(dim, dtype, true_fp32):
    gen = torch.Generator(device="cuda").manual_seed(dim)
    tol = GPU_TOL[dtype]
    mode = ("exclude", "zero")[dim % 2]
    # Tall row blocks (a long query; stacked short ones) against masked documents, fast backward.
    for shape_q in ((2, 150, dim), (9, 20, dim)):
        Q, D, qm, dm = _cuda_problem(gen, shape_q, (5, 203, dim), dtype, masks=True)
        check_against_reference(Q, D, qm, dm, torch.randn(shape_q[0], 5, device="cuda", generator=gen),
                                mask_mode=mode, backward="fast", tol=tol)
    # One short query per candidate set, no masks, deterministic backward.
    Q, D, _, _ = _cuda_problem(gen, (3, 30, dim), (3, 4, 77, dim), dtype, masks=False)
    check_against_reference(Q, D, None, None, torch.randn(3, 4, device="cuda", generator=gen),
                            backward="deterministic", tol=tol)
    # 2-D query, inference, long documents.
    Q, D, _, _ = _cuda_problem(gen, (32, dim), (6, 600, dim), dtype, masks=False)
    with torch.no_grad():
        assert rel_err(lik.maxsim(Q, D), lik.maxsim_reference(Q.double(), D.double())) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", WIDTHS)
def test_gpu_packed_search_and_warmup_at_every_width(dim, dtype, true_fp32):
    gen = torch.Generator(device="cuda").manual_seed(dim + 1)
    tol = GPU_TOL[dtype]
    q_list = [torch.randn(n, dim, device="cuda", generator=gen).to(dtype) for n in (30, 0, 7)]
    d_list = [torch.randn(n, dim, device="cuda", generator=gen).to(dtype) for n in (190, 5, 0)]
    q, cu_q, max_q = lik.pack(q_list)
    d, cu_d, max_d = lik.pack(d_list)
    grad = torch.randn(3, device="cuda", generator=gen)
    ref, ref_dq, ref_dd = _packed_reference(q_list, d_list, grad)
    for backward in ("fast", "deterministic"):
        qg, dg = q.clone().requires_grad_(), d.clone().requires_grad_()
        scores = lik.maxsim_varlen(qg, dg, cu_q, cu_d, max_q, max_d, backward=backward)
        dq, dd = torch.autograd.grad(scores, (qg, dg), grad)
        assert rel_err(scores, ref) < tol and rel_err(dq, ref_dq) < tol and rel_err(dd, ref_dd) < tol
    Q = torch.randn(4, 32, dim, device="cuda", generator=gen).to(dtype).requires_grad_()
    dg = d.clone().requires_grad_()
    scores = lik.maxsim_packed(Q, dg, cu_d, max_seqlen_d=max_d)
    padded = torch.zeros(3, max_d, dim, device="cuda", dtype=torch.float64)
    mask = torch.zeros(3, max_d, dtype=torch.bool, device="cuda")
    for i, x in enumerate(d_list):
        padded[i, :len(x)], mask[i, :len(x)] = x.double(), True
    assert rel_err(scores, lik.maxsim_reference(Q.double(), padded, d_mask=mask)) < tol
    scores.sum().backward()
    assert Q.grad.dtype == dtype and dg.grad.dtype == dtype
    # search and warmup at this width
    corpus = torch.randn(20, 40, dim, device="cuda", generator=gen).to(dtype)
    top, idx = lik.search(Q.detach(), corpus, k=5, chunk_size=7)
    full = lik.maxsim_reference(Q.detach().double(), corpus.double())
    assert rel_err(top, full.gather(1, idx)) < tol
    assert lik.warmup([(1, 32, dim)], dtype=dtype, training=True) > 0
