"""8-bit scoring: int8 / float8_e4m3fn operands with per-row scales, every scorer, CPU.

int8 runs the real kernels through Triton's interpreter; float8 runs the reference on the CPU (the interpreter's
float8 conversion flushes small values) and its kernels are covered by ``test_quantized_gpu.py``. The contract:
the scores equal MaxSim of the dequantized operands, a float query being quantized per token to the documents'
dtype first. Each similarity is ``float32(dot) * d_scale[t]`` and a query token's max over them is multiplied by
``q_scale[s]`` on every path (NaN for a negative ``q_scale[s]``), so a one-token query scores bit for bit the same
on the kernel and the reference; longer queries differ only by the fp32 order of the sum over query tokens.
"""

from __future__ import annotations

import pytest
import torch

import lik
from lik import _config
from lik.ops.maxsim import function as maxsim_function
from lik.ops.maxsim.function import uses_kernels
from lik.ops.maxsim.reference_varlen import maxsim_packed_reference, maxsim_varlen_reference
from lik.ops.quantization.function import check_fp8_supported

INT8, FP8 = torch.int8, torch.float8_e4m3fn
MODES = ["exclude", "zero"]


def _dequantized_maxsim(Q, D_q, d_scale, q_mask=None, d_mask=None, mask_mode="exclude", q_scale=None):
    """float64 MaxSim of the dequantized operands (a float ``Q`` quantized per token to ``D_q``'s dtype)."""
    if q_scale is None:
        Q, q_scale = lik.quantize(Q, D_q.dtype)
    Q64 = Q.double() * q_scale.double()[..., None]
    D64 = D_q.double() * d_scale.double()[..., None]
    if d_mask is not None:  # garbage (NaN scales) at masked tokens must not reach the float64 reference either
        D64 = torch.where(d_mask[..., None], D64, 0)
    if q_mask is not None:
        Q64 = torch.where(q_mask[..., None], Q64, 0)
    return lik.maxsim_reference(Q64, D64, q_mask, d_mask, mask_mode=mask_mode)


