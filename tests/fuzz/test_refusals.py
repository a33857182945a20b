"""Fuzz the refusal of complex tensors: whichever float argument of whichever op is complex, the call raises
``TypeError`` naming that argument before any kernel runs, on the kernels (interpreter) and the reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lik

from .common import PATHS, fuzz_settings, run_on


def _calls(shape_q, shape_d, dim):
    """``{(op, argument): make(tensor maker) -> call}``: every float argument of every public op."""
    cu = torch.tensor([0, shape_d[1]], dtype=torch.int32)
    cu_q = torch.tensor([0, shape_q[1]], dtype=torch.int32)
    shapes, starts = torch.tensor([[2, 2]]), torch.tensor([0])
    return {
        ("maxsim", "Q"): lambda t: lik.maxsim(t(shape_q), t(shape_d, real=True)),
        ("maxsim", "D"): lambda t: lik.maxsim(t(shape_q, real=True), t(shape_d)),
        ("maxsim_packed", "Q"): lambda t: lik.maxsim_packed(t(shape_q), t(shape_d[1:], real=True), cu),
        ("maxsim_packed", "d"): lambda t: lik.maxsim_packed(t(shape_q, real=True), t(shape_d[1:]), cu),
        ("maxsim_varlen", "q"): lambda t: lik.maxsim_varlen(t(shape_q[1:]), t(shape_d[1:], real=True), cu_q, cu),
        ("maxsim_varlen", "d"): lambda t: lik.maxsim_varlen(t(shape_q[1:], real=True), t(shape_d[1:]), cu_q, cu),
        ("search", "Q"): lambda t: lik.search(t(shape_q), t(shape_d, real=True), 1),
        ("search", "D"): lambda t: lik.search(t(shape_q, real=True), t(shape_d), 1),
        ("quantize", "x"): lambda t: lik.quantize(t(shape_d)),
        ("chamfer_distance", "x"): lambda t: lik.chamfer_distance(t(shape_q), t(shape_q, real=True)),
        ("chamfer_distance", "y"): lambda t: lik.chamfer_distance(t(shape_q, real=True), t(shape_q)),
        ("nearest_neighbors", "x"): lambda t: lik.nearest_neighbors(t(shape_q), t(shape_q, real=True)),
        ("ms_deform_attn", "value"): lambda t: lik.ms_deform_attn(
            t((1, 4, 1, dim)), shapes, starts, t((1, 2, 1, 1, 1, 2), real=True), t((1, 2, 1, 1, 1), real=True)),
        ("ms_deform_attn", "sampling_locations"): lambda t: lik.ms_deform_attn(
            t((1, 4, 1, dim), real=True), shapes, starts, t((1, 2, 1, 1, 1, 2)), t((1, 2, 1, 1, 1), real=True)),
        ("ms_deform_attn", "attention_weights"): lambda t: lik.ms_deform_attn(
            t((1, 4, 1, dim), real=True), shapes, starts, t((1, 2, 1, 1, 1, 2), real=True), t((1, 2, 1, 1, 1))),
    }


CALLS = sorted(_calls((1, 1, 1), (1, 1, 1, 1), 1))


@pytest.mark.parametrize("path", PATHS)
@fuzz_settings(2.0)
@given(
    target=st.sampled_from(CALLS),
    dtype=st.sampled_from([torch.complex64, torch.complex128]),
    n=st.integers(1, 2), lq=st.integers(1, 3), b=st.integers(1, 2), ld=st.integers(1, 3), dim=st.integers(1, 9),
)
def test_complex_tensors_are_refused_by_name(path, target, dtype, n, lq, b, ld, dim):
    def make(shape, real=False):
        return torch.randn(shape, dtype=torch.float32 if real else dtype)

    call = _calls((n, lq, dim), (b, ld, dim), dim)[target]
    op, argument = target
    with run_on(path), pytest.raises(TypeError, match=rf"^{argument}\b"):
        call(make)
