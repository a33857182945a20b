"""Removed documents of a lik.Index: ``remove`` (tombstones that search never returns, kept by ``save``),
``compact`` (the shards lose them, every id stays), ``get``, the version-3 manifest fields and their checks, and
search with removed documents on every placement, with filters, through the streamed source and across ranks.
Crashes during these writes: ``test_durability.py``."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lik
from lik.index.documents import live_selection
from lik.index.placement import ResidentSource, StreamedSource, plan_chunks
from lik.index.search import search_chunks

from .helpers import grid_docs, grid_queries, install_fake_cuda, padded, read_json
from .test_distributed import free_port

REMOVED = [0, 3, 4, 9]  # the first and last documents, and a run inside


@pytest.fixture
def docs():
    return grid_docs(torch.Generator().manual_seed(31))


@pytest.fixture
def reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the ids are under test here, not the kernels


def expected(Q, docs, ids, k, dtype=torch.float32):
    """Top-``k`` over the documents ``ids`` only, by :func:`lik.search` on their padded form, as ids."""
    D, d_mask = padded([docs[i] for i in ids])
    scores, positions = lik.search(Q.to(dtype), D.to(dtype), k, None, d_mask)
    return scores, torch.tensor(ids, dtype=torch.int64)[positions]


def assert_same(got, want):
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)


def live(num_ids, removed):
    return [i for i in range(num_ids) if i not in set(removed)]


@pytest.mark.parametrize("placement", ["host", "disk"])
@pytest.mark.parametrize("chunk_tokens", [1, 4, 1000])
def test_removed_documents_are_never_returned(tmp_path, docs, reference, placement, chunk_tokens):
    lik.Index.build(docs, dtype=torch.float32, out=tmp_path / "ix", shard_tokens=9, progress=False)
    index = lik.Index.load(tmp_path / "ix", placement=placement, chunk_tokens=chunk_tokens)
    Q = grid_queries(torch.Generator().manual_seed(4))
    index.search(Q, 5)  # a search before the removal must not leave its chunk selection behind
    index.remove(REMOVED)
    alive = live(len(docs), REMOVED)
    assert len(index) == len(alive) and index.num_ids == len(docs)
    for k in (1, 4, len(alive)):  # k = every live document: all of them, none removed
        assert_same(index.search(Q, k), expected(Q, docs, alive, k))
    subset = [9, 8, 3, 2, 1, 0]
    kept = [i for i in alive if i in subset]
    assert_same(index.search(Q, len(kept), doc_ids=subset), expected(Q, docs, kept, len(kept)))
    assert_same(index.search(Q[1], 2), tuple(t[1] for t in expected(Q, docs, alive, 2)))
    with pytest.raises(ValueError, match=rf"k must be in \[0, {len(alive)}\]"):
        index.search(Q, len(alive) + 1)
    with pytest.raises(ValueError, match=r"k must be in \[0, 3\] \(3 distinct live doc_ids\)"):
        index.search(Q, 4, doc_ids=subset)
    assert index.search(Q, 0, doc_ids=REMOVED)[1].shape == (3, 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8])
def test_kernels_skip_removed_documents(docs, dtype):
    """The interpreted kernels (where TRITON_INTERPRET=1) score the chunks; removal only selects among them."""
    index = lik.Index.build(docs, dtype=dtype, chunk_tokens=6, progress=False)
    Q = grid_queries(torch.Generator().manual_seed(5))
    want = lik.Index.build(docs, dtype=dtype, chunk_tokens=6, progress=False).search(Q, len(docs))
    index.remove(REMOVED)
    scores, ids = index.search(Q, len(docs) - len(REMOVED))
    keep = ~torch.isin(want[1], torch.tensor(REMOVED))
    assert torch.equal(ids, want[1][keep].view(3, -1)) and torch.equal(scores, want[0][keep].view(3, -1))


def test_remove_save_load_compact_keep_every_id(tmp_path, docs, reference):
    Q = grid_queries(torch.Generator().manual_seed(6))
    index = lik.Index.build(docs, dtype=torch.float32, shard_tokens=9, progress=False)
    index.save(tmp_path / "plain")
    assert read_json(tmp_path / "plain" / "manifest.json")["version"] == 2  # nothing removed: readable by older lik
    index.remove(REMOVED).remove([3, 0])  # removing again changes nothing
    index.save(tmp_path / "ix")
    manifest = read_json(tmp_path / "ix" / "manifest.json")
    assert manifest["version"] == 3 and manifest["removed"] == [[0, 1], [3, 5], [9, 10]]
    assert manifest["compacted"] == [] and manifest["num_ids"] == manifest["num_docs"] == len(docs)
    alive = live(len(docs), REMOVED)
    assert index.live_ids().tolist() == alive
    for placement in ("host", "disk"):
        loaded = lik.Index.load(tmp_path / "ix", placement=placement)
        assert len(loaded) == len(alive) and loaded.num_ids == len(docs) and loaded.live_ids().tolist() == alive
        assert_same(loaded.search(Q, 5), expected(Q, docs, alive, 5))
    before = [s.num_docs for s in loaded.segments]
    loaded.compact()
    assert sum(s.num_docs for s in loaded.segments) == len(alive) < sum(before)
    assert_same(loaded.search(Q, 5), expected(Q, docs, alive, 5))  # the same ids after compaction
    loaded.save(tmp_path / "ix", overwrite=True)
    manifest = read_json(tmp_path / "ix" / "manifest.json")
    assert manifest["removed"] == [] and manifest["compacted"] == [[0, 1], [3, 5], [9, 10]]
    assert manifest["num_docs"] == len(alive) and manifest["num_ids"] == len(docs)
    compacted = lik.Index.load(tmp_path / "ix")
    assert_same(compacted.search(Q, len(alive)), expected(Q, docs, alive, len(alive)))
    assert [t.tolist() for t in compacted.get(alive)] == [docs[i].tolist() for i in alive]
    # Ids keep counting: the next document is id 10, never a removed id again.
    compacted.add([docs[2] + 1]).remove([5])
    more, alive = docs + [docs[2] + 1], [i for i in alive if i != 5] + [10]
    assert compacted.num_ids == 11 and len(compacted) == len(alive) and compacted.live_ids().tolist() == alive
    assert_same(compacted.search(Q, 3, doc_ids=[10, 5, 2, 1]), expected(Q, more, [1, 2, 10], 3))
    compacted.compact().save(tmp_path / "ix", overwrite=True)
    again = lik.Index.load(tmp_path / "ix", placement="disk")
    assert read_json(tmp_path / "ix" / "manifest.json")["compacted"] == [[0, 1], [3, 6], [9, 10]]
    assert_same(again.search(Q, len(alive)), expected(Q, more, alive, len(alive)))


def test_get_reads_live_documents_back(docs):
    index = lik.Index.build(docs, dtype=torch.float32, shard_tokens=9, progress=False)
    got = index.get(torch.tensor([8, 1, 8, 0]))
    assert [t.tolist() for t in got] == [docs[i].tolist() for i in (8, 1, 8, 0)]
    assert got[0].dtype == torch.float32 and got[1].shape == (0, 6)
    quantized = lik.Index.build(docs, dtype=torch.int8, progress=False)
    tokens, scale = lik.quantize(docs[8], torch.int8)
    assert torch.equal(quantized.get([8])[0], tokens.float() * scale[:, None])
    index.remove([1])
    with pytest.raises(KeyError, match="document 1 was removed"):
        index.get([0, 1])
    with pytest.raises(ValueError, match=r"ids must be in \[0, 10\)"):
        index.get([10])
    with pytest.raises(TypeError, match="ids"):
        index.get([0.5])


def test_remove_checks_its_ids(docs):
    index = lik.Index.build(docs, progress=False)
    for bad, error in (([10], ValueError), ([-1], ValueError), ([1.0], TypeError), ("1", TypeError),
                       ([[1]], TypeError), (3, TypeError)):
        with pytest.raises(error, match="ids"):
            index.remove(bad)
    assert len(index) == len(docs)  # a refused call removes nothing
    index.remove([])
    assert len(index) == len(docs)


def test_everything_removed_and_compacted_is_an_empty_index(tmp_path, docs, reference):
    index = lik.Index.build(docs, progress=False).remove(range(len(docs)))
    Q = grid_queries(torch.Generator().manual_seed(7))
    assert len(index) == 0 and index.search(Q, 0)[1].shape == (3, 0)
    index.compact().save(tmp_path / "ix")
    empty = lik.Index.load(tmp_path / "ix")
    assert len(empty) == 0 and empty.num_ids == len(docs) and empty.segments == []
    empty.add([docs[0]])
    assert empty.search(Q, 1)[1].tolist() == [[10]] * 3


def test_streamed_chunks_of_removed_documents_are_never_copied(monkeypatch, docs, reference):
    """A chunk whose documents are all removed is left out of the selection, so ``"host"`` / ``"disk"`` on a GPU
    never copy it; the others score only their live documents, as the resident source does."""
    install_fake_cuda(monkeypatch)
    index = lik.Index.build(docs, dtype=torch.float32, shard_tokens=9, progress=False)
    segments = index.segments
    first_ids = [0]
    for segment in segments[:-1]:
        first_ids.append(first_ids[-1] + segment.num_docs)
    plans = plan_chunks(segments, first_ids, 4)
    removed = torch.tensor([0, 1, 3, 4, 9])
    selection = live_selection(plans, removed, "cpu")
    gone = [n for n, p in enumerate(plans) if set(range(p.first_id, p.first_id + p.num_docs)) <= set(removed.tolist())]
    assert gone and not {n for n, _ in selection} & set(gone)
    streamed = StreamedSource(segments, plans, "cpu", staged=True)
    copied = []
    real_copy = streamed._copy
    monkeypatch.setattr(streamed, "_copy", lambda number, *args: copied.append(number) or real_copy(number, *args))
    Q = grid_queries(torch.Generator().manual_seed(8))
    got = search_chunks(Q, None, streamed, selection, 5)
    assert_same(got, search_chunks(Q, None, ResidentSource(segments, plans, "cpu"), selection, 5))
    assert_same(got, expected(Q, docs, live(len(docs), removed.tolist()), 5))
    assert copied == [n for n, _ in selection]


# ------------------------------------------------------------------ the manifest's id fields
@pytest.fixture
def saved_removed(tmp_path, docs):
    path = tmp_path / "ix"
    lik.Index.build(docs, dtype=torch.float32, shard_tokens=9, progress=False).remove(REMOVED).save(path)
    return path


def rewrite(path, edit, keep_digest=True):
    manifest = read_json(path / "manifest.json")
    edit(manifest)
    if keep_digest:  # so that each edit meets the check it is about, not the checksum first
        manifest["ids_sha256"] = lik.index.manifest.ids_digest(
            manifest.get("num_ids"), manifest.get("removed", []), manifest.get("compacted", []))
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(removed=[[3, 5], [0, 1]]), r"'removed\[1\]' must be \[start, stop\] with 5 <= start"),
    (lambda m: m.update(removed=[[0, 11]]), r"'removed\[0\]' must be .* stop <= num_ids \(10\)"),
    (lambda m: m.update(removed=[[2, 2]]), r"'removed\[0\]' must be \[start, stop\]"),
    (lambda m: m.update(removed=[[0, 1, 2]]), r"'removed\[0\]' must be \[start, stop\]"),
    (lambda m: m.update(removed=[["0", 1]]), r"'removed\[0\]' must be \[start, stop\]"),
    (lambda m: m.update(removed={"0": 1}), r"field 'removed' must be a list"),
    (lambda m: m.pop("compacted"), r"field 'compacted' must be a list"),
    (lambda m: m.update(compacted=[[0, 2]], num_ids=12), r"ids \[0, 1\] are both in field 'removed' and in"),
    (lambda m: m.update(compacted=[[10, 12]]), r"'compacted\[0\]' must be .* stop <= num_ids \(10\)"),
    (lambda m: m.update(compacted=[[10, 12]], num_ids=13), r"'num_ids' \(13\) must equal num_docs \(10\) plus"),
    (lambda m: m.update(num_ids=-1), r"field 'num_ids' must be an integer"),
    (lambda m: m.pop("num_ids"), r"field 'num_ids' is missing"),
])
def test_id_fields_are_checked(saved_removed, edit, message):
    rewrite(saved_removed, edit)
    for verify in (True, False):
        with pytest.raises(ValueError, match=r"manifest\.json: .*" + message):
            lik.Index.load(saved_removed, verify=verify)


def test_id_fields_are_guarded_by_their_checksum(saved_removed):
    """A valid-looking change to the removed ranges (one flipped digit) is refused, not loaded as another index."""
    rewrite(saved_removed, lambda m: m.update(removed=[[0, 1], [3, 4], [9, 10]]), keep_digest=False)
    with pytest.raises(ValueError, match=r"manifest\.json: field 'ids_sha256' does not match"):
        lik.Index.load(saved_removed, verify=False)
    rewrite(saved_removed, lambda m: m.update(removed=[[0, 1], [3, 4], [9, 10]]))
    assert len(lik.Index.load(saved_removed)) == 7


@pytest.mark.parametrize("version", [1, 2])
def test_id_fields_in_an_older_version_are_refused(saved_removed, version):
    """One flipped bit turns version 3 into 2 (or 1): that must not bring the removed documents back."""
    rewrite(saved_removed, lambda m: m.update(version=version))
    with pytest.raises(ValueError, match=rf"field 'num_ids' belongs to format version 3, the manifest says {version}"):
        lik.Index.load(saved_removed)


# ------------------------------------------------------------------ ranks
def rank_main(rank: int, world: int, port: int, path: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        index = lik.Index.load(path, shard=rank, num_shards=world, placement="host", device="cpu", chunk_tokens=4)
        Q = grid_queries(torch.Generator().manual_seed(5))
        results = {"all": index.search(Q, len(index)), "top": index.search(Q, 3),
                   "filtered": index.search(Q, 2, doc_ids=[0, 1, 2, 6, 9]), "none": index.search(Q, 0, doc_ids=[0])}
        try:
            index.remove([1])
        except ValueError as error:
            results["remove"] = str(error)
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ranks_skip_removed_documents(tmp_path, docs, reference):
    """Two gloo ranks over a compacted index with more removed documents: every rank returns the single-process
    result (the whole first rank's range is removed: it contributes nothing, the other rank gives all k)."""
    index = lik.Index.build(docs, dtype=torch.float32, shard_tokens=5, progress=False).remove([2]).compact()
    index.remove([0, 1, 3, 4, 5])  # with 9 stored documents, rank 0 holds positions 0..3: all removed
    index.save(tmp_path / "ix")
    Q = grid_queries(torch.Generator().manual_seed(5))
    alive = [6, 7, 8, 9]
    want = {"all": expected(Q, docs, alive, 4), "top": expected(Q, docs, alive, 3),
            "filtered": expected(Q, docs, [6, 9], 2), "none": index.search(Q, 0, doc_ids=[0])}
    for name, result in want.items():
        assert_same(index.search(Q, result[1].shape[1], doc_ids=[0, 1, 2, 6, 9] if name == "filtered" else
                                 [0] if name == "none" else None), result)
    mp.spawn(rank_main, args=(2, free_port(), str(tmp_path / "ix"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name, result in want.items():
            assert_same(got[name], result)
        assert "one shard of a distributed index" in got["remove"]


# ------------------------------------------------------------------ on the device
@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["gpu", "host", "disk"])
def test_removal_on_the_device_adds_no_host_sync(tmp_path, placement):
    """Every placement skips removed documents as the CPU does, and a search with removed documents waits on the
    device no more often than one without (the live positions are cached on the device)."""
    import warnings

    rng = torch.Generator().manual_seed(0)
    docs = [torch.nn.functional.normalize(torch.randn(n, 128, generator=rng), dim=-1)
            for n in torch.randint(1, 200, (600,), generator=rng).tolist()]
    lik.Index.build(docs, out=tmp_path / "ix", shard_tokens=20_000, progress=False)
    removed = torch.randperm(600, generator=rng)[:250]
    Q = torch.nn.functional.normalize(torch.randn(8, 32, 128, generator=rng), dim=-1)
    cpu = lik.Index.load(tmp_path / "ix", placement="host", device="cpu").remove(removed).search(Q, 20)

    def syncs(index):
        index.search(Q.cuda(), 20)  # the first search builds the chunk source and the cached selection
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = index.search(Q.cuda(), 20)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return result, len(caught)

    index = lik.Index.load(tmp_path / "ix", placement=placement, device="cuda", chunk_tokens=7_000)
    _, plain = syncs(index)
    (scores, ids), with_removed = syncs(index.remove(removed))
    assert with_removed <= plain
    assert not torch.isin(ids.cpu(), removed).any()
    # The same arithmetic as a filter to the live documents (bit for bit); the CPU reference within fp16 rounding.
    alive = live(600, removed.tolist())
    fresh = lik.Index.load(tmp_path / "ix", placement=placement, device="cuda", chunk_tokens=7_000)
    want = fresh.search(Q.cuda(), 20, doc_ids=alive)
    assert torch.equal(ids, want[1]) and torch.equal(scores, want[0])
    torch.testing.assert_close(scores.cpu(), cpu[0], rtol=2e-3, atol=2e-3)
