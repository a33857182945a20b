"""Shared pieces of the fuzz campaign: settings, the path under test, random contents, views, comparisons and the
float64 brute force of one MaxSim pair (written out here, independent of lik's own reference).

Contents are drawn from a seed that hypothesis picks, in one of three kinds:

* ``coarse``: multiples of 1/4 in [-1/2, 1/2] -- most similarities tie exactly;
* ``dyadic``: multiples of 1/8 in [-2, 2] -- every product, sum and gradient of the test sizes is exact in
  float16 / float32 whatever the summation order, so kernels and brute force must agree bit for bit, ties
  included;
* ``gaussian``: standard normal values, compared with a tolerance (gradients only where no near-tie makes the
  winner a matter of rounding).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from hypothesis import settings

from .conftest import PROFILE_VARIABLE

__all__ = [
    "PATHS", "KINDS", "EXACT_KINDS", "GARBAGE", "fuzz_settings", "run_on", "values", "as_view", "poison",
    "draw_mask", "as_mask_argument", "grads_of", "assert_matches", "pair_score", "brute_maxsim",
]

PATHS = ["kernel", "reference"]
KINDS = ["coarse", "dyadic", "gaussian"]
EXACT_KINDS = ("coarse", "dyadic")
GARBAGE = [float("nan"), float("inf"), -float("inf"), 1e30, -1e30]
LAYOUTS = ["contiguous", "transposed", "strided", "padded"]


def fuzz_settings(weight: float = 1.0) -> settings:
    """The active profile (``LIK_FUZZ_PROFILE``, default ``ci``) with ``weight`` times its example count: cheap
    properties ask for more examples, slow ones for fewer."""
    profile = settings.get_profile("lik-fuzz-" + os.environ.get(PROFILE_VARIABLE, "ci"))
    return settings(profile, max_examples=max(1, round(profile.max_examples * weight)))


@contextlib.contextmanager
def run_on(path: str):
    """Run the body through the Triton kernels (``"kernel"``: the interpreter on CPU tensors) or through the
    PyTorch reference path (``"reference"``), as tests/ops does: lik reads ``TRITON_INTERPRET`` on every call."""
    if path == "kernel" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("the kernel path on CPU tensors needs TRITON_INTERPRET=1 when Triton is imported")
    saved = os.environ.get("TRITON_INTERPRET")
    if path == "reference":
        os.environ["TRITON_INTERPRET"] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


def values(gen: torch.Generator, shape, kind: str, dtype=torch.float32) -> torch.Tensor:
    """Random contents of ``kind`` (see the module docstring), exactly representable in ``dtype``."""
    if kind == "coarse":
        x = torch.randint(-2, 3, shape, generator=gen).double() / 4
    elif kind == "dyadic":
        x = torch.randint(-16, 17, shape, generator=gen).double() / 8
    else:
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
    return x.to(dtype)


def poison(x: torch.Tensor, invalid: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``x`` with every element of the rows where ``invalid [x.shape[:-1]]`` is True replaced by garbage."""
    x = x.clone()
    picks = torch.randint(0, len(GARBAGE), x.shape, generator=gen)
    garbage = torch.tensor(GARBAGE, dtype=torch.float64)[picks].to(x.dtype)
    return torch.where(invalid[..., None], garbage, x)


def as_view(x: torch.Tensor, layout: str, requires_grad: bool = False) -> torch.Tensor:
    """A tensor equal to ``x`` laid out as ``layout``: ``contiguous``; ``transposed`` (first two dimensions
    swapped in storage); ``strided`` (every other element of the last dimension, garbage in between);
    ``padded`` (a slice of a buffer one element larger on every side, garbage around it). With
    ``requires_grad`` the view is a non-leaf of a leaf buffer, so gradients are taken with respect to it."""
    if x.dtype == torch.bool:
        fill = True
    elif x.dtype.is_floating_point:
        fill = float("nan")
    else:
        fill = 1
    if layout == "transposed" and x.dim() >= 2:
        leaf = x.transpose(0, 1).contiguous()
        leaf.requires_grad_(requires_grad)
        return leaf.transpose(0, 1)
    if layout == "strided" and x.dim() >= 1:
        leaf = torch.full(tuple(x.shape[:-1]) + (2 * x.shape[-1] + 1,), fill, dtype=x.dtype)
        leaf[..., 1::2] = x
        leaf.requires_grad_(requires_grad)
        return leaf[..., 1::2]
    if layout == "padded" and x.dim() >= 1:
        leaf = torch.full(tuple(s + 2 for s in x.shape), fill, dtype=x.dtype)
        inner = tuple(slice(1, s + 1) for s in x.shape)
        leaf[inner] = x
        leaf.requires_grad_(requires_grad)
        return leaf[inner]
    leaf = x.clone()
    leaf.requires_grad_(requires_grad)
    return leaf


def draw_mask(gen: torch.Generator, shape, density: float) -> torch.Tensor:
    """bool mask, True (a real token) with probability ``density``."""
    return torch.rand(shape, generator=gen) < density


