"""lik.maxsim against the float64 reference: kernels (Triton interpreter on CPU) and the reference path.

Every check compares scores and both gradients with the float64 reference on fresh random inputs.
"""

from __future__ import annotations

import pytest
import torch

import lik
from lik import _config
from lik.ops.maxsim.function import uses_kernels

from .helpers import check_against_reference, kernel_with_grads, rand_problem, reference_with_grads, rel_err

# (Nq, Lq, B, Ld, d): odd sizes, size 1, a query longer than one row group (split into exact partial sums),
# several short queries stacked in one tile, d not a power of two, single-token queries stacked one row each
# over two row blocks.
SHAPES = [
    (1, 1, 1, 1, 1),
    (1, 7, 3, 13, 8),
    (3, 5, 4, 17, 24),
    (2, 70, 3, 40, 16),
    (5, 3, 2, 33, 33),
    (37, 1, 3, 19, 16),
]


@pytest.fixture(params=["kernel", "reference"])
def path(request, monkeypatch):
    """Run each test through the Triton kernels (interpreter) and through the CPU reference path."""
    if request.param == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    return request.param


def _check(rng, shape, *, per_query=False, squeeze=False, masks=True, mask_mode="exclude", backward="fast",
           tol=2e-6):
    n_q, l_q, n_docs, l_d, dim = shape
    Q, D, qm, dm = rand_problem(rng, n_q, l_q, n_docs, l_d, dim, per_query=per_query, squeeze=squeeze, masks=masks)
    grad = torch.randn((n_docs,) if squeeze else (n_q, n_docs), generator=rng)
    s, _, _, rs = check_against_reference(Q, D, qm, dm, grad, mask_mode=mask_mode, backward=backward, tol=tol)
    assert s.dtype == torch.float32 and s.shape == rs.shape


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
def test_shared_documents(rng, path, shape, mask_mode):
    _check(rng, shape, mask_mode=mask_mode)


@pytest.mark.parametrize("shape", SHAPES[1:4])
@pytest.mark.parametrize("backward", ["fast", "deterministic"])
def test_per_query_documents(rng, path, shape, backward):
    _check(rng, shape, per_query=True, backward=backward)


@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3]])
def test_two_dimensional_query(rng, path, shape):
    _check(rng, (1,) + shape[1:], squeeze=True)


@pytest.mark.parametrize("backward", ["fast", "deterministic"])
def test_no_masks_and_both_backwards(rng, path, backward):
    _check(rng, (3, 9, 4, 21, 16), masks=False, backward=backward)


def test_kernels_really_run_under_interpreter(path):
    x = torch.zeros(1, 1, 1)
    assert uses_kernels(x) == (path == "kernel")


@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
def test_garbage_in_masked_positions_changes_nothing(rng, path, mask_mode):
    Q, D, qm, dm = rand_problem(rng, 3, 6, 4, 19, 16)
    dm[1] = False  # an all-masked document
    grad = torch.randn(3, 4, generator=rng)
    clean = kernel_with_grads(lik.maxsim, Q, D, qm, dm, grad, mask_mode=mask_mode)
    Qg, Dg = Q.clone(), D.clone()
    garbage = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30])
    Qg[~qm] = garbage[torch.randint(0, 4, (int((~qm).sum()),), generator=rng)][:, None]
    Dg[~dm] = garbage[torch.randint(0, 4, (int((~dm).sum()),), generator=rng)][:, None]
    dirty = kernel_with_grads(lik.maxsim, Qg, Dg, qm, dm, grad, mask_mode=mask_mode)
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b)
    if mask_mode == "exclude":
        assert torch.all(clean[0][:, 1] == 0)
        assert torch.all(clean[2][1] == 0)


def test_all_masked_document_scores_zero_with_zero_gradient(rng, path):
    Q, D, _, _ = rand_problem(rng, 2, 5, 3, 8, 16, masks=False)
    dm = torch.ones(3, 8, dtype=torch.bool)
    dm[2] = False
    grad = torch.randn(2, 3, generator=rng)
    s, dq, dd = kernel_with_grads(lik.maxsim, Q, D, None, dm, grad)
    rs, rdq, rdd = reference_with_grads(Q, D, None, dm, grad)
    assert torch.all(s[:, 2] == 0) and torch.all(dd[2] == 0)
    assert rel_err(s, rs) < 1e-6 and rel_err(dq, rdq) < 1e-6 and rel_err(dd, rdd) < 1e-6


