"""Input checking and canonical layout for every MaxSim entry point.

All checks run on shapes, dtypes and devices only (no host synchronisation), before any kernel is launched, and
each error names the offending argument. The canonical layout the kernels and the reference share is:

* ``q``: ``[Nq, Lq, d]``;
* ``d``: ``[n_sets, B, Ld, d]`` with ``n_sets`` 1 (shared documents) or ``Nq`` (one candidate set per query);
* ``q_mask``: bool ``[Nq, Lq]`` or None; ``d_mask``: bool ``[n_sets, B, Ld]`` or None.

Views are used throughout (``unsqueeze``), so non-contiguous inputs are never copied here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MaxSimInputs", "KERNEL_DTYPES", "MASK_MODES", "MAX_DIM", "check_mask", "check_matches", "check_width"]

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MASK_MODES = ("exclude", "zero")
MAX_DIM = 8192  # widest embedding d every path is compiled and tested for


def _check_tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_mask(name: str, mask, expected_shape: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    """Validate a token mask (bool, or integer 0/1 as produced by tokenizers) and return it as bool."""
    if mask is None:
        return None
    mask = _check_tensor(name, mask)
    if mask.dtype != torch.bool:
        if mask.dtype.is_floating_point or mask.dtype.is_complex:
            raise TypeError(f"{name} must be a bool (or integer 0/1) mask, got dtype {mask.dtype}")
        mask = mask != 0
    if tuple(mask.shape) != tuple(expected_shape):
        raise ValueError(f"{name} must have shape {list(expected_shape)}, got {list(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"{name} is on {mask.device} but the embeddings are on {device}")
    return mask


def check_matches(name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """``x`` must share ``ref``'s dtype, device and embedding dim (the last axis); errors name both."""
    if x.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {x.dtype} but {ref_name} has {ref.dtype}: pass both in one dtype")
    if x.device != ref.device:
        raise ValueError(f"{name} is on {x.device} but {ref_name} is on {ref.device}")
    if x.shape[-1] != ref.shape[-1]:
        raise ValueError(f"{name} has embedding dim {x.shape[-1]} but {ref_name} has {ref.shape[-1]}")


def check_width(name: str, x: torch.Tensor) -> None:
    """The embedding width ``d`` (``x``'s last axis) must be at most :data:`MAX_DIM`."""
    if x.shape[-1] > MAX_DIM:
        raise ValueError(
            f"embedding width d = {x.shape[-1]} of {name} (shape {list(x.shape)}) is above the supported "
            f"maximum d = {MAX_DIM}"
        )


@dataclass(frozen=True)
class MaxSimInputs:
    q: torch.Tensor
    d: torch.Tensor
    q_mask: torch.Tensor | None
    d_mask: torch.Tensor | None
    mask_mode: str
    squeeze_query: bool  # 2-D Q: the result is [B] instead of [1, B]
    per_query_documents: bool  # D was [Nq, B, Ld, d]

    @classmethod
    def build(
        cls,
        Q,
        D,
        q_mask=None,
        d_mask=None,
        mask_mode: str = "exclude",
        *,
        allow_float64: bool = False,
    ) -> "MaxSimInputs":
        Q = _check_tensor("Q", Q)
        D = _check_tensor("D", D)
        if mask_mode not in MASK_MODES:
            raise ValueError(f"mask_mode must be one of {MASK_MODES}, got {mask_mode!r}")
        if Q.dim() not in (2, 3):
            raise ValueError(f"Q must be [Lq, d] or [Nq, Lq, d], got shape {list(Q.shape)}")
        if D.dim() not in (3, 4):
            raise ValueError(f"D must be [B, Ld, d] or [Nq, B, Ld, d], got shape {list(D.shape)}")
        allowed = KERNEL_DTYPES + ((torch.float64,) if allow_float64 else ())
        if Q.dtype not in allowed:
            raise TypeError(f"Q must have dtype in {[str(t) for t in allowed]}, got {Q.dtype}")
        check_matches("D", D, "Q", Q)
        check_width("Q", Q)

        squeeze = Q.dim() == 2
        q = Q.unsqueeze(0) if squeeze else Q
        n_q, l_q, _ = q.shape
        per_query = D.dim() == 4
        if per_query:
            if squeeze:
                raise ValueError("D of shape [Nq, B, Ld, d] needs 3-D Q [Nq, Lq, d]; got 2-D Q")
            if D.shape[0] != n_q:
                raise ValueError(f"D is [Nq, B, Ld, d] with Nq={D.shape[0]} but Q has Nq={n_q}")
            d = D
        else:
            d = D.unsqueeze(0)

        q_mask = check_mask("q_mask", q_mask, tuple(Q.shape[:-1]), Q.device)
        d_mask = check_mask("d_mask", d_mask, tuple(D.shape[:-1]), Q.device)
        if q_mask is not None and squeeze:
            q_mask = q_mask.unsqueeze(0)
        if d_mask is not None and not per_query:
            d_mask = d_mask.unsqueeze(0)
        return cls(q, d, q_mask, d_mask, mask_mode, squeeze, per_query)

    def finish(self, scores: torch.Tensor) -> torch.Tensor:
        """Shape the canonical ``[Nq, B]`` result the way the caller passed ``Q``."""
        return scores[0] if self.squeeze_query else scores
