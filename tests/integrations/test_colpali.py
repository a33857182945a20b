"""colpali-engine integration: the drop-ins equal colpali-engine's own scoring (the installed package), and
enable() routes its processors and losses through lik, reversibly."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

import lik.integrations.colpali as lik_colpali
import lik.integrations.colpali_pages as colpali_pages
from lik.integrations import _patching

from .conftest import load_recording_modules, names_lik


def _ragged(rng, lengths, dim=16, dtype=torch.float32):
    return [torch.randn(n, dim, generator=rng).to(dtype) for n in lengths]


@pytest.fixture(params=[False, True], ids=["join-after-checks", "join-early"])
def join_early(request, monkeypatch):
    """Both orders of a page list's join: after the shape checks (the CPU's), or launched before them (an
    accelerator's, forced here on the CPU)."""
    monkeypatch.setattr(colpali_pages, "overlaps_host", lambda device: request.param)
    return request.param


def test_score_multi_vector_matches_block_padding(colpali_scoring, rng, join_early):
    _, processing, _ = colpali_scoring
    stock = processing.BaseVisualRetrieverProcessor.__dict__["score_multi_vector"].__func__
    stock = _patching.original(stock)
    qs = _ragged(rng, (3, 5, 1, 4))
    # Pages 2 and 5 are the longest of their blocks of 3: colpali-engine pads every other page with zeros.
    ps = _ragged(rng, (4, 9, 2, 7, 7, 3, 1, 0))
    for batch_size in (3, 128):
        expected = stock(qs, ps, batch_size=batch_size, device="cpu")
        got = lik_colpali.score_multi_vector(qs, ps, batch_size=batch_size, device="cpu")
        assert got.dtype == torch.float32 and got.device.type == "cpu"
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
    equal = _ragged(rng, (6, 6, 6, 6))  # equal pages take the dense path
    torch.testing.assert_close(lik_colpali.score_multi_vector(qs, equal, batch_size=3, device="cpu"),
                               stock(qs, equal, batch_size=3, device="cpu"), rtol=1e-6, atol=1e-5)
    padded = torch.nn.utils.rnn.pad_sequence(ps, batch_first=True)
    torch.testing.assert_close(lik_colpali.score_multi_vector(torch.stack(qs[:1]), padded, device="cpu"),
                               stock(torch.stack(qs[:1]), padded, device="cpu"), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("budgets", [None, (1500, 500)])
def test_score_multi_vector_rows_of_ragged_queries(colpali_scoring, rng, monkeypatch, budgets, join_early):
    """Query tokens are scored as rows and summed per query: empty queries, one-token queries, the tensor form,
    and several calls when the packed copy or the per-row maxima exceed their budgets."""
    _, processing, _ = colpali_scoring
    stock = processing.BaseVisualRetrieverProcessor.__dict__["score_multi_vector"].__func__
    stock = _patching.original(stock)
    if budgets is not None:
        monkeypatch.setattr(colpali_pages, "PACK_BUDGET_BYTES", budgets[0])  # two pages per packed copy
        monkeypatch.setattr(lik_colpali, "_ROW_SCORES_BUDGET_BYTES", budgets[1])  # two pages per call
    qs = _ragged(rng, (3, 0, 1, 7, 3))
    for ps in (_ragged(rng, (9, 9, 9, 9, 9)), _ragged(rng, (4, 9, 2, 7, 7, 3, 1))):
        torch.testing.assert_close(lik_colpali.score_multi_vector(qs, ps, batch_size=3, device="cpu"),
                                   stock(qs, ps, batch_size=3, device="cpu"), rtol=1e-6, atol=1e-5)
        padded_q = torch.nn.utils.rnn.pad_sequence(qs, batch_first=True)
        torch.testing.assert_close(lik_colpali.score_multi_vector(padded_q, ps, batch_size=3, device="cpu"),
                                   stock(padded_q, ps, batch_size=3, device="cpu"), rtol=1e-6, atol=1e-5)
    empty = _ragged(rng, (0, 0))
    got = lik_colpali.score_multi_vector(empty, _ragged(rng, (5, 2)), device="cpu")
    assert torch.equal(got, torch.zeros(2, 2))
    assert torch.equal(lik_colpali.score_multi_vector(torch.zeros(2, 0, 16), _ragged(rng, (5, 2)), device="cpu"),
                       torch.zeros(2, 2))


def test_score_multi_vector_garbage_pages_match_colpali(colpali_scoring, rng):
    """inf / NaN in a page reach exactly the scores they reach in colpali-engine (its zero padding of shorter
    queries meets an inf as 0 * inf = NaN; lik's padding row does the same)."""
    _, processing, _ = colpali_scoring
    stock = processing.BaseVisualRetrieverProcessor.__dict__["score_multi_vector"].__func__
    stock = _patching.original(stock)
    qs = _ragged(rng, (4, 2, 4))
    ps = _ragged(rng, (6, 6, 6, 6))
    ps[1][2, 3] = float("inf")
    ps[2][0, 0] = float("nan")
    expected = stock(qs, ps, device="cpu")
    got = lik_colpali.score_multi_vector(qs, ps, device="cpu")
    assert torch.equal(got.isnan(), expected.isnan()) and expected.isnan().any()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5, equal_nan=True)


def test_score_multi_vector_bf16_sums_in_fp32(colpali_scoring, rng):
    _, processing, _ = colpali_scoring
    stock = processing.BaseVisualRetrieverProcessor.score_multi_vector
    stock = _patching.original(stock)
    qs = _ragged(rng, (20, 17), dim=128, dtype=torch.bfloat16)
    ps = _ragged(rng, (300, 257, 300), dim=128, dtype=torch.bfloat16)
    exact = stock([q.double() for q in qs], [p.double() for p in ps], device="cpu")
    got = lik_colpali.score_multi_vector(qs, ps, device="cpu")
    stock_bf16 = stock(qs, ps, device="cpu")
    assert (got.double() - exact).abs().max() < 1e-3
    assert (got.double() - exact).abs().max() <= (stock_bf16.double() - exact).abs().max()


@pytest.mark.parametrize("lengths, batch_size, budget, joins", [
    ((6, 6, 6, 6), 128, None, 1),  # equal pages: the early join is the dense batch
    ((6, 4, 6, 6), 1, None, 1),  # ragged, no page padded (blocks of one): the early join is the packed copy
    ((6, 4, 5, 6), 128, None, 1),  # ragged and padded: the early join is the packed copy (zero tokens on the maxima)
    ((6, 4), 128, None, 1),  # first and last differ: no early join
    ((5, 3, 7, 5), 128, None, 1),  # as many rows as four pages of 5: that early score dropped, the join kept
    ((2, 40, 2), 1, 1000, 1),  # joined early, but the long middle page splits the copy budget: dropped
])
def test_score_multi_vector_joins_pages_once(colpali_scoring, rng, monkeypatch, lengths, batch_size, budget, joins):
    _, processing, _ = colpali_scoring
    stock = processing.BaseVisualRetrieverProcessor.__dict__["score_multi_vector"].__func__
    stock = _patching.original(stock)
    monkeypatch.setattr(colpali_pages, "overlaps_host", lambda device: True)
    if budget is not None:
        monkeypatch.setattr(colpali_pages, "PACK_BUDGET_BYTES", budget)
    ps = _ragged(rng, lengths)
    qs = _ragged(rng, (3, 2))
    cat = torch.cat
    joined = []

    def counting_cat(tensors, *args, **kwargs):
        if len(tensors) >= len(ps) and all(any(t is p for p in ps) for t in tensors if t.shape[0] > 1):
            joined.append(len(tensors))
        return cat(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "cat", counting_cat)
    got = lik_colpali.score_multi_vector(qs, ps, batch_size=batch_size, device="cpu")
    monkeypatch.setattr(torch, "cat", cat)
    torch.testing.assert_close(got, stock(qs, ps, batch_size=batch_size, device="cpu"), rtol=1e-6, atol=1e-5)
    assert len(joined) == joins


@pytest.mark.parametrize("lengths", [(6, 6, 6, 6), (1,), (6, 12, 0, 6), (6, 3, 9, 6), (0, 5, 5, 0), (4, 9, 2, 7)])
@pytest.mark.parametrize("early", [False, True], ids=["join-after-lengths", "join-early"])
def test_score_multi_vector_page_lengths_without_the_shape_pass(colpali_scoring, rng, monkeypatch, lengths, early):
    """A list of 2-D pages is measured by element counts, with no per-page shape pass, whether it was joined early
    or not: equal pages, ragged ones, empty ones, as many rows as equal pages would have; all match colpali-engine.
    Zero-wide pages (element counts say nothing of their lengths) take the pass."""
    _, processing, _ = colpali_scoring
    stock = processing.BaseVisualRetrieverProcessor.__dict__["score_multi_vector"].__func__
    stock = _patching.original(stock)
    monkeypatch.setattr(colpali_pages, "overlaps_host", lambda device: early)
    passes = []
    sizes = colpali_pages.checked_sizes
    monkeypatch.setattr(colpali_pages, "checked_sizes", lambda name, items: passes.append(name) or sizes(name, items))
    ps = _ragged(rng, lengths)
    qs = _ragged(rng, (3, 2))
    got = lik_colpali.score_multi_vector(qs, ps, batch_size=2, device="cpu")
    torch.testing.assert_close(got, stock(qs, ps, batch_size=2, device="cpu"), rtol=1e-6, atol=1e-5)
    assert passes.count("ps") == 0
    flat = [torch.zeros(n, 0) for n in lengths]
    got = lik_colpali.score_multi_vector([torch.zeros(3, 0)], flat, batch_size=2, device="cpu")
    assert torch.equal(got, torch.zeros(1, len(lengths))) and passes.count("ps") == 1


def test_score_multi_vector_zero_token_meets_garbage_and_negative_similarities(colpali_scoring, rng, join_early):
    """The zero token of a padded page (applied to its row maxima, not copied in) is what colpali-engine's
    padding gives: it wins where every similarity is negative, and a query row holding inf or NaN meets it as NaN
    (0 * inf)."""
    _, processing, _ = colpali_scoring
    stock = processing.BaseVisualRetrieverProcessor.__dict__["score_multi_vector"].__func__
    stock = _patching.original(stock)
    qs = _ragged(rng, (3, 5, 2))
    qs[1][2, 4] = float("inf")
    qs[2][0, 1] = float("nan")
    ps = _ragged(rng, (6, 3, 5, 6))
    ps[1] = -qs[0][:1].expand(3, -1).clone() - 0.1  # every similarity with query 0's first token is negative
    for batch_size in (2, 128):
        expected = stock(qs, ps, batch_size=batch_size, device="cpu")
        got = lik_colpali.score_multi_vector(qs, ps, batch_size=batch_size, device="cpu")
        assert torch.equal(got.isnan(), expected.isnan()) and expected.isnan().any() and not expected.isnan().all()
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5, equal_nan=True)


