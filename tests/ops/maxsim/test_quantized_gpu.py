"""8-bit scoring on the GPU (`pytest -m gpu`): the int8 and float8 kernels compiled for real, against the
reference run on the CPU with the same quantized operands.

int8: each row maximum is bit-equal to the reference's (exact int32 sums, the same fp32 scaling), so one-token
queries score bit for bit alike and longer ones differ only by the fp32 order of the sum over query tokens.
float8: fp32 sums (Hopper's partial fp8 products promoted to fp32 once per 128-deep chunk), so the scores differ
from the reference's exact sum by fp32 rounding of the running sum plus whatever precision the tensor cores keep
inside one chunk (up to 128 products): ``FP8_RTOL`` bounds it; the tests print the error seen.
"""

from __future__ import annotations

import pytest
import torch

import lik
from lik import _config

pytestmark = pytest.mark.gpu

CUDA = "cuda"
INT8, FP8 = torch.int8, torch.float8_e4m3fn
MODES = ["exclude", "zero"]
DIMS = [16, 64, 128, 200, 300, 1000, 4096]
FP8_RTOL = 1e-3  # relative to the score scale (sum of |max| over query tokens); see the module docstring


def _dtypes():
    fp8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    return [INT8] + ([FP8] if fp8 else [])


def _problem(n_q, l_q, n_docs, l_d, dim, dtype, *, per_query=False, seed=0):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    Q = torch.nn.functional.normalize(torch.randn(n_q, l_q, dim, device=CUDA, generator=gen), dim=-1)
    shape_d = ((n_q,) if per_query else ()) + (n_docs, l_d, dim)
    D = torch.nn.functional.normalize(torch.randn(shape_d, device=CUDA, generator=gen), dim=-1)
    D_q, d_scale = lik.quantize(D, dtype)
    q_mask = torch.rand(n_q, l_q, device=CUDA, generator=gen) > 0.2
    d_mask = torch.rand(shape_d[:-1], device=CUDA, generator=gen) > 0.2
    return Q, D_q, d_scale, q_mask, d_mask


def _cpu(x):
    return None if x is None else x.cpu()


def _check(scores, Q_q, q_scale, D_q, d_scale, q_mask, d_mask, mask_mode):
    """GPU scores against the CPU reference of the same quantized operands."""
    expected = lik.maxsim_reference(
        _cpu(Q_q), _cpu(D_q), _cpu(q_mask), _cpu(d_mask), mask_mode=mask_mode, q_scale=_cpu(q_scale),
        d_scale=_cpu(d_scale),
    )
    scores = scores.cpu()
    assert torch.isnan(scores).equal(torch.isnan(expected))
    scale = expected.nan_to_num().abs().max().clamp_min(1.0).item()  # (NaN scores are compared above)
    error = (scores - expected).nan_to_num().abs().max().item() / scale
    print(f"{D_q.dtype} d={D_q.shape[-1]} {mask_mode}: max relative error {error:.2e}")
    bound = 4e-6 * Q_q.shape[-2] if D_q.dtype == INT8 else FP8_RTOL
    assert error <= bound


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("mask_mode", MODES)
@pytest.mark.parametrize(
    "shape", [(1, 32, 40, 300, False), (32, 32, 20, 180, False), (1, 1024, 4, 1024, False), (3, 20, 7, 65, True)],
    ids=["textual", "stacked", "colpali", "per-query"],
)
def test_8bit_kernels_match_the_reference(dtype, dim, mask_mode, shape):
    n_q, l_q, n_docs, l_d, per_query = shape
    Q, D_q, d_scale, q_mask, d_mask = _problem(n_q, l_q, n_docs, l_d, dim, dtype, per_query=per_query)
    Q_q, q_scale = lik.quantize(Q, dtype)
    for masks in ((None, None), (q_mask, d_mask)):
        scores = lik.maxsim(Q, D_q, *masks, mask_mode=mask_mode, d_scale=d_scale)
        again = lik.maxsim(Q_q, D_q, *masks, mask_mode=mask_mode, q_scale=q_scale, d_scale=d_scale)
        assert torch.equal(scores, again)
        _check(scores, Q_q, q_scale, D_q, d_scale, *masks, mask_mode)


