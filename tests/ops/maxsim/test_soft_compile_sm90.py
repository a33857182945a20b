"""The soft reductions' kernels and the int8-stored ``D``'s dQ gather compile for Hopper (sm_90) on a CPU-only
machine: the launches of a training workload are recorded under the interpreter with the GPU heuristics and each
distinct one is compiled to a cubin with Triton's own toolchain (the harness of tests/test_compile_sm90.py)."""

from __future__ import annotations

import json

import pytest
import torch

import lik
from lik import _config, _device
from ...test_compile_sm90 import _describe, _record_launches, compile_for_sm90
from .helpers import rand_problem


def _workload():
    gen = torch.Generator().manual_seed(0)
    options = [dict(reduction="smooth", tau=0.1), dict(reduction="topk", top_k=4), dict(reduction="topk", top_k=16)]
    for dtype, dim in ((torch.float16, 128), (torch.float32, 128), (torch.bfloat16, 96), (torch.float16, 1000)):
        for kw in options:
            Q = torch.randn(4, 32, dim, generator=gen).to(dtype).requires_grad_()
            D = torch.randn(5, 70, dim, generator=gen).to(dtype).requires_grad_()
            q_mask = torch.rand(4, 32, generator=gen) > 0.2
            d_mask = torch.rand(5, 70, generator=gen) > 0.2
            lik.maxsim(Q, D, q_mask, d_mask, normalize_by="query_tokens", **kw).sum().backward()
            lik.maxsim(Q, D, mask_mode="zero", **kw).sum().backward()
            if kw["reduction"] == "topk":  # (top-k's products form of dD)
                lik.maxsim(Q, D, q_mask, d_mask, backward="deterministic", **kw).sum().backward()
        q = torch.randn(39, dim, generator=gen).to(dtype).requires_grad_()
        d = torch.randn(110, dim, generator=gen).to(dtype).requires_grad_()
        cu_q = torch.tensor([0, 5, 38, 39], dtype=torch.int32)
        cu_d = torch.tensor([0, 40, 40, 110], dtype=torch.int32)
        lik.maxsim_varlen(q, d, cu_q, cu_d, 33, 70, **options[0]).sum().backward()
        lik.maxsim_packed(Q.detach().requires_grad_(), d, cu_d, max_seqlen_d=70, **options[1]).sum().backward()
    Q = torch.randn(4, 32, 128, generator=gen).half().requires_grad_()
    D = torch.randn(5, 70, 128, generator=gen).half().requires_grad_()
    lik.maxsim(Q, D.clone(), save_d_as=torch.int8).sum().backward()


# (about 76 distinct launches: minutes of compilation on a cold Triton cache)
@pytest.mark.slow
def test_soft_and_stored_launches_compile_for_sm90(monkeypatch):
    if not _config.interpreting():
        pytest.skip("records launches through Triton's interpreter (TRITON_INTERPRET=1)")
    launches = _record_launches(monkeypatch, _workload)
    names = {fn.__name__ for fn, _, _ in launches}
    assert {"soft_fwd_kernel", "soft_bwd_dq_kernel", "soft_bwd_dd_kernel", "maxsim_bwd_dq_kernel"} <= names
    compile_for_sm90(launches, timeout=1500)


@pytest.mark.parametrize("reduction,kw", [("smooth", {"tau": 0.1}), ("topk", {"top_k": 4})])
def test_one_compiled_variant_across_batches_and_lengths(monkeypatch, reduction, kw):
    """What the GPU test counts in Triton's cache, offline: the signature, constants and 16-byte alignment Triton
    would compile each launch with are the same for every batch size and length (Lq within its bucket, 17..32),
    one document (a single dQ range) and a one-token document included."""
    if not _config.interpreting():
        pytest.skip("records launches through Triton's interpreter (TRITON_INTERPRET=1)")

    def workload():
        for n_q, l_q, n_docs, l_d in [(16, 32, 16, 180), (3, 29, 17, 301), (40, 17, 100, 64), (1, 20, 1, 1)]:
            Q, D, q_mask, d_mask = rand_problem(
                torch.Generator().manual_seed(2), n_q, l_q, n_docs, l_d, 128, dtype=torch.float16
            )
            Q, D = Q.requires_grad_(), D.requires_grad_()
            lik.maxsim(Q, D, q_mask, d_mask, reduction=reduction, **kw).sum().backward()

    with pytest.MonkeyPatch.context() as device:  # an H200's 132 SMs: the dQ launch splits its documents
        device.setattr(_device, "sm_count", lambda _: 132)
        launches = _record_launches(monkeypatch, workload)
    variants = {}
    for fn, args, kwargs in launches:
        variants.setdefault(fn.__name__, set()).add(json.dumps(_describe(fn, args, kwargs), sort_keys=True))
    want = {"soft_fwd_kernel": 1, "soft_bwd_dq_kernel": 1, "soft_bwd_dd_kernel": 1}
    if reduction == "topk":  # (its dD: atomics from the dQ launch outside backward="deterministic")
        del want["soft_bwd_dd_kernel"]
    assert {name: len(v) for name, v in variants.items()} == want
