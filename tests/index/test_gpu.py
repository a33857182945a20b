"""lik.Index on a CUDA device: the three placements agree with each other and with the CPU reference, and device
memory for "host" / "disk" does not grow with the corpus. Run on the device with ``pytest -m gpu``."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lik

pytestmark = pytest.mark.gpu


def random_docs(n_docs: int, dim: int = 128, seed: int = 0) -> list[torch.Tensor]:
    rng = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 300, (n_docs,), generator=rng).tolist()
    return [torch.nn.functional.normalize(torch.randn(n, dim, generator=rng), dim=-1) for n in lengths]


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8])
def test_placements_agree(tmp_path, dtype):
    docs = random_docs(500)
    lik.Index.build(docs, dtype=dtype, out=tmp_path / "ix", shard_tokens=20_000, progress=False)
    Q = torch.nn.functional.normalize(torch.randn(8, 32, 128), dim=-1)
    cpu = lik.Index.load(tmp_path / "ix", placement="host", device="cpu").search(Q, 10)
    results = {}
    for placement in ("gpu", "host", "disk"):
        index = lik.Index.load(tmp_path / "ix", placement=placement, device="cuda", chunk_tokens=7_000)
        results[placement] = index.search(Q.cuda(), 10)
        assert results[placement][1].device.type == "cuda"
    for placement, (scores, ids) in results.items():
        # Streaming changes where chunks live, never the arithmetic: placements agree bit for bit.
        assert torch.equal(ids, results["gpu"][1]), placement
        assert torch.equal(scores, results["gpu"][0]), placement
    torch.testing.assert_close(results["gpu"][0].cpu(), cpu[0], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("placement", ["host", "disk"])
def test_streamed_device_memory_is_flat_in_corpus_size(tmp_path, placement):
    Q = torch.nn.functional.normalize(torch.randn(4, 32, 128), dim=-1).half().cuda()
    peaks = []
    for n_docs in (400, 1600):
        path = tmp_path / f"ix{n_docs}"
        lik.Index.build(random_docs(n_docs, seed=n_docs), out=path, progress=False)
        index = lik.Index.load(path, placement=placement, device="cuda", chunk_tokens=16_384)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        index.search(Q, 10)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        del index
    assert peaks[1] <= peaks[0] * 1.1 + (1 << 20), peaks


def _nccl_rank(rank, world, port, path, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        index = lik.Index.load(path, shard=rank, num_shards=world, placement="host", device=f"cuda:{rank}")
        Q = torch.nn.functional.normalize(torch.randn(8, 32, 128, generator=torch.Generator().manual_seed(1)), dim=-1)
        scores, ids = index.search(Q.to(f"cuda:{rank}"), 10)
        torch.save((scores.cpu(), ids.cpu()), os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_ranks_match_one_gpu(tmp_path):
    lik.Index.build(random_docs(300), out=tmp_path / "ix", shard_tokens=10_000, progress=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_nccl_rank, args=(2, port, str(tmp_path / "ix"), str(tmp_path)), nprocs=2, join=True)
    Q = torch.nn.functional.normalize(torch.randn(8, 32, 128, generator=torch.Generator().manual_seed(1)), dim=-1)
    want = lik.Index.load(tmp_path / "ix", placement="gpu", device="cuda:0").search(Q.cuda(), 10)
    for rank in range(2):
        scores, ids = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(ids, want[1].cpu())
        torch.testing.assert_close(scores, want[0].cpu(), rtol=0, atol=0)


def test_resident_index_is_one_call_over_all_its_documents_unless_chunk_tokens_is_given(tmp_path):
    docs = random_docs(300, seed=3)
    lik.Index.build(docs, out=tmp_path / "ix", shard_tokens=20_000, progress=False)
    Q = torch.nn.functional.normalize(torch.randn(4, 32, 128), dim=-1).cuda()
    whole = lik.Index.load(tmp_path / "ix", placement="gpu", device="cuda")
    chunked = lik.Index.load(tmp_path / "ix", placement="gpu", device="cuda", chunk_tokens=3_000)
    scores, ids = whole.search(Q, 10)
    # The shards lie back to back in one device buffer: one packed call scores the whole corpus.
    assert len(whole.segments) > 1 and len(whole._chunk_source().plans) == 1
    assert len(chunked._chunk_source().plans) > len(chunked.segments)
    chunked_scores, chunked_ids = chunked.search(Q, 10)
    assert torch.equal(ids, chunked_ids) and torch.equal(scores, chunked_scores)
    built = lik.Index.build([d.cuda() for d in docs], shard_tokens=20_000, placement="gpu", progress=False)
    assert built.segments[0].tokens.is_cuda and len(built._chunk_source().plans) == 1
    assert torch.equal(built.search(Q, 10)[1], ids)
    whole.add(docs[:3])  # an added segment has a buffer of its own: a second call
    assert len(whole._chunk_source().plans) == 2


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8, torch.float8_e4m3fn])
def test_ragged_queries_on_the_gpu_equal_one_search_per_query(dtype):
    docs = random_docs(400, seed=5)
    index = lik.Index.build([d.cuda() for d in docs], dtype=dtype, placement="gpu", progress=False)
    rng = torch.Generator().manual_seed(6)
    qs = [torch.nn.functional.normalize(torch.randn(n, 128, generator=rng), dim=-1).cuda() for n in (32, 7, 0, 1, 300)]
    scores, ids = index.search(qs, 10)
    for number, q in enumerate(qs):
        if q.shape[0]:
            one = index.search(q, 10)
            torch.testing.assert_close(one[0], scores[number], rtol=1e-5, atol=1e-4)
            assert torch.equal(one[1], ids[number])


@pytest.mark.parametrize("placement", ["host", "disk"])
def test_back_to_back_streamed_searches_wait_for_each_other(tmp_path, placement):
    # Three chunks: a search's last chunk is scored from buffer 0, which the next search's first copy refills. Each
    # search waits for the last one's scoring of that buffer (and, staged, for its copy out of the pinned buffer):
    # unsynchronised searches equal synchronised ones.
    docs = random_docs(300)
    lik.Index.build(docs, out=tmp_path / "ix", progress=False)
    index = lik.Index.load(tmp_path / "ix", placement=placement, device="cuda", chunk_tokens=16_000)
    assert len(index._chunk_source().plans) % 2 == 1
    gen = torch.Generator().manual_seed(3)
    queries = [torch.nn.functional.normalize(torch.randn(n, 32, 128, generator=gen), dim=-1).cuda() for n in
               (256, 1, 256, 3, 256, 1)]  # fmt: skip
    want = []
    for Q in queries:
        want.append(index.search(Q, 10))
        torch.cuda.synchronize()
    got = [index.search(Q, 10) for Q in queries]  # no synchronisation in between
    for (ws, wi), (gs, gi) in zip(want, got):
        assert torch.equal(gi, wi) and torch.equal(gs, ws)


def test_one_query_search_host_path_is_two_merge_launches(monkeypatch):
    # The resident search's merge: block top-k and one row merge that decodes, no torch.topk, nothing read back.
    # The query is in the index's dtype (float16), as the reference below needs: maxsim_packed takes Q and d in one
    # dtype and raises a TypeError for a float32 Q against float16 tokens.
    from lik.retrieval import keys

    index = lik.Index.build(random_docs(3000), placement="gpu", progress=False)
    Q = torch.nn.functional.normalize(torch.randn(32, 128), dim=-1).to("cuda", index.dtype)
    index.search(Q, 10)
    torch.cuda.synchronize()
    launched, launch = [], keys.launch

    def recorded(kernel, *args, **kwargs):
        launched.append(kernel.fn.__name__)
        launch(kernel, *args, **kwargs)

    monkeypatch.setattr(keys, "launch", recorded)
    monkeypatch.setattr(torch.Tensor, "topk", lambda *a, **kw: pytest.fail("torch.topk in a resident search"))
    torch.cuda.set_sync_debug_mode("error")  # a read back (.item(), a device-to-host copy) raises in the search
    try:
        scores, ids = index.search(Q, 10)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        monkeypatch.undo()
    assert launched == ["block_top_keys_kernel", "row_top_keys_kernel"]
    exact = lik.maxsim_packed(Q, *_packed(index)).topk(10)
    assert torch.equal(ids.cpu(), exact.indices.cpu())
    torch.testing.assert_close(scores.cpu(), exact.values.cpu(), rtol=1e-5, atol=1e-4)


def _packed(index):
    from lik.index.placement import coalesce

    (whole,) = coalesce(index.segments)
    return whole.tokens, whole.cu_seqlens.to(device="cuda", dtype=torch.int32)
