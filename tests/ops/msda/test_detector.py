"""A real detector with lik inside: HF transformers' ``DeformableDetrForObjectDetection``, switched to lik exactly as
the README says (one assignment before the model is built), against the stock model with the same weights.

The switch must take effect (every deformable-attention layer holds lik's module, and each forward calls it once
per layer), and the loss and every parameter's gradient must match the stock PyTorch path: to float64 rounding on
the CPU (both run ``grid_sample`` there), to fp32 rounding through lik's kernels (Triton's interpreter on the CPU,
compiled on the GPU), and within the bf16 error of the stock path itself under autocast on the GPU.
"""

from __future__ import annotations

import pytest
import torch

import lik
import lik.ops.msda.backward as msda_backward_module
import lik.ops.msda.forward as msda_forward_module
from lik._config import interpreting

transformers = pytest.importorskip("transformers")
pytest.importorskip("scipy")  # the DETR loss matches predictions to targets with scipy's Hungarian solver
modeling = pytest.importorskip("transformers.models.deformable_detr.modeling_deformable_detr")


def small_config(**changes):
    """A tiny Deformable DETR: 4 feature levels (three ResNet stages and one extra conv), 2 heads of 16 channels,
    2 points, one encoder and two decoder layers; no timm and no download."""
    backbone = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16, 24, 32],
                                         depths=[1, 1, 1, 1], layer_type="basic",
                                         out_features=["stage2", "stage3", "stage4"])
    settings = dict(backbone_config=backbone, use_timm_backbone=False, d_model=32, encoder_layers=1,
                    decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                    decoder_ffn_dim=32, num_queries=6, encoder_n_points=2, decoder_n_points=2, num_labels=3,
                    dropout=0.0)
    settings.update(changes)
    return transformers.DeformableDetrConfig(**settings)


def build_pair(monkeypatch, config, dtype=torch.float32, device="cpu"):
    """(stock model, lik model) with identical weights; the lik one is built after the README's one-line switch."""
    torch.manual_seed(0)
    stock = transformers.DeformableDetrForObjectDetection(config).to(device=device, dtype=dtype)
    with monkeypatch.context() as patch:
        # The README's switch, verbatim (undone when the block ends, so later tests see the stock class).
        patch.setattr(transformers.models.deformable_detr.modeling_deformable_detr, "MultiScaleDeformableAttention",
                      lik.MultiScaleDeformableAttention)
        switched = transformers.DeformableDetrForObjectDetection(config).to(device=device, dtype=dtype)
    switched.load_state_dict(stock.state_dict())
    return stock, switched


def attention_modules(model):
    return [m.attn for m in model.modules() if hasattr(m, "attn") and isinstance(m.attn, torch.nn.Module)]


def count_calls(modules):
    calls = []
    for module in modules:
        module.register_forward_hook(lambda mod, args, out: calls.append(type(mod)))
    return calls


