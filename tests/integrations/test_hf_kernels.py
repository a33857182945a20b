"""Hugging Face ``kernels`` integration: transformers' Deformable DETR layers pick lik's layer by kernel mapping
(``kernels.kernelize``), from lik's repository object or from a local kernel repository directory, offline, with
no patching of transformers' code; outputs and gradients match the stock model."""

from __future__ import annotations

import pytest
import torch

import lik
import lik.integrations.transformers as lik_transformers
from lik.integrations import hf_kernels

kernels = pytest.importorskip("kernels")
modeling = pytest.importorskip("transformers.models.deformable_detr.modeling_deformable_detr")


@pytest.fixture
def marked_layers(monkeypatch):
    """transformers' layer class as transformers marks it when a ``kernels`` version it supports is installed
    (``@use_kernel_forward_from_hub("MultiScaleDeformableAttention")``, through kernels' own function); marked
    here when the installed ``kernels`` is outside transformers' supported range, and unmarked afterwards."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    stock = modeling.MultiScaleDeformableAttention
    if getattr(stock, "kernel_layer_name", None) != hf_kernels.LAYER_NAME:
        for name in ("kernel_layer_name", "kernel_condition"):
            monkeypatch.setattr(stock, name, None, raising=False)
        kernels.replace_kernel_forward_from_hub(stock, hf_kernels.LAYER_NAME)
    return stock


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
    return DeformableDetrModel(config)


def _layers(model):
    return [m for m in model.modules() if type(m).__name__ == "MultiScaleDeformableAttention"]


def _run(model, pixels):
    model.zero_grad(set_to_none=True)
    out = model(pixel_values=pixels).last_hidden_state
    out.square().sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_kernelized(repository, count_calls, mode, tol):
    stock = _tiny_detr().eval()  # no dropout: two runs must agree
    pixels = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    want_out, want_grads = _run(stock, pixels)
    calls = count_calls(lik_transformers, "ms_deform_attn")
    assert _run(stock, pixels)[0].equal(want_out) and calls == []  # the stock forward until kernelize
    with kernels.use_kernel_mapping({hf_kernels.LAYER_NAME: {"cpu": repository}}, inherit_mapping=False):
        model = kernels.kernelize(stock, mode=mode, device="cpu", use_fallback=False)
    layers = _layers(model)
    assert layers and all(type(m) is modeling.MultiScaleDeformableAttention for m in layers)  # no class replaced
    got_out, got_grads = _run(model, pixels)
    assert len(calls) == len(layers)
    torch.testing.assert_close(got_out, want_out, rtol=tol, atol=tol)
    scale = max(g.abs().max().item() for g in want_grads.values())
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=0, atol=tol * scale, msg=name)


@pytest.mark.parametrize("mode", ["INFERENCE", "TRAINING", "TRAINING|TORCH_COMPILE"])
def test_kernelize_with_lik_repository(marked_layers, count_calls, reference_path, mode):
    flags = kernels.Mode.FALLBACK
    for name in mode.split("|"):
        flags = getattr(kernels.Mode, name) if flags == kernels.Mode.FALLBACK else flags | getattr(kernels.Mode, name)
    _check_kernelized(hf_kernels.LikLayerRepository(), count_calls, flags, 1e-5)


def test_kernelize_with_local_repository_runs_the_kernels(marked_layers, count_calls, tmp_path):
    """A local kernel repository directory (kernels' LocalLayerRepository), the kernels through the interpreter."""
    path = hf_kernels.local_repository(tmp_path / "repo")
    assert hf_kernels.local_repository(path) == path  # idempotent
    repository = kernels.LocalLayerRepository(repo_path=path, layer_name=hf_kernels.LAYER_NAME)
    assert repository.load() is lik.MultiScaleDeformableAttention
    _check_kernelized(repository, count_calls, kernels.Mode.TRAINING, 2e-4)


def test_kernel_mapping_and_global_registration(marked_layers, count_calls, reference_path):
    mapping = hf_kernels.kernel_mapping()
    assert list(mapping) == [hf_kernels.LAYER_NAME] and set(mapping[hf_kernels.LAYER_NAME]) == {"cuda", "cpu"}
    with kernels.use_kernel_mapping(mapping):
        model = kernels.kernelize(_tiny_detr().eval(), mode=kernels.Mode.INFERENCE, device="cpu", use_fallback=False)
    calls = count_calls(lik_transformers, "ms_deform_attn")
    with torch.no_grad():
        model(pixel_values=torch.randn(1, 3, 64, 64))
    assert len(calls) == len(_layers(model))


def test_layer_passes_kernels_validation():
    """kernels' rules for a layer: stateless, only the allowed extra members, the same forward signature kinds."""
    from kernels.layer.layer import _validate_layer

    _validate_layer(check_cls=modeling.MultiScaleDeformableAttention, cls=lik.MultiScaleDeformableAttention,
                    repo=hf_kernels.LikLayerRepository())
    assert lik.MultiScaleDeformableAttention.has_backward and lik.MultiScaleDeformableAttention.can_torch_compile
    assert hf_kernels.layers.MultiScaleDeformableAttention is lik.MultiScaleDeformableAttention


def test_transformers_kernel_config_with_the_local_repository(marked_layers, count_calls, reference_path, tmp_path):
    """transformers' own switch (``use_kernels`` with a ``KernelConfig`` naming the local repository)."""
    from transformers.utils import is_kernels_available

    if not is_kernels_available():
        pytest.skip("the installed kernels version is outside the range this transformers supports")
    from transformers import KernelConfig

    path = hf_kernels.local_repository(tmp_path / "repo")
    model = _tiny_detr().eval()
    config = KernelConfig({hf_kernels.LAYER_NAME: {"cpu": f"{path}:{hf_kernels.LAYER_NAME}"}}, use_local_kernel=True)
    model.set_use_kernels(True, kernel_config=config)
    calls = count_calls(lik_transformers, "ms_deform_attn")
    with torch.no_grad():
        model(pixel_values=torch.randn(1, 3, 64, 64))
    assert len(calls) == len(_layers(model))


def test_repository_object_and_bad_arguments():
    a, b = hf_kernels.LikLayerRepository(), hf_kernels.LikLayerRepository(hf_kernels.LAYER_NAME)
    assert a == b and hash(a) == hash(b) and a.load() is lik.MultiScaleDeformableAttention and "lik" in str(a)
    with pytest.raises(ValueError, match="layer_name"):
        hf_kernels.LikLayerRepository("SiluAndMul")
    with pytest.raises(TypeError, match="layer_name"):
        hf_kernels.LikLayerRepository(3)
    with pytest.raises(TypeError, match="devices"):
        hf_kernels.kernel_mapping("cuda")
    with pytest.raises(ValueError, match="devices"):
        hf_kernels.kernel_mapping(("cuda", "tpu2"))