def test_score_multi_vector_names_pages_of_another_width_in_a_later_copy(rng, monkeypatch):
    """Page lengths are element counts over the first page's width, so a copy whose pages are all of another width
    (it joins without error) must be named before its lengths are used."""
    monkeypatch.setattr(colpali_pages, "PACK_BUDGET_BYTES", 5 * 16 * 4 * 2)  # two pages of 4 x 16 per copy
    ps = [torch.randn(4, 16), torch.randn(4, 16), torch.randn(8, 8), torch.randn(8, 8)]
    for batch_size in (1, 128):
        with pytest.raises(ValueError, match=r"ps: every item must have the same embedding width, got \[8, 16\]"):
            lik_colpali.score_multi_vector(_ragged(rng, (3,)), ps, batch_size=batch_size, device="cpu")


@pytest.mark.parametrize("join_early_order", [False, True])
def test_score_multi_vector_names_pages_narrower_than_the_queries(rng, monkeypatch, join_early_order):
    """Pages all of one width that differs from the queries' are named as colpali-engine's arguments (not as
    lik.maxsim's), in every input form."""
    monkeypatch.setattr(colpali_pages, "overlaps_host", lambda device: join_early_order)
    pages = [torch.randn(8, 8), torch.randn(8, 8)]
    for ps in (pages, torch.stack(pages), pages + [torch.randn(3, 8)]):
        with pytest.raises(ValueError, match=r"ps has embedding width 8 but the queries have 16"):
            lik_colpali.score_multi_vector(_ragged(rng, (3,)), ps, device="cpu")


