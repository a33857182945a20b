"""Input checks of :func:`lik.maxsim_residual` and its canonical layout.

Every check raises a one-line ``ValueError`` / ``TypeError`` naming the argument, before any kernel runs. The
``cu_seqlens`` values and the code range are read once on the host (one synchronisation on a GPU), so unchecked
offsets or codes never reach a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lik.compression.codec import ResidualCodec

__all__ = ["ResidualInputs", "check_residual_inputs"]

_FLOAT_Q = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class ResidualInputs:
    """Checked inputs: ``q [Nq, Lq, d]``, ``q_mask`` bool ``[Nq, Lq]`` or None, ``codes`` int ``[T]``,
    ``residuals`` uint8 ``[T, d * nbits // 8]``, ``cu`` int32 ``[B + 1]`` (all on ``q``'s device),
    ``squeeze`` (a 2-D ``Q``) and ``max_len`` (the longest document)."""

    q: torch.Tensor
    q_mask: torch.Tensor | None
    codes: torch.Tensor
    residuals: torch.Tensor
    cu: torch.Tensor
    codec: ResidualCodec
    squeeze: bool
    max_len: int

    @property
    def n_docs(self) -> int:
        return int(self.cu.shape[0]) - 1

    def finish(self, scores: torch.Tensor) -> torch.Tensor:
        """``[Nq, B]`` -> the caller's shape (``[B]`` for a 2-D ``Q``)."""
        return scores[0] if self.squeeze else scores


def _tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_residual_inputs(Q, codes, residuals, codec, cu_seqlens, q_mask=None) -> ResidualInputs:
    """Validate the arguments of :func:`lik.maxsim_residual` and bring them to one device and layout.

    Returns a :class:`ResidualInputs`; see that function for the argument contract."""
    if not isinstance(codec, ResidualCodec):
        raise TypeError(f"codec must be a lik.compression.ResidualCodec, got {type(codec).__name__}")
    Q = _tensor("Q", Q)
    if Q.dtype not in _FLOAT_Q:
        raise TypeError(f"Q must be float16, bfloat16, float32 or float64, got {Q.dtype}")
    if Q.dim() not in (2, 3):
        raise ValueError(f"Q must be [Lq, d] or [Nq, Lq, d], got shape {tuple(Q.shape)}")
    dim = int(Q.shape[-1])
    if dim % 8:
        raise ValueError(f"Q's last dimension d must be a multiple of 8 (ColBERT packs whole bytes), got {dim}")
    if dim != codec.dim:
        raise ValueError(f"Q's last dimension must equal the codec's d = {codec.dim}, got {dim}")
    codes = _tensor("codes", codes)
    if codes.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"codes must be int32 or int64, got {codes.dtype}")
    if codes.dim() != 1:
        raise ValueError(f"codes must be 1-D [T], got shape {tuple(codes.shape)}")
    residuals = _tensor("residuals", residuals)
    if residuals.dtype != torch.uint8:
        raise TypeError(f"residuals must be uint8, got {residuals.dtype}")
    width = codec.packed_dim
    if residuals.dim() != 2 or tuple(residuals.shape) != (codes.shape[0], width):
        raise ValueError(
            f"residuals must have shape [{codes.shape[0]}, {width}] (codes' T, d * nbits // 8 for nbits "
            f"{codec.nbits}), got {tuple(residuals.shape)}"
        )
    cu_seqlens = _tensor("cu_seqlens", cu_seqlens)
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 (int64 accepted), got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be 1-D [B + 1] with B >= 0, got shape {tuple(cu_seqlens.shape)}")
    device = Q.device
    for name, t in (("codes", codes), ("residuals", residuals), ("cu_seqlens", cu_seqlens)):
        if t.device != device:
            raise ValueError(f"{name} must be on Q's device {device}, got {t.device}")
    if codec.device != device:
        raise ValueError(f"codec must be on Q's device {device} (codec.to(device)), got {codec.device}")
    squeeze = Q.dim() == 2
    q = Q.unsqueeze(0) if squeeze else Q
    if q_mask is not None:
        q_mask = _tensor("q_mask", q_mask)
        if q_mask.dtype != torch.bool:
            raise TypeError(f"q_mask must be bool, got {q_mask.dtype}")
        if tuple(q_mask.shape) != tuple(Q.shape[:-1]):
            raise ValueError(f"q_mask must have shape {tuple(Q.shape[:-1])} (Q's without d), got {tuple(q_mask.shape)}")
        if q_mask.device != device:
            raise ValueError(f"q_mask must be on Q's device {device}, got {q_mask.device}")
        q_mask = q_mask.unsqueeze(0) if squeeze else q_mask
    n_tokens = int(codes.shape[0])
    cu_host = cu_seqlens.to("cpu", torch.int64)
    if int(cu_host[0]) != 0 or int(cu_host[-1]) != n_tokens:
        raise ValueError(
            f"cu_seqlens must start at 0 and end at T = {n_tokens}, got {int(cu_host[0])} .. {int(cu_host[-1])}"
        )
    lengths = cu_host[1:] - cu_host[:-1]
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError("cu_seqlens must be non-decreasing")
    if n_tokens and (int(codes.min()) < 0 or int(codes.max()) >= codec.num_centroids):
        raise ValueError(f"codes must lie in [0, {codec.num_centroids}) (the codec's centroids)")
    max_len = int(lengths.max()) if lengths.numel() else 0
    return ResidualInputs(
        q,
        q_mask,
        codes,
        residuals,
        cu_seqlens.to(torch.int32),
        codec,
        squeeze,
        max_len,
    )
