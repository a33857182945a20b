"""Every dD / dQ path of the MaxSim backward against the float64 reference (Triton interpreter on CPU).

dD routes: the fp32 atomic scatter (``"fast"``; chunked through a bounded buffer) and the sorted-winners gather
(``"deterministic"``; selectable for ``"fast"``). Each route is forced here on odd shapes, with masks in both
modes, sort chunks of one document and of several, 16- and 32-bit sort keys, partial dQ document steps and a
feature block narrower than ``d``.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch

import lik
from lik import _config
from lik.ops.maxsim.backward_sorted import chunk_documents, sorted_winners
from lik.ops.maxsim.forward import maxsim_forward
from lik.ops.maxsim.validation import MaxSimInputs

from .helpers import check_against_reference, kernel_with_grads, rand_problem

# (Nq, Lq, B, Ld, d)
SHAPES = [(5, 7, 3, 13, 8), (3, 37, 2, 40, 24), (1, 1, 1, 1, 1), (4, 3, 5, 33, 33)]
# route name -> (backward mode, config field values)
ROUTES = {
    "scatter": ("fast", {"fast_dd": "atomic"}),
    "scatter-chunked": ("fast", {"fast_dd": "atomic", "atomic_workspace_bytes": 1}),
    "sorted-fast": ("fast", {"fast_dd": "sorted"}),
    "sorted": ("deterministic", {"deterministic_dd": "sorted"}),
    "sorted-chunked": ("deterministic", {"sort_workspace_entries": 1}),
    "sorted-row-capped": ("deterministic", {"sort_chunk_rows": 40}),
}


@contextlib.contextmanager
def _route(name, **tiles):
    """Force one dD route (and optional tiles) on the interpreter's backward config."""
    backward, fields = ROUTES[name]
    base = _config.maxsim_backward_config(dim=16, dtype=torch.float32, device=torch.device("cpu"))
    with _config.override(maxsim_backward=replace(base, **fields, **tiles)):
        yield backward


@pytest.fixture(autouse=True)
def _kernels_only():
    if not _config.interpreting():
        pytest.skip("kernel paths run under TRITON_INTERPRET=1 (or on the GPU tests)")


def _check(rng, shape, *, per_query=False, masks=True, mask_mode="exclude", backward="fast", tol=2e-6,
           dtype=torch.float32):
    n_q, l_q, n_docs, l_d, dim = shape
    Q, D, qm, dm = rand_problem(rng, n_q, l_q, n_docs, l_d, dim, per_query=per_query, masks=masks, dtype=dtype)
    grad = torch.randn((n_q, n_docs), generator=rng)
    _, dq, dd, _ = check_against_reference(Q, D, qm, dm, grad, mask_mode=mask_mode, backward=backward, tol=tol)
    return dq, dd


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
def test_dd_routes(rng, shape, route, mask_mode):
    with _route(route) as backward:
        _check(rng, shape, mask_mode=mask_mode, backward=backward)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dq_docs", [1, 3])
@pytest.mark.parametrize("entries", [1, 4])
def test_tiles(rng, shape, dq_docs, entries):
    """Partial dQ document steps, sorted-gather blocks of 1 and 4 contributions, narrow feature blocks."""
    for route in ("scatter", "sorted"):
        with _route(route, block_k=16, dq_docs=dq_docs, sort_entries=entries) as backward:
            _check(rng, shape, backward=backward)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_per_query_documents_and_no_masks(rng, route):
    with _route(route) as backward:
        _check(rng, (3, 20, 2, 19, 16), per_query=True, backward=backward)
        _check(rng, (3, 20, 2, 19, 16), masks=False, backward=backward)
        _check(rng, (2, 70, 3, 19, 16), backward=backward)


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("per_query", [False, True])
def test_fp16_routes(rng, route, per_query):
    """fp16 gradients: the atomic scatter goes through its fp32 buffer (chunked or not) and a cast."""
    with _route(route) as backward:
        _check(rng, (3, 9, 5, 21, 16), per_query=per_query, backward=backward, tol=1e-3, dtype=torch.float16)