def batch(dtype, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randn(2, 3, 64, 48, generator=gen).to(device=device, dtype=dtype)
    boxes = [torch.tensor([[0.5, 0.5, 0.2, 0.3], [0.3, 0.6, 0.1, 0.1]]), torch.tensor([[0.4, 0.4, 0.3, 0.3]])]
    classes = [torch.tensor([0, 2]), torch.tensor([1])]
    labels = [{"class_labels": c.to(device), "boxes": b.to(device=device, dtype=dtype)} for c, b in zip(classes, boxes)]
    return pixels, labels


def loss_and_grads(model, pixels, labels, autocast_dtype=None):
    model.zero_grad(set_to_none=True)
    with torch.autocast(pixels.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        out = model(pixel_values=pixels, labels=labels)
    out.loss.backward()
    grads = {name: p.grad.detach().double().clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach().double(), out.logits.detach().double(), grads


def relative(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def grad_error(got, want):
    """Relative error of all gradients together (each parameter's own error is noisy where its gradient is tiny)."""
    assert got.keys() == want.keys()
    diff = sum(((got[k] - want[k]) ** 2).sum() for k in want)
    norm = sum((want[k] ** 2).sum() for k in want)
    return (diff / norm).sqrt().item()


def check_switch(stock, switched, config):
    stock_attn, lik_attn = attention_modules(stock), attention_modules(switched)
    layers = config.encoder_layers + config.decoder_layers
    assert len(stock_attn) == len(lik_attn) == layers
    assert all(type(m) is modeling.MultiScaleDeformableAttention for m in stock_attn)
    assert all(type(m) is lik.MultiScaleDeformableAttention for m in lik_attn)
    return count_calls(lik_attn)


def test_switch_float64_matches_stock_model(monkeypatch):
    config = small_config()
    stock, switched = build_pair(monkeypatch, config, torch.float64)
    calls = check_switch(stock, switched, config)
    pixels, labels = batch(torch.float64, "cpu")
    want = loss_and_grads(stock, pixels, labels)
    got = loss_and_grads(switched, pixels, labels)
    assert calls == [lik.MultiScaleDeformableAttention] * (config.encoder_layers + config.decoder_layers)
    assert torch.isfinite(want[0]) and want[0] > 0
    assert relative(got[0], want[0]) < 1e-12
    assert relative(got[1], want[1]) < 1e-12
    assert len(want[2]) > 50 and grad_error(got[2], want[2]) < 1e-10


@pytest.mark.skipif(not interpreting(), reason="runs lik's kernels through Triton's interpreter")
def test_switch_fp32_runs_lik_kernels_and_matches_stock_model(monkeypatch):
    config = small_config()
    stock, switched = build_pair(monkeypatch, config, torch.float32)
    calls = check_switch(stock, switched, config)
    launches = []
    for module in (msda_forward_module, msda_backward_module):
        def counted(kernel, *args, _launch=module.launch, **kwargs):
            launches.append(getattr(kernel, "fn", kernel).__name__)
            return _launch(kernel, *args, **kwargs)

        monkeypatch.setattr(module, "launch", counted)
    pixels, labels = batch(torch.float32, "cpu")
    reference = loss_and_grads(stock.double(), pixels.double(), [{k: v.double() if v.is_floating_point() else v
                                                                 for k, v in t.items()} for t in labels])
    want = loss_and_grads(stock.float(), pixels, labels)
    got = loss_and_grads(switched, pixels, labels)
    layers = config.encoder_layers + config.decoder_layers
    assert calls == [lik.MultiScaleDeformableAttention] * layers
    # One forward and one backward kernel per layer: the kernels ran, not the grid_sample fallback.
    assert sorted(launches) == sorted(["msda_fwd_kernel"] * layers + ["msda_bwd_kernel"] * layers)
    for name, tol in (("loss", 1e-5), ("logits", 1e-5)):
        index = 0 if name == "loss" else 1
        assert relative(got[index], reference[index]) < tol, name
        assert relative(want[index], reference[index]) < tol, name
    # lik's fp32 gradients are as close to float64 as the stock fp32 path's are.
    lik_err, stock_err = grad_error(got[2], reference[2]), grad_error(want[2], reference[2])
    assert lik_err < max(2 * stock_err, 1e-5), (lik_err, stock_err)


@pytest.mark.gpu
@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16])
def test_gpu_switch_matches_stock_model(monkeypatch, autocast_dtype):
    config = small_config(d_model=64, encoder_attention_heads=4, decoder_attention_heads=4, num_queries=20)
    stock, switched = build_pair(monkeypatch, config, torch.float32, "cuda")
    calls = check_switch(stock, switched, config)
    pixels, labels = batch(torch.float32, "cuda")
    reference = loss_and_grads(stock.double(), pixels.double(), [{k: v.double() if v.is_floating_point() else v
                                                                 for k, v in t.items()} for t in labels])
    stock.float()
    want = loss_and_grads(stock, pixels, labels, autocast_dtype)
    got = loss_and_grads(switched, pixels, labels, autocast_dtype)
    assert calls == [lik.MultiScaleDeformableAttention] * (config.encoder_layers + config.decoder_layers)
    # Measured against float64: lik within a small factor of the stock path's own error in the same precision.
    floor = 1e-5 if autocast_dtype is None else 2e-2
    for index in (0, 1):
        lik_err, stock_err = relative(got[index], reference[index]), relative(want[index], reference[index])
        assert lik_err < max(2 * stock_err, floor), (index, lik_err, stock_err)
    lik_err, stock_err = grad_error(got[2], reference[2]), grad_error(want[2], reference[2])
    assert lik_err < max(2 * stock_err, floor), (lik_err, stock_err)