def _close(scores, expected, n_terms):
    """fp32 arithmetic against float64: a few ulps per similarity, summed over ``n_terms`` query tokens."""
    tol = 4e-6 * max(1, n_terms)
    torch.testing.assert_close(scores.double(), expected.double(), rtol=tol, atol=tol, equal_nan=True)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the padded forward launches (lik.maxsim's one door to them), so an int8 test can assert the kernel
    (not the reference) ran."""
    calls = []
    real = maxsim_function.launch_forward

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(maxsim_function, "launch_forward", counted)
    return calls


def _problem(rng, shape_q, shape_d, dtype, masks):
    Q = torch.nn.functional.normalize(torch.randn(shape_q, generator=rng), dim=-1)
    D = torch.nn.functional.normalize(torch.randn(shape_d, generator=rng), dim=-1)
    D_q, d_scale = lik.quantize(D, dtype)
    q_mask = d_mask = None
    if masks:
        q_mask = torch.rand(shape_q[:-1], generator=rng) > 0.25
        d_mask = torch.rand(shape_d[:-1], generator=rng) > 0.25
    return Q, D_q, d_scale, q_mask, d_mask


# ----------------------------------------------------------------------------------------------------------------
# Semantics: both dtypes, every layout of lik.maxsim

@pytest.mark.parametrize("dtype", [INT8, FP8])
@pytest.mark.parametrize("mask_mode", MODES)
@pytest.mark.parametrize("dim", [16, 40, 128, 300])
@pytest.mark.parametrize(
    "shape_q, shape_d",
    [((7, None), (5, 11, None)), ((3, 9, None), (4, 33, None)), ((2, 5, None), (2, 3, 17, None))],
    ids=["2d", "3d", "per-query"],
)
def test_scores_equal_maxsim_of_dequantized_operands(rng, dtype, mask_mode, dim, shape_q, shape_d, kernel_calls):
    shape_q, shape_d = (*shape_q[:-1], dim), (*shape_d[:-1], dim)
    for masks in (False, True):
        Q, D_q, d_scale, q_mask, d_mask = _problem(rng, shape_q, shape_d, dtype, masks)
        scores = lik.maxsim(Q, D_q, q_mask, d_mask, mask_mode=mask_mode, d_scale=d_scale)
        expected_shape = (shape_d[-3],) if len(shape_q) == 2 else (shape_q[0], shape_d[-3])
        assert scores.dtype == torch.float32 and scores.shape == expected_shape
        _close(scores, _dequantized_maxsim(Q, D_q, d_scale, q_mask, d_mask, mask_mode), shape_q[-2])
        # A query quantized by the caller scores the same as the float one the scorer quantizes.
        Q_q, q_scale = lik.quantize(Q, dtype)
        again = lik.maxsim(Q_q, D_q, q_mask, d_mask, mask_mode=mask_mode, q_scale=q_scale, d_scale=d_scale)
        assert torch.equal(again, scores)
        # The reference takes the same arguments and repeats the kernels' arithmetic.
        reference = lik.maxsim_reference(Q, D_q, q_mask, d_mask, mask_mode=mask_mode, d_scale=d_scale)
        _close(scores, reference, shape_q[-2])
    assert len(kernel_calls) == (4 if dtype == INT8 else 0)  # int8: the interpreter ran the kernel; fp8: reference


@pytest.mark.parametrize("dim", [16, 64, 200, 300, 520])
@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_one_token_queries_score_bit_for_bit_like_the_reference(rng, dim, dtype):
    """Without a sum over query tokens every path does the same fp32 operations: equal bits (int8 kernel)."""
    Q = torch.randn(1, dim, generator=rng)
    D_q, d_scale = lik.quantize(torch.randn(6, 37, dim, generator=rng), dtype)
    scores = lik.maxsim(Q, D_q, d_scale=d_scale)
    reference = lik.maxsim_reference(Q, D_q, d_scale=d_scale)
    assert torch.equal(scores, reference)


@pytest.mark.parametrize("dim", [16, 100, 300])
def test_int8_accumulation_is_exact_for_the_whole_int8_range(rng, dim):
    """Arbitrary int8 rows (-128 included) and arbitrary non-negative scales: the kernel's int32 sum is exact, so
    each one-token score equals the reference's (an exact float64 sum rounded once) bit for bit, and equals every
    similarity scaled by both scales in fp32 before the max (scaling after the max is exact)."""
    D_q = torch.randint(-128, 128, (4, 21, dim), generator=rng, dtype=torch.int8)
    Q_q = torch.randint(-128, 128, (5, 1, dim), generator=rng, dtype=torch.int8)
    d_scale = torch.rand(4, 21, generator=rng) * 3
    q_scale = torch.rand(5, 1, generator=rng) * 3
    q_scale[1] = 0.0
    scores = lik.maxsim(Q_q, D_q, q_scale=q_scale, d_scale=d_scale)
    reference = lik.maxsim_reference(Q_q, D_q, q_scale=q_scale, d_scale=d_scale)
    assert torch.equal(scores, reference)
    dots = torch.einsum("nsk,btk->nbst", Q_q.double(), D_q.double()).float()
    exact = (dots * d_scale[None, :, None, :]) * q_scale[:, None, :, None]
    assert torch.equal(scores, exact.amax(dim=-1).sum(dim=-1))
    assert torch.equal(scores[1], torch.zeros(4))


@pytest.fixture
def tile_variants(monkeypatch):
    """``(WHOLE_TILES, TAIL_N)`` of every padded forward launch, so a test can assert which loop it covered."""
    from lik.core import forward_launch as forward

    variants = []
    real = forward.launch

    def recorded(kernel, grid, *args, **kwargs):
        variants.append((kwargs["WHOLE_TILES"], kwargs["TAIL_N"]))
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(forward, "launch", recorded)
    return variants


@pytest.mark.parametrize("doc_len, variant", [(64, (True, 0)), (128, (True, 0)), (70, (True, 16)), (96, (True, 16)),
                                              (20, (True, 16)), (100, (False, 0)), (40, (False, 0))])
def test_int8_corpus_of_whole_tiles_and_a_narrow_tail(rng, doc_len, variant, tile_variants):
    """Long queries over an unmasked 8-bit corpus read its whole 64-token tiles without row clamp or select and at
    most 32 tokens after them in 16-token tiles (more take the clamped loop): a tie between a token of the first
    tile and the last token, an inf or NaN scale in the last token, a view whose documents lie apart (rows still
    back to back: whole tiles) and one whose features are strided (the clamped loop) all score as the reference
    (one-token queries: bit for bit), whichever loop runs."""
    Q = torch.randn(5, 1, 24, generator=rng).abs()
    D = torch.randn(4, doc_len, 24, generator=rng)
    D[3] = -D[3].abs()  # every similarity negative: a column read past the end (similarity 0) would win
    D_q, d_scale = lik.quantize(D, INT8)
    D_q[0, doc_len - 1], d_scale[0, doc_len - 1] = D_q[0, 2], d_scale[0, 2]  # a tie across tiles
    d_scale[1, doc_len - 1] = float("inf")
    d_scale[2, doc_len - 1] = float("nan")
    wide = torch.zeros(4, doc_len, 48, dtype=INT8)
    wide[..., ::2] = D_q
    apart = torch.full((4, doc_len + 7, 24), 127, dtype=INT8)  # garbage after each document: read if the document
    apart[:, :doc_len] = D_q                                    # stride were taken from the length
    config = _config.MaxSimForwardConfig(32, 1, 64, 32, 4, 1)
    for docs, scales in [(D_q, d_scale), (apart[:, :doc_len], d_scale), (wide[..., ::2], d_scale)]:
        with _config.override(maxsim_forward=config):
            scores = lik.maxsim(Q, docs, d_scale=scales)
        torch.testing.assert_close(scores, lik.maxsim_reference(Q, docs, d_scale=scales), rtol=0, atol=0,
                                   equal_nan=True)
        assert scores[:, 2].isnan().all()
        assert torch.isfinite(scores[:, [0, 3]]).all() and (scores[:, 3] < 0).all()
    assert tile_variants == [variant, variant, (False, 0)]


@pytest.mark.parametrize("n_q, l_q", [(1, 1), (1, 45), (3, 8), (5, 33)])
def test_whole_tiles_read_the_query_rows_by_the_width(rng, n_q, l_q, tile_variants):
    """Whole tiles address the query's rows with 32-bit offsets and the width as stride (the embedding width equal
    to the feature block): one-token, ragged (45 = 32 + 13 rows), stacked (3 queries in 2-query tiles, the last one
    short) and split long queries score as the reference, from a contiguous query, from a strided one (copied, not
    read by the width) and against per-query documents; a NaN in a real query token makes its query's scores NaN,
    and garbage in the rows after the query (never read: rows are clamped) changes nothing."""
    dim = 32
    Q = torch.nn.functional.normalize(torch.randn(n_q, l_q, dim, generator=rng), dim=-1)
    Q_q, q_scale = lik.quantize(Q, INT8)
    D_q, d_scale = lik.quantize(torch.randn(4, 64, dim, generator=rng), INT8)
    storage = torch.full((n_q + 1, l_q + 3, 2 * dim), 127, dtype=INT8)  # garbage around and between the rows
    strided = storage[:n_q, :l_q, ::2]
    strided.copy_(Q_q)
    per_query_D, per_query_scale = lik.quantize(torch.randn(n_q, 3, 64, dim, generator=rng), INT8)
    expected = _dequantized_maxsim(Q_q, D_q, d_scale, q_scale=q_scale)
    for q_rows in (Q_q, strided):
        _close(lik.maxsim(q_rows, D_q, q_scale=q_scale, d_scale=d_scale), expected, l_q)
    _close(lik.maxsim(Q_q, per_query_D, q_scale=q_scale, d_scale=per_query_scale),
           _dequantized_maxsim(Q_q, per_query_D, per_query_scale, q_scale=q_scale), l_q)
    nan_scale = q_scale.clone()
    nan_scale[n_q - 1, l_q - 1] = float("nan")
    scores = lik.maxsim(Q_q, D_q, q_scale=nan_scale, d_scale=d_scale)
    assert scores[n_q - 1].isnan().all()
    _close(scores[: n_q - 1], expected[: n_q - 1], l_q)
    assert tile_variants == [(True, 0)] * 4


def test_whole_tiles_need_a_query_below_two_to_the_31_elements():
    """Past 2**31 query elements the query's 32-bit row offsets would wrap: that launch takes the clamped loop."""
    from lik.ops.maxsim.forward import whole_tiles

    config = _config.MaxSimForwardConfig(128, 1, 128, 128, 4, 3)
    assert whole_tiles(config, 1024, 128, 2, False, query_elements=2**31 - 1)
    assert not whole_tiles(config, 1024, 128, 2, False, query_elements=2**31)


