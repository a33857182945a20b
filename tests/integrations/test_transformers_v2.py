"""transformers integration, RT-DETRv2 / D-FINE: while enable() is in effect, every RT-DETRv2 and D-FINE model (built
before or after the switch) runs lik.ms_deform_attn_v2 in each decoder attention layer, with transformers' outputs
and gradients, for both sampling methods and per-level point counts; disable() returns them to transformers' code."""

from __future__ import annotations

import pytest
import torch

import lik.integrations.transformers as lik_transformers
from lik.integrations import _patching

transformers = pytest.importorskip("transformers")

_BACKBONE = {"model_type": "rt_detr_resnet", "embedding_size": 8, "hidden_sizes": [8, 16, 24, 32],
             "depths": [1, 1, 1, 1], "layer_type": "basic", "out_features": ["stage2", "stage3", "stage4"]}
_COMMON = dict(backbone_config=_BACKBONE, encoder_in_channels=[16, 24, 32], encoder_hidden_dim=32, d_model=32,
               encoder_ffn_dim=32, decoder_ffn_dim=32, encoder_attention_heads=2, decoder_attention_heads=2,
               decoder_layers=2, num_queries=6, decoder_in_channels=[32, 32, 32], num_denoising=0, num_labels=3)


def _tiny(family: str, method: str):
    """A tiny RT-DETRv2 (2 points per level) or D-FINE (3, 6, 3 points) with a small ResNet; no download."""
    if family == "rt_detr_v2":
        config = transformers.RTDetrV2Config(decoder_n_points=2, decoder_method=method, **_COMMON)
        model_class = transformers.RTDetrV2Model
    else:
        config = transformers.DFineConfig(decoder_n_points=[3, 6, 3], decoder_method=method, lqe_hidden_dim=8,
                                          **_COMMON)
        model_class = transformers.DFineModel
    torch.manual_seed(0)
    return model_class(config).eval()


def _run(model, pixels, probe):
    """The decoder's output and the gradient of a fixed projection of it with respect to every parameter (a
    parameter the output does not reach, such as the sampling offsets of a discrete layer, gets zeros)."""
    model.zero_grad(set_to_none=True)
    out = model(pixel_values=pixels).last_hidden_state
    (out * probe).sum().backward()
    grads = {name: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
             for name, p in model.named_parameters()}
    return out.detach(), grads


def _check(family, method, count_calls, dtype, tol, names=""):
    """Outputs and gradients (of the parameters whose names contain ``names``) with lik on, against the stock model,
    within ``tol`` of their largest element: in fp32 the encoder's gradients of these random tiny models are
    rounding noise (some true gradients are 0, as for attention key biases), so the full comparison is float64."""
    pytest.importorskip(f"transformers.models.{family}.modeling_{family}")
    before = _tiny(family, method).to(dtype)
    gen = torch.Generator().manual_seed(3)
    pixels = torch.randn(1, 3, 64, 64, generator=gen).to(dtype)
    probe = torch.randn(1, 6, 32, generator=gen).to(dtype)
    want_out, want_grads = _run(before, pixels, probe)
    want_grads = {k: g for k, g in want_grads.items() if names in k}
    scale = max(g.abs().max().item() for g in want_grads.values())
    assert scale > 0
    calls = count_calls(lik_transformers, "ms_deform_attn_v2")
    with lik_transformers.enabled():
        during = _tiny(family, method).to(dtype)
        for model in (before, during):
            got_out, got_grads = _run(model, pixels, probe)
            torch.testing.assert_close(got_out, want_out, rtol=tol, atol=tol)
            for name, grad in want_grads.items():
                torch.testing.assert_close(got_grads[name], grad, rtol=0, atol=tol * scale, msg=name)
        assert len(calls) == 2 * 2  # two decoder layers, each of both models
    calls.clear()
    got_out, _ = _run(during, pixels, probe)
    assert torch.equal(got_out, want_out) and calls == []


@pytest.mark.parametrize("method", ["default", "discrete"])
@pytest.mark.parametrize("family", ["rt_detr_v2", "d_fine"])
def test_models_run_lik_reference_path_until_disable(family, method, count_calls):
    """float64 models: lik's reference (float64 runs it, kernels or not) against transformers'. Every gradient of
    RT-DETRv2; D-FINE's decoder only: its random tiny encoder amplifies the value gradient's float64 rounding
    (lik sums level by level, transformers over all points at once) to 1e-3 of the largest gradient."""
    _check(family, method, count_calls, torch.float64, 1e-10, names="" if family == "rt_detr_v2" else "decoder.")


@pytest.mark.parametrize("method", ["default", "discrete"])
def test_d_fine_runs_lik_kernels(method, count_calls):
    """fp32 through lik's kernels (Triton's interpreter on the CPU): the output and the gradients of the
    deformable layers' own parameters, to fp32 rounding."""
    _check("d_fine", method, count_calls, torch.float32, 1e-4, names="encoder_attn")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["default", "discrete"])
def test_rt_detr_v2_runs_lik_kernels(method, count_calls):
    _check("rt_detr_v2", method, count_calls, torch.float32, 1e-4, names="encoder_attn")


@pytest.mark.parametrize("short", ["rt_detr_v2", "d_fine", "deimv2"])
def test_enable_routes_the_v2_function(short):
    modeling = pytest.importorskip(f"transformers.models.{short}.modeling_{short}")
    stock = modeling.multi_scale_deformable_attention_v2
    with lik_transformers.enabled():
        assert modeling.multi_scale_deformable_attention_v2 is stock and _patching.is_routed(stock)
    assert not _patching.is_routed(stock)


def test_levels_as_a_tensor_or_ints_give_one_result(rng):
    """transformers passes the levels as Python (H, W) pairs; a tensor of them works the same."""
    modeling = pytest.importorskip("transformers.models.d_fine.modeling_d_fine")
    hw = [(5, 7), (3, 4)]
    value = torch.randn(2, 47, 2, 4, generator=rng)
    loc = torch.rand(2, 3, 2, 5, 2, generator=rng)
    weights = torch.rand(2, 3, 2, 5, generator=rng)
    want = modeling.multi_scale_deformable_attention_v2(value, hw, loc, weights, [2, 3], "discrete")
    with lik_transformers.enabled():
        for levels in (hw, torch.tensor(hw)):
            got = modeling.multi_scale_deformable_attention_v2(value, levels, loc, weights, [2, 3], "discrete")
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
