"""The running top-k's int64 keys: their order is the search order (descending score, NaN last, ties and -0.0 to the
lower id), the kernel and the PyTorch arithmetic give the same keys, and scores and ids read back exactly."""

from __future__ import annotations

import pytest
import torch

from lik._device import interpreting
from lik.retrieval import keys as K

VALUES = torch.tensor([0.0, -0.0, 1.5, -1.5, float("inf"), float("-inf"), float("nan"), 2.0**-140, -(2.0**-140),
                       3.0e38, -3.0e38, 1.0, 1.0 + 2.0**-23])


def _scores(rng, rows=3, n=700):
    return VALUES[torch.randint(0, VALUES.numel(), (rows, n), generator=rng)]


def _search_order(scores, ids):
    """Python's sort of each row by (NaN, -score, id): the order a search returns."""
    order = []
    for row in scores.tolist():
        order.append(sorted(range(len(row)), key=lambda j: (row[j] != row[j], 0 if row[j] != row[j] else -row[j],
                                                            ids[j])))
    return order


@pytest.mark.parametrize("with_ids", [False, True])
def test_keys_sort_as_the_search_order_and_read_back(rng, with_ids, monkeypatch):
    scores = _scores(rng)
    ids = torch.randperm(5000, generator=rng)[: scores.shape[1]] if with_ids else None
    keys = K.candidate_keys(scores, 11, ids)  # through the kernel (the interpreter on the CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the PyTorch arithmetic
    assert torch.equal(keys, K.candidate_keys(scores, 11, ids))
    absolute = 11 + (torch.arange(scores.shape[1]) if ids is None else ids)
    order = keys.argsort(dim=1, descending=True)
    assert order.tolist() == _search_order(scores, absolute.tolist())
    got_scores, got_ids = K.decode_keys(K.top_keys(keys, 40))
    want = torch.tensor(_search_order(scores, absolute.tolist()))[:, :40]
    assert torch.equal(got_ids, absolute[want])
    expected = scores.gather(1, want)
    torch.testing.assert_close(got_scores, expected, rtol=0, atol=0, equal_nan=True)
    assert not got_scores[expected == 0].signbit().any()  # a zero reads back as 0.0


def test_decode_kernel_equals_the_pytorch_arithmetic(rng, monkeypatch):
    if not interpreting() and not torch.cuda.is_available():
        pytest.skip("the kernel needs Triton's interpreter or a CUDA device")
    device = "cpu" if interpreting() else "cuda"
    keys = K.candidate_keys(_scores(rng, 3, 300), 7).to(device)[:, ::2]  # strided: decoded as a contiguous copy
    monkeypatch.setattr(K, "uses_kernels", lambda x: True)  # the kernel (the interpreter on the CPU)
    got = K.decode_keys(keys)
    assert K.decode_keys(keys[:0])[0].shape == (0, 150)
    monkeypatch.setattr(K, "uses_kernels", lambda x: False)
    want = K.decode_keys(keys)
    assert torch.equal(got[1].cpu(), want[1].cpu()) and got[0].dtype == torch.float32
    # bit for bit, NaN and zeros included
    assert torch.equal(got[0].cpu().view(torch.int32), want[0].cpu().view(torch.int32))


def test_keys_of_strided_scores_and_empty_rows(rng):
    scores = _scores(rng, 2, 30)
    wide = torch.zeros(2, 60)
    wide[:, ::2] = scores
    assert torch.equal(K.candidate_keys(wide[:, ::2], 0), K.candidate_keys(scores, 0))
    assert K.candidate_keys(torch.zeros(0, 5), 0).shape == (0, 5)
    assert K.candidate_keys(torch.zeros(3, 0), 0).shape == (3, 0)


@pytest.mark.gpu
def test_gpu_kernel_keys_equal_the_pytorch_arithmetic(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    scores = torch.cat([_scores(generator, 4, 5000), torch.randn(4, 3000, generator=generator)], dim=1).cuda()
    ids = torch.randperm(20_000, generator=generator)[:8000].cuda()
    for positions in (None, ids):
        got = K.candidate_keys(scores, 2**31 + 5, positions)
        from lik import _dispatch

        monkeypatch.setattr(K, "uses_kernels", lambda x: False)
        want = K.candidate_keys(scores, 2**31 + 5, positions)
        monkeypatch.setattr(K, "uses_kernels", _dispatch.uses_kernels)
        assert torch.equal(got, want)