@pytest.mark.parametrize("first, middle", [(6, (12, None)), (0, (None,))])
def test_score_multi_vector_legacy_empty_page_is_named_after_an_early_join(rng, monkeypatch, first, middle):
    # torch.cat skips a legacy empty 1-D tensor, so the early join succeeds with as many rows as pages of the
    # first's length would have (four pages of 6; three empty pages): element counts must not pass it as a page.
    monkeypatch.setattr(colpali_pages, "overlaps_host", lambda device: True)
    ps = [torch.randn(first, 16)] + [torch.empty(0) if n is None else torch.randn(n, 16) for n in middle]
    ps.append(torch.randn(first, 16))
    bad = middle.index(None) + 1
    with pytest.raises(ValueError, match=rf"ps\[{bad}\] must be a \[L, d\] tensor, got torch.Size\(\[0\]\)"):
        lik_colpali.score_multi_vector(_ragged(rng, (3,), dim=16), ps, device="cpu")


def test_score_multi_vector_errors(rng):
    with pytest.raises(ValueError, match="No queries provided"):
        lik_colpali.score_multi_vector([], _ragged(rng, (3,)), device="cpu")
    with pytest.raises(ValueError, match="No passages provided"):
        lik_colpali.score_multi_vector(_ragged(rng, (3,)), [], device="cpu")
    with pytest.raises(ValueError, match=r"ps\[0\]"):
        lik_colpali.score_multi_vector(_ragged(rng, (3,)), [torch.randn(3)], device="cpu")
    with pytest.raises(ValueError, match=r"ps\[1\] must be a \[L, d\] tensor, got torch.Size\(\[3\]\)"):
        lik_colpali.score_multi_vector(_ragged(rng, (3,)), [torch.randn(3, 16), torch.randn(3), torch.randn(3, 16)],
                                       device="cpu")
    # Ragged lists (lengths read from element counts): a 3-D page, and a legacy empty 1-D one (which a join skips).
    with pytest.raises(ValueError, match=r"ps\[1\] must be a \[L, d\] tensor, got torch.Size\(\[1, 3, 16\]\)"):
        lik_colpali.score_multi_vector(_ragged(rng, (3,)), [torch.randn(3, 16), torch.randn(1, 3, 16),
                                                            torch.randn(5, 16)], device="cpu")
    with pytest.raises(ValueError, match=r"ps\[1\] must be a \[L, d\] tensor, got torch.Size\(\[0\]\)"):
        lik_colpali.score_multi_vector(_ragged(rng, (3,)), [torch.randn(3, 16), torch.empty(0), torch.randn(5, 16)],
                                       device="cpu")
    with pytest.raises(ValueError, match=r"ps\[1\] must be a \[L, d\] tensor, got list"):
        lik_colpali.score_multi_vector(_ragged(rng, (3,)), [torch.randn(3, 16), [1.0]], device="cpu")
    # Query lists are joined before their shapes are read: what the join would let through is still named.
    with pytest.raises(ValueError, match=r"qs\[1\] must be a \[L, d\] tensor, got torch.Size\(\[0\]\)"):
        lik_colpali.score_multi_vector([torch.randn(3, 16), torch.randn(0), torch.randn(2, 16)], _ragged(rng, (3,)),
                                       device="cpu")
    with pytest.raises(ValueError, match=r"qs\[0\] must be a \[L, d\] tensor, got torch.Size\(\[1, 3, 16\]\)"):
        lik_colpali.score_multi_vector([torch.randn(1, 3, 16), torch.randn(2, 16)], _ragged(rng, (3,)), device="cpu")
    with pytest.raises(ValueError, match=r"qs: every item must have the same embedding width, got \[8, 16\]"):
        lik_colpali.score_multi_vector(_ragged(rng, (3,)) + _ragged(rng, (2,), dim=8), _ragged(rng, (3,)),
                                       device="cpu")
    with pytest.raises(ValueError, match=r"ps: every item must have the same embedding width"):
        lik_colpali.score_multi_vector(_ragged(rng, (3,)), _ragged(rng, (3, 4)) + _ragged(rng, (2,), dim=8),
                                       device="cpu")


