"""The peers' APIs on lik (lik.integrations.flash_maxsim / late_interaction_kernels) against the peers' own
PyTorch references and helpers, run from the installed packages on the CPU (their kernels need a GPU: the
device benchmark compares those), and the deliberate differences."""

from __future__ import annotations

import pytest
import torch

import lik.integrations.flash_maxsim as our_fm
import lik.integrations.late_interaction_kernels as our_li

fm_naive = pytest.importorskip("flash_maxsim.naive")
li_reference = pytest.importorskip("late_interaction_kernels.reference")


def _docs(rng, n=6, width=12, dim=16):
    D = torch.randn(n, width, dim, generator=rng, dtype=torch.float64)
    lengths = torch.randint(1, width + 1, (n,), generator=rng)
    return D, lengths


def test_flash_maxsim_padded_and_packed_match_naive(rng):
    Q = torch.randn(7, 16, generator=rng, dtype=torch.float64)
    D, lengths = _docs(rng)
    expected = fm_naive.maxsim_naive(Q, D, lengths)
    torch.testing.assert_close(our_fm.flash_maxsim(Q, D, lengths), expected)
    packed, cu, max_d = our_fm.pack_docs([D[i, :n] for i, n in enumerate(lengths.tolist())])
    torch.testing.assert_close(our_fm.flash_maxsim(Q, packed, cu), expected)
    torch.testing.assert_close(our_fm.flash_maxsim_packed(Q, packed, cu, max_d), expected)


def test_flash_maxsim_batched_shared_and_per_query(rng):
    Q = torch.randn(3, 5, 16, generator=rng, dtype=torch.float64)
    D, lengths = _docs(rng)
    q_lengths = torch.tensor([5, 2, 1])
    expected = torch.stack([fm_naive.maxsim_naive(Q[i, :n], D, lengths) for i, n in enumerate(q_lengths)])
    torch.testing.assert_close(our_fm.flash_maxsim_batched(Q, D, lengths, query_lengths=q_lengths), expected)
    D4 = D[:6].reshape(3, 2, 12, 16)
    expected4 = torch.stack([fm_naive.maxsim_naive(Q[i], D4[i], lengths.view(3, 2)[i]) for i in range(3)])
    torch.testing.assert_close(our_fm.flash_maxsim_batched(Q, D4, lengths, shared_docs=False), expected4)
    Qg = Q.clone().requires_grad_()
    our_fm.flash_maxsim_batched_train(Qg, D, doc_lengths=lengths, query_lengths=q_lengths).sum().backward()
    assert torch.equal(Qg.grad[1, 2:], torch.zeros_like(Qg.grad[1, 2:]))  # padded query rows get nothing
    with torch.enable_grad():
        assert not our_fm.flash_maxsim_batched(Qg, D).requires_grad


def test_flash_varlen_and_packing_helpers_match(rng):
    import flash_maxsim

    queries = [torch.randn(n, 16, generator=rng) for n in (3, 5, 1)]
    docs = [torch.randn(n, 16, generator=rng) for n in (4, 9, 2)]
    ours, theirs = our_fm.pack_pairs(queries, docs), flash_maxsim.pack_pairs(queries, docs)
    for a, b in zip(ours, theirs):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    for a, b in zip(our_fm.pack_docs(docs), flash_maxsim.pack_docs(docs)):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    expected = torch.stack([fm_naive.maxsim_naive(q, d[None])[0] for q, d in zip(queries, docs)])
    torch.testing.assert_close(our_fm.flash_maxsim_varlen(*ours), expected)
    with pytest.raises(ValueError, match="q_embs"):
        our_fm.pack_pairs([], [])


def test_flash_deliberate_differences(rng):
    Q = torch.randn(4, 16, generator=rng)
    D = torch.randn(2, 5, 16, generator=rng)
    scores = our_fm.flash_maxsim(Q, D, torch.tensor([0, 5]))
    assert scores[0] == 0  # flash-maxsim's kernels give -inf for an empty document
    big = torch.full((1, 2, 16), 300.0, dtype=torch.bfloat16)  # products beyond float16's range
    assert torch.isfinite(our_fm.flash_maxsim(big[0, :1], big)).all()
    with pytest.raises(ValueError, match="doc_lengths"):
        our_fm.flash_maxsim(Q, D, torch.tensor([1, 2, 3]))


