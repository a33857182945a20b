"""Top-k on random data, robust to near-ties: half-precision products summed on tensor cores (or fp32 sums in any
order) differ from the float64 reference by a rounding bound, so between tokens whose similarities lie within it
the kernel may choose either; one such flip moves a whole gradient row. So the kernel's own choice (the forward's
saved tokens) is checked against the float64 similarities -- every chosen token valid, distinct, as many as the
reduction takes, within the bound of the reference's k-th, and exactly the reference's set wherever the k-th /
(k+1)-th gap exceeds twice the bound -- and its scores and gradients against a float64 reference on that choice.
A wrong token, weight or gradient still fails; a near-tie resolved by fp32 rounding does not."""

from __future__ import annotations

import pytest
import torch

import lik
from lik.ops.maxsim.options import check_options
from lik.ops.maxsim.reference import maxsim_reference
from lik.ops.maxsim.soft import padded_layout, soft_forward
from lik.ops.maxsim.validation import MaxSimInputs

from .helpers import rand_problem

# Output rounding of the gradients (their dtype) and of the 1 / count weights the dD product reads in it; fp32:
# thousands of atomic adds per token in any order (a wrong token moves a whole row: 1e-2 of the norm or more).
UNIT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-16}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-12)).item()


def chosen_tokens(Q, D, q_mask, d_mask, top_k):
    """The forward kernel's chosen tokens ``[Nq, B, Lq, top_k]`` (int64, -1: empty slot) for ``lik.maxsim(Q, D,
    q_mask, d_mask, reduction="topk", top_k=top_k)`` (the kernels are deterministic: the same as that call's)."""
    inputs = MaxSimInputs.build(Q, D, q_mask, d_mask)
    lay = padded_layout(inputs)
    _, stats = soft_forward(inputs.q, inputs.d, lay, check_options("topk", top_k=top_k), True)
    return stats.view(lay.n_queries, lay.n_docs, lay.q_len, top_k).long()


def check_selection(toks, Q, D, q_mask, d_mask, top_k):
    """``toks`` is a valid top-k choice for the float64 similarities of ``Q [Nq, Lq, d]`` and ``D [B, Ld, d]``
    (``mask_mode="exclude"``) up to the fp32 rounding bound; returns the float64 weights ``[Nq, B, Lq, Ld]``."""
    Q64, D64 = Q.double(), D.double()
    sims = torch.einsum("nsk,btk->nbst", Q64, D64)
    # |fp32 sum - exact| <= dim * 2^-24 * sum |q_i d_i| per product; tensor cores' fp32 adds, twice that, twice more
    bound = 4 * Q.shape[-1] * 2.0**-24 * torch.einsum("nsk,btk->nbst", Q64.abs(), D64.abs())
    valid = q_mask[:, None, :, None] & d_mask[None, :, None, :]
    n_valid = valid.sum(-1)  # [Nq, B, Lq]
    want_count = n_valid.clamp(max=top_k)
    filled = toks >= 0
    assert torch.equal(filled.sum(-1), want_count), "a row has the wrong number of chosen tokens"
    idx = toks.clamp(min=0)
    assert valid.gather(-1, idx)[filled].all(), "a masked or padded token was chosen"
    ordered = torch.where(filled, toks, -1 - torch.arange(top_k, device=toks.device)).sort(-1).values
    assert (ordered[..., 1:] != ordered[..., :-1]).all(), "a token was chosen twice"
    masked = sims.masked_fill(~valid, float("-inf"))
    ranked = masked.topk(min(top_k + 1, sims.shape[-1]), dim=-1).values
    kth = ranked.gather(-1, (want_count - 1).clamp(min=0)[..., None])
    slack = bound.masked_fill(~valid, 0).amax(-1, keepdim=True)
    got = sims.gather(-1, idx)
    assert (got[filled] >= (kth - 2 * slack).expand_as(got)[filled]).all(), "a chosen token is not among the top"
    # Where the k-th and (k+1)-th are further apart than the bound, the choice is the reference's set.
    if ranked.shape[-1] > top_k:
        clear = (n_valid > top_k) & (ranked[..., top_k - 1] - ranked[..., top_k] > 2 * slack[..., 0])
        want = masked.topk(top_k, dim=-1).indices.sort(-1).values
        assert torch.equal(toks.sort(-1).values[clear], want[clear]), "a clear top-k was chosen differently"
    weights = torch.zeros_like(sims)
    share = 1.0 / want_count.clamp(min=1).double()
    weights.scatter_add_(-1, idx, filled.double() * share[..., None])
    return weights


