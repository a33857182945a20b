"""transformers integration: lik.MultiScaleDeformableAttention is the module of lik.integrations.transformers,
and a Deformable DETR built after enable() calls lik in every deformable-attention layer."""

from __future__ import annotations

import pytest
import torch

import lik
import lik.integrations.transformers as lik_transformers


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


def test_models_built_after_enable_call_lik(monkeypatch):
    modeling = pytest.importorskip("transformers.models.deformable_detr.modeling_deformable_detr")
    stock_class = modeling.MultiScaleDeformableAttention
    stock_model = _tiny_detr()
    pixels = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = stock_model(pixel_values=pixels).last_hidden_state
    calls = []
    real_forward = lik_transformers.MultiScaleDeformableAttention.forward
    monkeypatch.setattr(lik_transformers.MultiScaleDeformableAttention, "forward",
                        lambda self, *a, **k: calls.append(1) or real_forward(self, *a, **k))
    with lik_transformers.enabled():
        model = _tiny_detr()
    assert modeling.MultiScaleDeformableAttention is stock_class  # restored
    attns = [m for m in model.modules() if type(m).__name__ == "MultiScaleDeformableAttention"]
    assert attns and all(isinstance(m, lik_transformers.MultiScaleDeformableAttention) for m in attns)
    with torch.no_grad():
        got = model(pixel_values=pixels).last_hidden_state
    assert len(calls) == len(attns)  # every deformable-attention layer ran lik, once per forward
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert lik_transformers.patch_model(stock_model) == len(attns)


@pytest.mark.parametrize("short", ["grounding_dino", "rt_detr", "mm_grounding_dino", "omdet_turbo"])
def test_enable_covers_the_family(short):
    modeling = pytest.importorskip(f"transformers.models.{short}.modeling_{short}")
    stock = modeling.MultiScaleDeformableAttention
    with lik_transformers.enabled():
        assert modeling.MultiScaleDeformableAttention is lik_transformers.MultiScaleDeformableAttention
    assert modeling.MultiScaleDeformableAttention is stock
