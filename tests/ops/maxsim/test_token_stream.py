"""The token-stream kernel of packed-corpus inference (lik.core.token_stream) against the float64 reference and
against the document loop it replaces, through the interpreter; and its launch choice (lik.config.packed)."""

from __future__ import annotations

import pytest
import torch

import lik
from lik import _device
from lik.config import override
from lik.config.packed import PackedStreamConfig, packed_stream_config
from lik.core.forward_launch import chunk_sums, packed_problem
from lik.ops.maxsim import packed_forward
from lik.ops.maxsim.reference_varlen import maxsim_packed_reference

# Tiles of 16 rows: the corpus below has documents shorter than, equal to and longer than a tile, one over three
# tiles, and empty ones at the start, in the middle and at the end.
LENGTHS = [0, 5, 16, 0, 40, 3, 1, 0, 16, 33, 0]
SMALL = dict(group_rows=8, groups=2, block_t=16, num_warps=4, num_stages=1)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


@pytest.fixture
def streamed(monkeypatch):
    """Counts the token-stream launches (a test that meant the stream and got the document loop fails)."""
    calls = []
    launch = packed_forward.launch_token_stream

    def counting(*args, **kwargs):
        calls.append(1)
        return launch(*args, **kwargs)

    monkeypatch.setattr(packed_forward, "launch_token_stream", counting)
    return calls


def _corpus(rng, lengths, dim, *, nan_doc=None, inf_doc=None, strided=False):
    cu = _cu(lengths)
    rows = int(cu[-1])
    d = torch.randn(rows, 2 * dim if strided else dim, generator=rng)
    d = d[:, ::2] if strided else d  # (a non-contiguous view: feature stride 2)
    if nan_doc is not None:
        d[int(cu[nan_doc]) + 2, 3] = float("nan")
    if inf_doc is not None:
        d[int(cu[inf_doc]) + 1, 0] = float("inf")
    return d, cu


@pytest.mark.parametrize("segments, programs_per_sm", [(3, 3), (1, 1)], ids=["unrolled-3-programs", "counted-loop"])
def test_stream_matches_reference_and_document_loop(streamed, segments, programs_per_sm):
    rng = torch.Generator().manual_seed(0)
    dim = 24  # (an odd width: the feature block is padded and masked)
    d, cu = _corpus(rng, LENGTHS, dim, nan_doc=4, inf_doc=9)
    d[int(cu[2]) + 7] = d[int(cu[2]) + 3]  # a tie inside a document
    Q = torch.randn(7, 3, dim, generator=rng).transpose(0, 1)  # [3, 7, dim], non-contiguous
    q_mask = torch.rand(3, 7, generator=rng) > 0.3
    q_mask[1] = False  # a query with every token masked
    expected = maxsim_packed_reference(Q.double(), d.double(), cu, q_mask)
    cfg = PackedStreamConfig(**SMALL, programs_per_sm=programs_per_sm, segments=segments)
    with override(packed_stream=cfg):
        got = lik.maxsim_packed(Q, d, cu, q_mask, max_seqlen_d=max(LENGTHS))
    assert streamed == [1]
    with override(packed_stream=PackedStreamConfig(stream=False)):
        loop = lik.maxsim_packed(Q, d, cu, q_mask, max_seqlen_d=max(LENGTHS))
    assert streamed == [1]
    assert got.shape == (3, len(LENGTHS))
    assert torch.isnan(got[:, 4][q_mask.any(1)]).all()  # the NaN reaches every query with a valid token
    assert (got[1] == 0).all()  # all-masked query
    assert (got[:, [0, 3, 7, 10]] == 0).all()  # empty documents
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(got, loop, rtol=1e-6, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("lengths", [[37], [0, 0, 0], [0, 3, 0]], ids=["one-document", "all-empty", "one-short"])
def test_stream_few_documents(streamed, lengths):
    rng = torch.Generator().manual_seed(1)
    d, cu = _corpus(rng, lengths, 16)
    if d.shape[0] == 0:
        d = torch.randn(0, 16)
    Q = torch.randn(2, 5, 16, generator=rng)
    with override(packed_stream=PackedStreamConfig(**SMALL, programs_per_sm=4)):
        got = lik.maxsim_packed(Q, d, cu, max_seqlen_d=max(lengths))
    expected = maxsim_packed_reference(Q.double(), d.double(), cu)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert len(streamed) == (1 if d.shape[0] else 0)  # no rows: nothing to stream, zeros without a kernel


def test_stream_zero_documents(streamed):
    got = lik.maxsim_packed(
        torch.randn(2, 5, 16), torch.randn(4, 16), torch.zeros(1, dtype=torch.int32), max_seqlen_d=0
    )
    assert got.shape == (2, 0) and streamed == []


def test_stream_int8_corpus(streamed):
    rng = torch.Generator().manual_seed(2)
    d, cu = _corpus(rng, LENGTHS, 32)
    Q = torch.randn(2, 6, 32, generator=rng)
    d_q, d_scale = lik.quantize(d, torch.int8)
    q_q, q_scale = lik.quantize(Q, torch.int8)
    cfg = PackedStreamConfig(**SMALL, programs_per_sm=2, segments=2)
    with override(packed_stream=cfg):
        got = lik.maxsim_packed(q_q, d_q, cu, max_seqlen_d=max(LENGTHS), q_scale=q_scale, d_scale=d_scale)
    assert streamed == [1]
    with override(packed_stream=PackedStreamConfig(stream=False)):
        loop = lik.maxsim_packed(q_q, d_q, cu, max_seqlen_d=max(LENGTHS), q_scale=q_scale, d_scale=d_scale)
    expected = maxsim_packed_reference(q_q, d_q, cu, q_scale=q_scale, d_scale=d_scale)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, loop, rtol=1e-6, atol=1e-6)


