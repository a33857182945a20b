"""The double-buffered streamed source, driven on CPU with stand-ins for CUDA streams, events and pinned memory:
every chunk arrives with its own tokens and offsets, buffer slots alternate, a slot is refilled only after the
chunk that last used it was handed back, and the search result equals the resident source's."""

from __future__ import annotations

import pytest
import torch

import lik
from lik.index import placement as placement_module
from lik.index.placement import ResidentSource, StreamedSource, plan_chunks
from lik.index.search import search_chunks, select_chunks

from .helpers import grid_docs, grid_queries, install_fake_cuda


@pytest.fixture
def fake_cuda(monkeypatch):
    install_fake_cuda(monkeypatch)
    return placement_module


@pytest.mark.parametrize("source", ["memory", "memory-staged", "file", "file-rank"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_streamed_chunks_equal_resident_chunks(fake_cuda, monkeypatch, tmp_path, source, dtype):
    """``memory``: host segments copied to the device buffers; ``memory-staged``: through the staging buffers;
    ``file``: a saved index's memory-mapped shards, read from the files into the staging buffers (the "disk"
    placement); ``file-rank``: the same for the second of two ranks (its segments start inside shards)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the reference scores: this test is about the plumbing
    rng = torch.Generator().manual_seed(9)
    docs = grid_docs(rng)
    index = lik.Index.build(docs, dtype=dtype, shard_tokens=9, progress=False, device="cpu")
    staged = source != "memory"
    if source.startswith("file"):
        index.save(tmp_path / "ix")
        rank = dict(shard=1, num_shards=2) if source == "file-rank" else {}
        whole = lik.Index.load(tmp_path / "ix", placement="disk", device="cpu")
        index = lik.Index.load(tmp_path / "ix", placement="disk", device="cpu", **rank)
        assert all(segment.region is not None for segment in index.segments)
        if source == "file-rank":  # the rank's first segment starts inside a shard: its region skips rows
            first = index.segments[0].region
            same_file = next(s.region for s in whole.segments if s.region.path == first.path)
            assert first.tokens_offset > same_file.tokens_offset
    first_ids = [0]
    for segment in index.segments[:-1]:
        first_ids.append(first_ids[-1] + segment.num_docs)
    plans = plan_chunks(index.segments, first_ids, chunk_tokens=4)
    resident = ResidentSource(index.segments, plans, "cpu")
    streamed = StreamedSource(index.segments, plans, "cpu", staged=staged)
    numbers = list(range(len(plans)))
    chunks = 0
    for position, (want, got) in enumerate(zip(resident.chunks(numbers), streamed.chunks(numbers))):
        # Checked when handed out, after the next chunk's copy was issued: that copy went to the other slot.
        assert torch.equal(got.tokens.view(torch.uint8), want.tokens.view(torch.uint8))
        assert torch.equal(got.cu_seqlens, want.cu_seqlens)
        assert (got.first_id, got.num_docs, got.max_seqlen) == (want.first_id, want.num_docs, want.max_seqlen)
        if want.scale is not None:
            assert torch.equal(got.scale, want.scale)
        if got.tokens.numel():
            assert got.tokens.data_ptr() == streamed.buffers[position % 2].data_ptr()
        chunks += 1
    assert chunks == len(plans) > (1 if source == "file-rank" else 2)

    Q = grid_queries(rng)
    for doc_ids in (None, torch.tensor([0, 3, 4, 9])):
        selection = select_chunks(plans, doc_ids)
        k = 4
        got = search_chunks(Q, None, streamed, selection, k)
        want = search_chunks(Q, None, resident, selection, k)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