@pytest.mark.parametrize("dtype", [INT8, FP8])
@pytest.mark.parametrize("dim", [40, 300])
def test_a_negative_query_scale_makes_its_query_nan(rng, dtype, dim, kernel_calls):
    """Scales are non-negative (lik.quantize's are): a negative query scale would turn its row's max into a min, so
    the kernels give that query NaN instead of a wrong number, on every layout; masked, it changes nothing."""
    Q, D_q, d_scale, _, d_mask = _problem(rng, (3, 9, dim), (5, 19, dim), dtype, masks=True)
    Q_q, q_scale = lik.quantize(Q, dtype)
    q_scale[1, 4] = -q_scale[1, 4]
    for mask_mode in MODES:
        scores = lik.maxsim(Q_q, D_q, None, d_mask, mask_mode=mask_mode, q_scale=q_scale, d_scale=d_scale)
        assert scores[1].isnan().all() and torch.isfinite(scores[[0, 2]]).all()
        reference = lik.maxsim_reference(Q_q, D_q, None, d_mask, mask_mode=mask_mode, q_scale=q_scale,
                                         d_scale=d_scale)
        _close(scores, reference, 9)
    q_mask = torch.ones(3, 9, dtype=torch.bool)
    q_mask[1, 4] = False
    masked = lik.maxsim(Q_q, D_q, q_mask, d_mask, q_scale=q_scale, d_scale=d_scale)
    assert torch.isfinite(masked).all()
    _close(masked, _dequantized_maxsim(Q_q, D_q, d_scale, q_mask, d_mask, q_scale=q_scale.clamp(min=0)), 9)
    # Packed corpus and pairs take the same path.
    d, cu_d, max_d = lik.pack([torch.randn(n, dim, generator=rng) for n in (5, 17, 0)])
    d_q, d_scale_packed = lik.quantize(d, dtype)
    corpus = lik.maxsim_packed(Q_q, d_q, cu_d, max_seqlen_d=max_d, q_scale=q_scale, d_scale=d_scale_packed)
    assert corpus[1, :2].isnan().all() and torch.isfinite(corpus[[0, 2]]).all()
    assert corpus[1, 2] == 0  # an empty document scores 0 whatever the query
    q, cu_q, max_q = lik.pack([Q_q[0, :4], Q_q[1], Q_q[2, :0]])
    q_scale_packed = torch.cat([q_scale[0, :4], q_scale[1]])
    pairs = lik.maxsim_varlen(q, d_q, cu_q, cu_d, max_q, max_d, q_scale=q_scale_packed, d_scale=d_scale_packed)
    assert torch.isfinite(pairs[0]) and pairs[1].isnan() and pairs[2] == 0
    _close(pairs, maxsim_varlen_reference(q, d_q, cu_q, cu_d, q_scale=q_scale_packed, d_scale=d_scale_packed), 9)
    assert len(kernel_calls) == (3 if dtype == INT8 else 0)


