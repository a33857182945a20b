"""flash-maxsim's 8-bit, training, reranking, top-k and reference functions on lik against the real flash-maxsim
0.3.0's CPU code (its quantizers and ``maxsim_naive*`` references run without a GPU), and the module's promise that
every public flash-maxsim function is either covered or named as not covered."""

from __future__ import annotations

import pytest
import torch

import lik.integrations.flash_maxsim as ours

flash_maxsim = pytest.importorskip("flash_maxsim")
naive = pytest.importorskip("flash_maxsim.naive")
quant = pytest.importorskip("flash_maxsim.flash_maxsim_quant")


def _corpus(rng, n=5, width=9, dim=16, dtype=torch.float32):
    return torch.randn(n, width, dim, generator=rng).to(dtype)


def test_every_public_function_is_covered_or_named():
    public = {name for name, value in vars(flash_maxsim).items()
              if callable(value) and not name.startswith("_") and getattr(value, "__module__", "").startswith(
                  "flash_maxsim")}
    not_covered_text = ours.__doc__.split("Not covered:")[1].split("Deliberate differences")[0]
    missing = [name for name in sorted(public) if name not in ours.__all__ and f"``{name}``" not in not_covered_text]
    assert missing == [], f"flash-maxsim functions neither covered nor named as not covered: {missing}"
    for name in ours.__all__:
        assert getattr(ours, name) is not None
        assert name in ours.__doc__ or name.startswith("DEFAULT_"), name


def test_affine_uint8_quantization_is_flash_maxsims(rng):
    D = _corpus(rng)
    for a, b in zip(ours.quantize_int8(D), quant.quantize_int8(D)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    codes, scales, mins = ours.quantize_int8(D)
    assert torch.equal(ours.dequantize_int8(codes, scales, mins), quant.dequantize_int8(codes, scales, mins))


def test_symmetric_quantizers_match_flash_maxsim_within_one_step(rng):
    D = _corpus(rng, dtype=torch.float16)
    (values, scales), (their_values, their_scales) = ours.quantize_int8_symmetric(D), quant.quantize_int8_symmetric(D)
    assert values.dtype == torch.int8 and scales.dtype == torch.float16 and scales.shape == (5, 9, 1)
    assert torch.equal(scales, their_scales)
    assert (values.int() - their_values.int()).abs().max() <= 1  # the peer divides in float16
    Q = torch.randn(7, 16, generator=rng)
    (q_values, q_scales), (their_q, their_q_scales) = ours.quantize_query_int8(Q), quant.quantize_query_int8(Q)
    assert q_scales.shape == (7,) and torch.equal(q_scales, their_q_scales)
    assert (q_values.int() - their_q.int()).abs().max() <= 1


def test_int8x8_scores_the_dequantized_operands(rng):
    Q = torch.randn(7, 16, generator=rng)
    D = _corpus(rng)
    lengths = torch.tensor([9, 1, 4, 9, 2])
    D_int8, d_scales = ours.quantize_int8_symmetric(D)
    Q_int8, q_scales = ours.quantize_query_int8(Q)
    q_deq = Q_int8.double() * q_scales.double()[:, None]
    d_deq = D_int8.double() * d_scales.double()
    expected = naive.maxsim_naive(q_deq, d_deq, lengths).float()
    scores = ours.flash_maxsim_int8x8(Q, D_int8, d_scales, doc_lengths=lengths)
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, expected)
    torch.testing.assert_close(ours.flash_maxsim_int8x8(None, D_int8, d_scales[..., 0], Q_int8, q_scales),
                               naive.maxsim_naive(q_deq, d_deq).float())
    # A float query is quantized per token first, as everywhere in lik (flash-maxsim keeps it in float16).
    assert torch.equal(ours.flash_maxsim_int8_symmetric(Q, D_int8, d_scales), ours.flash_maxsim_int8x8(Q, D_int8,
                                                                                                      d_scales))


