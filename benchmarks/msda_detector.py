"""End to end: HF transformers' ``DeformableDetrForObjectDetection`` (default config: ResNet-50, 4 levels, 6 + 6
layers, 300 queries; random weights) at 800x1333, one training step (forward + DETR loss + backward) and one
inference forward, with the stock PyTorch attention, with lik switched in as the README says, and with the original
Deformable-DETR CUDA op (``lik.bench.msda_cases.load_original_op``). Same weights and inputs for all; time (CUDA
events around each step, the variants interleaved step by step, median of ``--steps`` rounds after three warm-up
rounds), peak memory above the model and inputs (fresh, one variant at a time), the device time of one profiled step
(all kernels and the deformable-attention ones), and the loss, logits and gradients of each against the stock model
in fp32.

    PYTHONPATH=src python3 benchmarks/msda_detector.py --original-src /path/to/Deformable-DETR --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import transformers
import transformers.models.deformable_detr.modeling_deformable_detr as modeling

import lik
from lik.bench.msda_cases import OriginalModule, load_original_op

STOCK = modeling.MultiScaleDeformableAttention


def default_config():
    """The default config; its timm ResNet-50 backbone when it builds here without a download, else the same
    ResNet-50 from transformers."""
    try:
        config = transformers.DeformableDetrConfig(use_pretrained_backbone=False)
        transformers.DeformableDetrForObjectDetection(config)
        return config, "timm resnet50 (default)"
    except Exception as exc:  # noqa: BLE001 - any failure to build the default backbone: fall back
        print(f"default backbone did not build ({type(exc).__name__}: {str(exc)[:120]}); using transformers' ResNet-50")
        backbone = transformers.ResNetConfig(out_features=["stage2", "stage3", "stage4"])
        return transformers.DeformableDetrConfig(backbone_config=backbone, use_timm_backbone=False), "HF ResNet-50"


def build(config, attention_class, state=None):
    modeling.MultiScaleDeformableAttention = attention_class  # the README's switch
    try:
        torch.manual_seed(0)
        model = transformers.DeformableDetrForObjectDetection(config)
    finally:
        modeling.MultiScaleDeformableAttention = STOCK
    if state is not None:
        model.load_state_dict(state)
    attn = [m.attn for m in model.modules() if hasattr(m, "attn") and isinstance(m.attn, torch.nn.Module)]
    assert attn and all(type(a) is attention_class for a in attn), "the switch did not take effect"
    return model.cuda()


def inputs(batch, height, width, n_labels):
    gen = torch.Generator().manual_seed(1)
    pixels = torch.randn(batch, 3, height, width, generator=gen).cuda()
    mask = torch.ones(batch, height, width, dtype=torch.long, device="cuda")
    labels = []
    for _ in range(batch):
        centre = torch.rand(5, 2, generator=gen) * 0.6 + 0.2
        size = torch.rand(5, 2, generator=gen) * 0.2 + 0.05
        labels.append({"class_labels": torch.randint(0, n_labels, (5,), generator=gen).cuda(),
                       "boxes": torch.cat([centre, size], 1).cuda()})
    return pixels, mask, labels


def train_step(model, pixels, mask, labels, amp):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        out = model(pixel_values=pixels, pixel_mask=mask, labels=labels)
    out.loss.backward()
    return out


def timed(fn, steps, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_mb(fn):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def infer(model, pixels, mask, amp):
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        return model(pixel_values=pixels, pixel_mask=mask)


ATTENTION_KERNELS = ("msda", "ms_deformable", "grid_sampler")


def profile_step(step):
    """Device time of one step: all kernels, the deformable-attention ones (lik's, the original op's, or
    grid_sample's forward and backward), and the five longest kernel names."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    by_name = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
    attention = {n: t for n, t in by_name.items() if any(k in n for k in ATTENTION_KERNELS)}
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:5]
    return dict(device_ms=sum(by_name.values()), attention_ms=sum(attention.values()),
                attention_kernels={n[:70]: round(t, 3) for n, t in attention.items()},
                top=[(n[:70], round(t, 3)) for n, t in top])


