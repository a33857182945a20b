"""late-interaction-kernels' ``plaid`` module on lik against the peer's semantics: its bit order turned into
ColBERT's, scores and gradients in float64 against the peer's decoding (its ``unpack_residuals_reference`` from
the installed 0.4.5) done in float64, the padded and ragged layouts, and its references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lik
import lik.integrations.late_interaction_kernels as ours_package
from lik.compression.packing import unpack_residual_bits
from lik.integrations.late_interaction_kernels import plaid as ours

reference = pytest.importorskip("late_interaction_kernels.reference")


def _index(rng, nbits, n_docs=5, width=7, dim=16, n_centroids=9, dtype=torch.float64):
    centroids = torch.randn(n_centroids, dim, generator=rng, dtype=dtype)
    weights = torch.linspace(-0.3, 0.3, 2**nbits, dtype=dtype)
    codes = torch.randint(0, n_centroids, (n_docs, width), generator=rng)
    residuals = torch.randint(0, 256, (n_docs, width, (dim * nbits + 7) // 8), generator=rng, dtype=torch.uint8)
    return codes, residuals, centroids, weights


def _expected(Q, codes, residuals, lengths, centroids, weights, nbits, normalize):
    """The peer's scores (its reference's steps, its own bit unpacking), in float64."""
    q = Q.unsqueeze(0) if Q.dim() == 2 else Q
    buckets = reference.unpack_residuals_reference(residuals, nbits, q.shape[-1]).long()
    emb = centroids.double()[codes] + weights.double()[buckets]
    q = q.double()
    if normalize:
        emb, q = F.normalize(emb, dim=-1), F.normalize(q, dim=-1)
    valid = torch.arange(codes.shape[1])[None, :] < lengths[:, None]
    sim = torch.einsum("ild,jtd->ijlt", q, emb).masked_fill(~valid[None, :, None, :], float("-inf"))
    best = sim.max(dim=-1).values
    scores = torch.where(best == float("-inf"), 0.0, best).sum(-1)
    return scores[0] if Q.dim() == 2 else scores


def test_the_byte_table_turns_the_peers_bit_order_into_colberts():
    for nbits in (2, 4):
        peer_bytes = torch.arange(256, dtype=torch.uint8)[:, None]
        theirs = reference.unpack_residuals_reference(peer_bytes, nbits, 8 // nbits)
        mine = unpack_residual_bits(ours._colbert_byte_table(nbits)[peer_bytes.long()], nbits)
        assert torch.equal(mine.long(), theirs.long())
        assert len(set(ours._colbert_byte_table(nbits).tolist())) == 256  # a permutation: nothing lost


@pytest.mark.parametrize("nbits", [2, 4, 8])
@pytest.mark.parametrize("normalize", [True, False])
def test_scores_are_the_peers_in_float64(rng, nbits, normalize):
    codes, residuals, centroids, weights = _index(rng, nbits)
    lengths = torch.tensor([0, 1, 7, 9, 3])  # empty, single token, full, past the padding (counts 7), partial
    Q = torch.randn(3, 4, 16, generator=rng, dtype=torch.float64)
    got = ours.maxsim_residual(Q, codes, residuals, lengths, centroids, weights, nbits, normalize=normalize)
    expected = _expected(Q, codes, residuals, lengths.clamp(max=7), centroids, weights, nbits, normalize)
    assert got.dtype == torch.float64 and got.shape == (3, 5)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert torch.all(got[:, 0] == 0)


def test_the_compressed_cases_run_lik_maxsim_residual(rng, monkeypatch):
    calls = []
    real = ours._lik_maxsim_residual
    monkeypatch.setattr(ours, "_lik_maxsim_residual", lambda *a, **k: calls.append(1) or real(*a, **k))
    Q = torch.randn(2, 3, 16, generator=rng)
    for nbits, normalize, dim in ((2, True, 16), (4, True, 16), (8, True, 16), (2, False, 16), (2, True, 12)):
        codes, residuals, centroids, weights = _index(rng, nbits, dim=dim, dtype=torch.float32)
        ours.maxsim_residual(
            Q[..., :dim], codes, residuals, torch.full((5,), 7), centroids, weights, nbits, normalize=normalize
        )
    assert len(calls) == 2  # nbits 2 and 4 with normalize=True and d a multiple of 8; the rest decode


def test_an_odd_width_is_decoded_as_the_peer_decodes(rng):
    codes, residuals, centroids, weights = _index(rng, 2, dim=12)  # 3 bytes a token: no ColBERT layout
    Q = torch.randn(2, 3, 12, generator=rng, dtype=torch.float64)
    lengths = torch.tensor([7, 2, 0, 5, 1])
    torch.testing.assert_close(
        ours.maxsim_residual(Q, codes, residuals, lengths, centroids, weights, 2),
        _expected(Q, codes, residuals, lengths, centroids, weights, 2, True),
    )


@pytest.mark.parametrize("nbits", [2, 8])
def test_gradient_to_q_is_the_peers_formula_and_zero_for_empty_docs(rng, nbits):
    codes, residuals, centroids, weights = _index(rng, nbits)
    lengths = torch.tensor([3, 0, 7, 1, 5])
    Q = torch.randn(2, 4, 16, generator=rng, dtype=torch.float64).transpose(1, 2).contiguous().transpose(1, 2)
    a = Q.detach().clone().requires_grad_()
    b = Q.detach().clone().requires_grad_()
    grad = torch.randn(2, 5, generator=rng, dtype=torch.float64)
    ours.maxsim_residual(a, codes, residuals, lengths, centroids, weights, nbits).backward(grad)
    _expected(b, codes, residuals, lengths, centroids, weights, nbits, True).backward(grad)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
    c = Q.detach().clone().requires_grad_()
    ours.maxsim_residual(c, codes, residuals, torch.tensor([0, 0, 0, 0, 0]), centroids, weights, nbits).sum().backward()
    assert torch.equal(c.grad, torch.zeros_like(c))


def test_ragged_layout_matches_padded_and_shapes(rng):
    codes, residuals, centroids, weights = _index(rng, 4)
    lengths = torch.tensor([2, 0, 7, 4, 1])
    valid = torch.arange(7)[None, :] < lengths[:, None]
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
    Q = torch.randn(3, 4, 16, generator=rng, dtype=torch.float64)
    padded = ours.maxsim_residual(Q, codes, residuals, lengths, centroids, weights, 4)
    ragged = ours.maxsim_residual_varlen(Q, codes[valid], residuals[valid], cu, centroids, weights, 4)
    torch.testing.assert_close(ragged, padded)
    torch.testing.assert_close(ours.maxsim_residual(Q[1], codes, residuals, lengths, centroids, weights, 4), padded[1])
    empty = ours.maxsim_residual_varlen(
        Q, codes[:0, 0], residuals[:0, 0], torch.zeros(1, dtype=torch.int32), centroids, weights, 4
    )
    assert empty.shape == (3, 0)


def test_nan_in_a_query_token_is_not_hidden(rng):
    codes, residuals, centroids, weights = _index(rng, 2)
    Q = torch.randn(2, 3, 16, generator=rng, dtype=torch.float64)
    Q[1, 2, 5] = float("nan")
    scores = ours.maxsim_residual(Q, codes, residuals, torch.full((5,), 7), centroids, weights, 2, normalize=False)
    assert torch.isnan(scores[1]).all() and torch.isfinite(scores[0]).all()


def test_half_precision_through_lik(rng):
    codes, residuals, centroids, weights = _index(rng, 2, dtype=torch.float32)
    lengths = torch.tensor([7, 3, 1, 5, 6])
    Q = torch.randn(2, 4, 16, generator=rng)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        got = ours.maxsim_residual(Q.to(dtype), codes, residuals, lengths, centroids, weights, 2)
        expected = _expected(Q.to(dtype).float(), codes, residuals, lengths, centroids, weights, 2, True)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)


def test_approx_score_is_the_peers(rng, monkeypatch):
    qcs = torch.randn(12, 5, generator=rng)
    codes = torch.randint(0, 12, (6, 9), generator=rng)
    lengths = torch.tensor([0, 9, 4, 1, 12, 9])
    expected = reference.plaid_approx_score_reference(qcs, codes, lengths)
    torch.testing.assert_close(ours.plaid_approx_score(qcs, codes, lengths), expected)
    torch.testing.assert_close(ours.plaid_approx_score_reference(qcs, codes, lengths), expected)
    monkeypatch.setattr(ours, "_APPROX_ELEMENTS", 1)  # one document a block
    torch.testing.assert_close(ours.plaid_approx_score(qcs, codes, lengths), expected)
    assert ours.plaid_approx_score(qcs, codes, lengths)[0] == 0
    wild = codes.clone()
    wild[2, 0] = -3
    wild[3, 0] = 99  # read as centroid 0, as the peer's kernel does
    torch.testing.assert_close(
        ours.plaid_approx_score(qcs, wild, lengths),
        reference.plaid_approx_score_reference(qcs, wild.clamp(0, 11) * (wild < 12) * (wild >= 0), lengths),
    )


def test_our_residual_reference_is_the_peers(rng):
    codes, residuals, centroids, weights = _index(rng, 4, dtype=torch.float32)
    lengths = torch.tensor([3, 0, 7, 2, 6])
    Q = torch.randn(4, 16, generator=rng)
    for normalize in (True, False):
        torch.testing.assert_close(
            ours.maxsim_residual_reference(Q, codes, residuals, lengths, centroids, weights, 4, normalize=normalize),
            reference.maxsim_residual_reference(
                Q, codes, residuals, lengths, centroids, weights, 4, normalize=normalize
            ),
        )


def test_bad_input_names_the_argument(rng):
    codes, residuals, centroids, weights = _index(rng, 2)
    Q = torch.randn(2, 3, 16, dtype=torch.float64)
    lengths = torch.full((5,), 7)
    with pytest.raises(ValueError, match="nbits must be 2, 4, or 8"):
        ours.maxsim_residual(Q, codes, residuals, lengths, centroids, weights, 3)
    with pytest.raises(ValueError, match="residuals last dim 4 != expected 8"):
        ours.maxsim_residual(Q, codes, residuals, lengths, centroids, torch.zeros(16, dtype=torch.float64), 4)
    with pytest.raises(ValueError, match="codes must lie in"):
        ours.maxsim_residual(Q, codes + 9, residuals, lengths, centroids, weights, 2)
    with pytest.raises(TypeError, match="residuals must be uint8"):
        ours.maxsim_residual(Q, codes, residuals.to(torch.int32), lengths, centroids, weights, 2)
    with pytest.raises(ValueError, match="doc_lengths must be"):
        ours.maxsim_residual(Q, codes, residuals, lengths[:3], centroids, weights, 2)
    with pytest.raises(ValueError, match="bucket_weights must be"):
        ours.maxsim_residual(Q, codes, residuals, lengths, centroids, weights[:3], 2)


def test_the_package_exposes_plaid():
    assert ours_package.plaid is ours and "plaid" in ours_package.__all__
    assert lik.maxsim_residual is ours._lik_maxsim_residual


@pytest.mark.gpu
@pytest.mark.parametrize("nbits", [2, 4, 8])
@pytest.mark.parametrize("normalize", [True, False])
def test_against_the_peers_kernel_on_cuda(nbits, normalize):
    peer = pytest.importorskip("late_interaction_kernels.plaid")
    rng = torch.Generator().manual_seed(nbits * 2 + normalize)
    codes, residuals, centroids, weights = _index(
        rng, nbits, n_docs=40, width=70, dim=128, n_centroids=64, dtype=torch.float32
    )
    lengths = torch.randint(0, 71, (40,), generator=rng)
    lengths[3] = 0
    args = [t.cuda() for t in (codes, residuals, lengths, centroids, weights)]
    Q = torch.randn(3, 32, 128, generator=rng).cuda()
    for dtype in (torch.float16, torch.bfloat16):
        got = ours.maxsim_residual(Q.to(dtype), *args, nbits, normalize=normalize)
        theirs = peer.maxsim_residual(Q.to(dtype), *args, nbits, normalize=normalize)
        assert (got - theirs).abs().max().item() <= 3e-2 * max(1.0, theirs.abs().max().item())
    # The gradient against the peer's semantics in float64 (its bf16 kernel routes near-tied winners differently).
    a = Q.clone().requires_grad_()
    b = Q.double().clone().requires_grad_()
    grad = torch.randn(3, 40, device="cuda")
    ours.maxsim_residual(a, *args, nbits, normalize=normalize).backward(grad)
    _expected(b.cpu(), codes, residuals, lengths, centroids, weights, nbits, normalize).backward(grad.double().cpu())
    torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-4)
