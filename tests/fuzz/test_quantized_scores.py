"""Fuzz the 8-bit scorers: ``lik.maxsim`` and ``lik.maxsim_packed`` of an int8 / float8 corpus (with its
``d_scale``) equal the float64 MaxSim of the dequantized operands, for an 8-bit query with its ``q_scale`` and for a
float query (quantized per token by the brute force of ``test_quantize``), with masks, garbage in masked values and
scales, both mask modes, sizes from 0 and non-contiguous views; int8 on the kernels (interpreter) and the
reference, float8 on the reference (the CPU float8 path)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lik

from .common import LAYOUTS, PATHS, as_view, assert_matches, brute_maxsim, draw_mask, fuzz_settings, run_on
from .test_quantize import brute_quantize


@dataclass(frozen=True)
class QuantizedCase:
    scorer: str  # "maxsim" or "maxsim_packed"
    query_3d: bool
    n_q: int
    l_q: int
    n_docs: int
    l_d: int
    dim: int
    dtype: torch.dtype
    float_query: bool  # a float Q, quantized by the scorer
    masks: bool
    density: float
    garbage: bool
    mask_mode: str
    layouts: tuple[str, str]
    seed: int


@st.composite
def quantized_cases(draw):
    query_3d = draw(st.booleans())
    scorer = draw(st.sampled_from(["maxsim", "maxsim_packed"]))
    return QuantizedCase(
        scorer=scorer,
        query_3d=query_3d,
        n_q=draw(st.integers(0, 3)) if query_3d else 1,
        l_q=draw(st.integers(0, 5)),
        n_docs=draw(st.integers(0, 4)),
        l_d=draw(st.integers(0, 12)),
        dim=draw(st.sampled_from([1, 3, 8, 17, 32, 33])),
        dtype=draw(st.sampled_from([torch.int8, torch.float8_e4m3fn])),
        float_query=draw(st.booleans()),
        masks=draw(st.booleans()),
        density=draw(st.sampled_from([0.0, 0.5, 1.0])),
        garbage=draw(st.booleans()),
        mask_mode="exclude" if scorer == "maxsim_packed" else draw(st.sampled_from(["exclude", "zero"])),
        layouts=tuple(draw(st.sampled_from(LAYOUTS)) for _ in range(2)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _as_8bit(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return values.to(torch.int8) if dtype == torch.int8 else values.float().to(dtype)


@pytest.mark.parametrize("path", PATHS)
@fuzz_settings(1.0)
@given(case=quantized_cases())
def test_8bit_scores_are_maxsim_of_the_dequantized_operands(path, case):
    gen = torch.Generator().manual_seed(case.seed)
    Qf = torch.randn(case.n_q, case.l_q, case.dim, generator=gen, dtype=torch.float64)
    Df = torch.randn(1, case.n_docs, case.l_d, case.dim, generator=gen, dtype=torch.float64)
    Df[:, :, 1::3] = Df[:, :, ::3][:, :, : Df[:, :, 1::3].shape[2]]  # duplicated tokens: exact ties
    d_values, d_scale = brute_quantize(Df.float(), case.dtype)
    qm = draw_mask(gen, Qf.shape[:-1], case.density) if case.masks else torch.ones(Qf.shape[:-1], dtype=torch.bool)
    dm = draw_mask(gen, Df.shape[:-1], case.density) if case.masks else torch.ones(Df.shape[:-1], dtype=torch.bool)
    if case.scorer == "maxsim_packed":
        dm = torch.ones_like(dm)  # a packed corpus has no padding
    q_values, q_scale = brute_quantize(Qf.float(), case.dtype)
    if case.garbage:  # masked values anything 8-bit, masked scales NaN / inf
        d_values = torch.where(dm[..., None], d_values, 100.0)
        q_values = torch.where(qm[..., None], q_values, -100.0)
        d_scale = torch.where(dm, d_scale, float("nan"))
        q_scale = torch.where(qm, q_scale, float("inf"))
        Qf = torch.where(qm[..., None], Qf, float("nan"))
    Q = Qf.float() if case.float_query else _as_8bit(q_values, case.dtype)

    squeeze = (lambda t: t) if case.query_3d else (lambda t: t[0])
    call = dict(Q=as_view(squeeze(Q), case.layouts[0]),
                q_mask=squeeze(qm) if case.masks else None)
    if not case.float_query:
        call["q_scale"] = squeeze(q_scale).float()
    D8 = _as_8bit(d_values[0], case.dtype)
    with run_on(path):
        if case.scorer == "maxsim":
            scores = lik.maxsim(**call, D=as_view(D8, case.layouts[1]), d_mask=dm[0] if case.masks else None,
                                d_scale=d_scale[0].float(), mask_mode=case.mask_mode)
        else:
            cu = torch.arange(case.n_docs + 1, dtype=torch.int32) * case.l_d
            scores = lik.maxsim_packed(**call, d=as_view(D8.reshape(-1, case.dim), case.layouts[1]),
                                       cu_seqlens_d=cu, d_scale=d_scale[0].reshape(-1).float())

    # The brute force of the dequantized operands (a masked row's garbage never enters: pair_score zeroes it).
    q_deq = torch.where(qm[..., None], q_values * q_scale[..., None], 0)
    d_deq = torch.where(dm[..., None], d_values * d_scale[..., None], 0)
    expected, _ = brute_maxsim(q_deq, d_deq, qm, dm, case.mask_mode)
    assert scores.dtype == torch.float32
    # fp32 similarities scaled in fp32: each rounding is relative to the query row's largest term.
    assert_matches(scores, squeeze(expected), "scores", exact=False, rtol=1e-5 * max(1, case.l_q))
