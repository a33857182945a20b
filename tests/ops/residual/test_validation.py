"""lik.maxsim_residual refuses bad input by name, before any kernel runs."""

from __future__ import annotations

import pytest
import torch

from lik.ops.residual import maxsim_residual

from .helpers import make_codec, make_corpus


@pytest.fixture
def case():
    codec = make_codec(16, 2)
    codes, residuals, cu = make_corpus(codec, [3, 4])
    return torch.randn(2, 3, 16), codes, residuals, codec, cu


@pytest.mark.parametrize(
    ("change", "error", "name"),
    [
        (lambda a: {**a, "codes": a["codes"].to(torch.int16)}, TypeError, "codes"),
        (lambda a: {**a, "codes": a["codes"][:, None]}, ValueError, "codes"),
        (lambda a: {**a, "residuals": a["residuals"].to(torch.int32)}, TypeError, "residuals"),
        (lambda a: {**a, "residuals": a["residuals"][:, :3]}, ValueError, "residuals"),
        (lambda a: {**a, "Q": a["Q"][..., :12]}, ValueError, "multiple of 8"),
        (lambda a: {**a, "Q": torch.randn(2, 3, 24)}, ValueError, "codec's d"),
        (lambda a: {**a, "Q": a["Q"].to(torch.int32)}, TypeError, "Q"),
        (lambda a: {**a, "cu_seqlens": a["cu_seqlens"].float()}, TypeError, "cu_seqlens"),
        (lambda a: {**a, "cu_seqlens": torch.tensor([0, 5, 4, 7], dtype=torch.int32)}, ValueError, "cu_seqlens"),
        (lambda a: {**a, "cu_seqlens": torch.tensor([0, 3], dtype=torch.int32)}, ValueError, "cu_seqlens"),
        (lambda a: {**a, "codes": a["codes"] + 100}, ValueError, "codes"),
        (lambda a: {**a, "q_mask": torch.ones(2, 3)}, TypeError, "q_mask"),
        (lambda a: {**a, "q_mask": torch.ones(2, 4, dtype=torch.bool)}, ValueError, "q_mask"),
        (lambda a: {**a, "codec": "plaid"}, TypeError, "codec"),
    ],
)
def test_refused_by_name(case, change, error, name):
    Q, codes, residuals, codec, cu = case
    args = change({"Q": Q, "codes": codes, "residuals": residuals, "codec": codec, "cu_seqlens": cu, "q_mask": None})
    with pytest.raises(error, match=name):
        maxsim_residual(
            args["Q"], args["codes"], args["residuals"], args["codec"], args["cu_seqlens"], q_mask=args["q_mask"]
        )
