"""Every launch of lik.maxsim_from_hidden's forward compiles for Hopper (sm_90) on a CPU-only machine, within the
shared memory of an H100 / H200 and without spilling registers (the projected tile's fp32 accumulator lives in
registers): launches are recorded under the GPU heuristic with ``tests/test_compile_sm90.py``'s recorder and each
variant is compiled to a cubin (the interpreter accepts code the real compiler rejects)."""

from __future__ import annotations

import pytest
import torch

from lik import _config
from lik.ops.fused_head import forward as forward_module
from lik.ops.fused_head.forward import fused_head_forward
from lik.ops.fused_head.validation import FusedHeadInputs
from tests.test_compile_sm90 import _record_launches, compile_for_sm90


def _workload():
    """fp16 with masks, bias and winners (training), one fp16 query (32-row blocks), fp16 inference at d_out 256,
    bf16 packed, fp32 per query."""
    gen = torch.Generator().manual_seed(3)

    def run(dtype, d_out, *, masks=False, bias=True, per_query=False, packed=False, argmax=False, n_q=4):
        Q = torch.randn(n_q, 32, d_out, generator=gen).to(dtype)
        H = torch.randn(*((n_q,) if per_query else ()), 6, 40, 768, generator=gen).to(dtype)
        W = torch.randn(d_out, 768, generator=gen).to(dtype)
        b = torch.randn(d_out, generator=gen).to(dtype) if bias else None
        q_mask = torch.ones(n_q, 32, dtype=torch.bool) if masks else None
        d_mask = torch.ones(H.shape[:-1], dtype=torch.bool) if masks else None
        cu = None
        if packed:
            H, cu = H.reshape(-1, 768), torch.arange(0, 241, 40, dtype=torch.int32)
        inputs = FusedHeadInputs.build(Q, H, W, b, q_mask, d_mask, cu_seqlens=cu)
        fused_head_forward(inputs, argmax)

    run(torch.float16, 128, masks=True, argmax=True)
    run(torch.float16, 128, n_q=1)  # 32-row blocks
    run(torch.float16, 256, bias=False)
    run(torch.bfloat16, 128, packed=True)
    run(torch.float32, 96, masks=True, per_query=True, argmax=True)


def test_every_fused_head_launch_compiles_for_sm90_without_spilling(monkeypatch):
    if not _config.interpreting():
        pytest.skip("records launches through Triton's interpreter (TRITON_INTERPRET=1)")
    monkeypatch.setattr(forward_module, "interpreting", lambda: False)
    launches = _record_launches(monkeypatch, _workload)
    assert len(launches) == 5
    built = compile_for_sm90(launches)
    spilled = [(b["constants"], b["stack"]) for b in built if b["stack"]]
    assert not spilled, spilled
