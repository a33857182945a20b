"""Input checks and the canonical layout of :func:`lik.maxsim_from_hidden`.

Checks run on shapes, dtypes and devices only (no host synchronisation), before any kernel, and each error names
its argument. The canonical layout the kernels, the backward and the reference share:

* ``q``: ``[Nq, Lq, d_out]``; ``q_mask``: bool ``[Nq, Lq]`` or None;
* ``h``: padded ``[n_sets, B, Ld, d_model]`` (``n_sets`` 1: documents shared by every query; ``Nq``: one set per
  query), or packed ``[T, d_model]`` with ``cu_seqlens`` (int32 ``[B + 1]``, FlashAttention's convention);
* ``w``: ``[d_out, d_model]`` (``torch.nn.Linear.weight``); ``b``: ``[d_out]`` or None;
* ``d_mask``: bool ``[n_sets, B, Ld]`` or None (padded only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..maxsim.validation import KERNEL_DTYPES, MASK_MODES, MAX_DIM, canonical_query, check_mask, check_real

__all__ = ["FusedHeadInputs", "MAX_D_OUT"]

# Widest projection the kernel holds on chip (a tile of projected rows is [BLOCK_N, d_out] fp32 in registers).
MAX_D_OUT = 256


def _tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _same_kind(name: str, x: torch.Tensor, q: torch.Tensor) -> None:
    if x.dtype != q.dtype:
        check_real(name, x)
        raise TypeError(f"{name} has dtype {x.dtype} but Q has {q.dtype}: pass Q, H, W and b in one dtype")
    if x.device != q.device:
        raise ValueError(f"{name} is on {x.device} but Q is on {q.device}")


@dataclass(frozen=True)
class FusedHeadInputs:
    q: torch.Tensor
    h: torch.Tensor
    w: torch.Tensor
    b: torch.Tensor | None
    q_mask: torch.Tensor | None
    d_mask: torch.Tensor | None
    cu_seqlens: torch.Tensor | None  # packed h: int32 [B + 1]
    mask_mode: str
    normalize: bool
    squeeze_query: bool  # 2-D Q: the result is [B]
    per_query_documents: bool  # H was [Nq, B, Ld, d_model]

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def n_docs(self) -> int:
        return self.cu_seqlens.shape[0] - 1 if self.packed else self.h.shape[1]

    @classmethod
    def build(cls, Q, H, W, b=None, q_mask=None, d_mask=None, *, normalize=True, mask_mode="exclude",
              cu_seqlens=None, allow_float64: bool = True) -> FusedHeadInputs:
        Q, H, W = _tensor("Q", Q), _tensor("H", H), _tensor("W", W)
        if mask_mode not in MASK_MODES:
            raise ValueError(f"mask_mode must be one of {MASK_MODES}, got {mask_mode!r}")
        if not isinstance(normalize, bool):
            raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
        allowed = KERNEL_DTYPES + ((torch.float64,) if allow_float64 else ())
        if Q.dtype not in allowed:
            check_real("Q", Q)
            raise TypeError(f"Q must have dtype in {[str(t) for t in allowed]}, got {Q.dtype}")
        if Q.dim() not in (2, 3):
            raise ValueError(f"Q must be [Lq, d_out] or [Nq, Lq, d_out], got shape {list(Q.shape)}")
        for name, x in (("H", H), ("W", W)):
            _same_kind(name, x, Q)
        if W.dim() != 2:
            raise ValueError(f"W must be [d_out, d_model] (torch.nn.Linear.weight), got shape {list(W.shape)}")
        d_out, d_model = W.shape
        if d_out != Q.shape[-1]:
            raise ValueError(f"W has d_out = {d_out} rows but Q has embedding dim {Q.shape[-1]}")
        if d_out > MAX_D_OUT or d_model > MAX_DIM:
            raise ValueError(f"W is [{d_out}, {d_model}]: d_out must be at most {MAX_D_OUT} and d_model at most "
                             f"{MAX_DIM}")
        if b is not None:
            b = _tensor("b", b)
            _same_kind("b", b, Q)
            if tuple(b.shape) != (d_out,):
                raise ValueError(f"b must have shape [d_out] = [{d_out}], got {list(b.shape)}")
        if H.dim() == 0 or H.shape[-1] != d_model:
            raise ValueError(f"H must end in W's d_model = {d_model}, got shape {list(H.shape)}")
        q, q_mask, squeeze = canonical_query(Q, q_mask)
        if cu_seqlens is not None:
            return cls._packed(q, H, W, b, q_mask, d_mask, cu_seqlens, mask_mode, normalize, squeeze)
        if H.dim() not in (3, 4):
            raise ValueError(f"H must be [B, Ld, d_model], [Nq, B, Ld, d_model] or packed [T, d_model] with "
                             f"cu_seqlens, got shape {list(H.shape)}")
        per_query = H.dim() == 4
        if per_query:
            if Q.dim() == 2:
                raise ValueError("H of shape [Nq, B, Ld, d_model] needs 3-D Q [Nq, Lq, d_out]; got 2-D Q")
            if H.shape[0] != Q.shape[0]:
                raise ValueError(f"H is [Nq, B, Ld, d_model] with Nq={H.shape[0]} but Q has Nq={Q.shape[0]}")
        d_mask = check_mask("d_mask", d_mask, tuple(H.shape[:-1]), Q.device)
        h = H if per_query else H.unsqueeze(0)
        if d_mask is not None and not per_query:
            d_mask = d_mask.unsqueeze(0)
        return cls(q, h, W, b, q_mask, d_mask, None, mask_mode, normalize, squeeze, per_query)

    @classmethod
    def _packed(cls, q, H, W, b, q_mask, d_mask, cu_seqlens, mask_mode, normalize, squeeze) -> FusedHeadInputs:
        cu = _tensor("cu_seqlens", cu_seqlens)
        if H.dim() != 2:
            raise ValueError(f"H with cu_seqlens must be packed [T, d_model], got shape {list(H.shape)}")
        if d_mask is not None:
            raise ValueError("d_mask must be None for packed H (cu_seqlens already says which rows are real)")
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(f"cu_seqlens must be int32 [B + 1], got {cu.dtype} of shape {list(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"cu_seqlens is on {cu.device} but Q is on {q.device}")
        return cls(q, H, W, b, q_mask, None, cu, mask_mode, normalize, squeeze, False)

    def requires_grad(self) -> bool:
        return torch.is_grad_enabled() and (
            self.q.requires_grad or self.h.requires_grad or self.w.requires_grad
            or (self.b is not None and self.b.requires_grad))

    def finish(self, scores: torch.Tensor) -> torch.Tensor:
        """Shape the canonical ``[Nq, B]`` result the way the caller passed ``Q``."""
        return scores[0] if self.squeeze_query else scores