def test_zero_mode_matches_pylate_formula(rng, path):
    """PyLate: similarities multiplied by the masks, max over doc tokens, sum over query tokens."""
    Q, D, qm, dm = rand_problem(rng, 3, 6, 5, 11, 16)
    D = -D.abs()  # all-negative similarities: a masked 0 wins the max in "zero" mode, not in "exclude"
    Q = Q.abs()
    sim = torch.einsum("ash,bth->abst", Q.double(), D.double())
    sim = sim * qm[:, None, :, None] * dm[None, :, None, :]
    pylate = sim.max(dim=-1).values.sum(dim=-1)
    zero = lik.maxsim(Q, D, qm, dm, mask_mode="zero")
    exclude = lik.maxsim(Q, D, qm, dm, mask_mode="exclude")
    assert rel_err(zero, pylate) < 1e-6
    assert not torch.allclose(exclude.double(), pylate)


def test_nan_in_valid_token_reaches_only_its_pairs(path):
    Q = torch.nn.functional.normalize(torch.randn(3, 4, 16), dim=-1)
    D = torch.nn.functional.normalize(torch.randn(5, 7, 16), dim=-1)
    D[2, 3, 5] = float("nan")
    Q[1, 2, 0] = float("nan")
    s = lik.maxsim(Q, D)
    expected = torch.zeros(3, 5, dtype=torch.bool)
    expected[:, 2] = True
    expected[1, :] = True
    assert torch.equal(torch.isnan(s), expected)


def test_nan_in_masked_query_row_is_ignored(path):
    Q = torch.randn(1, 4, 16)
    D = torch.randn(2, 7, 16)
    qm = torch.tensor([[True, True, False, True]])
    Q[0, 2] = float("nan")
    assert not torch.isnan(lik.maxsim(Q, D, qm)).any()


@pytest.mark.parametrize("backward", ["fast", "deterministic"])
def test_ties_go_to_lowest_index(path, backward):
    """Duplicated document tokens: the gradient goes to the first copy only, as in the reference."""
    gen = torch.Generator().manual_seed(7)
    Q = torch.randn(2, 3, 16, generator=gen)
    base = torch.randn(4, 5, 16, generator=gen)
    D = torch.cat([base, base, base[:, :2]], dim=1)  # tokens t, t+5 (and t+10 for t<2) are equal
    grad = torch.randn(2, 4, generator=gen)
    s, dq, dd = kernel_with_grads(lik.maxsim, Q, D, None, None, grad, backward=backward)
    rs, rdq, rdd = reference_with_grads(Q, D, None, None, grad)
    assert rel_err(s, rs) < 1e-6 and rel_err(dq, rdq) < 1e-6
    assert torch.all(dd[:, 5:] == 0)
    assert rel_err(dd, rdd) < 1e-6


def test_ties_across_tiles_keep_the_earlier_tile(path):
    """The same token in two document tiles (interpreter tiles are 16 wide): the earlier one wins."""
    gen = torch.Generator().manual_seed(3)
    Q = torch.randn(1, 2, 16, generator=gen)
    D = torch.randn(1, 40, 16, generator=gen)
    D[0, 33] = D[0, 2] = Q[0, 0] * 10  # the max for query token 0, once in tile 0 and once in tile 2
    grad = torch.ones(1, 1)
    _, _, dd = kernel_with_grads(lik.maxsim, Q, D, None, None, grad)
    assert torch.all(dd[0, 33] == 0) and torch.any(dd[0, 2] != 0)


