"""Bad input raises before any kernel runs, naming the argument; the reference honours its memory budget."""

from __future__ import annotations

import pytest
import torch

import lik
from lik.ops.maxsim.reference import maxsim_reference

Q = torch.randn(2, 4, 8)
D = torch.randn(3, 5, 8)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(Q=torch.randn(8)), ValueError, "Q must be"),
        (dict(Q=torch.randn(1, 2, 4, 8)), ValueError, "Q must be"),
        (dict(D=torch.randn(5, 8)), ValueError, "D must be"),
        (dict(D=torch.randn(3, 5, 7)), ValueError, "embedding dim"),
        (dict(D=torch.randn(4, 3, 5, 8)), ValueError, "Nq=4"),
        (dict(Q=torch.randn(4, 8), D=torch.randn(1, 3, 5, 8)), ValueError, "3-D Q"),
        (dict(D=D.half()), TypeError, "one dtype"),
        (dict(Q=Q.long(), D=D.long()), TypeError, "Q must have dtype"),
        (dict(Q=[1.0]), TypeError, "Q must be a torch.Tensor"),
        (dict(q_mask=torch.ones(2, 5, dtype=torch.bool)), ValueError, "q_mask must have shape"),
        (dict(d_mask=torch.ones(3, 4, dtype=torch.bool)), ValueError, "d_mask must have shape"),
        (dict(d_mask=torch.ones(3, 5)), TypeError, "d_mask must be a bool"),
        (dict(mask_mode="ignore"), ValueError, "mask_mode"),
        (dict(backward="sometimes"), ValueError, "backward"),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, match):
    args = dict(Q=Q, D=D, q_mask=None, d_mask=None)
    options = {k: kwargs.pop(k) for k in ("mask_mode", "backward") if k in kwargs}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        lik.maxsim(args["Q"], args["D"], args["q_mask"], args["d_mask"], **options)


def test_device_mismatch_is_reported():
    meta_d = torch.empty(3, 5, 8, device="meta")
    with pytest.raises(ValueError, match="D is on meta"):
        lik.maxsim(Q, meta_d)


def test_mask_on_other_device_is_reported():
    with pytest.raises(ValueError, match="q_mask is on meta"):
        lik.maxsim(Q, D, torch.empty(2, 4, dtype=torch.bool, device="meta"))


@pytest.mark.parametrize("budget", [1, 4096, 1 << 30])
def test_reference_budget_does_not_change_results(rng, budget):
    Qr = torch.randn(3, 6, 16, generator=rng, dtype=torch.float64)
    Dr = torch.randn(9, 7, 16, generator=rng, dtype=torch.float64)
    dm = torch.rand(9, 7, generator=rng) > 0.3
    full = maxsim_reference(Qr, Dr, None, dm, budget_bytes=1 << 30)
    # Chunks of another size may take another BLAS blocking (and summation order) for the same products: equal to
    # float64 rounding, not bitwise (torch 2.13's CPU einsum differs in the last bits between batch sizes).
    torch.testing.assert_close(maxsim_reference(Qr, Dr, None, dm, budget_bytes=budget), full, rtol=1e-14, atol=1e-13)


def test_reference_never_holds_more_than_its_budget(monkeypatch):
    """The similarity chunks are sized by the budget: count the largest einsum output."""
    largest = []
    real_einsum = torch.einsum

    def spy(eq, *ops):
        out = real_einsum(eq, *ops)
        largest.append(out.numel() * out.element_size())
        return out

    monkeypatch.setattr(torch, "einsum", spy)
    Qr = torch.randn(4, 32, 16)
    Dr = torch.randn(100, 64, 16)
    budget = 4 * 32 * 64 * 4 * 10  # ten documents' similarities
    maxsim_reference(Qr, Dr, budget_bytes=budget)
    assert max(largest) <= budget
    assert len(largest) == 10