@pytest.mark.parametrize(
    "config",
    [
        _config.MaxSimForwardConfig(group_rows=16, groups=1, block_n=16, block_k=32, programs_per_sm=1),
        _config.MaxSimForwardConfig(group_rows=16, groups=2, block_n=16, block_k=32, programs_per_sm=3),
        _config.MaxSimForwardConfig(group_rows=16, groups=2, block_n=16, block_k=32),
        _config.MaxSimForwardConfig(group_rows=16, groups=1, block_n=16, block_k=32, flat_k=False),
        _config.MaxSimForwardConfig(group_rows=16, groups=1, block_n=16, block_k=64, programs_per_sm=1),
        _config.MaxSimForwardConfig(group_rows=16, groups=2, block_n=16, block_k=64, programs_per_sm=3),
    ],
    ids=["persistent", "persistent-stacked", "streamed-k", "streamed-k-nested", "persistent-resident",
         "persistent-stacked-resident"],
)
@pytest.mark.parametrize("mask_mode", MODES)
def test_int8_every_tile_variant(rng, config, mask_mode):
    """Persistent launches, streamed in feature chunks (block_k < d) or with the query block resident (one program
    walks every document here; one query loads the documents' scales one tile ahead, across documents, stacked
    queries per tile), and the streamed-k loop (flat and nested) with the 8-bit loader. (float8 runs the
    reference on the CPU; its kernels: test_quantized_gpu.py.)"""
    dim = 100 if config.programs_per_sm == 0 else 40
    Q, D_q, d_scale, q_mask, d_mask = _problem(rng, (3, 9, dim), (5, 19, dim), INT8, masks=True)
    with _config.override(maxsim_forward=config):
        for qm, dm in ((None, None), (q_mask, d_mask)):
            scores = lik.maxsim(Q, D_q, qm, dm, mask_mode=mask_mode, d_scale=d_scale)
            _close(scores, _dequantized_maxsim(Q, D_q, d_scale, qm, dm, mask_mode), 9)


