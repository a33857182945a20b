"""sentence-transformers integration: the drop-ins equal util.maxsim / maxsim_pairwise of the installed package
(bitwise in fp32 on the CPU), and enable() reroutes its multi-vector scoring, reversibly."""

from __future__ import annotations

import pytest
import torch

similarity = pytest.importorskip("sentence_transformers.util.similarity")
if not hasattr(similarity, "maxsim"):
    pytest.skip("this sentence-transformers has no multi-vector scoring", allow_module_level=True)

import lik.integrations.sentence_transformers as lik_st  # noqa: E402


def _stock(name):
    fn = getattr(similarity, name)
    return getattr(fn, "__wrapped__", fn) if getattr(fn, "__module__", "").startswith("lik") else fn


def test_ragged_lists_bitwise(rng, reference_path):
    a = [torch.randn(n, 16, generator=rng) for n in (3, 5, 1)]
    b = [torch.randn(n, 16, generator=rng) for n in (4, 9, 2, 7)]
    assert torch.equal(lik_st.maxsim(a, b), _stock("maxsim")(a, b))
    assert torch.equal(lik_st.maxsim_pairwise(a, b[:3]), _stock("maxsim_pairwise")(a, b[:3]))


def test_masks_garbage_empty_documents_and_length_normalisation(rng, reference_path):
    A = torch.randn(3, 6, 16, generator=rng)
    B = torch.randn(4, 8, 16, generator=rng)
    a_mask = torch.rand(3, 6, generator=rng) > 0.3
    b_mask = torch.rand(4, 8, generator=rng) > 0.4
    b_mask[1] = False  # no scoreable token: -1e9
    expected = _stock("maxsim")(A, B, a_mask, b_mask, length_normalize=True)
    B_garbage = B.clone()
    B_garbage[~b_mask] = float("nan")
    got = lik_st.maxsim(A, B_garbage, a_mask.float(), b_mask, length_normalize=True)
    assert torch.equal(got, expected)
    assert (got[:, 1] < -1e7).all()
    assert torch.equal(lik_st.maxsim_pairwise(A, B[:3], a_mask, b_mask[:3]),
                       _stock("maxsim_pairwise")(A, B[:3], a_mask, b_mask[:3]))
    assert torch.equal(lik_st.mean_maxsim(A, B), _stock("mean_maxsim")(A, B))


def test_zero_rows_are_padding_and_single_items(rng, reference_path):
    A = torch.randn(2, 5, 16, generator=rng)
    B = -torch.rand(3, 8, 16, generator=rng)  # negative similarities: a padding row must not win the max
    A = A.abs()
    B[0, 5:] = 0
    assert torch.equal(lik_st.maxsim(A, B), _stock("maxsim")(A, B))
    assert torch.equal(lik_st.maxsim(A[0], B[1]), _stock("maxsim")(A[0], B[1]))
    assert lik_st.maxsim([], B).shape == _stock("maxsim")([], B).shape == (0, 3)


def test_bf16_within_fp32_accumulation_tolerance(rng):
    A = torch.randn(2, 32, 64, generator=rng).bfloat16()
    B = torch.randn(5, 40, 64, generator=rng).bfloat16()
    exact = _stock("maxsim")(A.double(), B.double()).double()
    lik_error = (lik_st.maxsim(A, B).double() - exact).abs().max()
    assert lik_error < 1e-4  # bf16 products are exact in fp32: only the fp32 sums round
    assert lik_error <= (_stock("maxsim")(A, B).double() - exact).abs().max()  # the host rounds to bf16 first


def test_pairwise_count_mismatch_is_an_error(rng):
    with pytest.raises(ValueError, match="same number of items"):
        lik_st.maxsim_pairwise(torch.randn(2, 3, 8), torch.randn(3, 3, 8))


def test_enable_rebinds_and_restores(monkeypatch, rng):
    import sentence_transformers.util as util

    names = [n for n in ("maxsim", "maxsim_pairwise", "mean_maxsim", "mean_maxsim_pairwise") if hasattr(similarity, n)]
    before = {n: getattr(similarity, n) for n in names}
    calls = []
    real = lik_st._lik_maxsim
    monkeypatch.setattr(lik_st, "_lik_maxsim", lambda *a, **k: calls.append(1) or real(*a, **k))
    with lik_st.enabled():
        for n in names:
            assert getattr(similarity, n) is getattr(lik_st, n)
            assert getattr(util, n) is getattr(lik_st, n)
        fn = similarity.SimilarityFunction.to_similarity_fn("maxsim")
        fn(torch.randn(2, 3, 8), torch.randn(4, 5, 8))
        try:
            from sentence_transformers.multi_vector_encoder.scoring import colbert as scoring
        except ImportError:
            scoring = None
        if scoring is not None:
            scoring.colbert_scores(torch.randn(2, 3, 8), torch.randn(2, 2, 5, 8))
        assert len(calls) >= 2
    assert {n: getattr(similarity, n) for n in names} == before
    assert util.maxsim is before["maxsim"]
