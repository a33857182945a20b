"""The token stream on the GPU (`pytest -m gpu`): compiled for real with the heuristic's tiles, on realistic
shapes, against the document loop (forced) and, on a subsample, against the float64 reference.

The two paths fold the same products in the same row groups, so fp16 and int8 scores agree to fp32 rounding of
the sum over query rows; float8 to its tensor cores' partial sums (FP8_RTOL). Each test also asserts the
path it meant to time ran (the stream's launch counted).
"""

from __future__ import annotations

import pytest
import torch

import lik
from lik.config import override
from lik.config.packed import PackedStreamConfig, packed_stream_tiles
from lik.ops.maxsim import packed_forward

pytestmark = pytest.mark.gpu

CUDA = "cuda"
FP8_RTOL = 1e-3


def _dtypes():
    fp8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    return [torch.float16, torch.bfloat16, torch.int8] + ([torch.float8_e4m3fn] if fp8 else [])


@pytest.fixture
def streamed(monkeypatch):
    calls = []
    launch = packed_forward.launch_token_stream

    def counting(*args, **kwargs):
        calls.append(1)
        return launch(*args, **kwargs)

    monkeypatch.setattr(packed_forward, "launch_token_stream", counting)
    return calls


def _corpus(lengths, dim, dtype, seed=0):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    rows = torch.nn.functional.normalize(torch.randn(int(cu[-1]), dim, device=CUDA, generator=gen), dim=-1)
    if dtype in (torch.int8, torch.float8_e4m3fn):
        d, d_scale = lik.quantize(rows, dtype)
    else:
        d, d_scale = rows.to(dtype), None
    return d, d_scale, cu.to(CUDA)


def _queries(n_q, l_q, dim, dtype, seed=1):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    Q = torch.nn.functional.normalize(torch.randn(n_q, l_q, dim, device=CUDA, generator=gen), dim=-1)
    if dtype in (torch.int8, torch.float8_e4m3fn):
        return lik.quantize(Q, dtype)
    return Q.to(dtype), None


def _both(q, d, cu, longest, q_scale, d_scale, q_mask=None):
    cfg = packed_stream_tiles(q_len=q.shape[1], n_queries=q.shape[0], dim=q.shape[2], dtype=d.dtype, device=q.device)
    with override(packed_stream=cfg):
        stream = lik.maxsim_packed(q, d, cu, q_mask, max_seqlen_d=longest, q_scale=q_scale, d_scale=d_scale)
    with override(packed_stream=PackedStreamConfig(stream=False)):
        loop = lik.maxsim_packed(q, d, cu, q_mask, max_seqlen_d=longest, q_scale=q_scale, d_scale=d_scale)
    return stream, loop


def _agree(stream, loop, dtype):
    scale = loop.abs().max().clamp_min(1.0).item()
    error = (stream - loop).abs().max().item() / scale
    print(f"{dtype}: max relative difference stream vs loop {error:.2e}")
    assert error <= (FP8_RTOL if dtype == torch.float8_e4m3fn else 1e-5)


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
@pytest.mark.parametrize("n_q", [1, 32, 256])
def test_short_documents(streamed, dtype, n_q):
    gen = torch.Generator().manual_seed(n_q)
    lengths = torch.randint(60, 141, (20_000,), generator=gen).tolist()
    lengths[::997] = [0] * len(lengths[::997])  # empty documents here and there
    d, d_scale, cu = _corpus(lengths, 128, dtype)
    q, q_scale = _queries(n_q, 32, 128, dtype)
    stream, loop = _both(q, d, cu, max(lengths), q_scale, d_scale)
    assert streamed == [1]
    assert (stream[:, [i for i, n in enumerate(lengths) if n == 0]] == 0).all()
    _agree(stream, loop, dtype)


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
@pytest.mark.parametrize("n_q", [1, 32])
def test_colpali_pages(streamed, dtype, n_q):
    lengths = [1030] * 500
    d, d_scale, cu = _corpus(lengths, 128, dtype)
    q, q_scale = _queries(n_q, 32, 128, dtype)
    stream, loop = _both(q, d, cu, 1030, q_scale, d_scale)
    assert streamed == [1]
    _agree(stream, loop, dtype)


@pytest.mark.parametrize("dim", [64, 96, 200])
def test_widths_masks_and_reference(streamed, dim):
    gen = torch.Generator().manual_seed(dim)
    lengths = [0, 3, 1] + torch.randint(1, 300, (400,), generator=gen).tolist() + [0, 0]
    d, _, cu = _corpus(lengths, dim, torch.float16)
    q, _ = _queries(5, 20, dim, torch.float16)
    q_mask = torch.rand(5, 20, device=CUDA) > 0.3
    q_mask[2] = False
    stream, loop = _both(q, d, cu, max(lengths), None, None, q_mask)
    assert streamed == [1]
    _agree(stream, loop, torch.float16)
    expected = lik.maxsim_packed_reference(q.double().cpu(), d.double().cpu(), cu.cpu(), q_mask.cpu())
    torch.testing.assert_close(stream.double().cpu(), expected, rtol=2e-3, atol=2e-3)


def test_default_choice_takes_the_stream(streamed):
    lengths = [100] * 5000
    d, _, cu = _corpus(lengths, 128, torch.float16)
    q, _ = _queries(32, 32, 128, torch.float16)
    lik.maxsim_packed(q, d, cu, max_seqlen_d=100)
    assert streamed == [1]


def test_past_two_to_the_31_elements(streamed):
    # 64-bit offsets: a corpus of more than 2**31 fp16 elements (about 4.3 GB), documents near its end.
    rows = (2**31) // 128 + 4096
    d = torch.zeros(rows, 128, dtype=torch.float16, device=CUDA)
    d[-300:] = torch.randn(300, 128, device=CUDA).to(torch.float16)
    lengths = [rows - 300, 100, 0, 200]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=CUDA)
    q, _ = _queries(2, 32, 128, torch.float16)
    stream, loop = _both(q, d, cu, max(lengths), None, None)
    assert streamed == [1]
    _agree(stream, loop, torch.float16)
    expected = lik.maxsim_packed_reference(
        q.double().cpu(), d[-300:].double().cpu(), torch.tensor([0, 100, 100, 300], dtype=torch.int32)
    )
    torch.testing.assert_close(stream[:, 1:].double().cpu(), expected, rtol=2e-3, atol=2e-3)