@pytest.mark.parametrize("dim", DIMS)
def test_int8_one_token_queries_are_bit_exact(dim):
    Q, D_q, d_scale, _, d_mask = _problem(8, 1, 50, 333, dim, INT8)
    Q_q, q_scale = lik.quantize(Q, INT8)
    for mask_mode in MODES:
        scores = lik.maxsim(Q_q, D_q, None, d_mask, mask_mode=mask_mode, q_scale=q_scale, d_scale=d_scale)
        expected = lik.maxsim_reference(Q_q.cpu(), D_q.cpu(), None, d_mask.cpu(), mask_mode=mask_mode,
                                        q_scale=q_scale.cpu(), d_scale=d_scale.cpu())
        assert torch.equal(scores.cpu(), expected)


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("dim", [64, 128, 768])
@pytest.mark.parametrize("shape", [(1, 32, 40, 300), (32, 32, 20, 180), (1, 1024, 4, 1024)],
                         ids=["textual", "stacked", "colpali"])
def test_8bit_negative_query_scale_gives_nan_on_gpu(dtype, dim, shape):
    """The query scale multiplies the row's max after the loop: a negative one makes its query NaN (as in the
    reference), every other query keeps its score."""
    Q, D_q, d_scale, _, d_mask = _problem(*shape, dim, dtype)
    Q_q, q_scale = lik.quantize(Q, dtype)
    q_scale[0, shape[1] // 2] *= -1
    scores = lik.maxsim(Q_q, D_q, None, d_mask, q_scale=q_scale, d_scale=d_scale)
    assert scores[0].isnan().all() and torch.isfinite(scores[1:]).all()
    _check(scores, Q_q, q_scale, D_q, d_scale, None, d_mask, "exclude")


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("dim", [64, 128, 768])
def test_8bit_packed_and_pairs(dtype, dim):
    gen = torch.Generator().manual_seed(1)
    lengths = [300, 0, 57, 1, 1030]
    d, cu_d, max_d = lik.pack([torch.randn(n, dim, generator=gen) for n in lengths])
    d_q, d_scale = lik.quantize(d.to(CUDA), dtype)
    cu_d = cu_d.to(CUDA)
    Q = torch.randn(4, 32, dim, generator=gen).to(CUDA)
    corpus = lik.maxsim_packed(Q, d_q, cu_d, max_seqlen_d=max_d, d_scale=d_scale)
    Q_q, q_scale = lik.quantize(Q, dtype)
    _check_packed = lik.ops.maxsim.reference_varlen.maxsim_packed_reference
    expected = _check_packed(Q_q.cpu(), d_q.cpu(), cu_d.cpu(), q_scale=q_scale.cpu(), d_scale=d_scale.cpu())
    tol = 4e-6 * 32 if dtype == INT8 else FP8_RTOL
    assert ((corpus.cpu() - expected).abs().max() / expected.abs().max().clamp_min(1)).item() <= tol
    q, cu_q, max_q = lik.pack([torch.randn(n, dim, generator=gen) for n in (32, 5, 0, 17, 300)])
    pairs = lik.maxsim_varlen(q.to(CUDA), d_q, cu_q.to(CUDA), cu_d, max_q, max_d, d_scale=d_scale)
    q_q, q_scale = lik.quantize(q.to(CUDA), dtype)
    expected = lik.ops.maxsim.reference_varlen.maxsim_varlen_reference(
        q_q.cpu(), d_q.cpu(), cu_q, cu_d.cpu(), q_scale=q_scale.cpu(), d_scale=d_scale.cpu())
    tol = 4e-6 * 300 if dtype == INT8 else FP8_RTOL
    assert ((pairs.cpu() - expected).abs().max() / expected.abs().max().clamp_min(1)).item() <= tol


@pytest.mark.parametrize("dtype", _dtypes())
def test_8bit_garbage_nan_and_empty_documents_on_gpu(dtype):
    Q, D_q, d_scale, q_mask, d_mask = _problem(3, 20, 6, 70, 128, dtype)
    Q_q, q_scale = lik.quantize(Q, dtype)
    d_mask[2] = False  # an all-masked document
    for mask_mode in MODES:
        clean = lik.maxsim(Q_q, D_q, q_mask, d_mask, mask_mode=mask_mode, q_scale=q_scale, d_scale=d_scale)
        bad_d, bad_ds, bad_qs = D_q.clone(), d_scale.clone(), q_scale.clone()
        bad_d.view(torch.int8)[~d_mask] = 0x7F  # float8: NaN
        bad_ds[~d_mask] = float("nan")
        bad_qs[~q_mask] = float("inf")
        garbage = lik.maxsim(Q_q, bad_d, q_mask, d_mask, mask_mode=mask_mode, q_scale=bad_qs, d_scale=bad_ds)
        assert torch.equal(garbage, clean) and torch.isfinite(clean).all()
        assert torch.equal(clean[:, 2], torch.zeros(3, device=CUDA))
    nan_scale = d_scale.clone()
    nan_scale[4, 0] = float("nan")  # a token that held NaN at quantize time
    scores = lik.maxsim(Q_q, D_q, q_scale=q_scale, d_scale=nan_scale)
    assert scores[:, 4].isnan().all() and torch.isfinite(scores[:, [0, 1, 2, 3, 5]]).all()
    empty = lik.maxsim(Q, D_q[:, :0], d_scale=d_scale[:, :0])
    assert torch.equal(empty, torch.zeros(3, 6, device=CUDA))


@pytest.mark.parametrize("dtype", _dtypes())
def test_8bit_scoring_allocates_no_dequantized_copy(dtype):
    """The scales are applied to the product on chip: the call allocates far less than one copy of ``D``."""
    Q, D_q, d_scale, _, _ = _problem(4, 32, 2000, 300, 128, dtype)
    lik.maxsim(Q, D_q, d_scale=d_scale)  # compile first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    lik.maxsim(Q, D_q, d_scale=d_scale)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < D_q.numel() // 16


@pytest.mark.parametrize("dtype", _dtypes())
def test_8bit_search_and_warmup_on_gpu(dtype):
    Q, D_q, d_scale, _, d_mask = _problem(4, 32, 500, 120, 128, dtype)
    scores, indices = lik.search(Q, D_q, 10, None, d_mask, d_scale=d_scale, chunk_size=128)
    full = lik.maxsim(Q, D_q, None, d_mask, d_scale=d_scale).sort(dim=-1, descending=True, stable=True)
    assert torch.equal(indices, full.indices[:, :10]) and torch.equal(scores, full.values[:, :10])
    assert lik.warmup([(1, 32, 128), (32, 32, 128)], dtype=dtype, masks=True) > 0


@pytest.mark.parametrize("dtype", _dtypes())
def test_long_queries_over_whole_tiles_a_narrow_tail_and_ragged_tiles_after_warmup(dtype):
    """Long queries read an unmasked 8-bit corpus's whole tiles without row clamp or last-tile select and up to 32
    tokens after them in narrow tiles (more: the clamped loop): an inf and a NaN scale in the last token reach the
    scores as in the reference, at every length, and after warmup none of the lengths compiles."""
    from lik.core.quantized import loader_of
    from lik.ops.maxsim.forward import last_tiles
    from lik.ops.maxsim.forward_kernel import maxsim_fwd_kernel

    from ...test_precompile import _variants

    lik.warmup([(1, 300, 128)], dtype=dtype, masks=False)
    compiled = _variants(maxsim_fwd_kernel)
    widths = []
    for doc_len in (256, 262, 300, 20):
        Q, D_q, d_scale, _, _ = _problem(1, 300, 40, doc_len, 128, dtype, seed=5)
        d_scale[1, doc_len - 1] = float("inf")
        d_scale[2, doc_len - 1] = float("nan")
        Q_q, q_scale = lik.quantize(Q, dtype)
        scores = lik.maxsim(Q_q, D_q, q_scale=q_scale, d_scale=d_scale)
        clean = [0] + list(range(3, 40))
        _check(scores[:, clean], Q_q, q_scale, D_q[clean], d_scale[clean], None, None, "exclude")
        garbage = lik.maxsim_reference(Q_q.cpu(), D_q[1:3].cpu(), q_scale=q_scale.cpu(), d_scale=d_scale[1:3].cpu())
        assert torch.equal(scores[:, 1:3].cpu().isnan(), garbage.isnan()) and garbage[:, 1].isnan().all()
        assert torch.equal(scores[:, 1:3].cpu().isinf(), garbage.isinf()) and garbage[:, 0].isinf().all()
        config = _config.maxsim_forward_config(q_len=300, n_queries=1, dim=128, dtype=dtype, per_query=False,
                                               device=D_q.device, doc_len=doc_len)
        widths.append(last_tiles(config, doc_len, 128, loader_of(dtype), masked=False))
    assert widths == [(True, 0), (True, 16), (False, 0), (True, 16)]
    assert _variants(maxsim_fwd_kernel) == compiled


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("dim", [64, 128])
def test_persistent_programs_carry_scales_across_documents(dtype, dim):
    """One short query against many documents: each persistent program walks several documents and loads the
    next tile's scales (the next document's first, at a document's last tile) during the current product."""
    Q, D_q, d_scale, q_mask, d_mask = _problem(1, 32, 1000, 70, dim, dtype, seed=3)
    Q_q, q_scale = lik.quantize(Q, dtype)
    shipped = _config.maxsim_forward_config(q_len=32, n_queries=1, dim=dim, dtype=dtype, per_query=False,
                                            device=D_q.device, doc_len=70)
    assert shipped.programs_per_sm > 0  # (the launch these tests are about)
    variants = [None, _config.MaxSimForwardConfig(group_rows=shipped.group_rows, groups=1, block_n=64, block_k=dim,
                                                  num_stages=3, programs_per_sm=1)]
    for config in variants:
        for masks in ((None, None), (q_mask, d_mask)):
            if config is None:
                scores = lik.maxsim(Q_q, D_q, *masks, q_scale=q_scale, d_scale=d_scale)
            else:
                with _config.override(maxsim_forward=config):
                    scores = lik.maxsim(Q_q, D_q, *masks, q_scale=q_scale, d_scale=d_scale)
            _check(scores, Q_q, q_scale, D_q, d_scale, *masks, "exclude")


@pytest.mark.parametrize("doc_len", [1, 63, 64, 70, 300, 600])
def test_one_int8_query_keeps_a_whole_tile_max_per_document_on_gpu(doc_len):
    """The shipped launch of one short int8 query (persistent; short documents in 64-token tiles, long ones in 128)
    keeps each document's elementwise tile max and reduces it on the document's last tile: every length gives the
    reference's scores, and a NaN or a huge similarity stays in its own document."""
    Q, D_q, d_scale, _, _ = _problem(1, 32, 2000, doc_len, 128, INT8, seed=5)
    Q_q, q_scale = lik.quantize(Q[0], INT8)
    d_scale[7, doc_len - 1] = float("nan")
    d_scale[800, 0] = float("nan")
    d_scale[11, doc_len // 2] = 1e30
    scores = lik.maxsim(Q_q, D_q, q_scale=q_scale, d_scale=d_scale)
    assert scores[[7, 800]].isnan().all() and scores[11].abs() > 1e25
    assert torch.isfinite(scores).sum() == 1998
    rest = torch.arange(2000, device=CUDA) != 11  # (checked apart: its score sets the error's scale)
    _check(scores[rest], Q_q, q_scale, D_q[rest], d_scale[rest], None, None, "exclude")
    _check(scores[11:12], Q_q, q_scale, D_q[11:12], d_scale[11:12], None, None, "exclude")


def test_int8_every_forced_tile_variant_on_gpu():
    Q, D_q, d_scale, q_mask, d_mask = _problem(6, 40, 30, 150, 320, INT8)
    Q_q, q_scale = lik.quantize(Q, INT8)
    variants = [
        _config.MaxSimForwardConfig(group_rows=64, groups=1, block_n=64, block_k=64, flat_k=False),
        _config.MaxSimForwardConfig(group_rows=64, groups=2, block_n=64, block_k=128, num_stages=3),
    ]
    for config in variants:
        with _config.override(maxsim_forward=config):
            scores = lik.maxsim(Q_q, D_q, q_mask, d_mask, q_scale=q_scale, d_scale=d_scale)
        _check(scores, Q_q, q_scale, D_q, d_scale, q_mask, d_mask, "exclude")