@pytest.mark.parametrize("backward", ["fast", "deterministic"])
@pytest.mark.parametrize("first_token_masked", [False, True])
def test_rows_that_only_see_minus_inf_take_token_0(path, backward, first_token_masked):
    """Every similarity of document 0 is -inf (an -inf feature): the reference's max picks token 0, so its
    gradient goes to token 0, or nowhere when token 0 is masked; no other token of that document gets any."""
    gen = torch.Generator().manual_seed(11)
    Q = torch.randn(2, 3, 16, generator=gen)
    Q[..., 0] = Q[..., 0].abs() + 0.5
    D = torch.randn(2, 40, 16, generator=gen)
    D[0, :, 0] = -float("inf")
    dm = torch.ones(2, 40, dtype=torch.bool)
    dm[0, 0] = not first_token_masked
    grad = torch.randn(2, 2, generator=gen)
    s, dq, dd = kernel_with_grads(lik.maxsim, Q, D, None, dm, grad, backward=backward)
    rs, rdq, rdd = reference_with_grads(Q, D, None, dm, grad)
    assert torch.all(s[:, 0] == -float("inf"))
    torch.testing.assert_close(s.double(), rs.double(), rtol=1e-6, atol=1e-6)
    # The kernels' feature 0 of dQ is infinite when token 0 wins unmasked, finite (no gradient from document 0)
    # when it is masked; the reference's einsum backward has NaN there either way (0 * inf at losing tokens).
    if path == "kernel":
        assert torch.isfinite(dq[..., 0]).all() == first_token_masked
        assert torch.isfinite(dq[..., 0]).any() == first_token_masked
    torch.testing.assert_close(dq[..., 1:].double(), rdq[..., 1:].double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dd.double(), rdd.double(), rtol=1e-6, atol=1e-6, equal_nan=True)
    assert torch.all(dd[0, 1:] == 0)
    assert torch.all(dd[0, 0] == 0) == first_token_masked


def test_non_contiguous_inputs(rng, path):
    Qs = torch.randn(8, 3, 32, generator=rng)  # [Lq, Nq, 2d] storage
    Ds = torch.randn(11, 5, 2, 16, generator=rng)  # [Ld, B, 2, d] storage
    Q = Qs.transpose(0, 1)[..., ::2]  # [3, 8, 16] with feature stride 2
    D = Ds.transpose(0, 1)[:, :, 1]  # [5, 11, 16]
    qm = (torch.rand(8, 3, generator=rng) > 0.3).t()
    dm = (torch.rand(11, 5, generator=rng) > 0.3).t()
    assert not (Q.is_contiguous() or D.is_contiguous() or qm.is_contiguous() or dm.is_contiguous())
    grad = torch.randn(3, 5, generator=rng)
    s, dq, dd = kernel_with_grads(lik.maxsim, Q, D, qm, dm, grad)
    rs, rdq, rdd = reference_with_grads(Q.contiguous(), D.contiguous(), qm.contiguous(), dm.contiguous(), grad)
    assert rel_err(s, rs) < 1e-6 and rel_err(dq, rdq) < 1e-6 and rel_err(dd, rdd) < 1e-6


def test_expanded_query_broadcast_view(rng, path):
    """A stride-0 (expanded) query batch: the same query scored against per-query candidates."""
    q = torch.randn(1, 6, 16, generator=rng).expand(3, 6, 16)
    D = torch.randn(3, 2, 9, 16, generator=rng)
    expected = torch.stack([lik.maxsim_reference(q[i].contiguous(), D[i]) for i in range(3)])
    assert rel_err(lik.maxsim(q, D), expected) < 1e-6


@pytest.mark.parametrize(
    "shape", [(0, 4, 3, 5, 8), (2, 4, 0, 5, 8), (2, 0, 3, 5, 8), (2, 4, 3, 0, 8), (2, 4, 3, 5, 0)]
)
def test_empty_inputs(path, shape):
    n_q, l_q, n_docs, l_d, dim = shape
    Q = torch.randn(n_q, l_q, dim, requires_grad=True)
    D = torch.randn(n_docs, l_d, dim, requires_grad=True)
    s = lik.maxsim(Q, D)
    assert s.shape == (n_q, n_docs) and s.dtype == torch.float32
    assert torch.all(s == 0)
    s.sum().backward()
    assert torch.all(Q.grad == 0) and torch.all(D.grad == 0)


