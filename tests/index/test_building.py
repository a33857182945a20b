"""Index builds in batches: documents one by one, lik.index.DocumentBatch es (padded with a mask or lengths,
packed with cu_seqlens) and any mix give the same shards, split where documents one at a time split them; bad
batches are refused by name; the progress bar counts documents per second."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest
import torch
from tqdm import tqdm

import lik
from lik.index import DocumentBatch, building

from .helpers import grid_docs
from .test_plaid import make_docs

LENGTHS = (5, 0, 3, 7, 1, 4, 0, 2, 6, 3)


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(99)


def same_shards(a: lik.Index, b: lik.Index) -> None:
    assert len(a.segments) == len(b.segments)
    for x, y in zip(a.segments, b.segments):
        assert torch.equal(x.cu_seqlens, y.cu_seqlens)
        assert x.tokens.dtype == y.tokens.dtype and torch.equal(x.tokens.view(torch.uint8), y.tokens.view(torch.uint8))
        assert (x.scale is None) == (y.scale is None)
        assert x.scale is None or torch.equal(x.scale, y.scale)


def as_batches(docs: list[torch.Tensor]) -> list:
    """docs[0:4] padded with a mask (with a gap: a real token after a masked one), docs[4:7] padded with lengths,
    docs[7:9] packed, docs[9] alone."""
    width = max(d.shape[0] for d in docs) + 1
    pad = torch.full((4, width, docs[0].shape[1]), float("nan"))
    mask = torch.zeros(4, width, dtype=torch.bool)
    for b, doc in enumerate(docs[:4]):
        real = [t for t in range(doc.shape[0] + 1) if t != 1][: doc.shape[0]]  # skip position 1
        pad[b, real], mask[b, real] = doc, True
    lengths = [d.shape[0] for d in docs[4:7]]
    pad2 = torch.full((3, width, docs[0].shape[1]), float("nan"))
    for b, doc in enumerate(docs[4:7]):
        pad2[b, : doc.shape[0]] = doc
    cu = [0, docs[7].shape[0], docs[7].shape[0] + docs[8].shape[0]]
    return [DocumentBatch.padded(pad, mask=mask), DocumentBatch.padded(pad2, lengths=torch.tensor(lengths)),
            DocumentBatch.packed(torch.cat(docs[7:9]), torch.tensor(cu)), docs[9]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("shard_tokens", [1, 6, 10_000])
def test_batches_build_the_shards_of_one_document_at_a_time(rng, monkeypatch, dtype, shard_tokens):
    docs = grid_docs(rng, LENGTHS)
    one_by_one = lik.Index.build(docs, dtype=dtype, shard_tokens=shard_tokens, progress=False)
    monkeypatch.setattr(building, "BATCH_TOKENS", 4)  # runs of single documents cut into several batches
    same_shards(lik.Index.build(iter(docs), dtype=dtype, shard_tokens=shard_tokens, progress=False), one_by_one)
    same_shards(lik.Index.build(as_batches(docs), dtype=dtype, shard_tokens=shard_tokens, progress=False),
                one_by_one)
    if shard_tokens == 6:  # the split: a shard closes after the document that fills it
        assert [s.num_docs for s in one_by_one.segments] == [3, 1, 4, 1, 1]
    Q = torch.randn(2, 3, 6, generator=rng)
    added = lik.Index.build(docs[:4], dtype=dtype, progress=False).add(as_batches(docs)[1:])
    got, want = added.search(Q, 10), one_by_one.search(Q, 10)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_every_document_of_a_batch_keeps_its_tokens_and_order(rng, tmp_path):
    docs = grid_docs(rng, LENGTHS)
    index = lik.Index.build(as_batches(docs), dtype=torch.float32, out=tmp_path / "ix", shard_tokens=5,
                            progress=False)
    assert len(index) == len(docs)
    assert [t.tolist() for t in index.get(range(len(docs)))] == [d.tolist() for d in docs]
    batch = DocumentBatch.padded(torch.ones(3, 4, 6))  # no mask, no lengths: every row is a document of L tokens
    assert batch.lengths == (4, 4, 4) and batch.tokens.shape == (12, 6) and len(batch) == 3


def test_bad_batches_are_refused_by_name(rng):
    docs = grid_docs(rng, LENGTHS)
    with pytest.raises(ValueError, match=r"docs\[1\].*DocumentBatch"):
        lik.Index.build([docs[0], torch.zeros(2, 3, 6)], progress=False)
    with pytest.raises(TypeError, match=r"docs\[0\]"):
        lik.Index.build([[1.0, 2.0]], progress=False)
    with pytest.raises(ValueError, match=r"docs\[1\] has d=4"):
        lik.Index.build([docs[0], DocumentBatch.packed(torch.zeros(3, 4), [0, 3])], progress=False)
    with pytest.raises(ValueError, match="mask or lengths"):
        DocumentBatch.padded(torch.zeros(2, 3, 6), mask=torch.ones(2, 3, dtype=torch.bool), lengths=[1, 2])
    with pytest.raises(TypeError, match="mask"):
        DocumentBatch.padded(torch.zeros(2, 3, 6), mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask"):
        DocumentBatch.padded(torch.zeros(2, 3, 6), mask=torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="lengths"):
        DocumentBatch.padded(torch.zeros(2, 3, 6), lengths=[1, 4])
    with pytest.raises(TypeError, match="lengths"):
        DocumentBatch.padded(torch.zeros(2, 3, 6), lengths=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="embeddings"):
        DocumentBatch.padded(torch.zeros(3, 6))
    with pytest.raises(TypeError, match="embeddings"):
        DocumentBatch.padded(torch.zeros(2, 3, 6, dtype=torch.int8))
    with pytest.raises(ValueError, match="cu_seqlens"):
        DocumentBatch.packed(torch.zeros(5, 6), [0, 2, 4])
    with pytest.raises(ValueError, match="cu_seqlens"):
        DocumentBatch.packed(torch.zeros(5, 6), [0, 3, 2, 5])
    index = lik.Index.build(docs[:2], progress=False)
    with pytest.raises(ValueError, match=r"docs\[1\]"):  # all or nothing: the good batch before is not added
        index.add([as_batches(docs)[0], torch.zeros(2, 5)])
    assert len(index) == 2


def test_progress_bar_counts_documents_per_second(rng, capsys):
    lik.Index.build(as_batches(grid_docs(rng, LENGTHS)), progress=True)
    err = capsys.readouterr().err
    assert "index documents" in err and "10doc" in err.replace(" ", "") and "doc/s" in err


def test_progress_bar_says_when_a_compressed_build_trains_its_codec(capsys):
    lik.Index.build(make_docs(3), codec="plaid", nbits=2, dtype=torch.float32, progress=True)  # 20 documents
    err = capsys.readouterr().err
    assert err.index("train codec") < err.rindex("index documents") and "20doc" in err.replace(" ", "")


def test_hidden_progress_constructs_no_tqdm(rng, tmp_path, capsys, monkeypatch):
    def no_tqdm(*args, **kwargs):
        raise AssertionError("a hidden progress bar constructed tqdm")

    monkeypatch.setattr(building, "tqdm", no_tqdm)
    docs = grid_docs(rng, LENGTHS)
    for progress in (False, None):  # None: bars on a terminal only, and pytest's stderr is no terminal
        index = lik.Index.build(docs, shard_tokens=9, progress=progress)
        index.save(tmp_path / f"ix-{progress}", progress=progress)
    assert capsys.readouterr().err == ""
    assert list(building.progress_bar([1, 2], progress=False)) == [1, 2]
    with pytest.raises(AssertionError, match="constructed tqdm"):
        building.progress_bar(progress=True, desc="shown")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks a child (POSIX only)")
def test_a_child_killed_holding_tqdms_lock_does_not_stall_a_quiet_save(rng, tmp_path, monkeypatch):
    """tqdm's class lock is shared with forked children: one killed while holding it (say, inside a bar's update)
    leaves it held for good, and a bar constructed afterwards in the parent would wait forever."""
    monkeypatch.setattr(tqdm, "_lock", multiprocessing.RLock())  # (this test's own lock, poisoned below)
    index = lik.Index.build(grid_docs(rng, LENGTHS), shard_tokens=9, progress=False)
    pid = os.fork()
    if pid == 0:
        tqdm.get_lock().acquire()
        os._exit(0)  # exits holding it, as a killed child would
    os.waitpid(pid, 0)
    saved = threading.Thread(target=index.save, args=(tmp_path / "ix",), kwargs={"progress": False}, daemon=True)
    saved.start()
    saved.join(timeout=60)
    assert not saved.is_alive(), "save(progress=False) waited on tqdm's lock"
    assert len(lik.Index.load(tmp_path / "ix")) == len(LENGTHS)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.float16])
def test_gpu_batches_quantize_on_the_device_as_lik_quantize(dtype, monkeypatch):
    monkeypatch.setattr(building, "BATCH_TOKENS", 4096)  # several batches: the pinned staging buffer is reused
    rng = torch.Generator().manual_seed(0)
    docs = [torch.randn(n, 128, generator=rng) for n in torch.randint(0, 200, (300,), generator=rng).tolist()]
    on_gpu = lik.Index.build([d.cuda() for d in docs], dtype=dtype, shard_tokens=5_000, placement="host",
                             progress=False)
    from_cpu = lik.Index.build(docs, dtype=dtype, shard_tokens=5_000, placement="host", device="cuda",
                               progress=False)
    same_shards(on_gpu, from_cpu)
    resident = lik.Index.build(docs, dtype=dtype, shard_tokens=5_000, placement="gpu", device="cuda", progress=False)
    assert resident.segments[0].tokens.is_cuda
    assert torch.equal(torch.cat([s.tokens for s in resident.segments]).cpu().view(torch.uint8),
                       torch.cat([s.tokens for s in on_gpu.segments]).view(torch.uint8))
    tokens = torch.cat([s.tokens for s in on_gpu.segments])
    if dtype == torch.float16:
        assert torch.equal(tokens, torch.cat(docs).half())
    else:
        want, scale = lik.quantize(torch.cat(docs).cuda(), dtype)
        assert torch.equal(tokens.view(torch.uint8), want.cpu().view(torch.uint8))
        assert torch.equal(torch.cat([s.scale for s in on_gpu.segments]), scale.cpu())