def topk_against_own_choice(device, dtype, top_k, shape, seed=0):
    """``lik.maxsim(..., reduction="topk")`` in ``dtype`` against float64 on its own choice (``check_selection``),
    and its scores against the true top-k's within the rounding bound."""
    Q, D, q_mask, d_mask = rand_problem(torch.Generator().manual_seed(seed), *shape)
    Q, D, q_mask, d_mask = Q.to(device, dtype), D.to(device, dtype), q_mask.to(device), d_mask.to(device)
    toks = chosen_tokens(Q, D, q_mask, d_mask, top_k)
    weights = check_selection(toks, Q, D, q_mask, d_mask, top_k)
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
    s = lik.maxsim(Qg, Dg, q_mask, d_mask, reduction="topk", top_k=top_k)
    g = torch.linspace(-1, 1, s.numel(), device=device).view(s.shape)
    dq, dd = torch.autograd.grad(s, (Qg, Dg), g.to(s.dtype))
    Q64, D64, g64 = Q.double(), D.double(), g.double()
    sims = torch.einsum("nsk,btk->nbst", Q64, D64)
    s_own = (weights * sims).sum((-1, -2))
    dq_own = torch.einsum("nbst,nb,btk->nsk", weights, g64, D64)
    dd_own = torch.einsum("nbst,nb,nsk->btk", weights, g64, Q64)
    torch.testing.assert_close(s.double(), s_own, atol=1e-4, rtol=1e-5)
    assert _rel(dq, dq_own) < 3 * UNIT[dtype] and _rel(dd, dd_own) < 3 * UNIT[dtype]
    s64 = maxsim_reference(Q64, D64, q_mask, d_mask, reduction="topk", top_k=top_k)
    torch.testing.assert_close(s.double(), s64, atol=1e-3, rtol=1e-4)  # (a flip moves a mean by < the bound)
    return toks


@pytest.mark.parametrize("top_k", [3, 16])
def test_half_kernels_against_their_own_choice(top_k):
    """The interpreter's fp16 products (fp32 sums in numpy's order): ties at 1 / 8 steps plus random data."""
    topk_against_own_choice("cpu", torch.float16, top_k, (2, 5, 3, 37, 16))


def test_check_selection_fails_on_a_wrong_choice():
    rng = torch.Generator().manual_seed(4)
    Q, D, q_mask, d_mask = rand_problem(rng, 2, 4, 3, 21, 8)
    toks = chosen_tokens(Q, D, q_mask, d_mask, 3)
    check_selection(toks, Q, D, q_mask, d_mask, 3)
    sims = torch.einsum("nsk,btk->nbst", Q.double(), D.double()).masked_fill(~d_mask[None, :, None, :], 9.0)
    worst = sims.argmin(-1)  # each row's lowest valid token
    for wrong, message in [
        (torch.where(toks[..., :1] >= 0, worst[..., None], toks[..., :1]), "not among the top"),  # a bad token
        (torch.where(toks >= 0, toks[..., :1], toks), "twice"),  # the first slot repeated
        (toks.masked_fill(toks[..., 1:2] >= 0, -1), "number"),  # slots emptied
    ]:
        bad = toks.clone()
        if wrong.shape[-1] == 1:
            bad[..., :1] = wrong
        else:
            bad = wrong
        with pytest.raises(AssertionError, match=message):
            check_selection(bad, Q, D, q_mask, d_mask, 3)


_WIDE = [(16, 32, 16, 180, 128), (2, 300, 3, 1030, 128), (2, 9, 3, 40, 1000)]
# Every dtype at top_k 4, fp16 at 16 (the slots past 8 and the feature chunks of d = 1000 take the same code).
DEVICE_CASES = [(dt, 4, shape) for dt in (torch.float16, torch.bfloat16, torch.float32) for shape in _WIDE]
DEVICE_CASES += [(torch.float16, 16, shape) for shape in (*_WIDE, (3, 7, 5, 33, 256))]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,top_k,shape", DEVICE_CASES)
def test_topk_on_device_against_its_own_choice(dtype, top_k, shape):
    """Tensor-core half products (and fp32 IEEE ones) at the shapes of the smooth float64 GPU test."""
    topk_against_own_choice("cuda", dtype, top_k, shape)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_topk_on_device_at_training_shapes(dtype):
    """ColBERT's in-batch shape (B 32 of 128, to keep the float64 reference small) and a ColPali-like page."""
    topk_against_own_choice("cuda", dtype, 4, (32, 32, 32, 180, 128), seed=1)
    topk_against_own_choice("cuda", dtype, 4, (2, 1024, 2, 1024, 128), seed=2)