def test_nan_is_never_dropped(rng):
    """A NaN query token reaches the document gradient of every pair it touches (as in the reference)."""
    Q, D, _, _ = rand_problem(rng, 2, 5, 2, 40, 16, masks=False)
    Q[0, 1, 3] = float("nan")
    grad = torch.randn(2, 2, generator=rng)
    for route in sorted(ROUTES):
        with _route(route) as backward:
            _, _, dd = kernel_with_grads(lik.maxsim, Q, D, None, None, grad, backward=backward)
            assert torch.isnan(dd[0]).any() and torch.isnan(dd[1]).any()


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_nan_max_picks_the_first_nan_token(rng, masked, persistent):
    """Where a row's max is NaN its winner is the first NaN token, as ``torch.max`` picks it, even when that
    token sits in a later tile than a larger finite similarity (the kernels settle NaN rows in a second pass:
    after each document, or after all documents of a persistent program)."""
    Q, D, _, _ = rand_problem(rng, 2, 5, 2, 40, 16, masks=False)
    D[0, 3] = Q[0].sum(0)  # a clear finite winner for every row of query 0, in the first tile
    D[0, 21, 4] = D[0, 35, 2] = float("nan")  # NaN in the second and third tiles of the interpreter's 16
    Q[1, 2, 0] = float("nan")  # a NaN query row: every similarity NaN, so token 0 wins in each document
    d_mask = torch.ones(2, 40, dtype=torch.bool) if masked else None
    grad = torch.randn(2, 2, generator=rng)
    others = torch.ones(2, 5, dtype=torch.bool)
    others[1, 2] = False
    # Persistent: both queries stacked in one program that walks both documents (one SM off CUDA).
    tiles = _config.MaxSimForwardConfig(group_rows=16, groups=2, block_n=16, block_k=16, programs_per_sm=1)
    for route in sorted(ROUTES):
        forced = _config.override(maxsim_forward=tiles) if persistent else contextlib.nullcontext()
        with _route(route) as backward, forced:
            _, dq, dd = kernel_with_grads(lik.maxsim, Q, D, None, d_mask, grad, backward=backward)
        untouched = torch.ones(40, dtype=torch.bool)
        untouched[[0, 21]] = False
        assert torch.all(dd[0, untouched] == 0), route
        want_21 = (grad[:, 0, None, None] * Q).masked_select(others[..., None]).view(-1, 16).sum(0)
        torch.testing.assert_close(dd[0, 21], want_21, rtol=1e-5, atol=1e-5)
        assert torch.isnan(dd[0, 0]).any() and torch.isnan(dd[1, 0]).any(), route
        torch.testing.assert_close(dq[1, 2], grad[1, 0] * D[0, 0] + grad[1, 1] * D[1, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("persistent", [False, True])
def test_a_row_whose_similarities_are_all_minus_inf_wins_on_the_first_token(rng, persistent):
    """``torch.max`` over all-``-inf`` similarities picks token 0; a persistent program must not keep the winner
    of its previous document for such a row."""
    Q, D, _, _ = rand_problem(rng, 1, 3, 3, 20, 16, masks=False)
    Q[0, 1, 0] = float("inf")
    D[..., 0] = D[..., 0].abs() + 0.1  # row 1: +inf with every token ...
    D[1, :5, 0] = -D[1, :5, 0]  # ... but tokens 0-4 of document 1 (its winner: token 5)
    D[2, :, 0] = -D[2, :, 0]  # ... and every token of document 2 (all -inf: token 0)
    # Persistent: one program walks documents 0, 1, 2 in that order (one SM off CUDA).
    tiles = _config.MaxSimForwardConfig(group_rows=16, groups=1, block_n=16, block_k=16, programs_per_sm=1)
    with _config.override(maxsim_forward=tiles) if persistent else contextlib.nullcontext():
        scores, argmax = maxsim_forward(MaxSimInputs.build(Q, D, None, None, "exclude"), store_argmax=True)
    sim = torch.einsum("qk,btk->bqt", Q[0].double(), D.double())
    assert argmax[0, :, 1].tolist() == [0, 5, 0]
    assert torch.equal(argmax[0].long(), sim.max(-1).indices)
    assert scores[0].tolist()[:2] == [float("inf")] * 2 and scores[0, 2] == float("-inf")


def test_unknown_or_atomic_routes_are_refused(rng):
    Q, D, _, _ = rand_problem(rng, 2, 5, 2, 7, 16, masks=False)
    D.requires_grad_()
    base = _config.maxsim_backward_config(dim=16, dtype=torch.float32, device=torch.device("cpu"))
    for backward, fields in (("deterministic", {"deterministic_dd": "atomic"}), ("fast", {"fast_dd": "onehot"})):
        with _config.override(maxsim_backward=replace(base, **fields)):
            with pytest.raises(ValueError, match="dD route must be one of"):
                lik.maxsim(Q, D, backward=backward).sum().backward()


def test_sorted_winners_groups_rows_stably():
    """Segments follow document rows; inside one, contributions keep their (query, doc, token) order; triples
    without a winner (-1) are left out; per-query documents key by (query, doc, row)."""
    argmax = torch.tensor([[[2, -1, 0], [1, 2, 2]], [[2, 0, -1], [-1, -1, 1]]], dtype=torch.int32)  # [Nq 2, B 2, Lq 3]
    order, starts = sorted_winners(argmax, doc_len=3, per_query=False)
    rows = [order[starts[r]:starts[r + 1]].tolist() for r in range(6)]
    # flat index into [B, Nq, Lq] = (doc * Nq + query) * Lq + token
    assert rows == [[2, 4], [], [0, 3], [], [6, 11], [7, 8]]
    assert int(starts[-1]) == 8  # 8 winners; the 3 without one sort after every row
    order, starts = sorted_winners(argmax, doc_len=3, per_query=True)
    rows = [order[starts[r]:starts[r + 1]].tolist() for r in range(12)]
    assert rows == [[2], [], [0], [], [6], [7, 8], [4], [], [3], [], [11], []]


def test_sort_chunks_fit_the_workspace_and_row_cap():
    assert chunk_documents(n_queries=4, q_len=8, n_docs=100, workspace_entries=320) == 10
    assert chunk_documents(n_queries=4, q_len=8, n_docs=100, workspace_entries=1) == 1
    assert chunk_documents(n_queries=4, q_len=8, n_docs=5, workspace_entries=10**9) == 5
    assert chunk_documents(4, 8, 1000, 10**9, rows_per_doc=180, max_rows=32767) == 182
    assert chunk_documents(4, 8, 100, 10**9, rows_per_doc=10**6, max_rows=32767) == 1
