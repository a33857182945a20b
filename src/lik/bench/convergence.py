"""Training-loop check: a small contrastive model trained with ``lik.maxsim`` tracks a float32 reference.

A bias-free linear projection maps synthetic token embeddings (``d_in``) to ``dim``. Each query token copies the
first ``signal_dims`` features of a token of its positive document (planted positives) and has fresh, larger
nuisance values in the other features; negatives are the other documents of the batch. The projection has to
learn to ignore the nuisance features, so the loss falls from near ``log(B)``. The
loss is in-batch cross-entropy over ``maxsim(normalize(proj(Q)), normalize(proj(D)))``. The same initial weights,
batches and optimiser (SGD with momentum) are run with the scoring function under test and with
:func:`lik.maxsim_reference` in float32; the per-step losses are compared. SGD, not Adam: Adam divides each
update by the gradient's running magnitude, so on a plateau it amplifies rounding-level gradient differences
(measured on an H200 with Adam: the atomic backward's run-to-run rounding moved the loss by 1e-2); with SGD a
1e-6 relative change of the scores moves the losses by about 1e-6, so the comparison measures the kernels.

    python -m lik.bench.convergence --out DIR      (GPU: 200 steps; JSON + loss-curve plot)
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from collections.abc import Callable

import torch

import lik

__all__ = ["ConvergenceSetup", "synthetic_batches", "train", "compare", "main"]


@dataclass(frozen=True)
class ConvergenceSetup:
    """Sizes of the synthetic problem and of the run."""

    steps: int = 200
    batch: int = 32
    q_len: int = 16
    doc_len: int = 64
    d_in: int = 64
    dim: int = 32
    signal_dims: int = 16
    nuisance: float = 1.0
    noise: float = 0.3
    temperature: float = 0.05
    lr: float = 0.1
    seed: int = 0


def synthetic_batches(setup: ConvergenceSetup, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of ``(Q [B, Lq, d_in], D [B, Ld, d_in])``: query ``i``'s tokens share the signal features
    of ``Lq`` tokens of document ``i`` (plus noise); their nuisance features are drawn afresh (float32, generated
    once on the CPU so every backend sees the same numbers)."""
    gen = torch.Generator().manual_seed(setup.seed)
    scale = torch.full((setup.d_in,), setup.nuisance)
    scale[: setup.signal_dims] = 1.0
    batches = []
    for _ in range(setup.steps):
        docs = torch.randn(setup.batch, setup.doc_len, setup.d_in, generator=gen) * scale
        picks = torch.randint(0, setup.doc_len, (setup.batch, setup.q_len), generator=gen)
        queries = torch.gather(docs, 1, picks[..., None].expand(-1, -1, setup.d_in)).clone()
        queries[..., setup.signal_dims:] = torch.randn(queries[..., setup.signal_dims:].shape, generator=gen)
        queries[..., setup.signal_dims:] *= setup.nuisance
        queries = queries + setup.noise * torch.randn(queries.shape, generator=gen)
        batches.append((queries.to(device), docs.to(device)))
    return batches


def train(
    score_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    setup: ConvergenceSetup,
    dtype: torch.dtype = torch.float32,
) -> list[float]:
    """Train a fresh projection (seeded) on ``batches`` with ``score_fn(Q, D) -> [B, B]``; per-step losses.

    ``dtype``: the embeddings passed to ``score_fn`` (the weights and the loss stay float32)."""
    device = batches[0][0].device
    gen = torch.Generator().manual_seed(setup.seed + 1)
    weight = (torch.randn(setup.dim, setup.d_in, generator=gen) / setup.d_in**0.5).to(device).requires_grad_()
    optimiser = torch.optim.SGD([weight], lr=setup.lr, momentum=0.9)
    labels = torch.arange(setup.batch, device=device)
    losses = []
    for queries, docs in batches:
        q = torch.nn.functional.normalize(queries @ weight.T, dim=-1).to(dtype)
        d = torch.nn.functional.normalize(docs @ weight.T, dim=-1).to(dtype)
        scores = score_fn(q, d).float() / (setup.q_len * setup.temperature)
        loss = torch.nn.functional.cross_entropy(scores, labels)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    return losses


def compare(setup: ConvergenceSetup, device: torch.device, dtypes=(torch.float32,)) -> dict:
    """Losses of the float32 reference and of ``lik.maxsim`` (fast and deterministic) in each of ``dtypes``,
    with the largest per-step absolute difference from the reference."""
    batches = synthetic_batches(setup, device)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # float32 means float32 products, in both runs
    try:
        reference = train(lik.maxsim_reference, batches, setup)
        runs = {}
        for dtype in dtypes:
            for backward in ("fast", "deterministic"):
                losses = train(lambda q, d, b=backward: lik.maxsim(q, d, backward=b), batches, setup, dtype)
                name = f"lik-{backward}-{str(dtype).replace('torch.', '')}"
                runs[name] = {
                    "losses": losses,
                    "max_abs_diff": max(abs(a - b) for a, b in zip(losses, reference)),
                }
    finally:
        torch.set_float32_matmul_precision(precision)
    return {"setup": asdict(setup), "device": str(device), "reference_float32": reference, "runs": runs}


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(result["reference_float32"], label="float32 reference", color="black", linewidth=2)
    for name, run in result["runs"].items():
        top.plot(run["losses"], label=name, linestyle="--")
        diffs = [abs(a - b) for a, b in zip(run["losses"], result["reference_float32"])]
        bottom.semilogy([max(x, 1e-12) for x in diffs], label=name)
    top.set_ylabel("in-batch cross-entropy")
    top.legend()
    bottom.axhline(1e-3, color="red", linewidth=1, label="1e-3")
    bottom.set_ylabel("|loss - reference|")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m lik.bench.convergence", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out")
    p.add_argument("--steps", type=int, default=ConvergenceSetup.steps)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtypes = (torch.float32, torch.bfloat16, torch.float16) if device.type == "cuda" else (torch.float32,)
    result = compare(ConvergenceSetup(steps=args.steps), device, dtypes)
    result["torch"] = torch.__version__
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "convergence.json"), "w") as f:
        json.dump(result, f, indent=1)
    try:
        _plot(result, os.path.join(args.out, "convergence.png"))
    except ImportError:
        print("matplotlib is missing: no plot")
    for name, run in result["runs"].items():
        print(f"{name:28s} final loss {run['losses'][-1]:.4f} (reference {result['reference_float32'][-1]:.4f}), "
              f"max |diff| over {len(run['losses'])} steps {run['max_abs_diff']:.2e}")
    return result


if __name__ == "__main__":
    main()
