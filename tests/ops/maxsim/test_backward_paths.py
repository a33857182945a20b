"""Every dD / dQ path of the MaxSim backward against the float64 reference (Triton interpreter on CPU).

``"fast"`` is the fp32 atomic scatter; ``"deterministic"`` picks the flat one-hot dD (long queries) or the
per-query one-hot loop (short ones) by query length. Each route is forced here on odd shapes, with masks in both
modes, several query token blocks per query, partial dQ document steps and a feature block narrower than ``d``.
"""

from __future__ import annotations

import pytest
import torch

import lik
from lik import _config
from lik.ops.maxsim import backward as bw

from .helpers import kernel_with_grads, rand_problem, reference_with_grads, rel_err

# (Nq, Lq, B, Ld, d)
SHAPES = [(5, 7, 3, 13, 8), (3, 37, 2, 40, 24), (1, 1, 1, 1, 1), (4, 3, 5, 33, 33)]
# backward mode and, for "deterministic", whether the flat one-hot loop is forced on (True) or off (False)
ROUTES = {"scatter": ("fast", None), "flat-onehot": ("deterministic", True), "query-loop": ("deterministic", False)}


def _force(monkeypatch, route):
    backward, flat = ROUTES[route]
    if flat is not None:
        monkeypatch.setattr(bw, "uses_flat_onehot", lambda l_q: flat)
    return backward


@pytest.fixture(autouse=True)
def _kernels_only():
    if not _config.interpreting():
        pytest.skip("kernel paths run under TRITON_INTERPRET=1 (or on the GPU tests)")


def _check(rng, shape, *, per_query=False, masks=True, mask_mode="exclude", backward="fast", tol=2e-6):
    n_q, l_q, n_docs, l_d, dim = shape
    Q, D, qm, dm = rand_problem(rng, n_q, l_q, n_docs, l_d, dim, per_query=per_query, masks=masks)
    grad = torch.randn((n_q, n_docs), generator=rng)
    s, dq, dd = kernel_with_grads(lik.maxsim, Q, D, qm, dm, grad, mask_mode=mask_mode, backward=backward)
    rs, rdq, rdd = reference_with_grads(Q, D, qm, dm, grad, mask_mode)
    assert dq.dtype == Q.dtype and dd.dtype == D.dtype
    assert rel_err(dq, rdq) < tol
    assert rel_err(dd, rdd) < tol
    if qm is not None:
        assert torch.all(dq[~qm] == 0)
    if dm is not None:
        assert torch.all(dd[~dm] == 0)
    return dq, dd


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
def test_dd_routes(rng, monkeypatch, shape, route, mask_mode):
    _check(rng, shape, mask_mode=mask_mode, backward=_force(monkeypatch, route))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dq_docs", [1, 3])
@pytest.mark.parametrize("onehot", [(16, 16), (32, 32)])
def test_tiles(rng, shape, dq_docs, onehot):
    """Partial dQ document steps, one-hot row tiles larger than the query / document, narrow feature blocks."""
    cfg = _config.MaxSimBackwardConfig(
        block_rows=16, block_doc_rows=16, block_k=16, dq_docs=dq_docs, onehot_rows=onehot[0],
        onehot_doc_rows=onehot[1],
    )
    with _config.override(maxsim_backward=cfg):
        for backward in ("fast", "deterministic"):
            _check(rng, shape, backward=backward)


@pytest.mark.parametrize("backward", ["fast", "deterministic"])
def test_per_query_documents_and_no_masks(rng, backward):
    _check(rng, (3, 20, 2, 19, 16), per_query=True, backward=backward)
    _check(rng, (3, 20, 2, 19, 16), masks=False, backward=backward)
    _check(rng, (2, 70, 3, 19, 16), backward=backward)  # long queries: the flat one-hot when deterministic


def test_nan_is_never_dropped(rng):
    """A NaN query token reaches the document gradient of every pair it touches (as in the reference)."""
    Q, D, _, _ = rand_problem(rng, 2, 5, 2, 40, 16, masks=False)
    Q[0, 1, 3] = float("nan")
    grad = torch.randn(2, 2, generator=rng)
    for route in sorted(ROUTES):
        with pytest.MonkeyPatch.context() as mp:
            backward = _force(mp, route)
            _, _, dd = kernel_with_grads(lik.maxsim, Q, D, None, None, grad, backward=backward)
            assert torch.isnan(dd[0]).any() and torch.isnan(dd[1]).any()


def test_deterministic_route_heuristic():
    assert bw.uses_flat_onehot(1024) and bw.uses_flat_onehot(65)
    assert not bw.uses_flat_onehot(64) and not bw.uses_flat_onehot(32)