def test_late_interaction_maxsim_shapes_and_masks(rng):
    Q = torch.randn(3, 5, 16, generator=rng, dtype=torch.float64)
    D = torch.randn(4, 9, 16, generator=rng, dtype=torch.float64)
    q_mask = torch.rand(3, 5, generator=rng) > 0.3
    d_mask = torch.rand(4, 9, generator=rng) > 0.3
    d_mask[2] = False
    ref = li_reference.maxsim_reference
    torch.testing.assert_close(our_li.maxsim(Q, D, q_mask, d_mask), ref(Q, D, q_mask, d_mask))
    torch.testing.assert_close(our_li.maxsim(Q, D, normalize=True), ref(Q, D, normalize=True))
    torch.testing.assert_close(our_li.maxsim(Q[0], D[0]), ref(Q[0], D[0]))
    torch.testing.assert_close(our_li.maxsim(Q, D[0]), ref(Q, D[0]))
    torch.testing.assert_close(our_li.maxsim(Q[0], D, q_mask[0], d_mask), ref(Q[0], D, q_mask[0], d_mask))
    D4 = torch.randn(3, 2, 9, 16, generator=rng, dtype=torch.float64)
    expected4 = torch.stack([ref(Q[i:i + 1], D4[i], q_mask[i:i + 1])[0] for i in range(3)])
    torch.testing.assert_close(our_li.maxsim(Q, D4, q_mask), expected4)
    pairs = torch.stack([ref(Q[i], D[i], q_mask[i], d_mask[i]) for i in range(3)])
    torch.testing.assert_close(our_li.maxsim_pairs(Q, D[:3], q_mask, d_mask[:3]), pairs)
    with pytest.raises(ValueError, match="backward"):
        our_li.maxsim(Q, D, backward="fastest")


def test_late_interaction_varlen_is_a_cross_product(rng):
    import lik

    queries = [torch.randn(n, 16, generator=rng) for n in (3, 5)]
    docs = [torch.randn(n, 16, generator=rng) for n in (4, 9, 0, 2)]
    q, cu_q, _ = lik.pack(queries)
    d, cu_d, _ = lik.pack(docs)
    expected = torch.tensor([[float(li_reference.maxsim_reference(qq, dd)) if len(dd) else 0.0 for dd in docs]
                             for qq in queries])
    torch.testing.assert_close(our_li.maxsim_varlen(q, d, cu_q, cu_d), expected)


def test_late_interaction_retrieve_matches_the_peer_on_cpu(rng, reference_path):
    import late_interaction_kernels

    Q = torch.randn(2, 5, 16, generator=rng)
    D = torch.randn(20, 9, 16, generator=rng)
    d_mask = torch.rand(20, 9, generator=rng) > 0.2
    for largest in (True, False):
        ours = our_li.retrieve(Q, D, 7, d_mask=d_mask, largest=largest, chunk=8)
        theirs = late_interaction_kernels.retrieve(Q, D, 7, d_mask=d_mask, largest=largest, chunk=8)
        torch.testing.assert_close(ours[0], theirs[0])
        assert torch.equal(ours[1], theirs[1])
    assert our_li.retrieve(Q[0], D, 100)[1].shape == (20,)
    with pytest.raises(ValueError, match="top_k"):
        our_li.retrieve(Q, D, 0)


def test_late_interaction_nan_is_not_hidden(rng):
    Q = torch.randn(1, 4, 16, generator=rng)
    D = torch.randn(3, 5, 16, generator=rng)
    D[1, 2] = float("nan")
    scores, ids = our_li.retrieve(Q, D, 3, normalize=False)
    assert ids[0, -1] == 1 and torch.isnan(scores[0, -1])  # the peer's reference scores this document as if clean
