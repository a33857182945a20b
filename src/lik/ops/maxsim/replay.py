"""Replays of recorded eager inference launches of :func:`lik.maxsim`.

A serving loop calls ``lik.maxsim`` with the same shapes again and again, and a small call is host bound: checking
the arguments, building the canonical views, choosing the tile and keying the launch cost more host time than the
kernel takes on the device (docs/design.md, "The launch cache"). Everything those steps compute is fixed by what
:func:`replay_key` reads from the arguments (shapes, strides, dtypes, devices, 16-byte alignment, the flags that
choose the path), so a call whose key was launched before only reads its tensors' addresses, allocates the result
and replays the recorded launch. The first call with a key runs the full path, checks included, and records it.

A launch is recorded only when every tensor the kernel was given is a view of one of the caller's tensors (same
address), or is the call's float query quantized to an 8-bit corpus's dtype: a serving loop scores float queries
against a stored 8-bit corpus, so that quantization is recorded too (:func:`quantize_rows_replay`) and a replay
quantizes the new query into buffers of its own before the scoring launch. A call that makes any other tensor on
the way (an integer mask turned bool, a strided scale copied, a query whose rows are copied before quantizing)
keeps the full path. Nothing is replayed under ``torch.compile``, for CPU tensors, while a launch config is forced
(:func:`lik._config.override`) or a Triton launch hook is installed, or when a gradient is needed.
"""

from __future__ import annotations

import torch

from ..._config import _OVERRIDES
from ..._launch import REPLAY_LIMIT, _current_device, replay_allowed, replay_of
from ..quantization.function import rows_of
from ..quantization.kernel import quantize_rows_replay
from .forward import chunk_sums
from ...core.forward_kernel import maxsim_fwd_kernel

__all__ = ["replay_key", "replay", "recorder", "REPLAYS"]

# key -> (replay, slots, partial shape, squeeze, query quantization or None), or None for a key whose launch takes
# a tensor of its own that a replay cannot make.
REPLAYS: dict[tuple, tuple | None] = {}

# Slots holding buffers the call makes itself (negative, so that they never name a caller's tensor):
_PARTIAL = -1  # its fp32 per-chunk sums
_QUERY = -2  # its float query quantized to the documents' dtype
_QUERY_SCALE = -3  # that query's fp32 per-token scales


def _tensor_key(x: torch.Tensor) -> tuple:
    return x.shape, x.stride(), x.dtype, x.device, x.requires_grad, x.data_ptr() & 15 == 0


def replay_key(Q, D, q_mask, d_mask, mask_mode, backward, q_scale, d_scale) -> tuple | None:
    """What fixes the launch of an eager inference call besides its tensors' addresses, or None when this call may
    not be replayed (not CUDA tensors, ``torch.compile`` tracing, a forced config or a launch hook, an argument
    that is not a tensor, a query or documents that require grad while grad is enabled)."""
    if (not isinstance(Q, torch.Tensor) or not isinstance(D, torch.Tensor) or not Q.is_cuda or _OVERRIDES
            or type(mask_mode) is not str or type(backward) is not str or torch.compiler.is_compiling()
            or not replay_allowed()):
        return None
    # A call that may need a gradient takes the autograd path (or is refused): no key, so training pays nothing
    # here. Past this test the grad mode changes no check's outcome, so it is not part of the key.
    if torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad):
        return None
    parts = [_current_device(), mask_mode, backward, _tensor_key(Q), _tensor_key(D)]
    for x in (q_mask, d_mask, q_scale, d_scale):
        if x is None:
            parts.append(None)
        elif isinstance(x, torch.Tensor):
            parts.append(_tensor_key(x))
        else:
            return None
    if Q.dtype == torch.float32:  # fp32 products follow the matmul precision (TF32 or not)
        parts.append(torch.get_float32_matmul_precision())
    return tuple(parts)


