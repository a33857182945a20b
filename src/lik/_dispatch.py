"""How every op reaches its kernels: eager launch, ``torch.compile`` custom op, autograd Function or reference.

Two small pieces, shared by :func:`lik.maxsim`, the packed MaxSim entry points and :func:`lik.ms_deform_attn`:

* :func:`kernel_op` turns one host launcher (plain tensors and scalars in, tensors out) into a callable with two
  doors. Eager calls go straight to the launcher: the dispatcher's few microseconds would show on small,
  launch-bound calls (a Deformable-DETR decoder layer, a ColBERT training step). Under ``torch.compile`` the
  same launcher is reached as a ``torch.library`` custom operator with a shape-only fake implementation, because
  Dynamo cannot trace Triton's launch path; with the operator the call stays in one graph. Both doors run the
  same Python function, so they cannot drift apart.
* :func:`router` picks, for one public call, among the reference (inputs the kernels do not take: float64, CPU
  without ``TRITON_INTERPRET=1``), the autograd Function (a gradient is wanted), the custom operator (inference
  under ``torch.compile``) and the direct launch (eager inference: no autograd node, no saved buffers). All four
  callables take the same arguments, so the route adds one Python call and nothing else to a call's host time.

The caller computes the two facts the route needs, ``kernels`` (the op's "uses kernels?" predicate) and
``needs_grad`` (``torch.is_grad_enabled()`` and an input that requires grad), because some entry points need
``kernels`` earlier (the packed ones skip reading ``cu_seqlens`` values when the kernels run) and an inline
``or`` over a known set of tensors costs less than a generic loop.

Example (the packed MaxSim entry points; ``PackedInputs`` is their validated input bundle)::

    def _packed_forward_fake(q, d, cu_q, cu_d, q_mask, max_seqlen_q, store_argmax): ...

    @kernel_op("lik::maxsim_packed_forward", fake=_packed_forward_fake)
    def _packed_forward(q: Tensor, d: Tensor, cu_q: Tensor | None, cu_d: Tensor, q_mask: Tensor | None,
                        max_seqlen_q: int, store_argmax: bool) -> tuple[Tensor, Tensor]:
        scores, argmax = packed_forward(PackedInputs(q, d, cu_q, cu_d, q_mask, max_seqlen_q, False, True),
                                        store_argmax)
        return scores, argmax if argmax is not None else q.new_empty((0,), dtype=torch.int32)

    # In MaxSimPackedFunction.forward / backward: ``_packed_forward(...)`` and ``_packed_backward(...)``,
    # with no ``torch.compiler.is_compiling()`` test of their own.

    def _launch(inputs, deterministic):           # eager inference: the validated bundle as is
        return packed_forward(inputs, store_argmax=False)[0]

    def _compiled(inputs, deterministic):         # inference under torch.compile
        return _packed_forward.op(inputs.q, inputs.d, inputs.cu_q, inputs.cu_d, inputs.q_mask,
                                  inputs.max_seqlen_q, False)[0]

    def _autograd(inputs, deterministic):
        return MaxSimPackedFunction.apply(inputs.q, inputs.d, inputs.cu_q, inputs.cu_d, inputs.q_mask,
                                          inputs.max_seqlen_q, deterministic)

    _route = router(reference=lambda inputs, deterministic: packed_reference(inputs),
                    autograd=_autograd, compiled=_compiled, launch=_launch)

    def maxsim_varlen(q, d, cu_seqlens_q, cu_seqlens_d, max_seqlen_q=None, max_seqlen_d=None, *, backward="auto"):
        deterministic = resolve_backward(backward)
        kernels = isinstance(q, torch.Tensor) and uses_kernels(q)
        inputs = PackedInputs.build_pairs(q, d, cu_seqlens_q, cu_seqlens_d, max_seqlen_q, max_seqlen_d,
                                          read_values=not kernels, allow_float64=True)
        needs_grad = torch.is_grad_enabled() and (inputs.q.requires_grad or inputs.d.requires_grad)
        return _route(kernels, needs_grad, inputs, deterministic)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._device import interpreting

__all__ = ["kernel_op", "router", "uses_kernels", "resolve_backward", "BACKWARD_MODES"]

BACKWARD_MODES = ("auto", "fast", "deterministic")
# float8: the interpreter's conversion flushes small values, so CPU float8 runs the reference (GPU tests cover it).
_REFERENCE_ONLY_ON_CPU = (torch.float64, torch.bfloat16, torch.float8_e4m3fn)


def uses_kernels(x: torch.Tensor) -> bool:
    """Kernels run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``.

    float64 is reference-only. Triton's interpreter has no bfloat16 arithmetic and flushes small float8 values,
    so CPU bfloat16 and float8 run the reference even under the interpreter (their kernels are covered by the
    GPU tests); CPU int8 and the other float dtypes run the real kernels there."""
    if x.is_cuda:  # first and cheapest: this predicate is on every call's host path
        return x.dtype != torch.float64
    return x.device.type == "cpu" and x.dtype not in _REFERENCE_ONLY_ON_CPU and interpreting()


def resolve_backward(backward: str) -> bool:
    """``backward=`` of a trainable op: True for the deterministic (atomic-free) backward; "auto" follows
    ``torch.use_deterministic_algorithms``."""
    if backward not in BACKWARD_MODES:
        raise ValueError(f"backward must be one of {BACKWARD_MODES}, got {backward!r}")
    if backward == "auto":
        return torch.are_deterministic_algorithms_enabled()
    return backward == "deterministic"


def kernel_op(name: str, *, fake: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register ``launcher`` as the custom operator ``name`` (``"lik::..."``) with the fake (meta)
    implementation ``fake``, and return a callable that runs ``launcher`` directly in eager mode and the operator
    under ``torch.compile``.

    ``launcher`` must have the type annotations ``torch.library.custom_op`` needs (tensors, optional tensors,
    ints, floats, bools, strings) and must return tensors only (a 0-element placeholder where there is nothing
    to return). The returned callable keeps the operator as ``.op`` and the launcher as ``.launch``.

    Example:
        >>> def _scale_fake(x, factor): return torch.empty_like(x)
        >>> @kernel_op("lik_example::scale", fake=_scale_fake)
        ... def scale(x: torch.Tensor, factor: float) -> torch.Tensor:
        ...     return x * factor                        # a Triton launch in the real ops
        >>> scale(torch.ones(2), 3.0)                    # eager: the function itself, no dispatcher
        tensor([3., 3.])
    """

    def wrap(launcher: Callable[..., Any]) -> Callable[..., Any]:
        op = torch.library.custom_op(name, launcher, mutates_args=())
        op.register_fake(fake)

        def call(*args):
            if torch.compiler.is_compiling():
                return op(*args)
            return launcher(*args)

        call.op, call.launch = op, launcher
        call.__name__ = call.__qualname__ = launcher.__name__
        call.__doc__ = launcher.__doc__
        return call

    return wrap