def test_float16_against_float64(rng, path):
    Q, D, qm, dm = rand_problem(rng, 3, 12, 5, 30, 32, dtype=torch.float16)
    grad = torch.randn(3, 5, generator=rng)
    s, dq, dd = kernel_with_grads(lik.maxsim, Q, D, qm, dm, grad)
    rs, rdq, rdd = reference_with_grads(Q, D, qm, dm, grad)
    assert dq.dtype == torch.float16 and dd.dtype == torch.float16
    assert rel_err(s, rs) < 1e-3 and rel_err(dq, rdq) < 1e-3 and rel_err(dd, rdd) < 1e-3


def test_bfloat16_runs_and_matches(rng, path):
    Q, D, qm, dm = rand_problem(rng, 2, 6, 3, 9, 16, dtype=torch.bfloat16)
    grad = torch.randn(2, 3, generator=rng)
    s, dq, dd = kernel_with_grads(lik.maxsim, Q, D, qm, dm, grad)
    rs, rdq, rdd = reference_with_grads(Q, D, qm, dm, grad)
    assert dq.dtype == torch.bfloat16
    assert rel_err(s, rs) < 1e-2 and rel_err(dq, rdq) < 1e-2 and rel_err(dd, rdd) < 1e-2


def test_float64_inputs_use_the_reference_and_return_float64(rng):
    Q, D, qm, dm = rand_problem(rng, 2, 5, 3, 7, 8, dtype=torch.float64)
    s = lik.maxsim(Q, D, qm, dm)
    assert s.dtype == torch.float64
    assert torch.equal(s, lik.maxsim_reference(Q, D, qm, dm))


def test_integer_masks_equal_bool_masks(rng, path):
    Q, D, qm, dm = rand_problem(rng, 2, 5, 3, 7, 8)
    assert torch.equal(lik.maxsim(Q, D, qm.long(), dm.int()), lik.maxsim(Q, D, qm, dm))


@pytest.mark.parametrize(
    "forced",
    [
        _config.MaxSimForwardConfig(group_rows=16, groups=1, block_n=16, block_k=16),
        _config.MaxSimForwardConfig(group_rows=16, groups=4, block_n=32, block_k=32),
        _config.MaxSimForwardConfig(group_rows=32, groups=2, block_n=16, block_k=16),
        _config.MaxSimForwardConfig(group_rows=16, groups=2, block_n=16, block_k=64),
        _config.MaxSimForwardConfig(group_rows=16, groups=1, block_n=32, block_k=16),
        # Persistent launches (one SM off CUDA): programs loop over all 4 documents, over 2 each, or over 2 or 1.
        _config.MaxSimForwardConfig(group_rows=16, groups=1, block_n=16, block_k=16, programs_per_sm=1),
        _config.MaxSimForwardConfig(group_rows=16, groups=2, block_n=16, block_k=64, programs_per_sm=10),
        _config.MaxSimForwardConfig(group_rows=16, groups=1, block_n=16, block_k=16, programs_per_sm=27),
    ],
)
def test_forced_launch_configs_agree(rng, forced):
    """Other tilings (k split into chunks, more stacked groups, long-query splits, persistent launches that
    loop over documents) give the same numbers."""
    Q, D, qm, dm = rand_problem(rng, 3, 37, 4, 23, 40)
    grad = torch.randn(3, 4, generator=rng)
    rs, rdq, rdd = reference_with_grads(Q, D, qm, dm, grad)
    backward_cfg = _config.MaxSimBackwardConfig(block_rows=16, block_k=16)
    with _config.override(maxsim_forward=forced, maxsim_backward=backward_cfg):
        for backward in ("fast", "deterministic"):
            s, dq, dd = kernel_with_grads(lik.maxsim, Q, D, qm, dm, grad, backward=backward)
            assert rel_err(s, rs) < 2e-6 and rel_err(dq, rdq) < 2e-6 and rel_err(dd, rdd) < 2e-6