def as_mask_argument(mask: torch.Tensor | None, form: str, layout: str) -> torch.Tensor | None:
    """The mask as a caller passes it: bool, or integer 0/1 (int64 / int32 / uint8: tokenizers' attention
    masks), in ``layout``."""
    if mask is None:
        return None
    dtype = {"bool": torch.bool, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}[form]
    return as_view(mask.to(dtype), layout)


def grads_of(out: torch.Tensor, inputs, grad_out: torch.Tensor):
    """``d sum(out * grad_out) / d inputs``; an input that the output does not reach gets zeros."""
    if out.numel() == 0 or not out.requires_grad:
        return tuple(torch.zeros_like(t) for t in inputs)
    grads = torch.autograd.grad(out, inputs, grad_out.to(out.dtype), allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads))


def assert_matches(got: torch.Tensor, expected: torch.Tensor, what: str, *, exact: bool, rtol: float = 1e-5,
                   scale: float = 1.0):
    """``got`` equals ``expected`` (float64): same shape, NaN and infinities at the same places, and the finite
    values equal (``exact``) or within ``rtol`` of the largest expected magnitude (at least ``scale``: the size
    of the terms that cancelled into ``expected``)."""
    got, expected = got.detach().double(), expected.detach().double()
    assert tuple(got.shape) == tuple(expected.shape), (
        f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    )
    nan_got, nan_exp = torch.isnan(got), torch.isnan(expected)
    assert torch.equal(nan_got, nan_exp), (
        f"{what}: NaN at {nan_got.nonzero().tolist()}, expected at {nan_exp.nonzero().tolist()}\n"
        f"got {got}\nexpected {expected}"
    )
    inf_got, inf_exp = torch.isinf(got), torch.isinf(expected)
    assert torch.equal(inf_got, inf_exp) and torch.equal(got[inf_got], expected[inf_exp]), (
        f"{what}: infinities differ\ngot {got}\nexpected {expected}"
    )
    finite = ~(nan_exp | inf_exp)
    if not finite.any():
        return
    diff = (got[finite] - expected[finite]).abs()
    bound = 0.0 if exact else rtol * max(1.0, scale, float(expected[finite].abs().max()))
    worst = int(diff.argmax())
    position = finite.nonzero()[worst].tolist()
    assert float(diff.max()) <= bound, (
        f"{what}: differs by {float(diff.max()):.3g} (allowed {bound:.3g}) at {position}: "
        f"got {float(got[tuple(position)])!r}, expected {float(expected[tuple(position)])!r}"
    )


def pair_score(q: torch.Tensor, q_valid: torch.Tensor, d: torch.Tensor, d_valid: torch.Tensor, mask_mode: str):
    """float64 MaxSim of one query ``q [Lq, dim]`` and one document ``d [Ld, dim]`` under the contract, written
    out row by row; differentiable (the gradient goes to the winning token: the first of equal maxima).

    Returns ``(score, gap)``: ``gap`` is the smallest margin between a row's winner and the best
    strictly smaller candidate (inf when no row has one), so callers can tell when float32 rounding may pick
    another winner."""
    q = torch.where(q_valid[:, None], q, 0)  # masked rows never reach a value or a gradient
    d = torch.where(d_valid[:, None], d, 0)
    total = torch.zeros((), dtype=torch.float64)
    gap = float("inf")
    if mask_mode == "exclude" and not bool(d_valid.any()):
        return total, gap  # a document without a valid token scores 0, whatever the query holds
    if d.shape[0] == 0:
        return total, gap
    sims = (q[:, None, :] * d[None, :, :]).sum(-1)  # [Lq, Ld]
    for s in range(q.shape[0]):
        if not bool(q_valid[s]):
            continue  # a masked query token adds 0
        row = sims[s].detach()
        # "exclude": masked tokens are no candidates; "zero": their similarity is a constant 0 that competes.
        candidates = torch.where(d_valid, row, float("-inf") if mask_mode == "exclude" else 0.0)
        if bool(torch.isnan(candidates).any()):
            total = total + float("nan")
            continue
        best = candidates.max()
        winner = int((candidates == best).nonzero()[0])
        below = candidates[candidates < best]
        if below.numel() and torch.isfinite(best):
            gap = min(gap, float(best - below.max()))
        if bool(d_valid[winner]):
            total = total + sims[s, winner]
    return total, gap


def brute_maxsim(Q: torch.Tensor, D: torch.Tensor, q_valid: torch.Tensor, d_valid: torch.Tensor, mask_mode: str):
    """``Q [Nq, Lq, dim]``, ``D [Ns, B, Ld, dim]`` (``Ns`` 1 or ``Nq``), bool masks ``[Nq, Lq]`` /
    ``[Ns, B, Ld]`` -> ``(scores float64 [Nq, B], smallest winner gap)``."""
    n_q, n_docs = Q.shape[0], D.shape[1]
    rows, gap = [], float("inf")
    for n in range(n_q):
        s = n if D.shape[0] > 1 else 0
        row = []
        for j in range(n_docs):
            score, g = pair_score(Q[n], q_valid[n], D[s, j], d_valid[s, j], mask_mode)
            row.append(score)
            gap = min(gap, g)
        rows.append(torch.stack(row) if row else torch.zeros(0, dtype=torch.float64))
    if not rows:
        return torch.zeros(0, n_docs, dtype=torch.float64), gap
    return torch.stack(rows), gap
