"""transformers integration: lik.MultiScaleDeformableAttention is the module of lik.integrations.transformers,
and every Deformable DETR, whenever built or loaded, runs lik in each deformable-attention layer while enable()
is in effect, and transformers' own code after disable()."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

import lik
import lik.integrations.transformers as lik_transformers
from lik.integrations import _patching

from .conftest import load_recording_modules, names_lik


def test_top_level_name_is_the_integration_class():
    assert lik.MultiScaleDeformableAttention is lik_transformers.MultiScaleDeformableAttention


def test_module_matches_reference(rng):
    shapes = torch.tensor([[4, 5], [2, 3]])
    starts = torch.tensor([0, 20])
    value = torch.randn(1, 26, 2, 4, generator=rng)
    loc = torch.rand(1, 3, 2, 2, 2, 2, generator=rng)
    weights = torch.rand(1, 3, 2, 2, 2, generator=rng).softmax(-1)
    out = lik.MultiScaleDeformableAttention()(value, shapes, [(4, 5), (2, 3)], starts, loc, weights, 64)
    torch.testing.assert_close(out, lik.ms_deform_attn_reference(value, shapes, starts, loc, weights),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="value_spatial_shapes_list"):
        lik.MultiScaleDeformableAttention()(value, shapes, [(4, 5)], starts, loc, weights)


def _tiny_detr():
    from transformers import DeformableDetrConfig, DeformableDetrModel

    config = DeformableDetrConfig(
        d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=5, num_feature_levels=2, encoder_n_points=2,
        decoder_n_points=2, use_pretrained_backbone=False, backbone="resnet18", use_timm_backbone=False,
        backbone_config={"model_type": "resnet", "depths": [1, 1, 1, 1], "hidden_sizes": [8, 8, 8, 8],
                         "embedding_size": 8, "out_features": ["stage3", "stage4"]},
    )
    torch.manual_seed(0)
    return DeformableDetrModel(config).eval()


def _attention_layers(model):
    return [m for m in model.modules() if type(m).__name__ == "MultiScaleDeformableAttention"]


def test_models_built_before_and_during_enable_run_lik_until_disable(count_calls, reference_path):
    modeling = pytest.importorskip("transformers.models.deformable_detr.modeling_deformable_detr")
    stock_class = modeling.MultiScaleDeformableAttention
    before = _tiny_detr()
    pixels = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = before(pixel_values=pixels).last_hidden_state
    calls = count_calls(lik_transformers, "ms_deform_attn")
    with lik_transformers.enabled():
        assert modeling.MultiScaleDeformableAttention is stock_class  # no class replaced: its forward switched
        during = _tiny_detr()
        layers = _attention_layers(during)
        assert layers and all(type(m) is stock_class for m in layers)
        with torch.no_grad():
            for model in (before, during):
                torch.testing.assert_close(model(pixel_values=pixels).last_hidden_state, expected,
                                           rtol=1e-4, atol=1e-4)
        assert len(calls) == 2 * len(layers)  # every deformable-attention layer of both ran lik
    calls.clear()
    with torch.no_grad():
        for model in (before, during):
            assert torch.equal(model(pixel_values=pixels).last_hidden_state, expected)
    assert calls == []  # disable() reached the model built under the switch too


def test_models_pickle_while_enabled_and_load_as_the_switch_says(count_calls, reference_path):
    pytest.importorskip("transformers.models.deformable_detr.modeling_deformable_detr")
    with lik_transformers.enabled():
        model = _tiny_detr()
        payload = pickle.dumps(model)
        saved = io.BytesIO()
        torch.save(model, saved)
    loaded, modules = load_recording_modules(payload)
    assert not names_lik(modules), sorted(modules)
    saved.seek(0)
    pixels = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = model(pixel_values=pixels).last_hidden_state
    calls = count_calls(lik_transformers, "ms_deform_attn")
    for copy in (loaded, torch.load(saved, weights_only=False)):
        with torch.no_grad():
            assert torch.equal(copy(pixel_values=pixels).last_hidden_state, expected) and calls == []
            with lik_transformers.enabled():
                torch.testing.assert_close(copy(pixel_values=pixels).last_hidden_state, expected,
                                           rtol=1e-4, atol=1e-4)
        assert len(calls) == len(_attention_layers(copy))
        calls.clear()


def test_patch_model_swaps_lik_in_for_good(count_calls, reference_path):
    pytest.importorskip("transformers.models.deformable_detr.modeling_deformable_detr")
    model = _tiny_detr()
    pixels = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = model(pixel_values=pixels).last_hidden_state
    layers = len(_attention_layers(model))
    assert lik_transformers.patch_model(model) == layers
    assert all(isinstance(m, lik_transformers.MultiScaleDeformableAttention) for m in _attention_layers(model))
    calls = count_calls(lik_transformers, "ms_deform_attn")
    with torch.no_grad():
        torch.testing.assert_close(model(pixel_values=pixels).last_hidden_state, expected, rtol=1e-4, atol=1e-4)
    assert len(calls) == layers


@pytest.mark.parametrize("short", ["grounding_dino", "rt_detr", "mm_grounding_dino", "omdet_turbo"])
def test_enable_covers_the_family(short):
    modeling = pytest.importorskip(f"transformers.models.{short}.modeling_{short}")
    stock = modeling.MultiScaleDeformableAttention
    with lik_transformers.enabled():
        assert modeling.MultiScaleDeformableAttention is stock and _patching.is_routed(stock.forward)
    assert not _patching.is_routed(stock.forward)
