"""The in-batch training shapes and inputs shared by the backward profiling scripts.

``SHAPES[name] = (Lq, B, Ld)`` with ``Nq = B`` (in-batch negatives), d = 128. ``in_batch_inputs`` draws
L2-normalised random ``Q [B, Lq, d]`` and ``D [B, Ld, d]`` with a fixed seed; ``contrastive_grad`` is the gradient
of the mean in-batch cross-entropy with respect to the scores (what a training step feeds the backward).
"""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

import torch

__all__ = ["SHAPES", "in_batch_inputs", "contrastive_grad", "backward_problem", "parse_shape_args"]

SHAPES = {
    "colbert-128": (32, 128, 180), "colbert-512": (32, 512, 180), "colbert-2048": (32, 2048, 180),
    "colpali-32": (1024, 32, 1024), "colpali-64": (1024, 64, 1024), "colpali-128": (1024, 128, 1024),
}


def in_batch_inputs(name: str, dtype: torch.dtype = torch.float16, dim: int = 128):
    """``(Q, D)`` on the current CUDA device for training shape ``name``."""
    l_q, n, l_d = SHAPES[name]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    Q = torch.nn.functional.normalize(torch.randn(n, l_q, dim, device=dev, generator=gen), dim=-1).to(dtype)
    D = torch.nn.functional.normalize(torch.randn(n, l_d, dim, device=dev, generator=gen), dim=-1).to(dtype)
    return Q, D


def contrastive_grad(scores: torch.Tensor) -> torch.Tensor:
    """fp32 ``d loss / d scores`` of the mean cross-entropy with the diagonal as positives."""
    n = scores.shape[0]
    return (torch.softmax(scores.float(), dim=1) - torch.eye(n, device=scores.device)).contiguous() / n


def backward_problem(name: str, dtype: torch.dtype = torch.float16, dim: int = 128) -> SimpleNamespace:
    """Everything the backward kernels take at shape ``name``: canonical inputs (``inputs``, ``q``, ``d``), the
    forward's ``scores`` and ``argmax``, the contrastive ``grad``, the backward ``cfg`` and its feature tiles
    (``block_k``, ``n_k``), the forward's tiles ``cfg_forward``."""
    from lik import _config
    from lik.ops.maxsim import backward as bw
    from lik.ops.maxsim.forward import maxsim_forward
    from lik.ops.maxsim.validation import MaxSimInputs

    Q, D = in_batch_inputs(name, dtype, dim)
    inputs = MaxSimInputs.build(Q, D, None, None, "exclude")
    scores, argmax = maxsim_forward(inputs, store_argmax=True)
    cfg = _config.maxsim_backward_config(dim=dim, dtype=dtype, device=Q.device)
    cfg_forward = _config.maxsim_forward_config(
        q_len=inputs.q.shape[1], n_queries=inputs.q.shape[0], dim=dim, dtype=dtype, per_query=False, device=Q.device,
        doc_len=inputs.d.shape[2], argmax=True,
    )
    block_k, n_k = bw.feature_blocks(dim, cfg.block_k)
    return SimpleNamespace(Q=Q, D=D, inputs=inputs, q=inputs.q, d=inputs.d, scores=scores, argmax=argmax,
                           grad=contrastive_grad(scores), cfg=cfg, cfg_forward=cfg_forward, block_k=block_k, n_k=n_k,
                           dtype=dtype, dim=dim)


def parse_shape_args() -> argparse.Namespace:
    """``--shape`` (one training shape, default colbert-128) and ``--out`` (default ``$OUT``), created."""
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="colbert-128", choices=sorted(SHAPES))
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    return args
