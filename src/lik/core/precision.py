"""Accumulation precision shared by every op's reference and host-side arithmetic."""

from __future__ import annotations

import torch

__all__ = ["accumulation_dtype"]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (the references' test precision); every other input accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
