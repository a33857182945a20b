"""lik.maxsim_residual on CPU: the kernel through the interpreter (when TRITON_INTERPRET=1) and the reference path,
against a float64 decode followed by maxsim_packed_reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lik.compression import ResidualCodec, train_codec
from lik.ops.maxsim.reference_varlen import maxsim_packed_reference
from lik.ops.residual import decode_tokens, maxsim_residual

from .helpers import expected, make_codec, make_corpus


@pytest.mark.parametrize("nbits", [1, 2, 4])
@pytest.mark.parametrize("dim", [8, 16, 24, 128])
def test_matches_float64(nbits, dim):
    codec = make_codec(dim, nbits)
    codes, residuals, cu = make_corpus(codec, [3, 0, 70, 1, 5])
    Q = torch.randn(2, 5, dim)
    out = maxsim_residual(Q, codes, residuals, codec, cu)
    assert out.shape == (2, 5) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected(Q, codes, residuals, codec, cu), atol=1e-4, rtol=1e-4)
    assert out[:, 1].eq(0).all()  # the empty document


def test_decode_matches_codec_decompress():
    codec = make_codec(16, 2)
    codes, residuals, _ = make_corpus(codec, [9])
    torch.testing.assert_close(
        decode_tokens(codec, codes, residuals, torch.float32), codec.decompress(codes, residuals), rtol=0, atol=0
    )


def test_equals_maxsim_packed_of_decompress():
    import lik

    codec = make_codec(32, 4)
    codes, residuals, cu = make_corpus(codec, [4, 17, 2], codes_dtype=torch.int64)
    Q = torch.randn(3, 7, 32)
    want = lik.maxsim_packed(Q, codec.decompress(codes, residuals), cu)
    torch.testing.assert_close(maxsim_residual(Q, codes, residuals, codec, cu), want, atol=1e-5, rtol=1e-5)


def test_two_d_query_one_doc_and_zero_docs():
    codec = make_codec(16, 2)
    codes, residuals, cu = make_corpus(codec, [6])
    Q = torch.randn(4, 16)
    out = maxsim_residual(Q, codes, residuals, codec, cu)
    assert out.shape == (1,)
    torch.testing.assert_close(out.double(), expected(Q, codes, residuals, codec, cu), atol=1e-5, rtol=1e-5)
    empty = torch.zeros(1, dtype=torch.int32)
    none = maxsim_residual(Q, codes[:0], residuals[:0], codec, empty)
    assert none.shape == (0,)
    assert maxsim_residual(Q[None], codes[:0], residuals[:0], codec, empty).shape == (1, 0)


def test_all_documents_empty_and_empty_queries():
    codec = make_codec(8, 1)
    codes, residuals, cu = make_corpus(codec, [0, 0])
    assert maxsim_residual(torch.randn(2, 3, 8), codes, residuals, codec, cu).eq(0).all()
    codes, residuals, cu = make_corpus(codec, [3, 2])
    assert maxsim_residual(torch.randn(0, 3, 8), codes, residuals, codec, cu).shape == (0, 2)
    assert maxsim_residual(torch.randn(2, 0, 8), codes, residuals, codec, cu).eq(0).all()


def test_masked_query_tokens_add_zero():
    codec = make_codec(16, 2)
    codes, residuals, cu = make_corpus(codec, [5, 0, 9])
    Q = torch.randn(3, 6, 16)
    Q[0, 2] = float("nan")  # garbage under the mask must not leak
    q_mask = torch.ones(3, 6, dtype=torch.bool)
    q_mask[0, 2] = False
    q_mask[2] = False  # an all-masked query
    out = maxsim_residual(Q, codes, residuals, codec, cu, q_mask=q_mask)
    want = expected(Q, codes, residuals, codec, cu, q_mask)
    assert torch.isfinite(out).all() and out[2].eq(0).all()
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_nan_in_query_propagates():
    codec = make_codec(16, 4)
    codes, residuals, cu = make_corpus(codec, [4, 0, 3])
    Q = torch.randn(2, 3, 16)
    Q[1, 0, 5] = float("nan")
    out = maxsim_residual(Q, codes, residuals, codec, cu)
    assert torch.isnan(out[1, 0]) and torch.isnan(out[1, 2])
    assert out[1, 1] == 0  # the empty document stays 0
    assert torch.isfinite(out[0]).all()


def test_non_contiguous_query():
    codec = make_codec(24, 2)
    codes, residuals, cu = make_corpus(codec, [7, 3])
    base = torch.randn(5, 48, 4)
    Q = base[..., 0].view(5, 2, 24).transpose(0, 1)[:, ::2]  # [2, 3, 24], strided
    assert not Q.is_contiguous()
    out = maxsim_residual(Q, codes, residuals, codec, cu)
    torch.testing.assert_close(out.double(), expected(Q, codes, residuals, codec, cu), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("copies", [(1, 3), (2, 66)])  # inside one tile; across tiles (64-token tiles at d 16)
def test_ties_go_to_lowest_token(copies):
    from lik._device import interpreting
    from lik.ops.residual.kernel import residual_forward

    if not interpreting():
        pytest.skip("the winners are the kernel's (the reference's are torch.max's)")
    codec = make_codec(16, 2)
    codes, residuals, cu = make_corpus(codec, [3, 70])
    first, second = (3 + c for c in copies)  # rows of the second document
    codes[second], residuals[second] = codes[first], residuals[first]
    q = decode_tokens(codec, codes[first : first + 1], residuals[first : first + 1], torch.float32)[None]
    scores, winners = residual_forward(q, None, codes, residuals, codec, cu, track_argmax=True)
    assert winners[0, 0, 1].item() == first
    torch.testing.assert_close(scores.double(), expected(q, codes, residuals, codec, cu), atol=1e-5, rtol=1e-5)


def test_kernel_path_runs_under_the_interpreter(monkeypatch):
    from lik._device import interpreting
    from lik.ops.residual import function, scan

    if not interpreting():
        pytest.skip("TRITON_INTERPRET=1 runs the kernel on CPU")
    calls = []
    real, stream = function.residual_forward, scan.residual_stream
    monkeypatch.setattr(function, "residual_forward", lambda *a, **k: calls.append("winners") or real(*a, **k))
    monkeypatch.setattr(scan, "residual_stream", lambda *a, **k: calls.append("stream") or stream(*a, **k))
    codec = make_codec(16, 2)
    codes, residuals, cu = make_corpus(codec, [3, 4])
    maxsim_residual(torch.randn(2, 3, 16), codes, residuals, codec, cu)  # inference: the token stream
    maxsim_residual(torch.randn(2, 3, 16, requires_grad=True), codes, residuals, codec, cu).sum().backward()
    assert calls == ["stream", "winners"]


def test_reference_path_and_fp16(monkeypatch):
    from lik.ops.residual import function

    codec = make_codec(24, 4)
    codes, residuals, cu = make_corpus(codec, [5, 0, 9])
    Q = torch.randn(2, 4, 24)
    want = expected(Q, codes, residuals, codec, cu)
    half = maxsim_residual(Q.half(), codes, residuals, codec, cu)  # kernel under the interpreter
    torch.testing.assert_close(half.double(), expected(Q.half(), codes, residuals, codec, cu), atol=2e-2, rtol=1e-2)
    monkeypatch.setattr(function, "uses_kernels", lambda x: False)
    q = Q.clone().requires_grad_(True)
    out = maxsim_residual(q, codes, residuals, codec, cu)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert q.grad.abs().sum() > 0


def test_wide_codec_decodes_in_chunks():
    codec = make_codec(264, 1)  # past the on-chip width: the reference path on every device
    codes, residuals, cu = make_corpus(codec, [2, 3])
    Q = torch.randn(2, 264)
    torch.testing.assert_close(
        maxsim_residual(Q, codes, residuals, codec, cu).double(),
        expected(Q, codes, residuals, codec, cu),
        atol=1e-5,
        rtol=1e-5,
    )


def test_gradcheck_float64_reference():
    codec = make_codec(8, 2)
    codes, residuals, cu = make_corpus(codec, [3, 0, 4])
    Q = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, False, True], [True, True, True]])
    assert torch.autograd.gradcheck(
        lambda q: maxsim_residual(q, codes, residuals, codec, cu, q_mask=mask), (Q,), eps=1e-6, atol=1e-5
    )


@pytest.mark.parametrize("nbits", [1, 4])
def test_gradient_matches_reference(nbits):
    codec = make_codec(16, nbits)
    codes, residuals, cu = make_corpus(codec, [6, 0, 11, 1])
    Q = torch.randn(3, 5, 16)
    q_mask = torch.rand(3, 5) > 0.3
    g = torch.randn(3, 4)
    q = Q.clone().requires_grad_(True)
    (maxsim_residual(q, codes, residuals, codec, cu, q_mask=q_mask) * g).sum().backward()
    q64 = Q.double().requires_grad_(True)
    d = decode_tokens(codec, codes, residuals, torch.float64)
    (maxsim_packed_reference(q64, d, cu, q_mask) * g.double()).sum().backward()
    torch.testing.assert_close(q.grad.double(), q64.grad, atol=1e-5, rtol=1e-5)
    assert q.grad[~q_mask].eq(0).all()


def test_codec_from_train_codec():
    g = torch.Generator().manual_seed(3)
    tokens = F.normalize(torch.randn(300, 32, generator=g), dim=-1)
    cu = torch.tensor([0, 40, 40, 170, 300], dtype=torch.int32)
    codec = train_codec(tokens, cu, 2, num_centroids=8)
    codes, residuals = codec.compress(tokens)
    Q = F.normalize(torch.randn(2, 6, 32, generator=g), dim=-1)
    out = maxsim_residual(Q, codes, residuals, codec, cu)
    torch.testing.assert_close(out.double(), expected(Q, codes, residuals, codec, cu), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("n_q", "l_q"), [(9, 3), (2, 70)])  # stacked short queries; a query split over blocks
def test_row_blocks(n_q, l_q):
    codec = make_codec(16, 2)
    codes, residuals, cu = make_corpus(codec, [4, 0, 19])
    Q = torch.randn(n_q, l_q, 16)
    q_mask = torch.rand(n_q, l_q) > 0.2
    out = maxsim_residual(Q, codes, residuals, codec, cu, q_mask=q_mask)
    torch.testing.assert_close(out.double(), expected(Q, codes, residuals, codec, cu, q_mask), atol=1e-4, rtol=1e-5)


def test_fp16_centroids_read_as_stored():
    base = make_codec(32, 2)
    codec = ResidualCodec(base.centroids.half(), base.bucket_cutoffs, base.bucket_weights, 2)  # as ColBERT stores
    codes, residuals, cu = make_corpus(codec, [6, 9])
    Q = torch.randn(2, 4, 32)
    out = maxsim_residual(Q, codes, residuals, codec, cu)
    torch.testing.assert_close(out.double(), expected(Q, codes, residuals, codec, cu), atol=1e-5, rtol=1e-5)


def test_documents_split_into_runs_past_32_bit_program_ids(monkeypatch):
    from lik._device import interpreting
    from lik.ops.residual import kernel

    if not interpreting():
        pytest.skip("the kernel launcher's split")
    codec = make_codec(16, 2)
    codes, residuals, cu = make_corpus(codec, [4, 0, 7, 2, 5])
    q = torch.randn(2, 3, 16)
    whole, whole_win = kernel.residual_forward(q, None, codes, residuals, codec, cu, track_argmax=True)
    monkeypatch.setattr(kernel, "DIVIDEND_LIMIT", 3)  # at most two documents' programs per launch
    split, split_win = kernel.residual_forward(q, None, codes, residuals, codec, cu, track_argmax=True)
    assert torch.equal(split, whole) and torch.equal(split_win, whole_win)
    assert whole_win[:, :, 1].eq(-1).all() and whole_win[:, :, 2].ge(4).all()


def test_two_d_query_with_mask_and_int64_offsets():
    codec = make_codec(16, 1)
    codes, residuals, cu = make_corpus(codec, [2, 5, 0])
    Q = torch.randn(4, 16)
    q_mask = torch.tensor([True, False, True, True])
    out = maxsim_residual(Q, codes, residuals, codec, cu.long(), q_mask=q_mask)
    assert out.shape == (3,) and out[2] == 0
    torch.testing.assert_close(out.double(), expected(Q, codes, residuals, codec, cu, q_mask), atol=1e-5, rtol=1e-5)
    q = Q.clone().requires_grad_(True)
    maxsim_residual(q, codes, residuals, codec, cu, q_mask=q_mask).sum().backward()
    assert q.grad[1].eq(0).all() and q.grad[0].abs().sum() > 0