def replay(key: tuple, tensors: tuple) -> torch.Tensor | None:
    """The scores of a call whose key was recorded, launched from ``tensors`` = ``(Q, D, q_mask, d_mask, q_scale,
    d_scale)``; None when nothing is recorded for ``key``."""
    recorded = REPLAYS.get(key)
    if recorded is None:
        return None
    launch, slots, partial_shape, squeeze, query = recorded
    device = tensors[0].device
    partial = torch.empty(partial_shape, dtype=torch.float32, device=device)
    made = [None, partial.data_ptr()]  # indexed by -slot
    if query is not None:
        quantize, ints, shape, dtype = query
        q = torch.empty(shape, dtype=dtype, device=device)
        q_scale = torch.empty(shape[:-1], dtype=torch.float32, device=device)
        quantize(tensors[0].data_ptr(), q.data_ptr(), q_scale.data_ptr(), *ints)
        made += [q.data_ptr(), q_scale.data_ptr()]
    launch(*[(made[-slot] if slot < 0 else tensors[slot].data_ptr()) if type(slot) is int else slot[0]
             for slot in slots])
    scores = chunk_sums(partial)
    return scores[0] if squeeze else scores


def _query_quantization(Q: torch.Tensor, quantized: tuple, squeeze: bool) -> tuple | None:
    """``(replay, ints, shape, dtype)`` of the quantization that made ``quantized = (q, q_scale)`` from the caller's
    float ``Q``, or None when it cannot be replayed (the rows were copied first, or the launch was not recorded)."""
    rows = rows_of(Q.unsqueeze(0) if squeeze else Q)  # what MaxSimInputs.build quantized
    if rows.data_ptr() != Q.data_ptr():  # a copy: its address changes every call
        return None
    q, q_scale = quantized
    recorded = quantize_rows_replay(rows, q.view(-1, q.shape[-1]), q_scale.view(-1))
    if recorded is None:
        return None
    return (*recorded, tuple(q.shape), q.dtype)


def recorder(key: tuple, tensors: tuple, squeeze: bool, quantized_query: tuple | None = None):
    """A ``maxsim_forward(..., recorder=)`` callback filing the launch it made under ``key``: each tensor argument
    as the index of the caller's tensor it is a view of (``tensors`` as for :func:`replay`), the buffer of sums
    as :data:`_PARTIAL`, the call's quantized float query and its scales (``quantized_query = (q, q_scale)``, made
    by ``MaxSimInputs.build``) as :data:`_QUERY` / :data:`_QUERY_SCALE`, every other argument as its value."""
    addresses = [x.data_ptr() if isinstance(x, torch.Tensor) else None for x in tensors]
    given = [a for a in addresses if a is not None]
    made = {} if quantized_query is None else {
        quantized_query[0].data_ptr(): _QUERY, quantized_query[1].data_ptr(): _QUERY_SCALE}

    def record(grid, args, options, partial):
        if len(set(given)) != len(given):  # two arguments at one address: which one a slot reads is ambiguous
            return
        slots = []
        for arg in args:
            if arg is partial:
                slots.append(_PARTIAL)
            elif isinstance(arg, torch.Tensor):
                address = arg.data_ptr()
                if address in addresses:
                    slots.append(addresses.index(address))
                elif address in made:
                    slots.append(made[address])
                else:  # a tensor this call made that a replay cannot make: its address changes every call
                    REPLAYS[key] = None
                    return
            else:
                slots.append((arg,))
        query = None
        if _QUERY in slots or _QUERY_SCALE in slots:
            query = _query_quantization(tensors[0], quantized_query, squeeze)
            if query is None:
                REPLAYS[key] = None
                return
        launch = replay_of(maxsim_fwd_kernel, grid, *args, **options)
        if launch is None:  # launched through Triton's own path: nothing recorded to replay
            return
        if len(REPLAYS) >= REPLAY_LIMIT:
            REPLAYS.clear()
        REPLAYS[key] = (launch, tuple(slots), tuple(partial.shape), squeeze, query)

    return record