@pytest.mark.parametrize("doc_len", [1, 15, 16, 17, 40])
def test_int8_one_query_whole_tile_max_starts_afresh_for_every_document(rng, doc_len, kernel_calls):
    """One short int8 query in a persistent launch keeps the elementwise max of its whole tile over a document and
    reduces its rows on the document's last tile. Every length (shorter than a tile, one tile, ragged, a last tile
    overlapping the one before) gives the reference's scores, one program walks all the documents, and a NaN or a
    huge similarity in one document reaches that document's score only."""
    forced = _config.MaxSimForwardConfig(group_rows=16, groups=1, block_n=16, block_k=32, programs_per_sm=1)
    Q_q, q_scale = lik.quantize(torch.randn(9, 32, generator=rng), INT8)
    D_q, d_scale = lik.quantize(torch.randn(7, doc_len, 32, generator=rng), INT8)
    d_scale[2, doc_len - 1] = float("nan")  # the last token of a document: NaN on its last tile
    d_scale[4, 0] = float("nan")  # on its first tile
    d_scale[5, doc_len // 2] = 1e30  # a max that would win every later document's rows if it were kept
    with _config.override(maxsim_forward=forced):
        scores = lik.maxsim(Q_q, D_q, q_scale=q_scale, d_scale=d_scale)
    assert len(kernel_calls) == 1
    expected = _dequantized_maxsim(Q_q, D_q, d_scale, q_scale=q_scale)
    assert scores[[2, 4]].isnan().all() and torch.isfinite(scores[[0, 1, 3, 5, 6]]).all()
    assert scores[5].abs() > 1e25 and scores[6].abs() < 1e3
    _close(scores, expected, 9)


def test_non_contiguous_views(rng):
    D_q, d_scale = lik.quantize(torch.randn(6, 30, 48, generator=rng), INT8)
    Q_q, q_scale = lik.quantize(torch.randn(12, 3, 48, generator=rng), INT8)
    views = (Q_q[::2].transpose(0, 1), q_scale[::2].t(), D_q[:, ::3], d_scale[:, ::3])
    scores = lik.maxsim(views[0], views[2], q_scale=views[1], d_scale=views[3])
    dense = lik.maxsim(*(v.contiguous() for v in views[::2]), q_scale=views[1].contiguous(),
                       d_scale=views[3].contiguous())
    assert torch.equal(scores, dense)


# ----------------------------------------------------------------------------------------------------------------
# Padding, empty documents, ties, NaN

@pytest.mark.parametrize("dtype", [INT8, FP8])
@pytest.mark.parametrize("mask_mode", MODES)
@pytest.mark.parametrize("dim", [32, 300])
def test_garbage_in_padded_positions_never_reaches_the_scores(rng, dtype, mask_mode, dim):
    Q, D_q, d_scale, q_mask, d_mask = _problem(rng, (3, 8, dim), (4, 13, dim), dtype, masks=True)
    Q_q, q_scale = lik.quantize(Q, dtype)
    clean = lik.maxsim(Q_q, D_q, q_mask, d_mask, mask_mode=mask_mode, q_scale=q_scale, d_scale=d_scale)
    bad_d, bad_ds = D_q.clone(), d_scale.clone()
    bad_q, bad_qs = Q_q.clone(), q_scale.clone()
    # Through int8 views (float8 has no CPU indexing kernels): random bytes, float8 NaN (0x7F) included.
    noise = torch.randint(-128, 128, D_q.shape, generator=rng, dtype=torch.int8)
    noise.view(-1)[:: 7] = 0x7F
    bad_d.view(torch.int8)[~d_mask] = noise[~d_mask]
    bad_q.view(torch.int8)[~q_mask] = noise[:3, :8][~q_mask]
    garbage = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30])
    bad_ds[~d_mask] = garbage.repeat(d_mask.numel())[: int((~d_mask).sum())]
    bad_qs[~q_mask] = garbage.repeat(q_mask.numel())[: int((~q_mask).sum())]
    scores = lik.maxsim(bad_q, bad_d, q_mask, d_mask, mask_mode=mask_mode, q_scale=bad_qs, d_scale=bad_ds)
    assert torch.equal(scores, clean)
    assert torch.isfinite(scores).all()


@pytest.mark.parametrize("dtype", [INT8, FP8])
@pytest.mark.parametrize("mask_mode", MODES)
def test_empty_and_all_masked_documents(rng, dtype, mask_mode):
    Q = torch.randn(2, 4, 32, generator=rng)
    for shape in ((0, 5, 32), (3, 0, 32), (3, 5, 0)):
        D_q, d_scale = lik.quantize(torch.randn(shape, generator=rng), dtype)
        scores = lik.maxsim(Q[..., : shape[-1]], D_q, mask_mode=mask_mode, d_scale=d_scale)
        assert scores.shape == (2, shape[0]) and scores.dtype == torch.float32
        assert torch.equal(scores, torch.zeros_like(scores))
    D_q, d_scale = lik.quantize(torch.randn(3, 5, 32, generator=rng), dtype)
    d_mask = torch.ones(3, 5, dtype=torch.bool)
    d_mask[1] = False  # an all-masked document
    scores = lik.maxsim(Q, D_q, d_mask=d_mask, mask_mode=mask_mode, d_scale=d_scale)
    assert torch.equal(scores[:, 1], torch.zeros(2))  # exclude: no valid token; zero: every similarity is 0
    _close(scores, _dequantized_maxsim(Q, D_q, d_scale, None, d_mask, mask_mode), 4)
    empty_q = lik.maxsim(Q[:, :0], D_q, d_scale=d_scale)
    assert torch.equal(empty_q, torch.zeros(2, 3))


