"""The forward with exactly the tiles the GPU heuristic picks (``gpu_tiles``: 128-token projected tiles, 32-deep k
chunks, one row block for the query rows) through the interpreter, in half precision: the winners are maximal in the
rows as the kernel rounds them, the gradients are the exact ones at those winners, packed bits equal padded bits.
The checks test_gpu.py runs on the device, on shapes the interpreter runs in seconds."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lik._device import interpreting
from lik.ops.fused_head import maxsim_from_hidden, maxsim_from_hidden_reference
from lik.ops.fused_head.forward import forced_config, fused_head_forward, gpu_tiles
from lik.ops.fused_head.validation import FusedHeadInputs

from .helpers import ULP, check_winners, problem, scored_documents, similarities, winner_scores

# On a GPU machine CPU tensors take the reference path; these tests force tiles on the interpreted kernel.
needs_interpreter = pytest.mark.skipif(not interpreting(), reason="the kernel through Triton's interpreter")

NAMES = ("Q", "H", "W", "b")
H200_PROGRAMS = 4 * 132  # the heuristic's split target on an H200 (4 programs per SM)
SLACK = 2 * ULP[torch.float16] + 1e-5  # one fp16 ulp per side (test_gpu.winner_slack); fp32 sums 40 deep


def _gpu_config(p):
    n_q, l_q, d_out = p["Q"].shape
    cfg = gpu_tiles(d_model=p["W"].shape[1], d_out=d_out, rows=n_q * l_q, dtype=p["Q"].dtype)
    return dataclasses.replace(cfg, target_programs=H200_PROGRAMS)


def _half_problem(rng):
    """fp16, 150-token documents (a full 128-token tile, then a ragged one), 18 query rows (one 32-row block, 14
    rows past the end), d_model 40 (a 32-deep k chunk, then 8), d_out 24 (padded to 32); a fully masked document, a
    masked query token, inf / NaN in masked hidden rows."""
    return problem(rng, n_q=2, l_q=9, n_docs=3, l_d=150, dtype=torch.float16)


def test_the_gpu_tiles_are_the_ones_forced():
    cfg = gpu_tiles(d_model=40, d_out=24, rows=18, dtype=torch.float16)
    assert (cfg.block_m, cfg.block_n, cfg.block_k) == (32, 128, 32)
    assert gpu_tiles(d_model=768, d_out=128, rows=512, dtype=torch.bfloat16).block_n == 128
    assert gpu_tiles(d_model=768, d_out=256, rows=64, dtype=torch.float16).block_n == 64


@needs_interpreter
def test_winners_and_gradients_at_gpu_tiles(rng):
    p = _half_problem(rng)
    weights = torch.randn(2, 3, generator=rng)
    leaves = {n: p[n].detach().clone().requires_grad_() for n in NAMES}
    with forced_config(_gpu_config(p)):
        scores = maxsim_from_hidden(*(leaves[n] for n in NAMES), p["q_mask"], p["d_mask"], backward="deterministic")
        got = torch.autograd.grad((scores * weights).sum(), [leaves[n] for n in NAMES])
        inputs = FusedHeadInputs.build(*(p[n] for n in NAMES), p["q_mask"], p["d_mask"])
        winners = fused_head_forward(inputs, True)[1]
    sim = similarities(p["Q"], scored_documents(p["H"], p["W"], p["b"], p["d_mask"], dtype=torch.float16),
                       p["d_mask"])
    check_winners(sim, winners, p["q_mask"], SLACK)
    assert (winners[:, 1] == -1).all() and (winners[0, :, -1] == -1).all()  # no valid token / masked query token
    # The scores are the winners' similarities in the rounded rows, summed in fp32.
    chosen = sim.gather(-1, winners.clamp_min(0).long()[..., None])[..., 0]
    torch.testing.assert_close(scores.double(), torch.where(winners >= 0, chosen, 0).sum(-1), rtol=0, atol=1e-5)
    exact = {n: p[n].detach().double().requires_grad_() for n in NAMES}
    at_winners = winner_scores(*(exact[n] for n in NAMES), p["q_mask"], p["d_mask"], winners)
    expected = torch.autograd.grad((at_winners * weights.double()).sum(), [exact[n] for n in NAMES])
    for name, g, e in zip(NAMES, got, expected):
        assert g.dtype == torch.float16 and torch.isfinite(g).all(), name
        # fp16 results: half an ulp (2^-11) of the largest, twice for the fp32 sums before the rounding
        assert (g.double() - e).abs().max() <= 2 * 2.0**-11 * e.abs().max(), name


@needs_interpreter
def test_packed_bits_equal_padded_at_gpu_tiles(rng):
    p = problem(rng, n_q=2, l_q=9, n_docs=5, l_d=150, masks=False, dtype=torch.float16)
    lengths = torch.tensor([150, 0, 1, 128, 129])  # full, empty, one token, one tile, a tile and a token
    d_mask = torch.arange(150)[None] < lengths[:, None]
    H = p["H"].clone()
    H[~d_mask] = float("nan")  # garbage only past each document's end
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    with forced_config(_gpu_config(p)):
        padded = maxsim_from_hidden(p["Q"], H, p["W"], p["b"], d_mask=d_mask)
        packed = maxsim_from_hidden(p["Q"], H[d_mask], p["W"], p["b"], cu_seqlens=cu)
    assert torch.isfinite(padded).all() and (padded[:, 1] == 0).all()
    expected = maxsim_from_hidden_reference(p["Q"].double(), H.double(), p["W"].double(), p["b"].double(),
                                            d_mask=d_mask)
    torch.testing.assert_close(padded.double(), expected, rtol=0, atol=1e-2)  # fp16 rows, 9 tokens
    torch.testing.assert_close(packed, padded, rtol=0, atol=0)


def test_check_winners_catches_a_wrong_winner_and_a_wrong_minus_one():
    """The winner check can fail: a non-maximal winner beyond the slack, a winner where none counts."""
    sim = torch.tensor([[[[0.10, 0.30, 0.2999], [0.5, float("-inf"), 0.1]]]], dtype=torch.float64)
    right = torch.tensor([[[1, 0]]], dtype=torch.int32)
    assert check_winners(sim, right, None, 1e-3) == 0
    assert check_winners(sim, torch.tensor([[[2, 0]]], dtype=torch.int32), None, 1e-3) == 1  # a near-tie
    with pytest.raises(AssertionError, match="short of the max"):
        check_winners(sim, torch.tensor([[[0, 0]]], dtype=torch.int32), None, 1e-3)
    with pytest.raises(AssertionError, match="-1"):
        check_winners(sim, right, torch.tensor([[True, False]]), 1e-3)
