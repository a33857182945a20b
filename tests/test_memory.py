"""``lik._memory.zeros``: the same tensor as ``torch.zeros`` whatever path clears it (the driver's memset on the
current CUDA stream, or ``zero_``), and ``zero_`` wherever the driver path is not certain to be right."""

from __future__ import annotations

import pytest
import torch

from lik import _memory
from lik._memory import driver_memset_available, zeros

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int32, torch.int64,
          torch.bool, torch.float8_e4m3fn]
SHAPES = [(0,), (1,), (7,), (3, 5), (2, 0, 4), (4, 3, 2, 5), ()]


def _expect_zeros(t: torch.Tensor, shape, dtype, device) -> None:
    assert t.shape == torch.Size(shape) and t.dtype == dtype and t.device.type == torch.device(device).type
    assert t.is_contiguous()
    assert not t.reshape(-1).view(torch.uint8).any()  # every byte zero, for every dtype


def _dirty_block(shape, dtype, device="cuda") -> None:
    """Leave a freed block of garbage in the allocator, the block the next allocation of this size reuses."""
    garbage = torch.empty(shape, dtype=dtype, device=device)
    garbage.reshape(-1).view(torch.uint8).fill_(0xFF)
    del garbage


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_cpu_zeros_equal_torch_zeros(shape, dtype):
    _dirty_block(shape, dtype, "cpu")
    _expect_zeros(zeros(shape, dtype, torch.device("cpu")), shape, dtype, "cpu")


def test_cpu_takes_zero_and_never_the_driver(monkeypatch):
    called = []
    monkeypatch.setattr(_memory, "_MEMSET", (lambda *a: called.append(a) or 0, lambda *a: called.append(a) or 0))
    out = zeros((5, 3), torch.float32, torch.device("cpu"))
    assert not out.any() and called == []


# --- GPU ---------------------------------------------------------------------------------------------------------


class _CountingMemset:
    """Wraps the loaded driver functions, counting calls, so a test can tell the driver path ran."""

    def __init__(self, monkeypatch):
        assert driver_memset_available(), "the GPU machine must reach the driver's memset"
        words, bytes_ = _memory._MEMSET
        self.calls = {"d32": 0, "d8": 0}

        def counted(name, fn):
            def call(*args):
                self.calls[name] += 1
                return fn(*args)
            return call

        monkeypatch.setattr(_memory, "_MEMSET", (counted("d32", words), counted("d8", bytes_)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (4, 22223, 8, 32), (1025, 3)])
def test_gpu_zeros_clear_reused_garbage_through_the_driver(shape, dtype, monkeypatch):
    memset = _CountingMemset(monkeypatch)
    _dirty_block(shape, dtype)
    out = zeros(shape, dtype, torch.device("cuda"))
    torch.cuda.synchronize()
    _expect_zeros(out, shape, dtype, "cuda")
    nbytes = out.numel() * out.element_size()
    assert memset.calls == ({"d32": 1, "d8": 0} if nbytes % 4 == 0 else {"d32": 0, "d8": 1})


@pytest.mark.gpu
def test_gpu_zero_size_launches_nothing(monkeypatch):
    memset = _CountingMemset(monkeypatch)
    out = zeros((3, 0), torch.float32, torch.device("cuda"))
    assert out.shape == (3, 0) and memset.calls == {"d32": 0, "d8": 0}


@pytest.mark.gpu
def test_gpu_memset_is_ordered_on_the_current_stream(monkeypatch):
    # A side stream busy with a long kernel that writes garbage into the block, then zeros on that stream: the
    # memset must land after the garbage, and the consumer on the same stream must see zeros.
    memset = _CountingMemset(monkeypatch)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(4):
            big = big @ big / 64  # keeps the stream busy for a while
        out = zeros((1 << 20,), torch.float32, torch.device("cuda"))
        total = out.sum()
    torch.cuda.synchronize()
    assert total.item() == 0.0 and memset.calls["d32"] == 1


@pytest.mark.gpu
def test_gpu_zeros_inside_a_cuda_graph(monkeypatch):
    memset = _CountingMemset(monkeypatch)
    src = torch.randn(1000, device="cuda")
    static_out = torch.empty(1000, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            buffer = zeros((1000,), torch.float32, torch.device("cuda"))
            buffer.index_add_(0, torch.arange(1000, device="cuda") % 10, src)  # an accumulation into the zeros
            static_out.copy_(buffer)
    assert memset.calls["d32"] == 1
    buffer.fill_(float("nan"))  # the replay must clear the garbage again
    graph.replay()
    torch.cuda.synchronize()
    expected = torch.zeros(1000, device="cuda").index_add_(0, torch.arange(1000, device="cuda") % 10, src)
    assert torch.equal(static_out, expected)


@pytest.mark.gpu
def test_gpu_falls_back_when_the_driver_refuses(monkeypatch):
    refused = {"n": 0}

    def refuse(*args):
        refused["n"] += 1
        return 201  # CUDA_ERROR_INVALID_CONTEXT

    monkeypatch.setattr(_memory, "_MEMSET", (refuse, refuse))
    for shape in [(1024,), (7,)]:
        _dirty_block(shape, torch.int8)
        out = zeros(shape, torch.int8, torch.device("cuda"))
        _expect_zeros(out, shape, torch.int8, "cuda")
    assert refused["n"] == 2


@pytest.mark.gpu
def test_gpu_another_device_than_the_current_one_takes_zero(monkeypatch):
    memset = _CountingMemset(monkeypatch)
    current = torch.cuda.current_device()
    monkeypatch.setattr(_memory, "_current_device", lambda: current + 1)  # as if another device were current
    _dirty_block((64,), torch.float32)
    out = zeros((64,), torch.float32, torch.device("cuda", current))
    _expect_zeros(out, (64,), torch.float32, "cuda")
    assert memset.calls == {"d32": 0, "d8": 0}


@pytest.mark.gpu
def test_gpu_zeros_from_another_thread():
    # The autograd engine runs CUDA backward nodes on its own thread: the driver path must work (or fall back) there.
    import threading

    results = []

    def work():
        _dirty_block((4096,), torch.float32)
        out = zeros((4096,), torch.float32, torch.device("cuda"))
        results.append(out.sum().item())

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert results == [0.0]