@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_ties_repeated_tokens_and_documents(rng, dtype):
    """Equal maxima give equal scores whichever token wins, and search ranks tied documents by index."""
    D_q, d_scale = lik.quantize(torch.randn(3, 6, 32, generator=rng), dtype)
    doubled = torch.cat([D_q, D_q], dim=1), torch.cat([d_scale, d_scale], dim=1)
    Q = torch.randn(5, 32, generator=rng)
    assert torch.equal(lik.maxsim(Q, *doubled[:1], d_scale=doubled[1]), lik.maxsim(Q, D_q, d_scale=d_scale))
    corpus, scales = torch.cat([D_q, D_q[:1], D_q[:1]]), torch.cat([d_scale, d_scale[:1], d_scale[:1]])
    scores, indices = lik.search(Q, corpus, k=5, d_scale=scales)
    first = indices.tolist().index(0)
    assert indices.tolist()[first: first + 3] == [0, 3, 4]
    assert scores[first] == scores[first + 1] == scores[first + 2]


@pytest.mark.parametrize("dtype", [INT8, FP8])
@pytest.mark.parametrize("mask_mode", MODES)
@pytest.mark.parametrize("dim", [32, 300])
def test_nan_rows_make_the_pairs_they_touch_nan(rng, dtype, mask_mode, dim):
    """A token holding NaN or inf quantizes to scale NaN: every pair it takes part in scores NaN (as the float
    kernels do for a NaN token); masked, it changes nothing."""
    D = torch.randn(4, 7, dim, generator=rng)
    D[1, 3, 0] = float("nan")
    D[2, 5, 1] = float("inf")
    D_q, d_scale = lik.quantize(D, dtype)
    assert d_scale[1, 3].isnan() and d_scale[2, 5].isnan()
    Q = torch.randn(2, 3, dim, generator=rng)
    scores = lik.maxsim(Q, D_q, mask_mode=mask_mode, d_scale=d_scale)
    assert scores[:, 1].isnan().all() and scores[:, 2].isnan().all()
    assert torch.isfinite(scores[:, [0, 3]]).all()
    d_mask = torch.ones(4, 7, dtype=torch.bool)
    d_mask[1, 3] = d_mask[2, 5] = False
    masked = lik.maxsim(Q, D_q, d_mask=d_mask, mask_mode=mask_mode, d_scale=d_scale)
    assert torch.isfinite(masked).all()
    _close(masked, _dequantized_maxsim(Q, D_q, d_scale, None, d_mask, mask_mode), 3)
    Q[1, 2, 0] = float("nan")  # a NaN query token: its query's scores are NaN, a masked one adds 0
    scores = lik.maxsim(Q, D_q, d_mask=d_mask, mask_mode=mask_mode, d_scale=d_scale)
    assert scores[1].isnan().all() and torch.isfinite(scores[0]).all()
    q_mask = torch.ones(2, 3, dtype=torch.bool)
    q_mask[1, 2] = False
    assert torch.isfinite(lik.maxsim(Q, D_q, q_mask, d_mask, mask_mode=mask_mode, d_scale=d_scale)).all()


# ----------------------------------------------------------------------------------------------------------------
# Packed layouts, search, warmup