@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
def test_inference_row_maxima_by_column_class(rng, monkeypatch, mask_mode):
    """Inference through the long-query loop keeps each row's max per column class (``tile.class_tile_max``) and
    combines the classes at the document's end: a NaN in one class reaches the row, a tie across classes and
    tiles, masked columns, a ragged last tile, an all-masked document and documents whose every similarity is
    negative all score as the reference."""
    from lik.ops.maxsim import tile

    calls = []
    original = tile.class_tile_max
    monkeypatch.setattr(tile, "class_tile_max", lambda *a: calls.append(1) or original(*a))
    Q, D, _, dm = rand_problem(rng, 3, 37, 6, 45, 24)
    D[1] = -D[1].abs()
    Q = Q.abs()  # document 1: every similarity negative, so a -inf or a zero from a wrong class would show
    dm[1] = True  # (a masked token is a 0 in "zero" mode)
    D[2, 41, 3] = float("nan")  # the ragged last tile, one class
    D[3, 9] = D[3, 30] = Q[0, 0] * 5  # the same winner in two tiles and two classes
    dm[4] = False
    dm[5, 11:19] = False
    with _config.override(maxsim_forward=_config.MaxSimForwardConfig(16, 1, 16, 32)):
        s = lik.maxsim(Q, D, None, dm, mask_mode=mask_mode)
    reference = lik.maxsim_reference(Q, D, None, dm, mask_mode=mask_mode)
    assert torch.equal(s.isnan(), reference.isnan()) and s[:, 2].isnan().all()
    clean = [0, 1, 3, 4, 5]
    assert rel_err(s[:, clean], reference[:, clean]) < 2e-6
    assert (s[:, 1] < 0).all()
    assert calls if uses_kernels(Q) else not calls


@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
def test_persistent_stacked_inference_row_maxima_by_column_class(rng, monkeypatch, mask_mode):
    """Stacked queries in a persistent launch (one program walks every document) keep each document's row maxima
    per column class and combine them on its last tile: a strong document followed by weaker ones (the classes
    start afresh per document), a NaN in one document only, a tie across tiles, all-negative similarities, masked
    columns, an all-masked document and a ragged last tile (the window) all score as the reference."""
    from lik.ops.maxsim import tile

    calls = []
    original = tile.class_tile_max
    monkeypatch.setattr(tile, "class_tile_max", lambda *a: calls.append(1) or original(*a))
    Q, D, _, dm = rand_problem(rng, 4, 9, 7, 37, 24)
    Q = Q.abs()
    D[0] = D[0].abs() * 4  # strong: its maxima would leak into the next documents without a fresh start
    D[1] = -D[1].abs()  # every similarity negative
    dm[1] = True  # (a masked token is a 0 in "zero" mode)
    D[3, 35, 2] = float("nan")  # the ragged last tile
    D[4, 5] = D[4, 21] = Q[0, 0] * 5  # the same winner in two tiles
    dm[5] = False
    forced = _config.MaxSimForwardConfig(group_rows=16, groups=2, block_n=16, block_k=32, programs_per_sm=1)
    with _config.override(maxsim_forward=forced):
        s = lik.maxsim(Q, D, None, dm, mask_mode=mask_mode)
    reference = lik.maxsim_reference(Q, D, None, dm, mask_mode=mask_mode)
    assert torch.equal(s.isnan(), reference.isnan()) and s[:, 3].isnan().all()
    clean = [0, 1, 2, 4, 5, 6]
    assert rel_err(s[:, clean], reference[:, clean]) < 2e-6
    assert (s[:, 1] < 0).all() and (s[:, 2] < s[:, 0]).all()
    assert calls if uses_kernels(Q) else not calls


def test_persistent_launch_with_per_query_documents(rng):
    """A persistent launch over per-query candidate documents (each query its own document set)."""
    Q, D, qm, dm = rand_problem(rng, 3, 19, 5, 21, 24, per_query=True)
    grad = torch.randn(3, 5, generator=rng)
    rs, rdq, rdd = reference_with_grads(Q, D, qm, dm, grad)
    forced = _config.MaxSimForwardConfig(group_rows=16, groups=1, block_n=16, block_k=32, programs_per_sm=4)
    with _config.override(maxsim_forward=forced):
        s, dq, dd = kernel_with_grads(lik.maxsim, Q, D, qm, dm, grad)
    assert rel_err(s, rs) < 2e-6 and rel_err(dq, rdq) < 2e-6 and rel_err(dd, rdd) < 2e-6


