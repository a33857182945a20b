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

__all__ = [
    "MaxSimInputs", "KERNEL_DTYPES", "QUANTIZED_DTYPES", "MASK_MODES", "MAX_DIM", "check_mask", "canonical_query",
    "check_matches",
    "check_real", "check_width", "check_quantized",
]

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)
MASK_MODES = ("exclude", "zero")
MAX_DIM = 8192  # widest embedding d every path is compiled and tested for


def _check_tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_real(name: str, x: torch.Tensor) -> None:
    """Embeddings are real: a complex ``x`` is refused (a cast would drop its imaginary part unseen). Callers test
    it where a dtype is already refused, so the float path pays nothing."""
    if x.is_complex():
        raise TypeError(f"{name} must be a real tensor (float or 8-bit), got complex dtype {x.dtype}")


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


def canonical_query(Q: torch.Tensor, q_mask) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """The one check of a query's mask, and the query's canonical layout, for every scorer taking dense queries
    (``lik.maxsim``, ``lik.maxsim_packed``, ``lik.search``): ``(q [Nq, Lq, d], q_mask bool [Nq, Lq] or None,
    squeeze)``, ``squeeze`` True for a 2-D ``Q`` (views; the mask is checked by :func:`check_mask` against
    ``Q.shape[:-1]``). ``Q`` is a tensor of 2 or 3 dimensions, checked by the caller."""
    q_mask = check_mask("q_mask", q_mask, tuple(Q.shape[:-1]), Q.device)
    if Q.dim() == 3:
        return Q, q_mask, False
    return Q.unsqueeze(0), (None if q_mask is None else q_mask.unsqueeze(0)), True