@pytest.mark.parametrize("dtype", [INT8, FP8])
@pytest.mark.parametrize("dim", [16, 96, 300])
def test_packed_corpus_and_pairs(rng, dtype, dim):
    lengths = (5, 0, 17, 1)
    d, cu_d, max_d = lik.pack([torch.randn(n, dim, generator=rng) for n in lengths])
    d_q, d_scale = lik.quantize(d, dtype)
    Q = torch.randn(3, 6, dim, generator=rng)
    q_mask = torch.rand(3, 6, generator=rng) > 0.3
    corpus = lik.maxsim_packed(Q, d_q, cu_d, q_mask, max_seqlen_d=max_d, d_scale=d_scale)
    # The same documents padded, with a mask, through lik.maxsim: the same scores bit for bit.
    padded = torch.zeros(len(lengths), max_d, dim, dtype=dtype)
    padded_scale = torch.zeros(len(lengths), max_d)
    d_mask = torch.zeros(len(lengths), max_d, dtype=torch.bool)
    for i, (start, stop) in enumerate(zip(cu_d[:-1].tolist(), cu_d[1:].tolist())):
        padded[i, : stop - start], padded_scale[i, : stop - start] = d_q[start:stop], d_scale[start:stop]
        d_mask[i, : stop - start] = True
    assert torch.equal(corpus, lik.maxsim(Q, padded, q_mask, d_mask, d_scale=padded_scale))
    reference = maxsim_packed_reference(Q, d_q, cu_d, q_mask, d_scale=d_scale)
    _close(corpus, reference, 6)
    assert torch.equal(corpus[:, 1], torch.zeros(3))
    # Pairs: query i against document i, the query quantized by the caller or by the scorer.
    q, cu_q, max_q = lik.pack([torch.randn(n, dim, generator=rng) for n in (3, 4, 0, 2)])
    q_q, q_scale = lik.quantize(q, dtype)
    pairs = lik.maxsim_varlen(q_q, d_q, cu_q, cu_d, max_q, max_d, q_scale=q_scale, d_scale=d_scale)
    assert torch.equal(pairs, lik.maxsim_varlen(q, d_q, cu_q, cu_d, max_q, max_d, d_scale=d_scale))
    _close(pairs, maxsim_varlen_reference(q_q, d_q, cu_q, cu_d, q_scale=q_scale, d_scale=d_scale), 4)
    for i, (qs, qe, ds, de) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_d[:-1].tolist(),
                                             cu_d[1:].tolist())):
        one = lik.maxsim(q_q[qs:qe], d_q[ds:de][None], q_scale=q_scale[qs:qe], d_scale=d_scale[ds:de][None])
        assert torch.equal(pairs[i: i + 1], one)


@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_search_ranks_by_the_8bit_scores(rng, dtype):
    D_q, d_scale = lik.quantize(torch.randn(23, 9, 40, generator=rng), dtype)
    d_mask = torch.rand(23, 9, generator=rng) > 0.2
    Q = torch.randn(3, 5, 40, generator=rng)
    scores, indices = lik.search(Q, D_q, 6, None, d_mask, chunk_size=5, d_scale=d_scale)
    full = lik.maxsim(Q, D_q, None, d_mask, d_scale=d_scale)
    expected = full.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(indices, expected.indices[:, :6])
    assert torch.equal(scores, expected.values[:, :6])


@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_warmup_runs_the_8bit_variants(dtype):
    # Two shapes x (unmasked, masked "exclude", masked "zero"), and for (1, 5, 16) on the interpreter's 16-token
    # tiles one unmasked call at a whole number of tiles (the first length, 8, takes whole tiles and a narrow tail;
    # d = 300 streams its features: no such variant).
    assert lik.warmup([(1, 5, 16), (2, 9, 300)], dtype=dtype, device="cpu", masks=True) == 2 * 3 + 1
    with pytest.raises(ValueError, match="training"):
        lik.warmup([(1, 5, 16)], dtype=dtype, device="cpu", training=True)


# ----------------------------------------------------------------------------------------------------------------
# Errors: named, before any kernel runs

def test_int8_runs_the_kernels_under_the_interpreter_and_fp8_the_reference():
    assert uses_kernels(torch.zeros(1, dtype=INT8)) == uses_kernels(torch.zeros(1))
    assert not uses_kernels(torch.zeros(1, dtype=FP8))