@pytest.mark.parametrize("doc_len", [1, 16, 37])
@pytest.mark.parametrize("programs_per_sm", [1, 6, 27])
def test_persistent_flat_loop_over_unmasked_documents(rng, doc_len, programs_per_sm):
    """A persistent program walks its (document, tile) steps in one loop and writes each document on its last
    tile: one-tile and ragged documents, programs with 5, 3 / 2 and 1 documents, each document's max and winner
    starting afresh (a strong document first, identical documents side by side)."""
    Q, D, _, _ = rand_problem(rng, 3, 19, 5, doc_len, 24, masks=False)
    D[0] = 4 * D[0]  # larger similarities than any later document: a max carried over would show
    D[3] = D[2]  # identical documents: the same scores and winners
    grad = torch.randn(3, 5, generator=rng)
    rs, rdq, rdd = reference_with_grads(Q, D, None, None, grad)
    forced = _config.MaxSimForwardConfig(
        group_rows=16, groups=2, block_n=16, block_k=32, programs_per_sm=programs_per_sm
    )  # 3 row blocks on the one SM off CUDA
    with _config.override(maxsim_forward=forced):
        s, dq, dd = kernel_with_grads(lik.maxsim, Q, D, None, None, grad)
    assert rel_err(s, rs) < 2e-6 and rel_err(dq, rdq) < 2e-6 and rel_err(dd, rdd) < 2e-6
    assert torch.equal(s[:, 2], s[:, 3])


@pytest.mark.parametrize("doc_len", [17, 23, 31])
@pytest.mark.parametrize("programs_per_sm", [1, 27])
def test_persistent_last_tile_overlapping_the_tile_before(rng, doc_len, programs_per_sm):
    """A persistent program reads a ragged document's last tile as its last 16 tokens, overlapping the tile
    before it: a max inside the overlap counts once, a tie between an overlap token and a later token goes to the
    first, a tie between the first tile and the overlap too, and an inf or NaN in the overlap or at the end reaches
    the scores as in the reference."""
    Q, D, _, _ = rand_problem(rng, 3, 19, 5, doc_len, 24, masks=False)
    overlap = doc_len - 16  # the first token both tiles read (interpreter tiles are 16 wide)
    D[0, overlap + 1] = D[0, doc_len - 1] = Q[0, 0] * 10  # query token 0's max, in the overlap and at the end
    D[1, 0] = D[1, overlap] = Q[1, 3] * 10  # a tie between the first tile and the overlap
    grad = torch.randn(3, 5, generator=rng)
    rs, rdq, rdd = reference_with_grads(Q, D, None, None, grad)
    forced = _config.MaxSimForwardConfig(
        group_rows=16, groups=2, block_n=16, block_k=32, programs_per_sm=programs_per_sm
    )
    with _config.override(maxsim_forward=forced):
        s, dq, dd = kernel_with_grads(lik.maxsim, Q, D, None, None, grad)
        assert rel_err(s, rs) < 2e-6 and rel_err(dq, rdq) < 2e-6 and rel_err(dd, rdd) < 2e-6
        assert torch.any(dd[0, overlap + 1] != 0) and torch.all(dd[0, doc_len - 1] == 0)
        assert torch.any(dd[1, 0] != 0) and torch.all(dd[1, overlap] == 0)
        D[2, overlap + 2, 0] = float("inf")
        D[3, doc_len - 1, 5] = float("nan")
        D[4, overlap, 1] = float("-inf")
        scores = lik.maxsim(Q, D)
    torch.testing.assert_close(scores, lik.maxsim_reference(Q.double(), D.double()).float(), rtol=2e-6, atol=2e-6,
                               equal_nan=True)
    assert torch.isnan(scores[:, 3]).all() and not torch.isnan(scores[:, :3]).any()


