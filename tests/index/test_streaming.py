"""The double-buffered streamed source, driven on CPU with stand-ins for CUDA streams, events and pinned memory:
every chunk arrives with its own tokens and offsets, buffer slots alternate, a slot is refilled only after the
chunk that last used it was handed back, and the search result equals the resident source's."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import lik
from lik.index import placement as placement_module
from lik.index.placement import ResidentSource, StreamedSource, plan_chunks, read_into
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
    monkeypatch.setattr(placement_module, "READ_PIECE_BYTES", 16)  # chunks of a file read by several threads
    monkeypatch.setattr(placement_module, "READ_THREADS", 3)
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


class _CountingPool(ThreadPoolExecutor):
    def __init__(self, workers):
        super().__init__(workers)
        self.submitted = 0

    def submit(self, *args, **kwargs):
        self.submitted += 1
        return super().submit(*args, **kwargs)


@pytest.mark.parametrize("size, max_pieces, pieces", [(101, 4, 4), (101, 3, 3), (20, 4, 2), (13, 4, 0), (0, 4, 0)])
def test_read_into_splits_a_read_among_threads(tmp_path, size, max_pieces, pieces):
    data = bytes(range(256)) * 2
    path = tmp_path / "shard"
    path.write_bytes(data)
    out = torch.full((size,), 7, dtype=torch.uint8)
    with open(path, "rb", buffering=0) as file, _CountingPool(4) as pool:
        read_into(file, 37, out, pool, max_pieces=max_pieces, piece_bytes=10)
        assert pool.submitted == pieces  # 0: one read on the calling thread (under two pieces' worth)
    assert out.tolist() == list(data[37 : 37 + size])
    fp32 = torch.empty(3, 5)  # any dtype: its bytes are filled
    with open(path, "rb", buffering=0) as file, ThreadPoolExecutor(2) as pool:
        read_into(file, 1, fp32[1:], pool, piece_bytes=8)
    assert fp32[1:].flatten().view(torch.uint8).tolist() == list(data[1:41])


def test_read_into_past_the_end_of_the_file_names_it(tmp_path):
    path = tmp_path / "shard-00000.safetensors"
    path.write_bytes(bytes(100))
    with open(path, "rb", buffering=0) as file, ThreadPoolExecutor(3) as pool:
        with pytest.raises(ValueError, match=r"shard-00000\.safetensors: file ended before byte 130"):
            read_into(file, 70, torch.empty(60, dtype=torch.uint8), pool, max_pieces=2, piece_bytes=10)  # [100, 130)
        with pytest.raises(ValueError, match="file ended before byte 101"):
            read_into(file, 0, torch.empty(101, dtype=torch.uint8))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks a child (POSIX only)")
def test_a_forked_child_reads_with_threads_of_its_own(tmp_path):
    data = bytes(range(256)) * 4
    path = tmp_path / "shard"
    path.write_bytes(data)
    out = torch.empty(1000, dtype=torch.uint8)
    with open(path, "rb", buffering=0) as file:
        read_into(file, 3, out, placement_module.read_pool(), max_pieces=4, piece_bytes=100)  # the parent's threads
        pid = os.fork()
        if pid == 0:  # the inherited pool has no threads: work sent to it would never run
            signal.alarm(30)
            try:
                child_out = torch.empty(1000, dtype=torch.uint8)
                read_into(file, 3, child_out, placement_module.read_pool(), max_pieces=4, piece_bytes=100)
                os._exit(0 if child_out.tolist() == list(data[3:1003]) else 1)
            finally:
                os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert out.tolist() == list(data[3:1003])
