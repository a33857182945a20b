"""An empty side scores 0 on every path, whatever the other side holds (masked garbage or an unmasked NaN).

The rule (docs/design.md): a document with no token taking part in the max (no token at all, or, under
``mask_mode="exclude"``, no valid token) scores 0 and gets zero gradient, and so does every query token's pair
with it; an empty query scores 0 against every document. Each case runs through the Triton kernels (interpreter)
and the CPU reference, and is compared with a float64 brute force over the valid tokens.
"""

from __future__ import annotations

import pytest
import torch

import lik

GARBAGE = [float("nan"), float("inf"), float("-inf")]


@pytest.fixture(params=["kernel", "reference"])
def path(request, monkeypatch):
    """Run each test through the Triton kernels (interpreter) and through the CPU reference path."""
    if request.param == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    return request.param


def brute_force(Q, D, q_mask=None, d_mask=None, mask_mode="exclude"):
    """float64 MaxSim ``[Nq, B]`` by loops over the tokens that take part; differentiable, garbage never read."""
    Q, D = Q.double(), D.double()
    n_q, l_q, _ = Q.shape
    n_docs, l_d = D.shape[-3], D.shape[-2]
    rows = []
    for i in range(n_q):
        docs = D[i] if D.dim() == 4 else D
        doc_masks = None if d_mask is None else (d_mask[i] if d_mask.dim() == 3 else d_mask)
        row = []
        for j in range(n_docs):
            total = Q.new_zeros(())
            for s in range(l_q):
                if q_mask is not None and not q_mask[i, s]:
                    continue
                sims = []
                for t in range(l_d):
                    if doc_masks is None or doc_masks[j, t]:
                        sims.append(Q[i, s] @ docs[j, t])
                    elif mask_mode == "zero":
                        sims.append(Q.new_zeros(()))
                if sims:  # no token taking part: this query token adds 0
                    total = total + torch.stack(sims).max()
            row.append(total)
        rows.append(torch.stack(row) if row else Q.new_zeros(0))
    return torch.stack(rows) if rows else Q.new_zeros(0, n_docs)


def scores_and_grads(fn, Q, D, *args, **kwargs):
    Q = Q.detach().clone().requires_grad_()
    D = D.detach().clone().requires_grad_()
    scores = fn(Q, D, *args, **kwargs)
    dq, dd = torch.autograd.grad(scores.sum(), (Q, D), allow_unused=True)
    return scores.detach(), (torch.zeros_like(Q) if dq is None else dq), (torch.zeros_like(D) if dd is None else dd)


@pytest.mark.parametrize("garbage", GARBAGE)
@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
@pytest.mark.parametrize("per_query", [False, True])
def test_masked_query_garbage_against_tokenless_documents(rng, path, garbage, mask_mode, per_query):
    Q = torch.randn(2, 3, 8, generator=rng)
    Q[1, 1] = garbage
    q_mask = torch.tensor([[True, True, False], [True, False, True]])
    D = torch.randn((2,) * per_query + (3, 0, 8), generator=rng)
    s, dq, dd = scores_and_grads(lik.maxsim, Q, D, q_mask, mask_mode=mask_mode)
    assert s.shape == (2, 3) and torch.equal(s, brute_force(Q, D, q_mask).float())
    assert torch.equal(dq, torch.zeros_like(Q)) and dd.shape == D.shape


@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
@pytest.mark.parametrize("squeeze", [False, True])
def test_unmasked_nan_query_against_tokenless_documents_scores_zero(rng, path, mask_mode, squeeze):
    Q = torch.randn(1, 4, 8, generator=rng)
    Q[0, 2] = float("nan")
    D = torch.randn(2, 0, 8, generator=rng)
    s, dq, _ = scores_and_grads(lik.maxsim, Q[0] if squeeze else Q, D, mask_mode=mask_mode)
    assert torch.equal(s, torch.zeros(2) if squeeze else torch.zeros(1, 2))
    assert torch.equal(dq, torch.zeros_like(dq))


@pytest.mark.parametrize("garbage", GARBAGE)
@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
def test_empty_query_against_documents_holding_garbage(rng, path, garbage, mask_mode):
    D = torch.randn(3, 4, 8, generator=rng)
    D[0, 1] = garbage  # masked
    D[2, 3] = garbage  # valid: an empty query still touches no token
    d_mask = torch.tensor([[True, False, True, True], [True] * 4, [True] * 4])
    Q = torch.randn(2, 0, 8, generator=rng)
    s, _, dd = scores_and_grads(lik.maxsim, Q, D, None, d_mask, mask_mode=mask_mode)
    assert s.shape == (2, 3) and torch.equal(s, brute_force(Q, D, None, d_mask).float())
    assert torch.equal(dd, torch.zeros_like(D))


def test_all_masked_document_scores_zero_against_an_unmasked_nan_query(rng, path):
    """Under "exclude" a document whose every token is masked is empty: 0 and zero gradients, NaN query or not."""
    Q = torch.randn(1, 3, 8, generator=rng)
    Q[0, 0] = float("nan")
    D = torch.randn(1, 5, 8, generator=rng)
    D[0, 2] = float("inf")
    s, dq, dd = scores_and_grads(lik.maxsim, Q, D, None, torch.zeros(1, 5, dtype=torch.bool))
    assert torch.equal(s, torch.zeros(1, 1))
    assert torch.equal(dq, torch.zeros_like(Q)) and torch.equal(dd, torch.zeros_like(D))