def test_stream_fp8_corpus():
    # CPU float8 runs the reference through the public API (the interpreter flushes small float8 values), so the
    # launch is called directly, on values float8 holds exactly and the interpreter does not flush.
    rng = torch.Generator().manual_seed(3)
    cu = _cu(LENGTHS)
    grid = torch.tensor([-2.0, -1.0, -0.5, 0.5, 1.0, 1.5, 2.0])
    d = grid[torch.randint(0, 7, (int(cu[-1]), 32), generator=rng)].to(torch.float8_e4m3fn)
    q = grid[torch.randint(0, 7, (2, 6, 32), generator=rng)].to(torch.float8_e4m3fn)
    d_scale = torch.rand(d.shape[0], generator=rng) + 0.5
    q_scale = torch.rand(2, 6, generator=rng) + 0.5
    problem = packed_problem(q, d, cu, q_scale=q_scale, d_scale=d_scale)
    got = chunk_sums(packed_forward.launch_token_stream(problem, PackedStreamConfig(**SMALL, programs_per_sm=3)))
    # (non-negative scales: MaxSim of the dequantized rows, docs/design.md "8-bit corpora")
    expected = maxsim_packed_reference(
        q.double() * q_scale.double()[..., None], d.double() * d_scale.double()[:, None], cu
    )
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_choice_of_path(monkeypatch):
    cpu = torch.device("cpu")
    args = dict(q_len=32, n_queries=32, dim=128, dtype=torch.float16, device=cpu)
    monkeypatch.setattr(_device, "interpreting", lambda: False)
    monkeypatch.setattr(_device, "arch", lambda device: (9, 0))
    cfg = packed_stream_config(**args, n_rows=5_000_000, n_docs=50_000)
    assert cfg is not None and cfg.block_m == 256 and cfg.block_t == 64 and cfg.max_registers == 128
    one = packed_stream_config(**{**args, "n_queries": 1}, n_rows=5_000_000, n_docs=50_000)
    assert one is not None and one.block_m == 32 and one.block_t == 128
    int8_args = {**args, "dtype": torch.int8}
    assert packed_stream_config(**{**int8_args, "n_queries": 1}, n_rows=5_000_000, n_docs=50_000) is None  # the loop
    assert packed_stream_config(**int8_args, n_rows=5_000_000, n_docs=50_000) is not None  # 32 queries stream
    fp8_one = packed_stream_config(
        **{**args, "dtype": torch.float8_e4m3fn, "n_queries": 1}, n_rows=5_000_000, n_docs=50_000
    )
    assert fp8_one is not None and fp8_one.block_m == 64 and fp8_one.programs_per_sm == 3
    assert packed_stream_config(**args, n_rows=5_150_000, n_docs=5_000) is None  # ColPali pages: the document loop
    assert packed_stream_config(**args, n_rows=5_000 * 256, n_docs=5_000) is not None  # 4 tiles of 64, the limit
    assert packed_stream_config(**args, n_rows=5_000 * 257, n_docs=5_000) is None
    assert packed_stream_config(**args, n_rows=50_000 * 4096, n_docs=50_000) is None  # long documents
    assert packed_stream_config(**{**args, "dim": 512}, n_rows=5_000_000, n_docs=50_000) is None  # streamed k
    with override(packed_stream=PackedStreamConfig(stream=False)):
        assert packed_stream_config(**args, n_rows=5_000_000, n_docs=50_000) is None
    forced = PackedStreamConfig(block_t=32)
    with override(packed_stream=forced):
        assert packed_stream_config(**args, n_rows=50_000 * 4096, n_docs=50_000) is forced
    with override(maxsim_varlen=lik.config.MaxSimForwardConfig(group_rows=16, groups=1, block_n=16, block_k=32)):
        assert packed_stream_config(**args, n_rows=5_000_000, n_docs=50_000) is None  # the document loop's tiles
        with override(packed_stream=forced):
            assert packed_stream_config(**args, n_rows=5_000_000, n_docs=50_000) is forced
    with pytest.raises(TypeError, match="packed_stream"):
        with override(packed_stream=object()):
            pass


def test_training_keeps_the_document_loop(streamed):
    rng = torch.Generator().manual_seed(4)
    d, cu = _corpus(rng, [5, 9], 16)
    Q = torch.randn(1, 4, 16, generator=rng, requires_grad=True)
    with override(packed_stream=PackedStreamConfig(**SMALL)):
        lik.maxsim_packed(Q, d, cu, max_seqlen_d=9).sum().backward()
    assert streamed == [] and Q.grad is not None
