"""The compressed scan (score_residual_packed, maxsim_residual without a gradient): the token stream with the residual
loader and the bounded-scratch fallback, each forced, against a float64 decode + maxsim_packed_reference; the
on-chip decoder against the codec's; the launch heuristic's choice of path."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import lik
from lik.compression import ResidualCodec
from lik.compression.packing import pack_residual_bits
from lik.config import override
from lik.config.residual import ResidualStreamConfig, residual_stream_config
from lik.ops.residual import decode_into, decode_tokens, maxsim_residual, scan, score_residual_packed
from lik.ops.residual.decode import group_weights

from .helpers import expected, make_codec, make_corpus

# 16-token tiles (the interpreter's); programs_per_sm 8 splits the tokens among several programs (one SM off CUDA)
STREAM = ResidualStreamConfig(32, 1, 16, 4, 1, 8)
FALLBACK = ResidualStreamConfig(chunk_tokens=20)
# empty first, one token, across tiles, ending on a tile boundary, empty last
LENGTHS = [0, 1, 37, 0, 5, 21, 0]


@pytest.fixture
def paths(monkeypatch):
    """Counts the calls of each kernel path (so a test cannot pass on another path)."""
    calls = {"stream": 0, "fallback": 0}
    for name, real in (("stream", scan.residual_stream), ("fallback", scan.residual_fallback)):

        def counted(*args, _name=name, _real=real, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(scan, f"residual_{name}", counted)
    return calls


def _kernels():
    from lik._device import interpreting

    if not interpreting():
        pytest.skip("TRITON_INTERPRET=1 runs the kernels on CPU")


@pytest.mark.parametrize("nbits", [1, 2, 4])
@pytest.mark.parametrize("dim", [8, 24, 96, 128])
def test_decoder_matches_codec(nbits, dim):
    _kernels()
    codec = make_codec(dim, nbits, k=7)
    codes, residuals, _ = make_corpus(codec, [41])
    out = decode_into(torch.empty(41, dim), codes, residuals, codec)
    torch.testing.assert_close(out, decode_tokens(codec, codes, residuals, torch.float32), atol=2e-7, rtol=0)
    half = decode_into(torch.empty(41, dim, dtype=torch.float16), codes.long(), residuals, codec)
    torch.testing.assert_close(half, out.half(), atol=1e-3, rtol=0)  # the fp32 decode, then the cast


def test_group_weights_undo_colberts_bit_order():
    for nbits in (1, 2, 4):
        weights = torch.arange(2**nbits, dtype=torch.float32)
        codec = ResidualCodec(torch.eye(8), torch.zeros(2**nbits - 1), weights, nbits)
        table = group_weights(codec)
        # a byte of dimensions all in bucket b, as ColBERT packs it: its first group is b's bits reversed
        for b in range(2**nbits):
            byte = int(pack_residual_bits(torch.full((1, 8), b), nbits)[0, 0])
            assert table[byte >> (8 - nbits)] == b


@pytest.mark.parametrize(
    ("path", "nbits", "dim"),
    [
        ("stream", 2, 128),
        ("table", 2, 96),  # a width below its power of two: masked columns
        ("fallback", 4, 24),
        pytest.param("stream", 2, 96, marks=pytest.mark.slow),
        pytest.param("table", 1, 16, marks=pytest.mark.slow),
        pytest.param("table", 4, 24, marks=pytest.mark.slow),
        pytest.param("stream", 1, 16, marks=pytest.mark.slow),
        pytest.param("stream", 4, 24, marks=pytest.mark.slow),
        pytest.param("fallback", 1, 16, marks=pytest.mark.slow),
        pytest.param("fallback", 2, 128, marks=pytest.mark.slow),
    ],
)
def test_paths_match_float64(paths, path, nbits, dim):
    _kernels()
    codec = make_codec(dim, nbits)
    codes, residuals, cu = make_corpus(codec, LENGTHS)
    g = torch.Generator().manual_seed(2)
    Q = torch.randn(3, 5, dim, generator=g)
    q_mask = torch.rand(3, 5, generator=g) > 0.3
    q_mask[0, 1] = False
    Q[0, 1] = float("nan")  # garbage under the mask must not leak
    q_mask[2] = False  # an all-masked query
    forced = {"stream": STREAM, "table": dataclasses.replace(STREAM, byte_table=True), "fallback": FALLBACK}[path]
    with override(residual_stream=forced):
        out = score_residual_packed(Q, q_mask, codes, residuals, codec, cu)
    assert paths["fallback" if path == "fallback" else "stream"] == 1 and sum(paths.values()) == 1
    want = expected(Q, codes, residuals, codec, cu, q_mask)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)
    empty = torch.tensor(LENGTHS) == 0
    assert out[:, empty].eq(0).all() and out[2].eq(0).all()


@pytest.mark.parametrize("path", ["stream", pytest.param("fallback", marks=pytest.mark.slow)])
def test_nan_query_token_and_fp16(paths, path):
    _kernels()
    codec = make_codec(32, 2, dtype=torch.float16)  # centroids as ColBERT stores them
    codes, residuals, cu = make_corpus(codec, [4, 0, 19, 1], codes_dtype=torch.int64)
    g = torch.Generator().manual_seed(3)
    Q = F.normalize(torch.randn(2, 6, 32, generator=g), dim=-1)
    with override(residual_stream=STREAM if path == "stream" else FALLBACK):
        half = score_residual_packed(Q.half(), None, codes, residuals, codec, cu)
        Q[1, 3, 7] = float("nan")
        out = score_residual_packed(Q, None, codes, residuals, codec, cu)
    assert paths[path] == 2
    want16 = expected(torch.where(Q.isnan(), 0.0, Q).half(), codes, residuals, codec, cu)
    torch.testing.assert_close(half.double(), want16, atol=2e-2, rtol=1e-2)
    assert torch.isnan(out[1, [0, 2, 3]]).all() and out[1, 1] == 0 and torch.isfinite(out[0]).all()
    torch.testing.assert_close(out[0].double(), expected(Q[:1], codes, residuals, codec, cu)[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", ["stream", "fallback"])
def test_non_contiguous_inputs(paths, path):
    _kernels()
    codec = make_codec(24, 2)
    codes, residuals, cu = make_corpus(codec, [7, 3, 30])
    Q = torch.randn(5, 48, 4)[..., 0].view(5, 2, 24).transpose(0, 1)[:, ::2]  # [2, 3, 24], strided
    wide = torch.zeros(codes.shape[0], 2, dtype=codes.dtype)
    wide[:, 1] = codes
    strided_codes = wide[:, 1]
    assert not Q.is_contiguous() and not strided_codes.is_contiguous()
    with override(residual_stream=STREAM if path == "stream" else FALLBACK):
        out = score_residual_packed(Q, None, strided_codes, residuals, codec, cu)
    assert paths[path] == 1
    torch.testing.assert_close(out.double(), expected(Q, codes, residuals, codec, cu), atol=1e-4, rtol=1e-4)


# stacked short queries (one row block); a query split over row groups (two row blocks)
@pytest.mark.parametrize(("n_q", "l_q"), [(9, 3), pytest.param(2, 70, marks=pytest.mark.slow)])
def test_stacked_and_split_query_rows(paths, n_q, l_q):
    _kernels()
    codec = make_codec(16, 2)
    codes, residuals, cu = make_corpus(codec, [4, 0, 19])
    Q = torch.randn(n_q, l_q, 16)
    q_mask = torch.rand(n_q, l_q) > 0.2
    out = maxsim_residual(Q, codes, residuals, codec, cu, q_mask=q_mask)  # no gradient: the scan
    torch.testing.assert_close(out.double(), expected(Q, codes, residuals, codec, cu, q_mask), atol=1e-4, rtol=1e-4)
    assert paths["stream"] == 1


def test_empty_sizes():
    codec = make_codec(16, 1)
    codes, residuals, cu = make_corpus(codec, [0, 0, 0])
    Q = torch.randn(2, 3, 16)
    assert score_residual_packed(Q, None, codes, residuals, codec, cu).eq(0).all()  # T = 0
    none = torch.zeros(1, dtype=torch.int32)
    assert score_residual_packed(Q, None, codes, residuals, codec, none).shape == (2, 0)  # no documents
    codes, residuals, cu = make_corpus(codec, [3, 1])
    assert score_residual_packed(Q[:0], None, codes, residuals, codec, cu).shape == (0, 2)
    assert score_residual_packed(Q[:, :0], None, codes, residuals, codec, cu).eq(0).all()
    out = score_residual_packed(Q.double(), None, codes, residuals, codec, cu)  # float64: the reference
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected(Q, codes, residuals, codec, cu), atol=1e-12, rtol=1e-12)


def test_fallback_runs_and_a_document_longer_than_a_run(paths):
    _kernels()
    codec = make_codec(16, 4)
    codes, residuals, cu = make_corpus(codec, [3, 45, 2, 0, 9, 9, 9, 1])
    Q = torch.randn(2, 4, 16)
    with override(residual_stream=ResidualStreamConfig(chunk_tokens=10)):
        out = maxsim_residual(Q, codes, residuals, codec, cu)
    assert paths["fallback"] == 1
    torch.testing.assert_close(out.double(), expected(Q, codes, residuals, codec, cu), atol=1e-4, rtol=1e-4)


def test_heuristic_paths(monkeypatch):
    from lik import _device

    monkeypatch.setattr(_device, "interpreting", lambda: False)
    monkeypatch.setattr(_device, "arch", lambda device: (9, 0))  # the H200's tiles
    monkeypatch.setattr(_device, "shared_memory", lambda device: 232448)
    cpu = torch.device("cpu")
    pick = lambda n_q, dim=128: residual_stream_config(  # noqa: E731
        q_len=32, n_queries=n_q, dim=dim, dtype=torch.float16, device=cpu
    )
    assert pick(1).chunk_tokens == 0 and pick(1).block_m == 32
    assert pick(32).chunk_tokens > 0  # 4 row blocks: the fallback (MAX_FUSED_ROW_BLOCKS = 2)
    assert pick(256).chunk_tokens > 0  # 32 row blocks would decode every tile 32 times
    assert pick(1, dim=256).chunk_tokens > 0  # wider than the stream's resident rows
    with override(residual_stream=STREAM):
        assert pick(256) == STREAM


def test_exported():
    assert lik.ops.residual.score_residual_packed is score_residual_packed


def test_many_documents_in_one_tile(paths):
    _kernels()
    codec = make_codec(16, 1)
    lengths = [1] * 9 + [0, 2, 0, 3, 20, 1, 1]  # more than the unrolled passes' documents in a 16-token tile
    codes, residuals, cu = make_corpus(codec, lengths)
    Q = torch.randn(2, 3, 16)
    with override(residual_stream=STREAM):
        out = score_residual_packed(Q, None, codes, residuals, codec, cu)
    assert paths["stream"] == 1
    torch.testing.assert_close(out.double(), expected(Q, codes, residuals, codec, cu), atol=1e-4, rtol=1e-4)


def test_four_bits_take_the_fallback_on_a_gpu(monkeypatch):
    """4 bits gather each dimension's weight in the stream's loader: the fallback (decode once, packed scan) even
    for one query; 1 and 2 bits (and an unknown width) keep the stream; a forced config and the interpreter win."""
    from lik import _device
    from lik.config.residual import FALLBACK_CHUNK_TOKENS, FUSED_NBITS

    monkeypatch.setattr(_device, "arch", lambda device: (9, 0))
    monkeypatch.setattr(_device, "shared_memory", lambda device: 232448)
    pick = lambda n_q, nbits: residual_stream_config(  # noqa: E731
        q_len=32, n_queries=n_q, dim=128, dtype=torch.float16, device=torch.device("cpu"), nbits=nbits
    )
    monkeypatch.setattr(_device, "interpreting", lambda: True)
    assert pick(1, 4).chunk_tokens == 0  # the interpreter runs the stream at every width
    monkeypatch.setattr(_device, "interpreting", lambda: False)
    assert FUSED_NBITS == (1, 2)
    for n_q in (1, 2, 256):
        assert pick(n_q, 4) == ResidualStreamConfig(32, pick(n_q, 4).groups, chunk_tokens=FALLBACK_CHUNK_TOKENS)
    for nbits in (1, 2, None):
        assert pick(1, nbits).chunk_tokens == 0 and pick(1, nbits) == pick(1, 2)
        assert pick(256, nbits).chunk_tokens > 0
    with override(residual_stream=STREAM):
        assert pick(1, 4) == STREAM


@pytest.mark.gpu
def test_four_bit_scan_speed_print():
    """Prints (asserts only agreement): one query of 32 tokens against ~5M compressed tokens at 2 and 4 bits, the
    stream and the fallback forced, the heuristic's choice for each width, and the two paths' largest difference."""
    import functools

    from triton.testing import do_bench

    cuda = torch.device("cuda")
    g = torch.Generator(device=cuda).manual_seed(0)
    for nbits in (2, 4):
        centroids = F.normalize(torch.randn(4096, 128, device=cuda, generator=g), dim=-1).half()
        codec = ResidualCodec(centroids, torch.zeros(2**nbits - 1), torch.linspace(-0.05, 0.05, 2**nbits), nbits)
        lengths = torch.randint(50, 151, (50_000,), device=cuda, generator=g)
        cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
        t = int(cu[-1])
        codes = torch.randint(0, 4096, (t,), device=cuda, generator=g, dtype=torch.int32)
        residuals = torch.randint(0, 256, (t, 16 * nbits), device=cuda, generator=g, dtype=torch.uint8)
        Q = F.normalize(torch.randn(1, 32, 128, device=cuda), dim=-1).half()
        args = (Q, None, codes, residuals, codec, cu)
        call = functools.partial(score_residual_packed, *args)
        one = dict(q_len=32, n_queries=1, dim=128, dtype=Q.dtype, device=cuda)
        times, outs = {}, {}
        for name, forced in (("stream", residual_stream_config(**one)), ("fallback", FALLBACK_FORCED)):
            with override(residual_stream=forced):
                times[name], outs[name] = do_bench(call), call()
        heuristic = do_bench(call)
        choice = "fallback" if residual_stream_config(**one, nbits=nbits).chunk_tokens else "stream"
        torch.testing.assert_close(outs["stream"], outs["fallback"], atol=3e-2, rtol=3e-3)
        print(
            f"\nresidual scan nbits={nbits} Nq=1 T={t}: stream {times['stream']:.3f} ms, fallback "
            f"{times['fallback']:.3f} ms, scan.py's launch {heuristic:.3f} ms; config(nbits={nbits}) picks {choice}"
        )


FALLBACK_FORCED = ResidualStreamConfig(chunk_tokens=1 << 18)