def test_affine_int8_scores_the_dequantized_corpus(rng, monkeypatch):
    Q = torch.randn(7, 16, generator=rng, dtype=torch.float64)
    D = _corpus(rng)
    lengths = torch.tensor([9, 3, 1, 9, 5])
    codes, scales, mins = quant.quantize_int8(D)
    expected = naive.maxsim_naive(Q, quant.dequantize_int8(codes, scales, mins).double(), lengths)
    torch.testing.assert_close(ours.flash_maxsim_int8(Q, codes, scales, mins, lengths), expected)
    # Dequantized a chunk of documents at a time: two documents per chunk here, same scores.
    monkeypatch.setattr("lik.integrations.flash_maxsim.quantized._DEQUANTIZED_CHUNK_BYTES", 2 * 9 * 16 * 4)
    torch.testing.assert_close(ours.flash_maxsim_int8(Q, codes, scales[..., 0], mins[..., 0], lengths), expected)
    with pytest.raises(TypeError, match="D_uint8"):
        ours.flash_maxsim_int8(Q, codes.to(torch.int8), scales, mins)
    with pytest.raises(ValueError, match="scales"):
        ours.flash_maxsim_int8(Q, codes, scales[:, :4], mins)


def test_train_gradients_match_the_naive_reference(rng):
    Q = torch.randn(6, 16, generator=rng, dtype=torch.float64, requires_grad=True)
    D = _corpus(rng, dtype=torch.float64).requires_grad_()
    ours.flash_maxsim_train(Q, D).sum().backward()
    Q2, D2 = Q.detach().clone().requires_grad_(), D.detach().clone().requires_grad_()
    naive.maxsim_naive(Q2, D2).sum().backward()
    torch.testing.assert_close(Q.grad, Q2.grad)
    torch.testing.assert_close(D.grad, D2.grad)


def test_rerank_functions_match_the_naive_reference(rng):
    Q = torch.randn(6, 16, generator=rng, dtype=torch.float64)
    docs = [torch.randn(n, 16, generator=rng, dtype=torch.float64) for n in (4, 9, 1)]
    padded = torch.zeros(3, 9, 16, dtype=torch.float64)
    for i, doc in enumerate(docs):
        padded[i, :len(doc)] = doc
    lengths = torch.tensor([4, 9, 1])
    expected = naive.maxsim_naive(Q, padded, lengths)
    packed, cu, max_d = ours.pack_docs(docs)
    torch.testing.assert_close(ours.flash_maxsim_rerank(Q, packed, cu, max_d), expected)
    # Documents anywhere in a token tensor, in any order.
    tokens = torch.cat([torch.randn(3, 16, generator=rng, dtype=torch.float64), docs[1], docs[0], docs[2]])
    offsets = torch.tensor([12, 3, 16])
    torch.testing.assert_close(ours.flash_maxsim_rerank_direct(Q, tokens, offsets, lengths, 9), expected)
    # Each query against its own candidates, with query lengths.
    queries = torch.randn(2, 6, 16, generator=rng, dtype=torch.float64)
    candidates = padded[None].expand(2, -1, -1, -1)
    q_lengths = torch.tensor([6, 2])
    scores = ours.flash_maxsim_rerank_padded(queries, candidates, q_lengths, lengths[None].expand(2, -1))
    torch.testing.assert_close(scores, torch.stack([naive.maxsim_naive(queries[i, :n], padded, lengths)
                                                    for i, n in enumerate(q_lengths.tolist())]))
    with pytest.raises(ValueError, match="doc_lengths"):
        ours.flash_maxsim_rerank_padded(queries, candidates, None, lengths)


def test_pairs_match_the_naive_reference(rng):
    queries = [torch.randn(n, 16, generator=rng, dtype=torch.float64) for n in (3, 5)]
    docs = [torch.randn(n, 16, generator=rng, dtype=torch.float64) for n in (7, 2)]
    expected = torch.stack([naive.maxsim_naive(q, d[None])[0] for q, d in zip(queries, docs)])
    torch.testing.assert_close(ours.flash_maxsim_pairs(queries, docs), expected)
    Q, D = torch.stack([queries[0]] * 2), torch.stack([docs[0]] * 2)
    torch.testing.assert_close(ours.flash_maxsim_pairs(Q, D), expected[:1].expand(2))
    torch.testing.assert_close(ours.flash_maxsim_pairs([Q[0], Q[1]], [D[0], D[1]]), expected[:1].expand(2))
    torch.testing.assert_close(ours.flash_maxsim_pairs_dense(Q, D, torch.tensor([3, 1]), torch.tensor([7, 2])),
                               torch.stack([expected[0], naive.maxsim_naive(Q[1, :1], D[1:, :2])[0]]))