@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
def test_persistent_program_scores_an_all_masked_document_after_valid_ones(rng, mask_mode):
    """The valid-token count restarts with each document of a persistent program: an all-masked document
    walked after valid ones scores 0 ("exclude") or its masked zeros ("zero"), as in the reference."""
    Q, D, qm, dm = rand_problem(rng, 2, 19, 4, 37, 24)
    dm[2] = False
    grad = torch.randn(2, 4, generator=rng)
    rs, rdq, rdd = reference_with_grads(Q, D, qm, dm, grad, mask_mode=mask_mode)
    # One program walks documents 0, 1, 2, 3 (one SM off CUDA).
    forced = _config.MaxSimForwardConfig(group_rows=16, groups=4, block_n=16, block_k=32, programs_per_sm=1)
    with _config.override(maxsim_forward=forced):
        s, dq, dd = kernel_with_grads(lik.maxsim, Q, D, qm, dm, grad, mask_mode=mask_mode)
    assert rel_err(s, rs) < 2e-6 and rel_err(dq, rdq) < 2e-6 and rel_err(dd, rdd) < 2e-6
    if mask_mode == "exclude":
        assert torch.all(s[:, 2] == 0)


@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
def test_mixed_documents_and_inference_path_agree(rng, mask_mode):
    """All-masked documents, NaN and ragged tails side by side; the inference launch (no argmax) and the
    training launch give the same bits."""
    Q, D, qm, dm = rand_problem(rng, 3, 21, 5, 37, 24)
    D[2, 4, 1] = float("nan")
    dm[3] = False
    grad = torch.randn(3, 5, generator=rng)
    for masks in ((qm, dm), (None, None)):
        got, dq, _ = kernel_with_grads(lik.maxsim, Q, D, *masks, grad, mask_mode=mask_mode)
        want, rdq, _ = reference_with_grads(Q, D, *masks, grad, mask_mode)
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert rel_err(torch.nan_to_num(got), torch.nan_to_num(want)) < 2e-6
        finite = ~torch.isnan(rdq).any(-1)
        assert rel_err(dq[finite], rdq[finite]) < 2e-6
        with torch.no_grad():
            inference = lik.maxsim(Q, D, *masks, mask_mode=mask_mode)
        assert torch.equal(torch.nan_to_num(inference, nan=-7.0), torch.nan_to_num(got, nan=-7.0))


def test_override_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown"):
        with _config.override(maxsim_fwd=None):
            pass


def test_auto_backward_follows_deterministic_flag(monkeypatch):
    from lik.ops.maxsim.function import resolve_backward

    assert resolve_backward("deterministic") and not resolve_backward("fast")
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert resolve_backward("auto")
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: False)
    assert not resolve_backward("auto")


def test_deterministic_backward_is_repeatable(rng):
    Q, D, qm, dm = rand_problem(rng, 3, 9, 4, 21, 16)
    grad = torch.randn(3, 4, generator=rng)
    first = kernel_with_grads(lik.maxsim, Q, D, qm, dm, grad, backward="deterministic")
    second = kernel_with_grads(lik.maxsim, Q, D, qm, dm, grad, backward="deterministic")
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("per_query, squeeze, masks, backward", [
    (False, False, True, "fast"), (True, False, True, "deterministic"), (False, True, False, "auto"),
])
def test_torch_compile_traces_without_graph_break(rng, per_query, squeeze, masks, backward):
    """``torch.compile(fullgraph=True)``: one graph (the kernels are custom operators to Dynamo), the same scores
    and gradients as eager, training and inference. ``aot_eager`` traces forward and backward as inductor would,
    without generating code (CI has no GPU)."""
    Q, D, qm, dm = rand_problem(rng, 3, 5, 4, 9, 16, per_query=per_query, squeeze=squeeze, masks=masks)
    grad = torch.randn((4,) if squeeze else (3, 4), generator=rng)

    def score(q, d, q_mask, d_mask):
        return lik.maxsim(q, d, q_mask, d_mask, backward=backward)

    torch._dynamo.reset()
    compiled = torch.compile(score, backend="aot_eager", fullgraph=True)
    got = kernel_with_grads(compiled, Q, D, qm, dm, grad)
    want = kernel_with_grads(score, Q, D, qm, dm, grad)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    with torch.no_grad():
        assert torch.equal(compiled(Q, D, qm, dm), want[0])