def router(
    *,
    reference: Callable[..., Any],
    autograd: Callable[..., Any],
    compiled: Callable[..., Any],
    launch: Callable[..., Any],
) -> Callable[..., Any]:
    """Return ``route(kernels, needs_grad, *args)``, which calls exactly one of the four paths with ``*args``.

    Args:
        reference: the PyTorch reference, taken when ``kernels`` is False (it carries its own autograd).
        autograd: usually ``SomeFunction.apply`` (or a thin wrapper unpacking ``args``), taken when ``kernels``
            and ``needs_grad``; its forward and backward reach the kernels through :func:`kernel_op` callables.
        compiled: inference under ``torch.compile``: the forward custom operator (``some_kernel_op.op``).
        launch: eager inference: the host launcher, called directly.

    The four checks are ordered so eager inference, the host-bound case, pays one ``is_compiling()`` test.

    Example (:func:`lik.ms_deform_attn`, whose four paths take the same five tensors)::

        _route = router(reference=ms_deform_attn_reference, autograd=_autograd,
                        compiled=_forward.op, launch=msda_forward)
        return _route(_uses_kernels(value, loc, attn), needs_grad, value, shapes, starts, loc, attn)
    """

    def route(kernels: bool, needs_grad: bool, *args):
        if not kernels:
            return reference(*args)
        if needs_grad:
            return autograd(*args)
        if torch.compiler.is_compiling():
            return compiled(*args)
        return launch(*args)

    return route