def test_topk_is_the_exact_top_k(rng):
    Q = torch.randn(6, 16, generator=rng)
    D = _corpus(rng, n=12)
    lengths = torch.randint(1, 10, (12,), generator=rng)
    exact = naive.maxsim_naive(Q, D, lengths)
    scores, indices = ours.flash_maxsim_topk(Q, D, k=5, doc_lengths=lengths)
    expected_scores, expected_indices = exact.topk(5)
    torch.testing.assert_close(scores, expected_scores)
    assert torch.equal(indices, expected_indices)
    assert ours.flash_maxsim_topk(Q, D, k=100)[1].shape == (12,)


def test_naive_references_are_flash_maxsims(rng):
    Q = torch.randn(6, 16, generator=rng)
    D = _corpus(rng)
    lengths = torch.tensor([9, 0, 3, 9, 1])
    for name in ("maxsim_naive", "maxsim_naive_fp32"):
        mine, theirs = getattr(ours, name)(Q, D, lengths), getattr(naive, name)(Q, D, lengths)
        assert mine.dtype == theirs.dtype
        torch.testing.assert_close(mine, theirs)
        assert mine[1] == float("-inf")  # flash-maxsim's empty document, kept by its references
    Qh, Dh = Q.half(), D.half()
    mine = ours.maxsim_naive(Qh, Dh)
    assert mine.dtype == torch.float16  # sums in the input dtype, as flash-maxsim's
    torch.testing.assert_close(mine, naive.maxsim_naive(Qh, Dh), atol=0.05, rtol=2e-3)
    for name in ("maxsim_at_operator", "maxsim_bmm"):
        torch.testing.assert_close(getattr(ours, name)(Q, D), getattr(naive, name)(Q, D))
    torch.testing.assert_close(ours.maxsim_chunked(Q, D, chunk_size=2, fp32_reduce=True),
                               naive.maxsim_chunked(Q, D, chunk_size=2, fp32_reduce=True))
    Qs = torch.randn(3, 6, 16, generator=rng)
    torch.testing.assert_close(ours.maxsim_naive_batched(Qs, D, lengths), naive.maxsim_naive_batched(Qs, D, lengths))
    torch.testing.assert_close(ours.maxsim_naive_batched(Qs, D[:3, None].expand(-1, 2, -1, -1), shared_docs=False),
                               naive.maxsim_naive_batched(Qs, D[:3, None].expand(-1, 2, -1, -1), shared_docs=False))
    D_int8, d_scales = quant.quantize_int8_symmetric(Dh)
    torch.testing.assert_close(ours.maxsim_naive_int8(Qh, D_int8, d_scales), naive.maxsim_naive_int8(Qh, D_int8,
                                                                                                     d_scales))


def test_kernel_variants_score_as_flash_maxsim(rng):
    Q = torch.randn(6, 16, generator=rng, dtype=torch.float64)
    D = _corpus(rng, dtype=torch.float64)
    lengths = torch.tensor([9, 2, 5, 9, 1])
    expected = naive.maxsim_naive(Q, D, lengths)
    for variant in (ours.flash_maxsim_persistent, ours.flash_maxsim_qreuse, ours.flash_maxsim_splitk):
        torch.testing.assert_close(variant(Q, D, lengths), expected)


def test_warmup_counts_the_shapes_it_ran(monkeypatch):
    result = ours.warmup(shapes=[(2, 4, 30, 16)], train_shapes=[(2, 4, 30, 16)], device="cpu")
    assert result["fwd_shapes"] == 1 and result["bwd_shapes"] == 1 and result["wall_seconds"] > 0
    # Variants compiled already take milliseconds: the time is not rounded to 0 ("nothing ran").
    monkeypatch.setattr("lik.integrations.flash_maxsim.scoring._lik_warmup", lambda *args, **kwargs: 1)
    assert ours.warmup(shapes=[(2, 4, 30, 16)], train_shapes=[])["wall_seconds"] > 0
