"""flash-maxsim's tests/test_backward.py on the CPU: ``flash_maxsim_train``'s float16 gradients against the float32
einsum reference it uses, read as the script reads them (the reference's gradients rounded to float16).

Where every maximum has a clear winner the gradients agree to one float16 step. The script's ColPali-size check
(51 200 maxima over 1 024 tokens) also meets near-ties, where two tokens' similarities differ by less than two
float32 sums of the same products do: there the winner may differ between lik and the einsum, and one different
winner moves a gradient row by a whole token, past the script's 0.1 bound. That is a listed difference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lik.integrations.flash_maxsim import flash_maxsim_train


def _script_errors(Q: torch.Tensor, D: torch.Tensor) -> tuple[float, float, float]:
    """The script's (Q.grad error, D.grad error) and the smallest top-two gap of the maxima (float64)."""
    Q, D = Q.clone().requires_grad_(True), D.clone().requires_grad_(True)
    flash_maxsim_train(Q, D).sum().backward()
    Q2, D2 = Q.detach().float().requires_grad_(True), D.detach().float().requires_grad_(True)
    torch.einsum("qd,bld->bql", Q2, D2).max(dim=2).values.sum(dim=1).sum().backward()
    q_err = (Q.grad.float() - Q2.grad.half().float()).abs().max().item()
    d_err = (D.grad.float() - D2.grad.half().float()).abs().max().item()
    top2 = torch.einsum("qd,bld->bql", Q.detach().double(), D.detach().double()).topk(2, dim=2).values
    return q_err, d_err, (top2[..., 0] - top2[..., 1]).min().item()


def _unit(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return F.normalize(torch.randn(*shape, generator=generator), dim=-1).half()


def test_script_first_check():
    g = torch.Generator().manual_seed(0)
    q_err, d_err, _ = _script_errors(_unit(16, 128, generator=g), _unit(10, 64, 128, generator=g))
    assert q_err == 0.0 and d_err == 0.0  # the GPU run printed 0.000000 for both


def test_long_query_gradients_agree_where_winners_are_clear():
    g = torch.Generator().manual_seed(1)
    q_err, d_err, gap = _script_errors(_unit(256, 128, generator=g), _unit(3, 256, 128, generator=g))
    assert gap > 1e-6  # no near-tie in this draw (float32 sums of these products differ by ~1e-7)
    assert q_err <= 2**-11 * 8 and d_err <= 2**-11 * 8  # one float16 step of the largest gradients (< 8)


def test_one_other_winner_is_past_the_scripts_bound():
    # An exact tie (a token repeated) goes to the lower index, as the design says; a reference choosing the other
    # token would move two rows of D.grad by a whole query token, and at a near-tie between two distinct tokens a
    # row of Q.grad by their difference: either is past the script's 0.1 bound.
    g = torch.Generator().manual_seed(2)
    Q, D = _unit(4, 128, generator=g), _unit(1, 32, 128, generator=g)
    D[0, 20] = D[0, 5]
    Q[0] = D[0, 5]
    Q, D = Q.requires_grad_(True), D.requires_grad_(True)
    flash_maxsim_train(Q, D).sum().backward()
    assert D.grad[0, 20].abs().max().item() == 0.0
    assert torch.equal(D.grad[0, 5], Q.detach()[0])
    assert Q.detach()[0].float().abs().max().item() > 0.1
    assert (D[0, 5] - D[0, 7]).detach().float().abs().max().item() > 0.1