@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_bad_8bit_arguments_raise_naming_the_argument(dtype, kernel_calls, monkeypatch):
    quantize_calls = []
    real_quantize = lik.ops.quantization.function.quantize
    monkeypatch.setattr(lik.ops.quantization.function, "quantize",
                        lambda *a, **k: quantize_calls.append(1) or real_quantize(*a, **k))
    D_q, d_scale = real_quantize(torch.randn(3, 5, 16), dtype)
    Q = torch.randn(4, 16)
    Q_grad = torch.randn(4, 16, requires_grad=True)
    Q_q, q_scale = real_quantize(Q, dtype)
    other = INT8 if dtype == FP8 else FP8
    cases = [
        (dict(Q=Q, D=D_q), ValueError, "d_scale is required"),
        (dict(Q=Q, D=D_q, d_scale=d_scale[:, :4]), ValueError, r"d_scale must have shape D.shape\[:-1\]"),
        (dict(Q=Q, D=D_q, d_scale=d_scale.half()), TypeError, "d_scale must be float32"),
        (dict(Q=Q, D=D_q, d_scale=d_scale.tolist()), TypeError, "d_scale must be a torch.Tensor"),
        (dict(Q=Q_q, D=D_q, d_scale=d_scale), ValueError, "q_scale is required"),
        (dict(Q=Q_q, D=D_q, d_scale=d_scale, q_scale=q_scale[:2]), ValueError, "q_scale must have shape"),
        (dict(Q=Q, D=D_q, d_scale=d_scale, q_scale=q_scale), ValueError, "q_scale is only for an 8-bit Q"),
        (dict(Q=Q, D=D_q.float(), d_scale=d_scale), ValueError, "d_scale is only for an 8-bit D"),
        (dict(Q=Q_q, D=D_q.float()), TypeError, "8-bit queries score 8-bit documents"),
        (dict(Q=real_quantize(Q, other)[0], D=D_q, d_scale=d_scale, q_scale=q_scale), TypeError, "mixed 8-bit"),
        (dict(Q=Q_grad, D=D_q, d_scale=d_scale), ValueError, "Q requires grad"),
        (dict(Q=Q_q, D=D_q, d_scale=d_scale.clone().requires_grad_(), q_scale=q_scale), ValueError,
         "d_scale requires grad"),
        (dict(Q=Q[:, :8], D=D_q, d_scale=d_scale), ValueError, "embedding dim"),
        (dict(Q=Q, D=D_q[0], d_scale=d_scale[0]), ValueError, r"D must be \[B, Ld, d\]"),
    ]
    if dtype == FP8:  # int8 tensors cannot require grad at all
        cases.append((dict(Q=Q_q, D=D_q.clone().requires_grad_(), d_scale=d_scale, q_scale=q_scale), ValueError,
                      "D .* requires grad"))
    for kwargs, error, message in cases:
        Q_arg, D_arg = kwargs.pop("Q"), kwargs.pop("D")
        for scorer in (lik.maxsim, lik.maxsim_reference):
            with pytest.raises(error, match=message):
                scorer(Q_arg, D_arg, **kwargs)
        if Q_arg is not Q_grad:  # search runs under no_grad: a float query needing grad is just detached there
            with pytest.raises(error, match=message):
                lik.search(Q_arg, D_arg, 1, **kwargs)
    assert not kernel_calls and not quantize_calls  # every error came before any kernel


@pytest.mark.parametrize("dtype", [INT8, FP8])
def test_bad_packed_8bit_arguments(dtype):
    d, cu_d, max_d = lik.pack([torch.randn(n, 16) for n in (3, 4)])
    d_q, d_scale = lik.quantize(d, dtype)
    q, cu_q, max_q = lik.pack([torch.randn(n, 16) for n in (2, 5)])
    q_q, q_scale = lik.quantize(q, dtype)
    with pytest.raises(ValueError, match="d_scale is required"):
        lik.maxsim_packed(q, d_q, cu_d)
    with pytest.raises(ValueError, match=r"d_scale must have shape d.shape\[:-1\] = \[7\]"):
        lik.maxsim_packed(q, d_q, cu_d, d_scale=d_scale[None])
    with pytest.raises(ValueError, match="q_scale is required"):
        lik.maxsim_varlen(q_q, d_q, cu_q, cu_d, d_scale=d_scale)
    with pytest.raises(TypeError, match="q_scale must be float32"):
        lik.maxsim_varlen(q_q, d_q, cu_q, cu_d, q_scale=q_scale.double(), d_scale=d_scale)
    with pytest.raises(TypeError, match="8-bit queries score 8-bit documents"):
        lik.maxsim_varlen(q_q, d, cu_q, cu_d, q_scale=q_scale)


def test_fp8_on_a_gpu_without_fp8_names_the_argument_and_the_alternative(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"D: float8_e4m3fn needs .* use torch.int8 instead"):
        check_fp8_supported(torch.device("cuda", 0), "D")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_supported(torch.device("cuda", 0), "D")


def test_torch_compile_traces_8bit_scoring_as_one_graph(rng):
    """Under ``torch.compile`` the 8-bit launch is the same custom operator (scales as optional tensors)."""
    Q_q, q_scale = lik.quantize(torch.randn(2, 5, 32, generator=rng), INT8)
    D_q, d_scale = lik.quantize(torch.randn(3, 7, 32, generator=rng), INT8)
    d_mask = torch.rand(3, 7, generator=rng) > 0.3
    compiled = torch.compile(
        lambda q, d, qs, ds: lik.maxsim(q, d, None, d_mask, q_scale=qs, d_scale=ds), backend="aot_eager",
        fullgraph=True,
    )
    assert torch.equal(compiled(Q_q, D_q, q_scale, d_scale), lik.maxsim(Q_q, D_q, None, d_mask, q_scale=q_scale,
                                                                         d_scale=d_scale))
