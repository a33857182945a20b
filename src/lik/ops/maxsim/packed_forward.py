"""Forward launcher of packed MaxSim: the padded forward kernel with packed documents (and, for pairs, packed
queries), told so by its ``LAYOUT`` flag (:mod:`lik.core.segments`)."""

from __future__ import annotations

import torch

from ..._config import cdiv, feature_chunks, maxsim_forward_doc_programs, maxsim_varlen_config
from ..._launch import launch
from ...core.division import divisor_constants
from ...core.quantized import FLOAT, loader_chunks, loader_of
from ...core.segments import PACKED, PAIRS
from .forward import dot_precision, scale_pointers
from ...core.forward_kernel import maxsim_fwd_kernel
from .packing import PackedInputs

__all__ = ["packed_forward"]


def packed_forward(inputs: PackedInputs, store_argmax: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the forward kernel on packed inputs.

    Returns fp32 scores (pairs ``[N]``, corpus ``[Nq, B]``) and, with ``store_argmax``, the int32 winners as
    absolute rows of ``d`` (pairs ``[Tq]``, corpus ``[Nq, B, Lq]``; -1 where a row gets no gradient).
    """
    q, d, device = inputs.q, inputs.d, inputs.q.device
    dim = d.shape[1]
    n_docs = inputs.cu_d.numel() - 1
    if inputs.pairs:
        n_q, l_q, score_shape, argmax_shape = 1, inputs.max_seqlen_q, (n_docs,), (q.shape[0],)
    else:
        n_q, l_q = q.shape[0], q.shape[1]
        score_shape, argmax_shape = (n_q, n_docs), (n_q, n_docs, l_q)
    argmax = None
    if store_argmax:
        # Pairs: -1 everywhere first, since with unchecked cu_seqlens some packed query rows may belong to no
        # pair and the backward must see "no gradient" there, not garbage. The corpus kernel writes every entry.
        fill = inputs.pairs or q.numel() == 0 or d.numel() == 0 or n_docs == 0
        argmax = torch.empty(argmax_shape, dtype=torch.int32, device=device)
        if fill:
            argmax.fill_(-1)
    if q.numel() == 0 or d.numel() == 0 or n_docs == 0:  # no token, no document or dim == 0: every score is 0
        return torch.zeros(score_shape, dtype=torch.float32, device=device), argmax

    cfg = maxsim_varlen_config(
        q_len=max(1, l_q), n_queries=n_q, dim=dim, dtype=q.dtype, pairs=inputs.pairs, device=device
    )
    loader = loader_of(d.dtype)
    block_k, num_k = loader_chunks(*feature_chunks(dim, cfg.block_k), loader)
    if inputs.pairs:
        # At least one program per pair: the hint only sizes the grid (see the kernel).
        n_chunks = n_row_blocks = max(1, cdiv(l_q, cfg.group_rows))
        partial = torch.empty((n_chunks, 1, n_docs), dtype=torch.float32, device=device)
        q_strides = (0, *q.stride())
        argmax_strides = (0, 0, 1)
    else:
        n_chunks = cdiv(l_q, cfg.group_rows)
        n_row_blocks = cdiv(n_q * n_chunks, cfg.groups)
        partial = torch.empty((n_chunks, n_q, n_docs), dtype=torch.float32, device=device)
        q_strides = q.stride()
        argmax_strides = argmax.stride() if argmax is not None else (0, 0, 0)
    # Stacked rows in inference walk their documents in a persistent launch where the config has one (the kernel's
    # packed persistent loop, as the padded launch's); winners, 8-bit rows and streamed feature chunks keep a
    # program per document.
    persistent = (not inputs.pairs and not store_argmax and cfg.programs_per_sm > 0 and cfg.groups > 1
                  and loader == FLOAT and num_k == 1)
    doc_programs = n_docs
    options = {}
    if persistent:
        doc_programs = maxsim_forward_doc_programs(cfg, n_row_blocks=n_row_blocks, n_docs=n_docs, device=device)
        if cfg.max_registers:
            options["maxnreg"] = cfg.max_registers
    q_mask = inputs.q_mask
    q_mask_arg, q_mask_strides = (q, (0, 0)) if q_mask is None else (q_mask.view(torch.uint8), q_mask.stride())
    scales = (partial, partial) if inputs.d_scale is None else scale_pointers(inputs.q_scale, inputs.d_scale)
    launch(
        maxsim_fwd_kernel, (n_row_blocks * doc_programs,),
        q, d, q_mask_arg, d, inputs.cu_q if inputs.pairs else inputs.cu_d, inputs.cu_d, partial,
        argmax if argmax is not None else partial, *scales,
        n_q, l_q, n_docs, 0, q.shape[0] if inputs.pairs else 0, d.shape[0], n_chunks, n_row_blocks, doc_programs,
        *divisor_constants(n_row_blocks), *divisor_constants(n_chunks),
        *q_strides, 0, 0, *d.stride(), *q_mask_strides, 0, 0, 0, *partial.stride(), *argmax_strides,
        DIM=dim,
        GROUP_ROWS=cfg.group_rows,
        GROUPS=1 if inputs.pairs else cfg.groups,
        BLOCK_N=cfg.block_n,
        BLOCK_K=block_k,
        NUM_K=num_k,
        HAS_Q_MASK=q_mask is not None,
        HAS_D_MASK=False,
        EXCLUDE=True,
        STORE_ARGMAX=store_argmax,
        DOT_PRECISION=dot_precision(q.dtype),
        PERSISTENT=persistent,
        LAYOUT=(PAIRS if inputs.pairs else PACKED).value,
        LOADER=loader,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **options,
    )
    scores = partial[0] if n_chunks == 1 else partial.sum(dim=0)
    return (scores[0] if inputs.pairs else scores), argmax

