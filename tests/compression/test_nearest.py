"""The fused nearest-centroid kernel against its PyTorch reference and a float64 brute force: ties to the lowest
index across and within centroid tiles, NaN never winning, odd sizes, size 0 and 1, strided rows, refusals."""

from __future__ import annotations

import pytest
import torch

from lik.compression.nearest import nearest_centroid, nearest_centroid_reference


def _brute(x, c, bias="l2"):
    """float64, one point at a time: the first index of the largest non-NaN score (0 and -inf if none)."""
    x, c = x.double(), c.double()
    codes, best = [], []
    for row in x:
        s = c @ row
        if bias == "l2":
            s = s - 0.5 * (c * c).sum(-1)
        value, idx = float("-inf"), 0
        for j, v in enumerate(s.tolist()):
            if v == v and v > value:
                value, idx = v, j
        codes.append(idx)
        best.append(value)
    return torch.tensor(codes, dtype=torch.int32), torch.tensor(best, dtype=torch.float64)


@pytest.mark.parametrize("bias", ["l2", None])
@pytest.mark.parametrize("n,k,d", [(1, 1, 3), (37, 70, 5), (130, 150, 20), (70, 9, 130)])
def test_float64_matches_brute_force(n, k, d, bias):
    g = torch.Generator().manual_seed(n * 1000 + k)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    c = torch.randn(k, d, generator=g, dtype=torch.float64)
    codes, scores = nearest_centroid(x, c, bias=bias)
    want_codes, want_scores = _brute(x, c, bias)
    assert codes.dtype == torch.int32 and scores.dtype == torch.float64
    assert torch.equal(codes, want_codes)
    torch.testing.assert_close(scores, want_scores, rtol=1e-12, atol=1e-12)
    ref_codes, ref_scores = nearest_centroid_reference(x, c, bias=bias)
    assert torch.equal(ref_codes, want_codes)
    torch.testing.assert_close(ref_scores, want_scores, rtol=1e-12, atol=1e-12)


def test_l2_bias_is_nearest_in_l2():
    g = torch.Generator().manual_seed(3)
    x, c = torch.randn(50, 6, generator=g, dtype=torch.float64), torch.randn(90, 6, generator=g, dtype=torch.float64)
    codes, _ = nearest_centroid(x, c)
    assert torch.equal(codes.long(), torch.cdist(x, c).argmin(dim=1))


def test_ties_go_to_the_lowest_index_within_and_across_tiles():
    # Integer data: every product exact in every dtype. Centroids repeat with a period of 5 and 67 (so copies
    # lie in one 64-wide tile and across tiles); the first copy must win.
    g = torch.Generator().manual_seed(1)
    base = torch.randint(-3, 4, (5, 8), generator=g).float()
    c = torch.cat([base, base, torch.full((57, 8), -9.0), base, base, base])  # 5 + 5 + 57 + 15 = 82 rows
    x = torch.randint(-3, 4, (40, 8), generator=g).float()
    for dtype in (torch.float64, torch.float32, torch.float16):
        codes, scores = nearest_centroid(x.to(dtype), c.to(dtype))
        want, best = _brute(x, c)
        assert torch.equal(codes, want), dtype
        assert (codes < 5).all()
        torch.testing.assert_close(scores.double(), best)
    # All-equal centroids: index 0 everywhere.
    same = torch.ones(200, 8)
    assert (nearest_centroid(x, same)[0] == 0).all()


def test_nan_never_wins_and_a_row_without_a_score_gets_zero():
    c = torch.tensor([[1.0, 0.0], [0.0, 1.0], [float("nan"), 0.0], [0.0, 2.0]], dtype=torch.float64)
    x = torch.tensor([[5.0, 0.0], [0.0, 5.0], [float("nan"), float("nan")]], dtype=torch.float64)
    for fn in (nearest_centroid, nearest_centroid_reference):
        codes, scores = fn(x, c)
        assert codes.tolist() == [0, 3, 0]
        assert scores[2] == float("-inf")
        assert scores[:2].tolist() == [5.0 - 0.5, 10.0 - 2.0]


