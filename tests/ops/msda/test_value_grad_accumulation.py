"""The value gradient's accumulation for fp16 / bf16 values: fp32 by default (an fp32 buffer cast once), atomics in
the value's own dtype only when opted in (``lik.config.msda.set_value_grad_accumulation("input")``), within the
documented error; fp32 values and the deterministic backward never change."""

from __future__ import annotations

import pytest
import torch

import lik.ops.msda.backward as backward_module
from lik.config import msda as msda_config
from lik.ops.msda import ms_deform_attn

from .helpers import rand_problem, reference64, rel_err, with_grads


@pytest.fixture
def buffer_dtypes(monkeypatch):
    """The dtype of the value-gradient buffer each atomic backward launch scatters into."""
    seen = []
    real = backward_module.launch

    def spy(kernel, grid, *args, **kwargs):
        if kernel is backward_module.msda_bwd_kernel and kwargs.get("ATOMIC_VALUE"):
            seen.append(args[8].dtype)  # value, shapes, starts, points, cells, loc, attn, grad_out, gvalue, ...
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(backward_module, "launch", spy)
    return seen


def _contended(rng, dtype):
    """64 samples per pixel neighbourhood: the value gradient of those pixels is a sum of many terms."""
    value, shapes, starts, loc, weights, grad = rand_problem(rng, 1, 16, 2, 8, [(4, 8), (3, 3)], 4)
    loc[..., 0, :, :] = torch.tensor([0.4, 0.6])
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in (value, shapes, starts, loc, weights, grad))


def test_default_accumulates_half_values_in_float32(rng, buffer_dtypes):
    assert msda_config.value_grad_accumulation() == "float32"
    problem = _contended(rng, torch.float16)
    got = with_grads(ms_deform_attn, *problem)
    assert buffer_dtypes == [torch.float32] and got[1].dtype == torch.float16
    # fp32 accumulation, one rounding to fp16 at the end: the value gradient is within fp16's half ulp.
    assert rel_err(got[1], reference64(*problem)[1]) <= 2 ** -11


def test_input_accumulation_is_opt_in_with_its_documented_error(rng, buffer_dtypes):
    problem = _contended(rng, torch.float16)
    ref = reference64(*problem)
    with msda_config.accumulate_value_grad_in("input"):
        assert msda_config.value_grad_accumulation() == "input"
        got = with_grads(ms_deform_attn, *problem)
    assert msda_config.value_grad_accumulation() == "float32"
    assert buffer_dtypes == [torch.float16] and got[1].dtype == torch.float16
    # Rounding after each of up to k = 64 adds: about sqrt(k) * 2**-12 relative (documented), under 8x that bound.
    err = rel_err(got[1], ref[1])
    assert err <= 8 * 2 ** -12, err
    for g, r in zip((got[0], got[2], got[3]), (ref[0], ref[2], ref[3])):  # the other results do not change
        assert rel_err(g, r) <= 2e-3


def test_input_accumulation_leaves_float32_and_deterministic_alone(rng, buffer_dtypes):
    problem = rand_problem(rng, 2, 5, 2, 8, [(3, 4), (2, 2)], 3)
    with msda_config.accumulate_value_grad_in("input"):
        got = with_grads(ms_deform_attn, *problem)
        saved = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            half = tuple(t.half() if t.is_floating_point() else t for t in problem)
            det = with_grads(ms_deform_attn, *half)
        finally:
            torch.use_deterministic_algorithms(saved)
    assert buffer_dtypes == [torch.float32]  # the fp32 call; the deterministic one launches no atomics
    assert rel_err(got[1], reference64(*problem)[1]) <= 2e-5
    assert rel_err(det[1], reference64(*half)[1]) <= 2 ** -11


def test_bad_mode_names_the_argument():
    with pytest.raises(ValueError, match="mode"):
        msda_config.set_value_grad_accumulation("bfloat16")
    with pytest.raises(ValueError, match="mode"):
        with msda_config.accumulate_value_grad_in("half"):
            pass
    assert msda_config.value_grad_accumulation() == "float32"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, bound", [(torch.bfloat16, 2 ** -8), (torch.float16, 2 ** -11)])  # half an ulp
def test_gpu_input_accumulation_error(rng, dtype, bound):
    """Decoder-like problem on the GPU: fp32 accumulation within half an ulp of the dtype; the opt-in within 16 ulps
    (sqrt(k) ulps with k, the samples on one pixel, in the tens here)."""
    value, shapes, starts, loc, weights, grad = rand_problem(rng, 2, 300, 8, 32, [(50, 84), (25, 42), (13, 21)], 4,
                                                             dtype=dtype, device="cuda")
    problem = (value, shapes, starts, loc, weights, grad)
    ref = reference64(*problem)[1]
    default = with_grads(ms_deform_attn, *problem)[1]
    with msda_config.accumulate_value_grad_in("input"):
        opted = with_grads(ms_deform_attn, *problem)[1]
    assert rel_err(default, ref) <= bound
    assert rel_err(opted, ref) <= 16 * bound