@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
def test_fully_masked_query_scores_zero_against_garbage(rng, path, mask_mode):
    """A query with no valid token adds nothing, even against NaN / inf in valid document tokens."""
    Q = torch.randn(2, 3, 8, generator=rng)
    Q[0] = float("nan")
    q_mask = torch.tensor([[False] * 3, [True, False, True]])
    D = torch.randn(2, 4, 8, generator=rng)
    D[0, 0], D[1, 2] = float("inf"), float("nan")
    s, dq, dd = scores_and_grads(lik.maxsim, Q, D, q_mask, mask_mode=mask_mode)
    expected = brute_force(Q, D, q_mask, mask_mode=mask_mode)
    assert torch.equal(s[0], torch.zeros(2)) and torch.equal(dq[0], torch.zeros(3, 8))
    assert torch.allclose(s.double(), expected, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("garbage", GARBAGE)
def test_packed_corpus_with_an_empty_document(rng, path, garbage):
    docs = [torch.randn(n, 8, generator=rng) for n in (5, 0, 3)]
    d, cu_d, max_d = lik.pack(docs)
    Q = torch.randn(2, 4, 8, generator=rng)
    Q[1, 2] = garbage
    q_mask = torch.tensor([[True, True, True, False], [True, True, False, True]])
    s, dq, dd = scores_and_grads(lik.maxsim_packed, Q, d, cu_d, q_mask)

    Qb = Q.detach().double().requires_grad_()
    db = d.double().requires_grad_()
    expected = torch.cat([brute_force(Qb, db[a:b][None], q_mask) for a, b in zip(cu_d[:-1], cu_d[1:])], dim=1)
    rdq, rdd = torch.autograd.grad(expected.sum(), (Qb, db))
    assert torch.allclose(s.double(), expected.detach(), rtol=1e-5, atol=1e-5) and torch.all(s[:, 1] == 0)
    assert torch.allclose(dq.double(), rdq, rtol=1e-5, atol=1e-5) and torch.all(dq[~q_mask] == 0)
    assert torch.allclose(dd.double(), rdd, rtol=1e-5, atol=1e-5)


def test_packed_unmasked_nan_query_against_an_empty_document(rng, path):
    d, cu_d, _ = lik.pack([torch.randn(4, 8, generator=rng), torch.randn(0, 8, generator=rng)])
    Q = torch.randn(3, 8, generator=rng)
    Q[1] = float("nan")
    s = lik.maxsim_packed(Q, d, cu_d)
    assert s[0].isnan() and s[1] == 0


def test_pairs_with_an_empty_side(rng, path):
    """maxsim_varlen: an unmasked NaN query against an empty document, and an empty query against inf, score 0."""
    q_nan = torch.randn(3, 8, generator=rng)
    q_nan[1] = float("nan")
    d_inf = torch.randn(2, 8, generator=rng)
    d_inf[0] = float("inf")
    q, cu_q, _ = lik.pack([q_nan, torch.randn(0, 8), torch.randn(2, 8, generator=rng)])
    d, cu_d, _ = lik.pack([torch.randn(0, 8), d_inf, torch.randn(3, 8, generator=rng)])
    s, dq, dd = scores_and_grads(lik.maxsim_varlen, q, d, cu_q, cu_d)
    pairs = list(zip(cu_q[:-1], cu_q[1:], cu_d[:-1], cu_d[1:]))
    expected = torch.cat([brute_force(q[a:b][None], d[c:e][None]) for a, b, c, e in pairs], dim=1)[0]
    assert torch.equal(s[:2], torch.zeros(2)) and torch.allclose(s.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(dq[:3], torch.zeros(3, 8)) and torch.equal(dd[:2], torch.zeros(2, 8))


@pytest.mark.parametrize("call", ["maxsim", "maxsim_packed", "maxsim_varlen", "search"])
@pytest.mark.parametrize("side", ["query", "documents"])
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_embeddings_are_refused(call, side, dtype):
    Q, D = torch.randn(3, 8), torch.randn(2, 4, 8)
    if side == "query":
        Q = Q.to(dtype)
    else:
        D = D.to(dtype)
    packed = D.reshape(-1, 8)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    names = {"maxsim": ("Q", "D"), "search": ("Q", "D"), "maxsim_packed": ("Q", "d"), "maxsim_varlen": ("q", "d")}
    calls = {
        "maxsim": lambda: lik.maxsim(Q, D),
        "search": lambda: lik.search(Q, D, k=1),
        "maxsim_packed": lambda: lik.maxsim_packed(Q, packed, cu),
        "maxsim_varlen": lambda: lik.maxsim_varlen(Q, packed[:3], torch.tensor([0, 3], dtype=torch.int32), cu[:2]),
    }
    name = names[call][0 if side == "query" else 1]
    # The padded scorers say why; the packed ones list the dtypes they take (a complex one is not among them).
    reason = "must be a real tensor" if call in ("maxsim", "search") else "must have dtype in .*complex"
    with pytest.raises(TypeError, match=rf"^{name} {reason}"):
        calls[call]()


def test_complex_query_against_an_8bit_corpus_is_refused():
    D, d_scale = lik.quantize(torch.randn(2, 4, 8), torch.int8)
    with pytest.raises(TypeError, match="^Q must be a real tensor"):
        lik.maxsim(torch.randn(3, 8, dtype=torch.complex64), D, d_scale=d_scale)
