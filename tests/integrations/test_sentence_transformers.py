"""sentence-transformers integration: the drop-ins equal util.maxsim / maxsim_pairwise of the installed package
(bitwise in fp32 on the CPU), and enable() reroutes its multi-vector scoring, reversibly."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

similarity = pytest.importorskip("sentence_transformers.util.similarity")
if not hasattr(similarity, "maxsim"):
    pytest.skip("this sentence-transformers has no multi-vector scoring", allow_module_level=True)

import lik.integrations.sentence_transformers as lik_st  # noqa: E402
from lik.integrations import _patching  # noqa: E402

from .conftest import load_recording_modules, names_lik  # noqa: E402


def _stock(name):
    return _patching.original(getattr(similarity, name))


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
    # bf16 products are exact in fp32: only the fp32 sums round, a few ulps of the largest score (~570 here, whose
    # ulp is 6e-5); rounding anything to bf16 would cost ~1.
    assert lik_error < 1e-6 * exact.abs().max()
    assert lik_error <= (_stock("maxsim")(A, B).double() - exact).abs().max()  # the host rounds to bf16 first


def test_pairwise_count_mismatch_is_an_error(rng):
    with pytest.raises(ValueError, match="same number of items"):
        lik_st.maxsim_pairwise(torch.randn(2, 3, 8), torch.randn(3, 3, 8))


def test_enable_switches_every_caller_and_restores(count_calls, rng, reference_path):
    import sentence_transformers.util as util

    names = [n for n in ("maxsim", "maxsim_pairwise", "mean_maxsim", "mean_maxsim_pairwise") if hasattr(similarity, n)]
    before = {n: getattr(similarity, n) for n in names}
    calls = count_calls(lik_st, "score_dense")
    A, B = torch.randn(2, 3, 8, generator=rng), torch.randn(4, 5, 8, generator=rng)
    with lik_st.enabled():
        assert {n: getattr(similarity, n) for n in names} == before  # nothing rebound: the functions switched
        for n in names:
            getattr(util, n)(A, B if "pairwise" not in n else B[:2])
        assert len(calls) == len(names)
        similarity.SimilarityFunction.to_similarity_fn("maxsim")(A, B)
        try:
            from sentence_transformers.multi_vector_encoder.scoring import colbert as scoring
        except ImportError:
            scoring = None
        assert len(calls) == len(names) + 1
        if scoring is not None:  # one call per candidate slot
            scoring.colbert_scores(A[:2], torch.randn(2, 2, 5, 8, generator=rng))
            assert len(calls) > len(names) + 1
    calls.clear()
    for n in names:
        getattr(util, n)(A, B if "pairwise" not in n else B[:2])
    assert calls == [] and util.maxsim is before["maxsim"]


# ------------------------------------------------------------------------- real models: pickles and disable()


def _encoder(path, **kwargs):
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Transformer

    torch.manual_seed(0)
    return MultiVectorEncoder(modules=[Transformer(path, max_seq_length=16)], device="cpu", **kwargs)


def test_models_pickle_while_enabled_and_load_as_the_switch_says(tiny_bert_path, count_calls, rng, reference_path):
    """A model built before the switch and one configured under it pickle (``pickle`` and ``torch.save``) while it
    is on; the pickles name no lik module, so they load where lik is absent, score as sentence-transformers off the
    switch and with lik on it."""
    before = _encoder(tiny_bert_path)
    before.similarity_fn_name  # noqa: B018 (stores sentence-transformers' function in the model)
    A, B = torch.randn(2, 3, 8, generator=rng), torch.randn(4, 5, 8, generator=rng)
    with lik_st.enabled():
        during = _encoder(tiny_bert_path, similarity_fn_name="meanmaxsim")
        payloads = [pickle.dumps(model) for model in (before, during)]
        saved = []
        for model in (before, during):
            saved.append(io.BytesIO())
            torch.save(model, saved[-1])
    expected = [_stock("maxsim")(A, B), _stock("mean_maxsim")(A, B)]
    calls = count_calls(lik_st, "score_dense")
    for payload, buffer, scores in zip(payloads, saved, expected):
        loaded, modules = load_recording_modules(payload)
        assert not names_lik(modules), sorted(modules)
        buffer.seek(0)
        for model in (loaded, torch.load(buffer, weights_only=False)):
            assert torch.equal(model.similarity(A, B), scores)
            assert calls == []
            with lik_st.enabled():
                torch.testing.assert_close(model.similarity(A, B), scores, rtol=1e-5, atol=1e-5)
            assert len(calls) == 1
            calls.clear()


def test_disable_restores_models_configured_while_enabled(tiny_bert_path, count_calls, rng, reference_path):
    model = _encoder(tiny_bert_path)
    A, B = torch.randn(2, 3, 8, generator=rng), torch.randn(4, 5, 8, generator=rng)
    calls = count_calls(lik_st, "score_dense")
    with lik_st.enabled():
        model.similarity_fn_name = "maxsim"
        built = _encoder(tiny_bert_path, similarity_fn_name="meanmaxsim")
        function = similarity.SimilarityFunction.to_similarity_fn("maxsim")
        model.similarity(A, B)
        assert len(calls) == 1
    calls.clear()
    assert torch.equal(model.similarity(A, B), _stock("maxsim")(A, B))
    assert torch.equal(built.similarity(A, B), _stock("mean_maxsim")(A, B))
    assert torch.equal(function(A, B), _stock("maxsim")(A, B))
    assert calls == []


@pytest.mark.parametrize("interpret", ["1", "0"], ids=["kernels", "reference"])
@pytest.mark.parametrize("name", ["maxsim", "maxsim_pairwise"])
def test_compiles_as_one_graph_with_empty_documents(rng, monkeypatch, name, interpret):
    """Under ``torch.compile(fullgraph=True)`` the drop-in is one graph, an empty document included: the empty
    documents are filled on the device, with no host read of them (the host's warning reads them in eager only)."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setattr(lik_st, "_warned_empty", False)  # a warning already given would skip the host read
    A, B = torch.randn(3, 5, 16, generator=rng), torch.randn(3, 7, 16, generator=rng)
    a_mask, b_mask = torch.rand(3, 5, generator=rng) > 0.3, torch.rand(3, 7, generator=rng) > 0.4
    b_mask[1] = False  # no scoreable token: -1e9

    def score(a, b, am, bm):
        return getattr(lik_st, name)(a, b, am, bm, length_normalize=True)

    torch._dynamo.reset()
    got = torch.compile(score, backend="aot_eager", fullgraph=True)(A, B, a_mask, b_mask)
    expected = _stock(name)(A, B, a_mask, b_mask, length_normalize=True)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (got[..., 1] < -1e7).all() if name == "maxsim" else got[1] < -1e7