def loss_and_grads(model, pixels, mask, labels, amp):
    out = train_step(model, pixels, mask, labels, amp)
    grads = torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None])
    return out.loss.detach().double(), out.logits.detach().double(), grads


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--original-src", default=os.environ.get("LIK_ORIGINAL_MSDA_SRC"))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", default="800x1333")
    parser.add_argument("--steps", type=int, default=7)
    args = parser.parse_args()
    if args.original_src:
        OriginalModule.function = load_original_op(args.original_src)
    height, width = map(int, args.size.split("x"))
    config, backbone = default_config()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, transformers=transformers.__version__,
                commit=os.environ.get("LIK_COMMIT", "unknown"), backbone=backbone, batch=args.batch, size=args.size,
                time=time.strftime("%Y-%m-%d %H:%M:%S"))
    print(json.dumps(meta), flush=True)
    pixels, mask, labels = inputs(args.batch, height, width, config.num_labels)

    variants = {"pytorch": STOCK, "lik": lik.MultiScaleDeformableAttention}
    if OriginalModule.function is not None:
        variants["cuda-op"] = OriginalModule
    state = None
    results, reference, models = {}, {}, {}
    # Correctness and peak memory, one variant at a time.
    for name, cls in variants.items():
        model = build(config, cls, state)
        if state is None:
            state = {k: v.clone() for k, v in model.state_dict().items()}
        calls = []
        hooks = [m.register_forward_hook(lambda mod, a, o: calls.append(1)) for m in model.modules()
                 if type(m) is cls]
        for amp in (False, True):
            if amp and name == "cuda-op":
                continue  # the original op dispatches float and double only
            key = f"{name}/{'bf16-autocast' if amp else 'fp32'}"
            model.train()
            calls.clear()
            loss, logits, grads = loss_and_grads(model, pixels, mask, labels, amp)
            row = dict(attention_calls_per_step=len(calls), loss=loss.item())
            if name == "pytorch" and not amp:
                reference = dict(loss=loss, logits=logits, grads=grads)
            else:
                row["vs_pytorch_fp32"] = dict(loss=rel(loss, reference["loss"]),
                                              logits=rel(logits, reference["logits"]),
                                              grads=rel(grads, reference["grads"]))
            del grads
            model.zero_grad(set_to_none=True)
            row["train_peak_MB"] = peak_mb(lambda: train_step(model, pixels, mask, labels, amp))
            model.zero_grad(set_to_none=True)
            model.eval()
            row["infer_peak_MB"] = peak_mb(lambda: infer(model, pixels, mask, amp))
            results[key] = row
            models[key] = (model, amp)
            print(key, json.dumps(row), flush=True)
        for h in hooks:
            h.remove()
        torch.cuda.empty_cache()

    # Time: the variants interleaved step by step (median of --steps rounds after warm-up).
    for phase in ("train", "infer"):
        times = {key: [] for key in models}
        for round_ in range(3 + args.steps):
            for key, (model, amp) in models.items():
                model.train(phase == "train")
                fn = (lambda: train_step(model, pixels, mask, labels, amp)) if phase == "train" else \
                    (lambda: infer(model, pixels, mask, amp))
                ms = timed(fn, 1, warmup=0)
                if round_ >= 3:
                    times[key].append(ms)
        for key, values in times.items():
            results[key][f"{phase}_ms"] = statistics.median(values)
            results[key][f"{phase}_ms_all"] = values
    # Where a training step's device time goes: one profiled fp32 step per variant.
    for key, (model, amp) in models.items():
        if not amp:
            model.train()
            results[key]["profile"] = profile_step(lambda: train_step(model, pixels, mask, labels, amp))
            print(key, json.dumps(results[key]["profile"]), flush=True)
        model.zero_grad(set_to_none=True)

    with open(os.path.join(args.out, "msda_detector.json"), "w") as fh:
        json.dump(dict(meta=meta, results=results), fh, indent=1)
    print(f"\n{meta['device']} transformers {meta['transformers']} {backbone}, batch {args.batch} at {args.size}")
    print(f"{'variant':26} | {'train ms':>9} {'peak MB':>8} | {'infer ms':>9} {'peak MB':>8} | attn dev ms | "
          f"err vs pytorch fp32 (loss / logits / grads)")
    for key, r in results.items():
        err = r.get("vs_pytorch_fp32")
        err = f"{err['loss']:.1e} / {err['logits']:.1e} / {err['grads']:.1e}" if err else "-"
        attn = f"{r['profile']['attention_ms']:6.1f}" if "profile" in r else "     -"
        print(f"{key:26} | {r['train_ms']:9.1f} {r['train_peak_MB']:8.0f} | {r['infer_ms']:9.1f} "
              f"{r['infer_peak_MB']:8.0f} | {attn}      | {err}")


if __name__ == "__main__":
    main()
