"""Launch configurations: one deterministic heuristic per op, and :func:`override` to force one.

A heuristic picks the tiles of a kernel family from what changes the best tile (the query-length bucket, ``d``,
the dtype, a few flags, the GPU architecture and SM count) and never benchmarks on the hot path. Tests, benchmarks
and users chasing the last percent force a configuration for a ``with`` block::

    from lik.config import MaxSimForwardConfig, override

    with override(maxsim_forward=MaxSimForwardConfig(group_rows=16, groups=2, block_n=16, block_k=128)):
        lik.maxsim(Q, D)

The heuristics live one module per op: :mod:`lik.config.maxsim`, :mod:`lik.config.msda`,
:mod:`lik.config.nearest`, :mod:`lik.config.packed` (the token stream of packed corpora, key ``packed_stream``),
:mod:`lik.config.residual` (the compressed-corpus scan, key ``residual_stream``); the device facts they read, in
:mod:`lik._device`.
"""

from __future__ import annotations

from .forced import forced, override
from .maxsim import (
    LONG_DOCUMENT,
    MAX_RESIDENT_DIM,
    MaxSimBackwardConfig,
    MaxSimForwardConfig,
    feature_chunks,
    maxsim_backward_config,
    maxsim_forward_config,
    maxsim_forward_doc_programs,
    maxsim_varlen_config,
)
from .msda import MsdaBackwardConfig, MsdaForwardConfig, msda_backward_config, msda_forward_config
from .nearest import NEAREST_POINT_MAX_DIM, NearestConfig, nearest_config
from .packed import PackedStreamConfig, packed_stream_config, packed_stream_tiles

__all__ = [
    "override", "forced",
    "MaxSimForwardConfig", "MaxSimBackwardConfig", "maxsim_forward_config", "maxsim_forward_doc_programs",
    "maxsim_backward_config", "maxsim_varlen_config", "feature_chunks", "LONG_DOCUMENT", "MAX_RESIDENT_DIM",
    "MsdaForwardConfig", "MsdaBackwardConfig", "msda_forward_config", "msda_backward_config",
    "NearestConfig", "nearest_config", "NEAREST_POINT_MAX_DIM",
    "PackedStreamConfig", "packed_stream_config", "packed_stream_tiles",
]