def check_matches(name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """``x`` must share ``ref``'s dtype, device and embedding dim (the last axis); errors name both."""
    if x.dtype != ref.dtype:
        check_real(name, x)
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


def _check_scale(name: str, scale, rows_name: str, rows: torch.Tensor) -> torch.Tensor:
    if scale is None:
        raise ValueError(
            f"{name} is required: {rows_name} is {rows.dtype}, pass its per-row scale from lik.quantize "
            f"({rows_name}_q, {name} = lik.quantize(x, {rows.dtype}))"
        )
    scale = _check_tensor(name, scale)
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 (as lik.quantize returns it), got {scale.dtype}")
    if tuple(scale.shape) != tuple(rows.shape[:-1]):
        raise ValueError(
            f"{name} must have shape {rows_name}.shape[:-1] = {list(rows.shape[:-1])}, got {list(scale.shape)}"
        )
    if scale.device != rows.device:
        raise ValueError(f"{name} is on {scale.device} but {rows_name} is on {rows.device}")
    if scale.requires_grad:
        raise ValueError(f"{name} requires grad: 8-bit scoring is inference only (no gradient flows to the scales)")
    return scale


def check_quantized(Q, D, q_scale, d_scale, *, q_name: str = "Q", d_name: str = "D"):
    """Check the 8-bit side of a scorer's arguments; return ``(q_scale, d_scale, quantize_q)``.

    ``D`` int8 / float8_e4m3fn needs ``d_scale`` (fp32, ``D.shape[:-1]``); a ``Q`` of the same dtype needs
    ``q_scale``; a float ``Q`` gets ``quantize_q`` True: the caller quantizes it per token to ``D``'s dtype
    (:func:`quantize_query`) once every other check has passed, so the scores are MaxSim of the dequantized
    operands. Float ``D`` takes no scales and no 8-bit ``Q``. Everything 8-bit is inference only. Errors name
    the argument; nothing runs here.
    """
    Q = _check_tensor(q_name, Q)
    D = _check_tensor(d_name, D)
    if D.dtype not in QUANTIZED_DTYPES:
        if Q.dtype in QUANTIZED_DTYPES:
            raise TypeError(
                f"{q_name} is {Q.dtype} but {d_name} is {D.dtype}: 8-bit queries score 8-bit documents of the same "
                f"dtype (quantize {d_name} with lik.quantize, or pass a float {q_name})"
            )
        for name, scale, rows_name, rows in (("q_scale", q_scale, q_name, Q), ("d_scale", d_scale, d_name, D)):
            if scale is not None:
                raise ValueError(
                    f"{name} is only for an 8-bit {rows_name} (int8 or float8_e4m3fn), got {rows_name} {rows.dtype}"
                )
        return None, None, False
    if Q.dtype in QUANTIZED_DTYPES and Q.dtype != D.dtype:
        raise TypeError(
            f"{q_name} is {Q.dtype} but {d_name} is {D.dtype}: mixed 8-bit operands are not supported, "
            f"quantize both to one dtype"
        )
    if Q.dtype not in QUANTIZED_DTYPES and Q.dtype not in KERNEL_DTYPES + (torch.float64,):
        check_real(q_name, Q)
        raise TypeError(f"{q_name} must be float or {D.dtype} to score an {D.dtype} {d_name}, got {Q.dtype}")
    if D.requires_grad:
        raise ValueError(f"{d_name} ({D.dtype}) requires grad: 8-bit scoring is inference only")
    d_scale = _check_scale("d_scale", d_scale, d_name, D)
    if Q.dtype == D.dtype:
        if Q.requires_grad:
            raise ValueError(f"{q_name} ({Q.dtype}) requires grad: 8-bit scoring is inference only")
        q_scale = _check_scale("q_scale", q_scale, q_name, Q)
    else:
        if q_scale is not None:
            raise ValueError(
                f"q_scale is only for an 8-bit {q_name}; a float {q_name} ({Q.dtype}) is quantized per token to "
                f"{D.dtype} by the scorer"
            )
        if Q.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{q_name} requires grad but {d_name} is {D.dtype}: 8-bit scoring is inference only (no gradient "
                f"flows through the quantization); detach {q_name} or run under torch.no_grad()"
            )
    if Q.device != D.device:
        raise ValueError(f"{d_name} is on {D.device} but {q_name} is on {Q.device}")
    if D.dtype == torch.float8_e4m3fn:
        from ..quantization.function import check_fp8_supported

        check_fp8_supported(D.device, d_name)
    return q_scale, d_scale, Q.dtype != D.dtype


def quantize_query(Q: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A float query quantized per token to the documents' 8-bit ``dtype`` (:func:`lik.quantize`)."""
    from ..quantization.function import quantize

    return quantize(Q.detach(), dtype)


@dataclass(frozen=True)
class MaxSimInputs:
    q: torch.Tensor
    d: torch.Tensor
    q_mask: torch.Tensor | None
    d_mask: torch.Tensor | None
    mask_mode: str
    squeeze_query: bool  # 2-D Q: the result is [B] instead of [1, B]
    per_query_documents: bool  # D was [Nq, B, Ld, d]
    q_scale: torch.Tensor | None = None  # 8-bit rows: fp32 [Nq, Lq]
    d_scale: torch.Tensor | None = None  # 8-bit rows: fp32 [n_sets, B, Ld]
    # fp32 products: None follows torch.get_float32_matmul_precision(); "tf32" for operands already split into
    # TF32 parts by an internal caller (Chamfer's nearest neighbours).
    dot_precision: str | None = None

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
        q_scale=None,
        d_scale=None,
    ) -> MaxSimInputs:
        Q = _check_tensor("Q", Q)
        D = _check_tensor("D", D)
        # One test on the float path's host time; the 8-bit checks live in check_quantized.
        eight_bit = q_scale is not None or d_scale is not None or D.dtype in QUANTIZED_DTYPES or (
            Q.dtype in QUANTIZED_DTYPES
        )
        if mask_mode not in MASK_MODES:
            raise ValueError(f"mask_mode must be one of {MASK_MODES}, got {mask_mode!r}")
        if Q.dim() not in (2, 3):
            raise ValueError(f"Q must be [Lq, d] or [Nq, Lq, d], got shape {list(Q.shape)}")
        if D.dim() not in (3, 4):
            raise ValueError(f"D must be [B, Ld, d] or [Nq, B, Ld, d], got shape {list(D.shape)}")
        quantize_q = False
        if eight_bit:
            q_scale, d_scale, quantize_q = check_quantized(Q, D, q_scale, d_scale)
            if not quantize_q:
                check_matches("D", D, "Q", Q)
            elif D.shape[-1] != Q.shape[-1]:  # Q is quantized to D's dtype below; the devices were checked
                raise ValueError(f"D has embedding dim {D.shape[-1]} but Q has {Q.shape[-1]}")
        else:
            allowed = KERNEL_DTYPES + ((torch.float64,) if allow_float64 else ())
            if Q.dtype not in allowed:
                check_real("Q", Q)
                raise TypeError(f"Q must have dtype in {[str(t) for t in allowed]}, got {Q.dtype}")
            check_matches("D", D, "Q", Q)
        check_width("Q", Q)

        per_query = D.dim() == 4
        if per_query:
            if Q.dim() == 2:
                raise ValueError("D of shape [Nq, B, Ld, d] needs 3-D Q [Nq, Lq, d]; got 2-D Q")
            if D.shape[0] != Q.shape[0]:
                raise ValueError(f"D is [Nq, B, Ld, d] with Nq={D.shape[0]} but Q has Nq={Q.shape[0]}")
            d = D
        else:
            d = D.unsqueeze(0)

        q, q_mask, squeeze = canonical_query(Q, q_mask)
        d_mask = check_mask("d_mask", d_mask, tuple(D.shape[:-1]), Q.device)
        if d_mask is not None and not per_query:
            d_mask = d_mask.unsqueeze(0)
        if not eight_bit:
            return cls(q, d, q_mask, d_mask, mask_mode, squeeze, per_query)
        if quantize_q:  # last: every check has passed
            q, q_scale = quantize_query(q, d.dtype)
        elif squeeze:
            q_scale = q_scale.unsqueeze(0)
        if not per_query:
            d_scale = d_scale.unsqueeze(0)
        return cls(q, d, q_mask, d_mask, mask_mode, squeeze, per_query, q_scale, d_scale)

    def finish(self, scores: torch.Tensor) -> torch.Tensor:
        """Shape the canonical ``[Nq, B]`` result the way the caller passed ``Q``."""
        return scores[0] if self.squeeze_query else scores
