"""The fused head's forward launcher and launch heuristic: canonical inputs to :mod:`.kernel`."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..._device import cdiv, interpreting, next_power_of_2, sm_count
from ..._launch import launch
from ...core.forward_launch import dot_precision
from ...core.segments import PACKED, PADDED
from .kernel import fused_head_forward_kernel
from .validation import FusedHeadInputs

__all__ = ["FusedHeadConfig", "fused_head_config", "gpu_tiles", "forced_config", "row_splits", "fused_head_forward"]


@dataclass(frozen=True)
class FusedHeadConfig:
    block_m: int  # query rows per block streamed through a projected tile
    block_n: int  # document tokens per projected tile
    block_k: int  # d_model chunk of the projection's k loop
    num_warps: int = 4
    num_stages: int = 2
    min_split_rows: int = 512  # fewest query rows a program takes when a document's rows are split
    target_programs: int = 0  # split rows until about this many programs (0: 4 per SM)


_FORCED: list[FusedHeadConfig] = []


@contextlib.contextmanager
def forced_config(cfg: FusedHeadConfig):
    """Force the launch config inside the block (tests take every branch through it)."""
    _FORCED.append(cfg)
    try:
        yield
    finally:
        _FORCED.pop()


def fused_head_config(*, d_model: int, d_out: int, rows: int, dtype: torch.dtype = torch.float16
                      ) -> FusedHeadConfig:
    """Tiles for ``d_out`` (padded to a power of two, at most 256), ``d_model`` and ``rows`` query rows per set.

    A projected tile is ``[block_n, d_out]`` fp32 in registers next to the ``[block_m, block_n]`` similarities. Each
    tile reads ``W`` again (from L2: ``d_out x d_model``), so tall tiles (128 tokens) keep that traffic at the size of
    the hidden rows read from DRAM; at d_out <= 128 in half precision they fit 8 warps' registers with 32-deep ``k``
    chunks (sm_90 builds: 255 registers, no spill, 37-49 KiB of shared memory); fp32 operands and d_out = 256 take
    64-token tiles (216-218 registers, no spill; 128 spilled). ``tests/ops/fused_head/test_compile_sm90.py`` keeps
    every variant free of spills. Query rows stream in blocks of up to 64 (one block for a 32-token query). Not yet
    timed on a GPU: ``forced_config`` overrides it."""
    if _FORCED:
        return _FORCED[-1]
    if interpreting():
        return FusedHeadConfig(block_m=16, block_n=16, block_k=32, min_split_rows=16, target_programs=8)
    return gpu_tiles(d_model=d_model, d_out=d_out, rows=rows, dtype=dtype)


def gpu_tiles(*, d_model: int, d_out: int, rows: int, dtype: torch.dtype) -> FusedHeadConfig:
    """The tiles :func:`fused_head_config` picks on a GPU (a function of its own so that interpreter tests can force
    exactly the GPU's blocks on small shapes)."""
    d_out_pad = max(16, next_power_of_2(d_out))
    block_n = 128 if d_out_pad <= 128 and dtype != torch.float32 else 64
    block_m = min(64, max(16, next_power_of_2(rows)))
    block_k = min(32, max(16, next_power_of_2(d_model)))
    return FusedHeadConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=8, num_stages=3)


def row_splits(cfg: FusedHeadConfig, rows: int, programs: int, device: torch.device) -> tuple[int, int]:
    """``(n_splits, split_rows)``: a document's ``rows`` query rows shared by ``n_splits`` programs of
    ``split_rows`` rows each (a multiple of ``block_m``), enough for about ``cfg.target_programs`` programs in all
    but never fewer than ``cfg.min_split_rows`` rows a program (each split projects the document again)."""
    blocks = cdiv(rows, cfg.block_m)
    target = cfg.target_programs or 4 * sm_count(device)
    wanted = min(cdiv(target, max(1, programs)), max(1, rows // max(1, cfg.min_split_rows)), blocks)
    split_blocks = cdiv(blocks, max(1, wanted))
    return cdiv(blocks, split_blocks), split_blocks * cfg.block_m


def fused_head_forward(inputs: FusedHeadInputs, store_argmax: bool
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(scores fp32 [Nq, B], argmax [Nq, B, Lq] int32 or None)`` of canonical inputs: each query token's winning
    document token (-1 where it takes no gradient), a view of the kernel's row buffer."""
    q, h, w, b = inputs.q, inputs.h, inputs.w, inputs.b
    n_q, l_q, d_out = q.shape
    d_model = w.shape[1]
    n_docs = inputs.n_docs
    per_query = inputs.per_query_documents
    n_sets = n_q if per_query else 1
    rows = l_q if per_query else n_q * l_q
    device = q.device
    best = torch.empty((n_sets, n_docs, rows), dtype=torch.float32, device=device)
    key = torch.empty((n_sets, n_docs, rows) if store_argmax else (1,), dtype=torch.int32, device=device)
    if n_docs and rows:
        cfg = fused_head_config(d_model=d_model, d_out=d_out, rows=rows, dtype=q.dtype)
        n_splits, split_rows = row_splits(cfg, rows, n_sets * n_docs, device)
        packed = inputs.packed
        if packed:
            h_strides, doc_len, n_h_rows, cu = (0, 0, *h.stride()), 0, h.shape[0], inputs.cu_seqlens
        else:
            h_strides, doc_len, n_h_rows, cu = h.stride(), h.shape[2], 0, best
        q_mask, d_mask = inputs.q_mask, inputs.d_mask
        launch(
            fused_head_forward_kernel, (n_sets * n_docs * n_splits,),
            q, h, w, best if b is None else b, best if q_mask is None else q_mask,
            best if d_mask is None else d_mask, cu, best, key,
            n_q, l_q, n_docs, doc_len, n_h_rows, rows, n_splits, split_rows,
            *q.stride(), *h_strides, *w.stride(), 0 if b is None else b.stride(0),
            *((0, 0) if q_mask is None else q_mask.stride()),
            *((0, 0, 0) if d_mask is None else d_mask.stride()),
            best.stride(0), best.stride(1),
            D_MODEL=d_model, D_OUT=d_out, D_OUT_PAD=max(16, next_power_of_2(d_out)),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            HAS_BIAS=b is not None, HAS_Q_MASK=q_mask is not None, HAS_D_MASK=d_mask is not None,
            EXCLUDE=inputs.mask_mode == "exclude", NORMALIZE=inputs.normalize, TRACK_ARGMAX=store_argmax,
            PER_QUERY=per_query, LAYOUT=(PACKED if packed else PADDED).value, DOT_PRECISION=dot_precision(q.dtype),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    elif rows:  # no document: nothing to score
        best.zero_()
    if per_query:
        scores = best.view(n_q, n_docs, l_q).sum(-1)
        argmax = key.view(n_q, n_docs, l_q) if store_argmax else None
    else:
        scores = best[0].view(n_docs, n_q, l_q).sum(-1).t()
        argmax = key[0].view(n_docs, n_q, l_q).permute(1, 0, 2) if store_argmax else None
    return scores, argmax