def test_query_lengths_from_element_counts(colpali_scoring, rng):
    """Query lengths come from element counts over the width once the join has checked the shapes: ragged,
    empty and one-token queries in bfloat16 score as colpali-engine's, and zero-width rows (whose counts say
    nothing of their lengths) as well; the zero row appended to each join is shared per device, dtype and width
    and never written."""
    _, processing, _ = colpali_scoring
    stock = processing.BaseVisualRetrieverProcessor.__dict__["score_multi_vector"].__func__
    stock = _patching.original(stock)
    qs = _ragged(rng, (6, 0, 1, 11, 2), dtype=torch.bfloat16)
    ps = _ragged(rng, (5, 5, 5), dtype=torch.bfloat16)
    for _ in range(2):
        torch.testing.assert_close(lik_colpali.score_multi_vector(qs, ps, device="cpu"),
                                   stock(qs, ps, device="cpu"), rtol=1e-2, atol=5e-2)
    zero = colpali_pages.ZERO_ROWS[(torch.device("cpu"), torch.bfloat16, 16)]
    assert zero.shape == (1, 16) and not zero.any()
    narrow = [torch.randn(3, 0), torch.randn(0, 0), torch.randn(2, 0)]
    pages = [torch.randn(4, 0), torch.randn(1, 0)]
    got = lik_colpali.score_multi_vector(narrow, pages, device="cpu")
    assert torch.equal(got, stock(narrow, pages, device="cpu")) and got.shape == (3, 2)


