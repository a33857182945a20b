"""maxsim_from_hidden refuses bad input with a one-line error naming the argument, before any kernel runs."""

from __future__ import annotations

import pytest
import torch

from lik.ops.fused_head import maxsim_from_hidden, maxsim_from_hidden_reference
from lik.ops.fused_head import forward as forward_module

Q, H, W, B = torch.randn(2, 3, 8), torch.randn(4, 5, 12), torch.randn(8, 12), torch.randn(8)
CU = torch.tensor([0, 2, 5], dtype=torch.int32)

CASES = [
    (dict(Q=Q.numpy()), TypeError, "Q must be a torch.Tensor"),
    (dict(H=None), TypeError, "H must be a torch.Tensor"),
    (dict(Q=Q.to(torch.int32)), TypeError, "Q must have dtype"),
    (dict(H=H.half()), TypeError, "H has dtype"),
    (dict(W=W.double()), TypeError, "W has dtype"),
    (dict(b=B.half()), TypeError, "b has dtype"),
    (dict(Q=Q[0, 0]), ValueError, "Q must be"),
    (dict(W=W[None]), ValueError, "W must be"),
    (dict(W=torch.randn(7, 12)), ValueError, "W has d_out"),
    (dict(Q=torch.randn(2, 3, 300), W=torch.randn(300, 12), b=None), ValueError, "d_out must be at most 256"),
    (dict(b=torch.randn(7)), ValueError, "b must have shape"),
    (dict(H=torch.randn(4, 5, 11)), ValueError, "H must end in"),
    (dict(H=torch.randn(5, 12)), ValueError, "H must be"),
    (dict(H=torch.randn(3, 4, 5, 12)), ValueError, "H is \\[Nq, B, Ld, d_model\\] with Nq=3"),
    (dict(Q=Q[0], H=torch.randn(2, 4, 5, 12)), ValueError, "needs 3-D Q"),
    (dict(q_mask=torch.ones(2, 4, dtype=torch.bool)), ValueError, "q_mask must have shape"),
    (dict(d_mask=torch.ones(4, 6, dtype=torch.bool)), ValueError, "d_mask must have shape"),
    (dict(d_mask=torch.ones(4, 5)), TypeError, "d_mask must be a bool"),
    (dict(mask_mode="max"), ValueError, "mask_mode must be one of"),
    (dict(normalize=1), TypeError, "normalize must be a bool"),
    (dict(backward="fastest"), ValueError, "backward must be one of"),
    (dict(H=torch.randn(5, 12), cu_seqlens=CU.long()), ValueError, "cu_seqlens must be int32"),
    (dict(H=torch.randn(5, 12), cu_seqlens=CU[None]), ValueError, "cu_seqlens must be int32"),
    (dict(H=torch.randn(5, 12), cu_seqlens=CU, d_mask=torch.ones(5, dtype=torch.bool)), ValueError,
     "d_mask must be None for packed H"),
    (dict(cu_seqlens=CU), ValueError, "H with cu_seqlens must be packed"),
]


@pytest.mark.parametrize("change,error,words", CASES, ids=[c[2][:24] for c in CASES])
def test_errors_name_the_argument(monkeypatch, change, error, words):
    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel ran before the inputs were checked")

    monkeypatch.setattr(forward_module, "launch", no_launch)
    args = dict(Q=Q, H=H, W=W, b=B)
    args.update(change)
    kw = {k: args.pop(k) for k in list(args) if k not in ("Q", "H", "W", "b", "q_mask", "d_mask")}
    for fn in (maxsim_from_hidden, maxsim_from_hidden_reference):
        if fn is maxsim_from_hidden_reference and "backward" in kw:
            continue
        with pytest.raises(error, match=words) as caught:
            fn(**args, **kw)
        assert "\n" not in str(caught.value)


def test_bad_packed_offsets_are_refused_by_the_reference():
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        maxsim_from_hidden_reference(Q, torch.randn(5, 12), W, cu_seqlens=torch.tensor([0, 4, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        maxsim_from_hidden_reference(Q, torch.randn(5, 12), W, cu_seqlens=torch.tensor([0, 6], dtype=torch.int32))


def test_bad_packed_offsets_are_refused_by_the_backward():
    """The kernels clamp offsets they cannot check without a synchronisation; the backward reads them anyway."""
    H = torch.randn(5, 12, requires_grad=True)
    scores = maxsim_from_hidden(Q, H, W, cu_seqlens=torch.tensor([0, 4, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        scores.sum().backward()
