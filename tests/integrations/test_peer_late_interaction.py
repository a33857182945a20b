"""late-interaction-kernels' MaxSimScorer, padded, fp8, top-k, pair-list and patch functions on lik against the
real late-interaction-kernels 0.4.5's CPU code (its reference module, ``pack_padded`` and fp8 quantizers run
without a GPU), and the module's promise that every public name is covered."""

from __future__ import annotations

import warnings

import pytest
import torch

import lik
import lik.integrations.late_interaction_kernels as ours

peer = pytest.importorskip("late_interaction_kernels")
reference = pytest.importorskip("late_interaction_kernels.reference")
peer_padded = pytest.importorskip("late_interaction_kernels.padded")
peer_fp8 = pytest.importorskip("late_interaction_kernels.fp8")


def test_every_public_name_is_covered():
    for name in peer.__all__:
        if name not in ("__version__", "reference"):
            assert name in ours.__all__ and name in ours.__doc__, name
    for module in ("fp8", "padded", "topk", "score_pairs", "plaid", "fused_head"):
        theirs = pytest.importorskip(f"late_interaction_kernels.{module}")
        public = getattr(theirs, "__all__", None) or [  # fused_head has no __all__: its own public functions
            name
            for name, value in vars(theirs).items()
            if not name.startswith("_") and callable(value) and getattr(value, "__module__", "") == theirs.__name__
        ]
        assert public and set(public) <= set(getattr(ours, module).__all__), module
        assert f":mod:`.{module}`" in ours.__doc__.split("Not covered:")[0], module


def test_scorer_is_maxsim_with_the_peers_defaults(rng):
    Q = torch.randn(3, 6, 16, generator=rng, dtype=torch.float64, requires_grad=True)
    D = torch.randn(4, 9, 16, generator=rng, dtype=torch.float64)
    q_mask = torch.rand(3, 6, generator=rng) > 0.3
    d_mask = torch.rand(4, 9, generator=rng) > 0.3
    scorer = ours.MaxSimScorer()
    assert repr(scorer) == "MaxSimScorer(normalize=True, backward='auto', mask_pad_token=None)"
    expected = reference.maxsim_reference(Q, D, q_mask, d_mask, normalize=True)
    torch.testing.assert_close(scorer(Q, D, q_mask, d_mask), expected)
    assert scorer(Q, D).requires_grad and not scorer.score(Q, D).requires_grad
    with torch.no_grad():
        assert not scorer(Q, D).requires_grad
    q_ids, d_ids = q_mask.long() * 7, d_mask.long() * 7
    torch.testing.assert_close(ours.MaxSimScorer(mask_pad_token=0).forward_with_ids(Q, D, q_ids, d_ids), expected)
    scores, ids = scorer.retrieve(Q.detach(), D, top_k=2)
    assert torch.equal(ids, reference.maxsim_reference(Q.detach(), D, normalize=True).topk(2).indices)
    with pytest.raises(ValueError, match="backward"):
        ours.MaxSimScorer(backward="fastest")
    with pytest.raises(ValueError, match="mask_pad_token"):
        scorer.forward_with_ids(Q, D, q_ids, d_ids)


