"""Input checks of :func:`lik.contrastive_loss`: the MaxSim inputs (:class:`~lik.ops.maxsim.validation.MaxSimInputs`,
checked once), the labels and the temperature. Shapes, dtypes and devices only (no host synchronisation), except the
range of labels held on the CPU, which costs nothing to read; each error names its argument."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..maxsim.validation import QUANTIZED_DTYPES, MaxSimInputs

__all__ = ["ContrastiveInputs", "check_labels", "check_temperature"]


def check_temperature(temperature) -> float:
    """``temperature`` as a Python float: a real number, finite and positive."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a positive Python number, got {type(temperature).__name__}")
    value = float(temperature)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature!r}")
    return value


def check_labels(labels, n_q: int, n_docs: int, device: torch.device) -> torch.Tensor | None:
    """``labels``: None (the diagonal: query ``i``'s positive is document ``i``, so ``Nq <= B``) or an int64 ``[Nq]``
    tensor on the embeddings' device with values in ``[0, B)`` (read here only for a CPU tensor: reading a CUDA
    one would synchronise, and the kernel turns an out-of-range label's row into NaN instead)."""
    if labels is None:
        if n_q > n_docs:
            raise ValueError(
                f"labels=None means the diagonal (query i's positive is document i), which needs Nq <= B; got "
                f"Nq = {n_q} queries and B = {n_docs} documents: pass labels"
            )
        return None
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be an int64 torch.Tensor or None, got {type(labels).__name__}")
    if labels.dtype != torch.int64:
        raise TypeError(f"labels must be int64 (as F.cross_entropy takes class indices), got {labels.dtype}")
    if tuple(labels.shape) != (n_q,):
        raise ValueError(f"labels must have shape [Nq] = [{n_q}], got {list(labels.shape)}")
    if labels.device != device:
        raise ValueError(f"labels is on {labels.device} but the embeddings are on {device}")
    if labels.device.type == "cpu" and n_q and bool(((labels < 0) | (labels >= n_docs)).any()):
        bad = labels[(labels < 0) | (labels >= n_docs)][0].item()
        raise ValueError(f"labels must lie in [0, B) = [0, {n_docs}), got {bad}")
    return labels


@dataclass(frozen=True)
class ContrastiveInputs:
    """A checked call: the canonical MaxSim bundle, the labels (None: the diagonal) and the temperature."""

    maxsim: MaxSimInputs
    labels: torch.Tensor | None
    temperature: float

    @classmethod
    def build(cls, Q, D, labels, temperature, q_mask, d_mask, mask_mode: str) -> ContrastiveInputs:
        for name, x in (("Q", Q), ("D", D)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dtype in QUANTIZED_DTYPES:
                raise TypeError(
                    f"{name} is {x.dtype}: contrastive_loss trains float embeddings (8-bit scoring is inference only)"
                )
        if Q.dim() != 3:
            raise ValueError(f"Q must be [Nq, Lq, d], got shape {list(Q.shape)} (one query is Q[None])")
        inputs = MaxSimInputs.build(Q, D, q_mask, d_mask, mask_mode, allow_float64=True)
        n_q, n_docs = Q.shape[0], inputs.d.shape[1]
        if n_q == 0:
            raise ValueError("Q holds no query (Nq = 0): the mean loss over no queries is undefined")
        if n_docs == 0:
            raise ValueError("D holds no document (B = 0): a query needs at least one candidate")
        temperature = check_temperature(temperature)
        return cls(inputs, check_labels(labels, n_q, n_docs, Q.device), temperature)