def test_inbatch_and_kd_match_and_train(colpali_scoring, rng):
    maxsim_module, _, _ = colpali_scoring
    q = torch.randn(4, 6, 16, generator=rng)
    q[0, 4:] = 0  # zero padding, colpali-engine's only padding
    d = torch.randn(5, 9, 16, generator=rng)
    d[1, 3:] = 0
    torch.testing.assert_close(lik_colpali.maxsim_inbatch(q, d), maxsim_module._torch_maxsim(q, d),
                               rtol=1e-6, atol=1e-5)
    d4 = torch.randn(4, 3, 9, 16, generator=rng)
    torch.testing.assert_close(lik_colpali.maxsim_kd(q, d4), maxsim_module._torch_maxsim_kd(q, d4),
                               rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("loss_name", ["ColbertLoss", "ColbertPairwiseCELoss", "ColbertSigmoidLoss",
                                       "ColbertNegativeCELoss", "ColbertPairwiseNegativeCELoss"])
@pytest.mark.parametrize("normalize_scores", [False, True])
def test_losses_with_enable_match_and_use_lik(colpali_scoring, rng, monkeypatch, loss_name, normalize_scores):
    maxsim_module, _, losses = colpali_scoring
    loss = getattr(losses, loss_name)(normalize_scores=normalize_scores)
    q = torch.nn.functional.normalize(torch.randn(4, 6, 16, generator=rng), dim=-1)
    q[1, 5:] = 0
    d = torch.nn.functional.normalize(torch.randn(4, 9, 16, generator=rng), dim=-1)
    negatives = torch.nn.functional.normalize(torch.randn(4, 2, 7, 16, generator=rng), dim=-1)
    args = (q, d, negatives) if "Negative" in loss_name else (q, d)
    results = []
    calls = []
    real = lik_colpali.score_dense
    monkeypatch.setattr(lik_colpali, "score_dense", lambda *a, **k: calls.append(1) or real(*a, **k))
    for use_lik in (False, True):
        leaves = [a.clone().requires_grad_() for a in args]
        if use_lik:
            with lik_colpali.enabled():
                value = loss(*leaves)
        else:
            value = loss(*leaves)
        value.backward()
        results.append((value, [leaf.grad for leaf in leaves]))
    assert calls, "enable() did not route the loss through lik"
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    # A zero-padding query row ties across every document token: colpali-engine's amax splits its gradient among
    # them, lik gives it to the first (the model's padding mask stops both). Real rows must agree.
    real_rows = q.any(dim=-1)
    torch.testing.assert_close(results[1][1][0][real_rows], results[0][1][0][real_rows], rtol=1e-4, atol=1e-5)
    for a, b in zip(results[0][1][1:], results[1][1][1:]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_smooth_max_keeps_colpali_path(colpali_scoring, rng, monkeypatch):
    _, _, losses = colpali_scoring
    calls = []
    monkeypatch.setattr(lik_colpali, "score_dense", lambda *a, **k: calls.append(1))
    q, d = torch.randn(3, 4, 8, generator=rng), torch.randn(3, 5, 8, generator=rng)
    with lik_colpali.enabled():
        losses.ColbertLoss(use_smooth_max=True, normalize_scores=False)(q, d)
    assert calls == []


def test_enable_is_reversible_and_covers_every_binding(colpali_scoring, count_calls, monkeypatch, rng,
                                                      reference_path):
    maxsim_module, processing, losses = colpali_scoring
    sites = [(maxsim_module, "maxsim_inbatch"), (maxsim_module, "maxsim_kd"), (processing, "maxsim_inbatch"),
             (losses, "maxsim_inbatch"), (losses, "maxsim_kd")]
    before = [getattr(m, n) for m, n in sites]
    stock_score = processing.BaseVisualRetrieverProcessor.__dict__["score_multi_vector"]
    q, d = torch.randn(2, 3, 8, generator=rng), torch.randn(2, 4, 8, generator=rng)
    calls = count_calls(lik_colpali, "score_dense")
    with lik_colpali.enabled():
        assert [getattr(m, n) for m, n in sites] == before  # nothing rebound: colpali-engine's functions switched
        for module, name in sites:
            count = len(calls)
            getattr(module, name)(q, d if name == "maxsim_inbatch" else d[:, None])
            assert len(calls) == count + 1, (module.__name__, name)
        qs, ps = _ragged(rng, (3, 2)), _ragged(rng, (4, 6, 5))
        got = processing.BaseVisualRetrieverProcessor.score_multi_vector(qs, ps, device="cpu")
        torch.testing.assert_close(got, lik_colpali.score_multi_vector(qs, ps, device="cpu"), rtol=0, atol=0)
        monkeypatch.setenv("COLPALI_SCORES_BACKEND", "torch")
        assert processing.maxsim_inbatch(torch.randn(2, 3, 8).bfloat16(), torch.randn(2, 3, 8).bfloat16()).dtype \
            == torch.bfloat16  # colpali-engine's own path
        monkeypatch.delenv("COLPALI_SCORES_BACKEND")
    calls.clear()
    for module, name in sites:
        getattr(module, name)(q, d if name == "maxsim_inbatch" else d[:, None])
    assert calls == [] and [getattr(m, n) for m, n in sites] == before
    assert processing.BaseVisualRetrieverProcessor.__dict__["score_multi_vector"] is stock_score


def test_scoring_objects_pickle_while_enabled_and_load_as_the_switch_says(colpali_scoring, count_calls, rng,
                                                                         reference_path):
    """colpali-engine's scoring functions and a loss, pickled (``pickle`` and ``torch.save``) while the switch is
    on, name no lik module and load as colpali-engine's own objects, which follow the loading process's switch."""
    maxsim_module, processing, losses = colpali_scoring
    objects = {"inbatch": maxsim_module.maxsim_inbatch, "kd": maxsim_module.maxsim_kd,
               "score": processing.BaseVisualRetrieverProcessor.score_multi_vector}
    with lik_colpali.enabled():
        objects["loss"] = losses.ColbertLoss(normalize_scores=False)
        payload = pickle.dumps(objects)
        saved = io.BytesIO()
        torch.save(objects, saved)
    loaded, modules = load_recording_modules(payload)
    assert not names_lik(modules), sorted(modules)
    saved.seek(0)
    q, d = torch.randn(2, 3, 8, generator=rng), torch.randn(2, 4, 8, generator=rng)
    calls = count_calls(lik_colpali, "score_dense")
    for copy in (loaded, torch.load(saved, weights_only=False)):
        assert all(copy[name] is objects[name] for name in ("inbatch", "kd", "score"))
        expected = copy["loss"](q, d)
        assert calls == []
        with lik_colpali.enabled():
            torch.testing.assert_close(copy["loss"](q, d), expected, rtol=1e-6, atol=1e-6)
        assert len(calls) == 1
        calls.clear()


def test_disable_restores_what_was_taken_while_enabled(colpali_scoring, count_calls, rng, reference_path):
    _, processing, losses = colpali_scoring
    calls = count_calls(lik_colpali, "score_dense")  # the losses
    packed_calls = count_calls(lik_colpali, "score_packed")  # score_multi_vector's ragged pages
    q, d = torch.randn(2, 3, 8, generator=rng), torch.randn(2, 4, 8, generator=rng)
    qs, ps = _ragged(rng, (3, 2)), _ragged(rng, (4, 6))
    with lik_colpali.enabled():
        score = processing.BaseVisualRetrieverProcessor.score_multi_vector
        inbatch = losses.maxsim_inbatch
        loss = losses.ColbertLoss(normalize_scores=False)
        score(qs, ps, device="cpu")
        inbatch(q, d)
        loss(q, d)
        assert len(calls) == 2 and len(packed_calls) == 1
    calls.clear()
    packed_calls.clear()
    score(qs, ps, device="cpu")
    inbatch(q, d)
    loss(q, d)
    assert calls == [] and packed_calls == []


@pytest.mark.gpu
def test_score_multi_vector_names_a_list_spread_over_devices(rng):
    cpu, gpu = _ragged(rng, (3,), dim=16)[0], _ragged(rng, (3,), dim=16)[0].cuda()
    with pytest.raises(ValueError, match=r"qs: every item must be on one device, got \['cpu', 'cuda:0'\]"):
        lik_colpali.score_multi_vector([gpu, cpu], [gpu, gpu], device="cuda")
    for pages in ([gpu, cpu, gpu], [gpu, cpu]):
        with pytest.raises(ValueError, match=r"ps: every item must be on one device, got \['cpu', 'cuda:0'\]"):
            lik_colpali.score_multi_vector([gpu], pages, device="cuda")


@pytest.mark.parametrize("interpret", ["1", "0"], ids=["kernels", "reference"])
def test_score_multi_vector_checks_once_and_scores_groups_unchecked(colpali_scoring, rng, monkeypatch, join_early,
                                                                   interpret):
    """The query rows are checked once and each group of pages reaches the internal entries (score_canonical for a
    dense batch, score_packed for packed pages) without a public scorer's validation, with colpali-engine's
    scores: several packed groups, one dense group, a padded tensor in chunks."""
    from lik.ops.maxsim.packing import PackedInputs
    from lik.ops.maxsim.validation import MaxSimInputs

    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    _, processing, _ = colpali_scoring
    stock = _patching.original(processing.BaseVisualRetrieverProcessor.__dict__["score_multi_vector"].__func__)
    builds = []
    for cls, name in ((MaxSimInputs, "build"), (PackedInputs, "build_corpus"), (PackedInputs, "build_pairs")):
        real = getattr(cls, name)
        monkeypatch.setattr(cls, name, classmethod(lambda cls, *a, _real=real, _name=name, **k: builds.append(_name)
                                                   or _real(*a, **k)))
    entries = {name: count_calls_of(monkeypatch, lik_colpali, name) for name in ("score_canonical", "score_packed")}
    monkeypatch.setattr(colpali_pages, "PACK_BUDGET_BYTES", 20 * 16 * 4)  # 20 rows (a page and a spare) per copy
    qs = _ragged(rng, (3, 5, 1))
    for ps, entry, count in ((_ragged(rng, (4, 9, 2, 7, 7, 3, 1, 0)), "score_packed", 3),
                             (_ragged(rng, (6, 6)), "score_canonical", 1)):
        for calls in entries.values():
            calls.clear()
        torch.testing.assert_close(lik_colpali.score_multi_vector(qs, ps, batch_size=3, device="cpu"),
                                   stock(qs, ps, batch_size=3, device="cpu"), rtol=1e-6, atol=1e-5)
        assert len(entries[entry]) == count and sum(map(len, entries.values())) == count, (entry, entries)
    # Two pages per call: per page, fp32 maxima of 10 query rows (9 and the zero row) and 3 x 5 gathered sums.
    monkeypatch.setattr(lik_colpali, "_ROW_SCORES_BUDGET_BYTES", 2 * 4 * (10 + 3 * 5))
    padded = torch.nn.utils.rnn.pad_sequence(_ragged(rng, (4, 9, 2, 7, 5)), batch_first=True)
    torch.testing.assert_close(lik_colpali.score_multi_vector(qs, padded, device="cpu"),
                               stock(qs, padded, device="cpu"), rtol=1e-6, atol=1e-5)
    assert len(entries["score_canonical"]) == 1 + 3
    # (The packed reference scores each document through lik.maxsim_reference, which checks its arguments.)
    assert builds == [] if interpret == "1" else set(builds) == {"build"}


def count_calls_of(monkeypatch, module, name):
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_score_multi_vector_checks_the_query_rows_once(rng):
    ps = _ragged(rng, (3, 4))
    with pytest.raises(TypeError, match=r"qs must have dtype in \[.*\], got torch.int32"):
        lik_colpali.score_multi_vector([torch.ones(3, 16, dtype=torch.int32)], [p.int() for p in ps], device="cpu")
    with pytest.raises(TypeError, match=r"qs must be a real tensor"):
        lik_colpali.score_multi_vector(torch.ones(1, 3, 16, dtype=torch.complex64), ps, device="cpu")
    with pytest.raises(ValueError, match=r"embedding width d = 8193 of qs"):
        lik_colpali.score_multi_vector([torch.zeros(1, 8193)], [torch.zeros(2, 8193)], device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_score_multi_vector_on_gpu_matches_colpali(colpali_scoring, rng, device):
    """On the GPU a page list is joined while its shapes are checked: equal pages (the dense batch), ragged pages
    with colpali-engine's zero tokens, and a padded tensor, against colpali-engine on fp32 copies."""
    _, processing, _ = colpali_scoring
    stock = processing.BaseVisualRetrieverProcessor.__dict__["score_multi_vector"].__func__
    stock = _patching.original(stock)
    qs = [t.cuda() for t in _ragged(rng, (20, 1, 33, 7), dim=128, dtype=torch.bfloat16)]
    for lengths in ((300,) * 40, (300, 120, 300, 57, 300, 1)):
        ps = [t.cuda() for t in _ragged(rng, lengths, dim=128, dtype=torch.bfloat16)]
        for batch_size in (128, 2):
            expected = stock([q.float() for q in qs], [p.float() for p in ps], batch_size=batch_size,
                             device="cuda")
            got = lik_colpali.score_multi_vector(qs, ps, batch_size=batch_size, device=device)
            assert got.device.type == "cpu" and got.dtype == torch.float32
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3)
    padded = torch.nn.utils.rnn.pad_sequence(ps, batch_first=True)
    torch.testing.assert_close(lik_colpali.score_multi_vector(qs, padded, device=device),
                               stock([q.float() for q in qs], padded.float(), device="cuda"), rtol=1e-4, atol=1e-3)