def test_candidate_sets_are_checked_with_the_peers_words(rng):
    Q = torch.randn(3, 6, 16, generator=rng)
    D = torch.randn(2, 4, 9, 16, generator=rng)
    with pytest.raises(ValueError, match="needs Q to be"):
        ours.maxsim(Q[0], D)
    with pytest.raises(ValueError, match=r"D.shape\[0\] == Q.shape\[0\]"):
        ours.maxsim(Q, D)
    with pytest.raises(ValueError, match="q_mask must be"):
        ours.maxsim(Q[:2], D, q_mask=torch.ones(2, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="same device"):
        ours.maxsim(Q, D.to("meta"))


def _padded_batch(rng, dtype=torch.float32):
    queries = torch.randn(3, 8, 16, generator=rng, dtype=dtype)
    documents = torch.randn(3, 4, 12, 16, generator=rng, dtype=dtype)
    q_len = torch.tensor([8, 1, 5], dtype=torch.int32)
    d_len = torch.tensor([[12, 3, 7, 1], [2, 12, 5, 6], [9, 9, 12, 4]], dtype=torch.int32)
    return queries, documents, q_len, d_len


def test_maxsim_padded_matches_the_peers_reference(rng):
    queries, documents, q_len, d_len = _padded_batch(rng, torch.float64)
    queries.requires_grad_()
    expected = reference.maxsim_padded_reference(queries.detach(), documents, q_len, d_len)
    scores = ours.maxsim_padded(queries, documents, q_len, d_len)
    torch.testing.assert_close(scores.float(), expected)
    scores.sum().backward()
    assert torch.equal(queries.grad[1, 1:], torch.zeros_like(queries.grad[1, 1:]))  # past the query's length
    assert ours.maxsim_padded(queries[:0], documents[:0], q_len[:0], d_len[:0]).shape == (0, 4)
    zero = d_len.clone()
    zero[0, 0] = 0
    assert ours.maxsim_padded(queries, documents, q_len, zero)[0, 0] == 0  # an empty document scores 0
    with pytest.raises(ValueError, match="doc_lengths must all be > 0"):
        ours.maxsim_padded(queries, documents, q_len, zero, validate=True)
    with pytest.raises(ValueError, match="doc_lengths"):
        ours.maxsim_padded(queries, documents, q_len, d_len[:2])


def _assert_same_batch(mine, theirs):
    for a, b in zip(mine, theirs, strict=True):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        else:
            assert type(a) is type(b) and a == b


def test_pack_padded_is_the_peers_layout(rng):
    batch = _padded_batch(rng)
    _assert_same_batch(ours.padded.pack_padded(*batch), peer_padded.pack_padded(*batch))
    empty = [x[:0] for x in batch]
    _assert_same_batch(ours.padded.pack_padded(*empty), peer_padded.pack_padded(*empty))
    too_long = batch[2].clone()
    too_long[1] = 9
    with pytest.raises(ValueError, match="query_lengths holds 9, past the padded length 8"):
        ours.padded.pack_padded(batch[0], batch[1], too_long, batch[3])
    zero = batch[2].clone()
    zero[0] = 0
    with pytest.raises(ValueError, match="query_lengths must all be > 0"):
        ours.padded.pack_padded(batch[0], batch[1], zero, batch[3], validate=True)


def test_maxsim_topk_is_retrieve_without_normalisation(rng):
    Q = torch.randn(2, 5, 16, generator=rng)
    D = torch.randn(12, 7, 16, generator=rng)
    expected = reference.maxsim_reference(Q, D)
    scores, indices = ours.topk.maxsim_topk(Q, D, 4, chunk_size=5)
    torch.testing.assert_close(scores, expected.topk(4).values)
    assert torch.equal(indices, expected.topk(4).indices)
    low_scores, low_indices = ours.topk.maxsim_topk(Q[0], D, 3, largest=False)
    assert torch.equal(low_indices, expected[0].topk(3, largest=False).indices)
    with pytest.raises(ValueError, match="k must be positive"):
        ours.topk.maxsim_topk(Q, D, 0)


def test_score_pairs_match_the_peers_reference(rng):
    queries = [torch.randn(n, 16, generator=rng, dtype=torch.float64) for n in (3, 5, 2)]
    docs = [torch.randn(n, 16, generator=rng, dtype=torch.float64) for n in (4, 9, 1, 6)]
    q, cu_q, max_q = lik.pack(queries)
    d, cu_d, max_d = lik.pack(docs)
    pair_q, pair_d = torch.tensor([0, 0, 2, 1, 2]), torch.tensor([3, 1, 1, 0, 3])
    expected = reference.maxsim_reference_scatter(q, d, cu_q, cu_d, pair_q, pair_d)
    q.requires_grad_()
    scores = ours.score_pairs.score_pairs_packed(
        q, d, cu_q, cu_d, pair_q, pair_d, max_seqlen_q=max_q, max_seqlen_d=max_d
    )
    torch.testing.assert_close(scores.float(), expected)
    scores.sum().backward()
    q2 = q.detach().clone().requires_grad_()
    torch.stack(
        [
            (q2[cu_q[i] : cu_q[i + 1]] @ d[cu_d[j] : cu_d[j + 1]].T).amax(-1).sum()
            for i, j in zip(pair_q.tolist(), pair_d.tolist())
        ]
    ).sum().backward()
    torch.testing.assert_close(q.grad, q2.grad)  # a query in two pairs gets both pairs' gradients
    assert ours.score_pairs.score_pairs_packed(q, d, cu_q, cu_d, pair_q[:0], pair_d[:0]).shape == (0,)
    with pytest.raises(ValueError, match="pair_q_idx / pair_d_idx"):
        ours.score_pairs.score_pairs_packed(q, d, cu_q, cu_d, pair_q, pair_d[:2])


def test_fp8_quantizers_are_the_peers(rng):
    X = torch.randn(3, 5, 16, generator=rng)
    for name in ("quantize_fp8_per_token", "quantize_fp8_per_tensor"):
        (values, scale), (their_values, their_scale) = getattr(ours.fp8, name)(X), getattr(peer_fp8, name)(X)
        assert values.dtype == torch.float8_e4m3fn and scale.shape == their_scale.shape
        torch.testing.assert_close(scale, their_scale)
        assert torch.equal(values.float(), their_values.float())
    values, scale = ours.fp8.quantize_fp8_per_tensor(X)
    torch.testing.assert_close(ours.fp8.dequantize_fp8_per_tensor(values, scale), X, atol=0.2, rtol=0.07)
    zero_values, zero_scale = ours.fp8.quantize_fp8_per_tensor(torch.zeros(4, 8))
    assert zero_scale == 0 and not zero_values.float().any()  # the peer: scale 1e-6 / 448
    assert ours.fp8.quantize_fp8_per_tensor(torch.empty(0, 8))[1].dim() == 0
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        ours.fp8.quantize_fp8_per_token(X, torch.float8_e5m2)


@pytest.mark.parametrize("per_token", [(True, True), (False, True), (True, False), (False, False)])
def test_fp8_scores_are_the_dequantized_operands(rng, per_token):
    Q = torch.randn(2, 6, 16, generator=rng)
    D = torch.randn(3, 9, 16, generator=rng)
    q_mask = torch.tensor([[True] * 4 + [False] * 2, [True] * 6])
    d_mask = torch.rand(3, 9, generator=rng) > 0.3
    quantizers = [ours.fp8.quantize_fp8_per_token if token else ours.fp8.quantize_fp8_per_tensor for token in per_token]
    (Q8, q_scale), (D8, d_scale) = quantizers[0](Q), quantizers[1](D)
    widen = [ours.fp8.dequantize_fp8_per_token if token else ours.fp8.dequantize_fp8_per_tensor for token in per_token]
    expected = reference.maxsim_reference(
        widen[0](Q8, q_scale).double(), widen[1](D8, d_scale).double(), q_mask, d_mask
    ).float()
    scores = ours.fp8.maxsim_inference_fp8(Q8, D8, scale_Q=q_scale, scale_D=d_scale, q_mask=q_mask, d_mask=d_mask)
    torch.testing.assert_close(scores, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        theirs = peer_fp8.maxsim_inference_fp8(Q8, D8, scale_Q=q_scale, scale_D=d_scale, q_mask=q_mask, d_mask=d_mask)
    torch.testing.assert_close(scores, theirs, atol=0.05, rtol=0.02)  # the peer rounds to bfloat16 on the CPU


def test_fp8_shapes_and_fallback(rng):
    Q8, q_scale = ours.fp8.quantize_fp8_per_token(torch.randn(6, 16, generator=rng))
    D8, d_scale = ours.fp8.quantize_fp8_per_token(torch.randn(9, 16, generator=rng))
    scalar = ours.fp8.maxsim_inference_fp8(Q8, D8, scale_Q=q_scale, scale_D=d_scale)
    assert scalar.shape == ()
    torch.testing.assert_close(
        scalar, reference.maxsim_reference(Q8.float() * q_scale[:, None], D8.float() * d_scale[:, None])
    )
    column = ours.fp8.maxsim_inference_fp8(
        Q8[None].expand(2, -1, -1), D8, scale_Q=q_scale.expand(2, -1), scale_D=d_scale
    )
    assert column.shape == (2,)
    monkey = pytest.MonkeyPatch()
    monkey.setattr(ours.fp8, "_FALLBACK_WARNED", False)
    with pytest.warns(RuntimeWarning, match="dequantized"):
        wide = ours.fp8.maxsim_inference_fp8(
            Q8.to(torch.float8_e5m2), D8.to(torch.float8_e5m2), scale_Q=q_scale, scale_D=d_scale
        )
    monkey.undo()
    torch.testing.assert_close(
        wide,
        reference.maxsim_reference(
            Q8.to(torch.float8_e5m2).float() * q_scale[:, None], D8.to(torch.float8_e5m2).float() * d_scale[:, None]
        ),
    )
    with pytest.raises(ValueError, match="scale_D"):
        ours.fp8.maxsim_inference_fp8(Q8, D8, scale_Q=q_scale, scale_D=d_scale[:3])


def test_patch_functions_throw_liks_switches(monkeypatch):
    import lik.integrations.colpali as lik_colpali
    import lik.integrations.pylate as lik_pylate

    calls = []
    for module in (lik_pylate, lik_colpali):
        for name in ("enable", "disable"):
            monkeypatch.setattr(module, name, lambda m=module.__name__, n=name: calls.append((m, n)))
    ours.patch_pylate()
    ours.unpatch_pylate()
    ours.patch_colpali_engine()
    ours.unpatch_colpali_engine()
    assert calls == [
        ("lik.integrations.pylate", "enable"),
        ("lik.integrations.pylate", "disable"),
        ("lik.integrations.colpali", "enable"),
        ("lik.integrations.colpali", "disable"),
    ]


def test_patch_pylate_routes_pylate_through_lik(count_calls):
    scores_module = pytest.importorskip("pylate.scores")
    import lik.integrations.pylate as lik_pylate

    calls = count_calls(lik_pylate, "colbert_scores")
    Q, D = torch.randn(2, 4, 8), torch.randn(3, 5, 8)
    ours.patch_pylate()
    try:
        assert lik_pylate.is_enabled()
        scores_module.colbert_scores(Q, D)
    finally:
        ours.unpatch_pylate()
    assert not lik_pylate.is_enabled() and len(calls) == 1


def test_half_precision_is_normalised_in_float32_and_rounded_once(rng, monkeypatch):
    Q = torch.randn(2, 6, 16, generator=rng).half()
    D = torch.randn(5, 9, 16, generator=rng).half()

    def once(x):
        return torch.nn.functional.normalize(x.float(), dim=-1).half()

    expected = lik.maxsim(once(Q), once(D))
    monkeypatch.setattr("lik.integrations.late_interaction_kernels.scoring._NORMALIZE_CHUNK_ROWS", 7)
    assert torch.equal(ours.maxsim(Q, D, normalize=True), expected)  # what torch.compile's fused normalisation gives
    assert torch.equal(ours.retrieve(Q, D, 5)[0], expected.sort(dim=-1, descending=True).values)
    Qg = Q.clone().requires_grad_()
    scores = ours.maxsim(Qg, D, normalize=True)
    assert torch.equal(scores, expected)
    scores.sum().backward()
    assert Qg.grad.dtype == torch.float16