def test_half_inputs_agree_with_the_reference_up_to_near_ties():
    g = torch.Generator().manual_seed(5)
    x = torch.nn.functional.normalize(torch.randn(150, 32, generator=g), dim=-1).half()
    c = torch.nn.functional.normalize(torch.randn(200, 32, generator=g), dim=-1).half()
    for bias in ("l2", None):
        codes, scores = nearest_centroid(x, c, bias=bias)
        ref_codes, ref_scores = nearest_centroid_reference(x, c, bias=bias)
        assert scores.dtype == torch.float32
        torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-5)
        # A differing code must be a near tie: its score within rounding of the winner's.
        exact = (x.double() @ c.double().T) - (0.5 * (c.double() ** 2).sum(-1) if bias else 0)
        gap = exact.max(dim=1).values - exact.gather(1, codes.long().unsqueeze(1)).squeeze(1)
        assert (gap <= 1e-3).all()
        assert (codes == ref_codes).float().mean() > 0.95


def test_strided_rows_and_columns():
    g = torch.Generator().manual_seed(6)
    wide = torch.randn(60, 40, generator=g, dtype=torch.float64)
    c = torch.randn(33, 20, generator=g, dtype=torch.float64)
    # Column stride 2 (copied to contiguous rows) and row stride 80 (read in place).
    for view in (wide[:, ::2], wide[::2, :20]):
        assert not view.is_contiguous()
        codes, scores = nearest_centroid(view, c)
        want, best = _brute(view, c)
        assert torch.equal(codes, want)
        torch.testing.assert_close(scores, best, rtol=1e-12, atol=1e-12)


def test_empty_sides():
    c = torch.randn(4, 3)
    codes, scores = nearest_centroid(torch.empty(0, 3), c)
    assert codes.shape == (0,) and scores.shape == (0,)
    codes, scores = nearest_centroid(torch.randn(3, 3), torch.empty(0, 3))
    assert codes.tolist() == [0, 0, 0] and torch.isneginf(scores).all()


def test_refusals():
    x, c = torch.randn(3, 4), torch.randn(2, 4)
    with pytest.raises(TypeError, match="x must be a floating"):
        nearest_centroid(torch.ones(3, 4, dtype=torch.int64), c)
    with pytest.raises(ValueError, match="centroids must be \\[K, 4\\]"):
        nearest_centroid(x, torch.randn(2, 5))
    with pytest.raises(ValueError, match="x must be 2-D"):
        nearest_centroid(x[0], c)
    with pytest.raises(ValueError, match="bias must be"):
        nearest_centroid(x, c, bias="cosine")
    with pytest.raises(TypeError, match="product_dtype"):
        nearest_centroid(x, c, product_dtype=torch.int8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_matches_torch_on_random_and_tied_data(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(100_003, 128, generator=g), dim=-1).to("cuda", dtype)
    c = torch.nn.functional.normalize(torch.randn(5_000, 128, generator=g), dim=-1).to("cuda", dtype)
    for bias in ("l2", None):
        codes, scores = nearest_centroid(x, c, bias=bias)
        ref_codes, ref_scores = nearest_centroid_reference(x, c, bias=bias)
        torch.testing.assert_close(scores, ref_scores, rtol=2e-3, atol=2e-3)
        # The chosen centroid is the best in exact arithmetic up to the operands' rounding.
        exact = nearest_centroid_reference(x.double(), c.double(), bias=bias)[1]
        picked = c.double()[codes.long()]
        chosen = (x.double() * picked).sum(-1)
        if bias:
            chosen = chosen - 0.5 * (picked**2).sum(-1)
        assert (exact - chosen).max() <= (2e-2 if dtype == torch.bfloat16 else 2e-3)
        assert (codes == ref_codes).float().mean() > 0.99
    # Ties: integer data, centroids repeated across 128-wide tiles; the first copy wins.
    base = torch.randint(-3, 4, (7, 128), generator=g).float()
    tied = torch.cat([base, torch.full((300, 128), -9.0), base, base]).to("cuda", dtype)
    xi = torch.randint(-3, 4, (9_999, 128), generator=g).float().to("cuda", dtype)
    codes, _ = nearest_centroid(xi, tied)
    assert torch.equal(codes, nearest_centroid_reference(xi.double(), tied.double())[0])
    assert (codes < 7).all()
