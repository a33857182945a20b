"""The host path of ``Index.search`` over a resident index: what runs between the call and its one scoring launch and
after it. A search of one query is host bound (BENCHMARKS.md, "lik.Index search"), so the ops are pinned: no
``torch.topk`` of the chunk's keys, no host synchronisation (``.item()`` / ``.tolist()`` / a device copy), no
tensor the search does not use, and the merge is two launches whose last one also decodes the scores and ids.

The scoring call is stubbed (its replay is tests/test_replay.py's) and the merge's launches are recorded, not run,
so the dispatch mode sees only the search's own ops; the CPU resident path is the GPU one without the device."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lik
import lik.index.search as search_module
from lik._device import interpreting
from lik.retrieval import keys as K

pytestmark = pytest.mark.skipif(not interpreting(), reason="the merge's kernels run under TRITON_INTERPRET=1")

# Every op a search of a dense query over one resident chunk may run, whichever caller (index.py) it is under:
# the query's batch view, the merge's buffers, the result's row views, and the id conversion of a search that may
# return padded ids (candidate generation), which an exact search can skip.
ALLOWED = {
    "aten.unsqueeze.default", "aten.empty.memory_format", "aten.select.int", "aten.ge.Scalar", "aten.clamp.default",
    "aten.scalar_tensor.default", "aten.where.self",
}  # fmt: skip
SYNCS = {"aten._local_scalar_dense.default", "aten._to_copy.default", "aten.copy_.default", "aten.topk.default"}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def stubbed(monkeypatch):
    """Index.search with the scoring call returning fixed scores and the merge's launches recorded."""
    launches, fixed = [], {}

    def score(query, tokens, cu, scale):
        key = (query.q.shape[0], cu.numel() - 1)
        if key not in fixed:
            fixed[key] = torch.randn(*key, generator=torch.Generator().manual_seed(key[1]))
        return fixed[key]

    monkeypatch.setattr(search_module, "score_packed", score)
    monkeypatch.setattr(K, "launch", lambda kernel, grid, *args, **kwargs: launches.append(kernel.fn.__name__))
    return launches


def _index(dtype=torch.float16, n_docs=3000):
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 9, (n_docs,), generator=gen).tolist()
    return lik.Index.build([torch.randn(n, 16, generator=gen) for n in lengths], dtype=dtype, progress=False,
                           device="cpu")  # fmt: skip


@pytest.mark.parametrize("shape", [(4, 16), (3, 4, 16)])
def test_one_resident_chunk(stubbed, shape):
    index = _index()
    Q = torch.randn(*shape).half()
    index.search(Q, 10)  # first call: the source and the live selection are built and cached
    stubbed.clear()
    with _Ops() as mode:
        scores, ids = index.search(Q, 10)
    assert stubbed == ["block_top_keys_kernel", "row_top_keys_kernel"]  # keys cut per block, merged and decoded
    assert not SYNCS & set(mode.ops), mode.ops
    assert set(mode.ops) <= ALLOWED, sorted(set(mode.ops) - ALLOWED)
    assert mode.ops.count("aten.empty.memory_format") == 3  # the blocks' keys, the scores, the ids
    assert len(mode.ops) <= 6, mode.ops
    assert scores.shape == shape[:-2] + (10,) and ids.dtype == torch.int64


def test_the_query_is_not_copied_when_it_is_in_the_index_dtype(stubbed):
    index = _index()
    Q = torch.randn(2, 4, 16).half()
    queries, squeeze, n, where = search_module.check_queries(Q, None, None, 16, torch.float16)
    assert queries[0].q.data_ptr() == Q.data_ptr() and not squeeze and n == 2
    queries, *_ = search_module.check_queries(Q.float(), None, None, 16, torch.float16)
    assert queries[0].q.dtype == torch.float16  # a float32 query is cast once, at the edge
    assert index.search(Q.float(), 3)[1].shape == (2, 3)


def test_resident_chunks_are_made_once():
    index = _index(n_docs=50)
    source = index._chunk_source()
    first = list(source.chunks(range(len(source.plans))))
    again = list(source.chunks(range(len(source.plans))))
    assert all(a is b for a, b in zip(first, again)) and len(first) == len(source.plans)


def test_several_chunks_merge_then_decode_once(stubbed):
    # Chunks of at most 100 tokens: every chunk is merged into the best so far, decoded once at the end.
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randn(n, 16, generator=gen) for n in torch.randint(1, 9, (300,), generator=gen).tolist()]
    index = lik.Index.build(docs, progress=False, device="cpu", chunk_tokens=100)
    Q = torch.randn(4, 16).half()
    index.search(Q, 5)
    stubbed.clear()
    index.search(Q, 5)
    chunks = len(index._chunk_source().plans)
    assert chunks > 2 and stubbed.count("decode_keys_kernel") == 1
    assert stubbed.count("row_top_keys_kernel") == chunks and "candidate_keys_kernel" not in stubbed


def test_search_results_unchanged_by_the_fused_merge(monkeypatch):
    # The real kernels (interpreted; blocks of 64 candidates, so several a row): the exact top-k.
    monkeypatch.setattr(K, "_BLOCK", 64)
    index = _index(n_docs=300)
    Q = torch.randn(2, 4, 16).half()
    scores, ids = index.search(Q, 7)
    tokens = [t.float() for t in index.get(range(300))]
    exact = torch.stack([torch.stack([(q.float() @ t.T).amax(1).sum() for t in tokens]) for q in Q])
    want_scores, want_ids = exact.topk(7, dim=1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(scores, want_scores, rtol=1e-3, atol=1e-3)
