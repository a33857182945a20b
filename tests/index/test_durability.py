"""The durability campaign of a saved lik.Index: damaged files, processes killed mid-write, concurrent writers,
readers during a replace, ``add`` racing searches.

Every damaged file gives a ``ValueError`` / ``FileNotFoundError`` naming it (or, where only a checksum could tell,
a structurally sound load with ``verify=False``); a write killed at any file-system step leaves the destination
loading as the old or the new index, and the next write removes what the dead writer left; of two writers that
do not overwrite, one gets ``FileExistsError``; a reader loads one whole generation and keeps reading it.

The fast profile (the default, a fixed seed) runs in CI; ``LIK_FUZZ_PROFILE=long`` (``make fuzz``) kills at
random instants many more times, flips every byte of every file and races longer, from a fresh seed each run
(``LIK_FUZZ_SEED=N`` replays one).
Processes are forked (the child inherits the built corpus: no interpreter start per kill), so these tests need
``os.fork``.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import threading
import time

import pytest
import torch

import lik
from lik.index import format as index_format
from lik.index import storage

from .helpers import (appear_while_writing, assert_clean, contents, count_steps, expected, fork, grid_docs,
                      grid_queries, index_files, install_fake_cuda, kill_points, killed_at, race_at_commit, read_json,
                      run_threads, which, write_version_1)

LONG = os.environ.get("LIK_FUZZ_PROFILE", "ci") == "long"
# A failing test shows its seed in its captured output; LIK_FUZZ_SEED replays it.
SEED = int(os.environ.get("LIK_FUZZ_SEED", random.randrange(1 << 30) if LONG else 20240611))
needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="kills a forked writer (POSIX only)")


@pytest.fixture(autouse=True)
def reference_scoring(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the files are under test, not the kernels: the reference scores
    print(f"durability campaign: LIK_FUZZ_SEED={SEED}")


@pytest.fixture(autouse=True)
def no_power_loss(monkeypatch):
    """``os.fsync`` does nothing here (it still counts as a step): it guards against power loss, which a test
    cannot cause, while a killed process's writes stay in the kernel's cache. ``test_format`` writes with it."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


@pytest.fixture(scope="module")
def corpora():
    """Two different corpora (``old`` and ``new``) and the contents each loads as."""
    rng = torch.Generator().manual_seed(17)
    old, new = grid_docs(rng), grid_docs(rng, lengths=(2, 4, 0, 5, 1, 3, 6))
    return {"old": old, "new": new}


# ------------------------------------------------------------------ damaged files
def damage_positions(size: int, rng: random.Random) -> list[int]:
    if LONG:
        return list(range(size))
    return sorted(set(range(min(size, 48))) | set(rng.sample(range(size), min(size, 24))))


def assert_refused_or_sound(path, files, original, verify: bool):
    try:
        index = lik.Index.load(path, verify=verify, placement="disk")
    except (ValueError, FileNotFoundError) as error:
        assert any(f.name in str(error) for f in files) or str(path) in str(error), error
        return None
    assert len(index) == original[0] and index.search(torch.ones(2, 6), 3)[1].shape == (3,)
    return contents(index)


@pytest.mark.parametrize("dtype, removed", [(torch.float16, []), (torch.int8, []), (torch.float16, [0, 4, 5])])
def test_byte_flips_and_truncations_of_every_file(tmp_path, corpora, dtype, removed):
    rng = random.Random(SEED)
    path = tmp_path / "ix"
    lik.Index.build(corpora["old"], dtype=dtype, shard_tokens=12, progress=False).remove(removed).save(path)
    files = index_files(path)
    assert len(files) >= 3
    original = contents(lik.Index.load(path))
    for file in files:
        data = file.read_bytes()
        for position in damage_positions(len(data), rng):
            damaged = bytearray(data)
            damaged[position] ^= 1 << rng.randrange(8)
            file.write_bytes(bytes(damaged))
            with_checksums = assert_refused_or_sound(path, files, original, verify=True)
            if file.name == "manifest.json":
                # Every manifest field is checked against the shards: a load that works is the original index.
                assert with_checksums in (None, original), f"manifest byte {position}"
            else:
                assert with_checksums is None, f"{file.name} byte {position} loaded with verify=True"
            assert_refused_or_sound(path, files, original, verify=False)
        for length in sorted({0, 1, 7, 8, 9, len(data) // 2, len(data) - 1}):
            file.write_bytes(data[:length])
            for verify in (True, False):
                with pytest.raises((ValueError, FileNotFoundError), match=file.name):
                    lik.Index.load(path, verify=verify)
        file.write_bytes(data + b"\0")
        with pytest.raises(ValueError, match=file.name):
            lik.Index.load(path)
        file.write_bytes(data)
    assert contents(lik.Index.load(path)) == original


# ------------------------------------------------------------------ processes killed mid-write
def check_every_kill_point(tmp_path, corpora, setup, operation, before, after, version_1=False):
    """Kill ``operation`` before each of its steps in turn: the destination must load as ``before`` or ``after``,
    and the next write must succeed and leave nothing of the dead one."""
    setup(tmp_path / "count")
    total = count_steps(lambda: operation(tmp_path / "count" / "ix"))
    assert total > 10
    seen = set()
    for step in kill_points(total):
        parent = tmp_path / f"kill-{step}"
        setup(parent)
        killed = killed_at(step, lambda parent=parent: operation(parent / "ix"))
        assert killed == (step <= total)
        state = which(parent / "ix", corpora, verify=True)
        assert state in (before, after), f"killed at step {step}: {state}"
        seen.add(state)
        lik.Index.build(corpora["new"], out=parent / "ix", overwrite=True, shard_tokens=7, progress=False)
        assert which(parent / "ix", corpora) == "new"
        assert_clean(parent, allow_version_1_leftovers=version_1)
        shutil.rmtree(parent)
    assert seen == {before, after}  # the kills covered both sides of the commit


def nothing(parent):
    parent.mkdir()


def saved_old(corpora):
    def setup(parent):
        parent.mkdir(exist_ok=True)
        lik.Index.build(corpora["old"], out=parent / "ix", shard_tokens=9, progress=False)

    return setup


@needs_fork
def test_build_killed_at_every_step(tmp_path, corpora):
    def build(path):
        lik.Index.build(iter(corpora["new"]), out=path, shard_tokens=7, progress=False)

    check_every_kill_point(tmp_path, corpora, nothing, build, None, "new")


@needs_fork
def test_replace_killed_at_every_step(tmp_path, corpora):
    index = lik.Index.build(corpora["new"], shard_tokens=7, progress=False)
    check_every_kill_point(tmp_path, corpora, saved_old(corpora),
                           lambda path: index.save(path, overwrite=True, progress=False), "old", "new")


@needs_fork
def test_replace_of_a_version_1_index_killed_at_every_step(tmp_path, corpora):
    def setup(parent):
        parent.mkdir()
        write_version_1(parent / "ix", corpora["old"])

    index = lik.Index.build(corpora["new"], dtype=torch.float32, shard_tokens=7, progress=False)
    check_every_kill_point(tmp_path, corpora, setup, lambda path: index.save(path, overwrite=True, progress=False),
                           "old", "new", version_1=True)


@needs_fork
@pytest.mark.parametrize("added, removed, compact", [(3, [], False), (0, [0, 3, 4], False), (2, [0, 3, 11], True)])
def test_a_change_then_save_killed_at_every_step(tmp_path, corpora, added, removed, compact):
    """An index loaded from the destination, changed (documents added, removed, compacted), saved back over it:
    the old index or the whole change, never less; removed documents stay removed through the save."""
    docs = corpora["old"] + corpora["new"][:added]
    changed = [doc for number, doc in enumerate(docs) if number not in removed]

    def operation(path):
        index = lik.Index.load(path, placement="disk").add(corpora["new"][:added]).remove(removed)
        (index.compact() if compact else index).save(path, overwrite=True, progress=False)

    check_every_kill_point(tmp_path, {**corpora, "changed": changed}, saved_old(corpora), operation, "old", "changed")


@needs_fork
def test_writers_killed_at_random_instants(tmp_path, corpora):
    """A child replacing the index in a loop, killed after a random delay; the long profile does it many times."""
    rng = random.Random(SEED)
    indexes = {name: lik.Index.build(docs, shard_tokens=5, progress=False) for name, docs in corpora.items()}
    saved_old(corpora)(tmp_path)

    def replace_forever():
        for number in range(10**9):
            indexes["new" if number % 2 else "old"].save(tmp_path / "ix", overwrite=True, progress=False)

    for _ in range(200 if LONG else 6):
        pid = fork(replace_forever)
        time.sleep(rng.uniform(0.0, 0.08))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        assert which(tmp_path / "ix", corpora, verify=True) in ("old", "new")
        assert which(tmp_path / "ix", corpora, verify=False, placement="disk") in ("old", "new")
    indexes["new"].save(tmp_path / "ix", overwrite=True, progress=False)
    assert_clean(tmp_path)


# ------------------------------------------------------------------ concurrent writers
@pytest.fixture(params=["system call", "portable fallback"])
def no_replace_rename(request, monkeypatch):
    """The OS's rename-without-replace (Linux, macOS), or the ``mkdir`` + ``rename`` used where there is none."""
    if request.param == "portable fallback":
        monkeypatch.setattr(storage, "_rename_syscall", lambda source, target: False)
    return request.param


def test_two_writers_without_overwrite_one_gets_file_exists(tmp_path, monkeypatch, corpora, no_replace_rename):
    race_at_commit(monkeypatch)
    outcomes = run_threads(*(
        lambda docs=docs: lik.Index.build(docs, out=tmp_path / "ix", shard_tokens=6, progress=False, placement="disk")
        for docs in corpora.values()))
    assert sorted(map(str, outcomes)).count("ok") == 1, outcomes
    loser = next(o for o in outcomes if o != "ok")
    assert isinstance(loser, FileExistsError) and "nothing was replaced" in str(loser)
    winner = list(corpora)[outcomes.index("ok")]
    assert which(tmp_path / "ix", corpora) == winner
    assert_clean(tmp_path)


def test_two_writers_with_overwrite_both_replace_in_turn(tmp_path, monkeypatch, corpora, no_replace_rename):
    saved_old(corpora)(tmp_path)
    newer = {"new": corpora["new"], "again": corpora["new"][:2]}
    race_at_commit(monkeypatch)
    outcomes = run_threads(*(
        lambda docs=docs: lik.Index.build(docs, out=tmp_path / "ix", overwrite=True, progress=False)
        for docs in newer.values()))
    assert outcomes == ["ok", "ok"]
    assert which(tmp_path / "ix", newer) in newer
    assert_clean(tmp_path)


def test_a_folder_appearing_during_a_write_is_never_deleted(tmp_path, monkeypatch, corpora):
    """Whatever appears at the destination while shards are written is the user's: refused, left as it was."""
    target = tmp_path / "ix"

    def users_folder():
        target.mkdir()
        (target / "thesis.tex").write_text("years of work")

    appear_while_writing(monkeypatch, users_folder)
    with pytest.raises(FileExistsError, match="nothing was replaced"):
        lik.Index.build(corpora["old"], out=target, progress=False)
    assert os.listdir(tmp_path) == ["ix"] and os.listdir(target) == ["thesis.tex"]
    shutil.rmtree(target)
    appear_while_writing(monkeypatch, users_folder)
    with pytest.raises(FileExistsError, match="is not a lik index"):
        lik.Index.build(corpora["old"], out=target, overwrite=True, progress=False)
    assert os.listdir(tmp_path) == ["ix"] and (target / "thesis.tex").read_text() == "years of work"


def test_another_index_appearing_during_a_write_is_kept(tmp_path, monkeypatch, corpora):
    target = tmp_path / "ix"
    appear_while_writing(monkeypatch, lambda: lik.Index.build(corpora["old"], out=target, progress=False))
    with pytest.raises(FileExistsError, match="nothing was replaced"):
        lik.Index.build(corpora["new"], out=target, progress=False)
    assert which(target, corpora) == "old"
    assert_clean(tmp_path)


@pytest.mark.parametrize("overwrite", [False, True])
def test_only_a_lik_index_is_replaced(tmp_path, corpora, overwrite):
    project = tmp_path / "project"
    project.mkdir()
    torch.save(corpora["old"], project / "embeddings.pt")
    (project / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("a file")
    index = lik.Index.build(corpora["new"], progress=False)
    match = "is not a lik index" if overwrite else "already exists"
    for target in (project, tmp_path / "file"):
        with pytest.raises(FileExistsError, match=match):
            index.save(target, overwrite=overwrite, progress=False)
        with pytest.raises(FileExistsError, match=match):
            lik.Index.build(torch.load(project / "embeddings.pt"), out=target, overwrite=overwrite, progress=False)
    assert sorted(os.listdir(project)) == ["embeddings.pt", "notes.txt"]
    assert (tmp_path / "file").read_text() == "a file"
    assert sorted(os.listdir(tmp_path)) == ["file", "project"]
    (tmp_path / "empty").mkdir()  # an empty directory holds nothing to lose: it may be written with overwrite
    if overwrite:
        index.save(tmp_path / "empty", overwrite=True, progress=False)
        assert which(tmp_path / "empty", corpora) == "new"
    else:
        with pytest.raises(FileExistsError, match="already exists"):
            index.save(tmp_path / "empty", progress=False)


def test_leftovers_are_removed_only_when_provably_a_dead_writers(tmp_path, corpora):
    saved_old(corpora)(tmp_path)
    dead = fork(lambda: None)
    os.waitpid(dead, 0)
    record = '{"lik": "index writer", "pid": %d, "host": "%s"}'
    leftovers = {
        ".ix.tmp-0123456789ab": record % (dead, storage.socket.gethostname()),  # a dead writer's: removed
        ".ix.tmp-00000000000a": record % (os.getpid(), storage.socket.gethostname()),  # alive: kept
        ".ix.tmp-00000000000b": record % (dead, "another-host"),  # cannot tell: kept
        ".ix.tmp-00000000000c": None,  # no marker (not lik's): kept
        ".ix.old-00000000000d": None,  # what an older lik renamed aside: may be the only copy, kept
        ".ix.tmp-00000000000e": "",  # an empty marker beside data: kept
    }
    for name, marker in leftovers.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "data").write_text("x")
        if marker is not None:
            (tmp_path / name / ".lik-writer").write_text(marker)
    killed_before_its_record = tmp_path / ".ix.tmp-00000000000f"  # only an empty marker: removed
    killed_before_its_record.mkdir()
    (killed_before_its_record / ".lik-writer").write_text("")
    stray = tmp_path / "ix" / "gen-0123456789abcdef0123456789abcdef"  # a killed replace's generation: removed
    stray.mkdir()
    (stray / ".lik-generation").write_text("")
    unmarked = tmp_path / "ix" / "gen-fedcba9876543210fedcba9876543210"  # not known to be lik's: kept
    unmarked.mkdir()
    (unmarked / "data").write_text("x")
    empty = tmp_path / "ix" / "gen-00000000000000000000000000000000"  # a removal killed before its rmdir: removed
    empty.mkdir()
    lik.Index.build(corpora["new"], out=tmp_path / "ix", overwrite=True, progress=False)
    assert sorted(os.listdir(tmp_path)) == sorted(["ix", *(n for n in leftovers if n != ".ix.tmp-0123456789ab")])
    assert not stray.exists() and not empty.exists() and unmarked.exists()
    assert not killed_before_its_record.exists()


# ------------------------------------------------------------------ readers during a replace
QUERIES = grid_queries(torch.Generator().manual_seed(2))


def search_matches(index, name, corpora, _cache={}):  # noqa: B006 (a cache of the reference results)
    key = (name, id(corpora[name]))
    if key not in _cache:
        _cache[key] = lik.Index.build(corpora[name], progress=False).search(QUERIES, 4)
    want, got = _cache[key], index.search(QUERIES, 4)
    return torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


@needs_fork
def test_readers_see_one_generation_while_a_writer_replaces(tmp_path, corpora):
    indexes = {name: lik.Index.build(docs, shard_tokens=4, progress=False) for name, docs in corpora.items()}
    saved_old(corpora)(tmp_path)
    early = lik.Index.load(tmp_path / "ix", placement="disk")  # memory-mapped before any replace
    replaces = 400 if LONG else 40

    def writer():
        for number in range(replaces):
            indexes["new" if number % 2 == 0 else "old"].save(tmp_path / "ix", overwrite=True, progress=False)

    pid = fork(writer)
    loads, finished = 0, False
    while not finished:
        done, status = os.waitpid(pid, os.WNOHANG)
        finished = done != 0
        assert not finished or os.waitstatus_to_exitcode(status) == 0, "the writer failed"
        for verify, placement in ((True, "host"), (False, "disk"), (False, "host")):
            index = lik.Index.load(tmp_path / "ix", verify=verify, placement=placement)
            name = [n for n, docs in corpora.items() if contents(index) == expected(docs)]
            assert len(name) == 1, "a load mixed two generations"
            assert search_matches(index, name[0], corpora)
            loads += 1
    assert loads >= 3
    # The index mapped before the replaces still reads the generation it loaded, though its files are deleted.
    assert contents(early) == expected(corpora["old"]) and search_matches(early, "old", corpora)


def test_a_load_started_before_a_replace_retries_on_the_new_generation(tmp_path, monkeypatch, corpora):
    saved_old(corpora)(tmp_path)
    newer = lik.Index.build(corpora["new"], progress=False)
    real_open = index_format.open_shard_file
    calls = []

    def open_after_a_replace(directory, manifest, info):
        if not calls:  # between this load's manifest read and its first shard: another writer replaces the index
            newer.save(tmp_path / "ix", overwrite=True, progress=False)
        calls.append(info.file)
        return real_open(directory, manifest, info)

    monkeypatch.setattr("lik.index.index.open_shard_file", open_after_a_replace)
    assert which(tmp_path / "ix", corpora, verify=True) == "new"
    assert len(calls) > len(read_json(tmp_path / "ix" / "manifest.json")["shards"])  # the first attempt failed


def test_a_streamed_index_reads_the_files_it_opened(tmp_path, monkeypatch, corpora):
    """``"disk"`` on a GPU reads chunks from the shard files: from the files opened at load, not by path."""
    from lik.index.placement import StreamedSource, plan_chunks

    install_fake_cuda(monkeypatch)
    saved_old(corpora)(tmp_path)
    index = lik.Index.load(tmp_path / "ix", placement="disk", device="cpu")
    lik.Index.build(corpora["new"], out=tmp_path / "ix", overwrite=True, shard_tokens=9, progress=False)
    segments = index.segments
    first_ids = [0]
    for segment in segments[:-1]:
        first_ids.append(first_ids[-1] + segment.num_docs)
    plans = plan_chunks(segments, first_ids, 1000)
    source = StreamedSource(segments, plans, "cpu", staged=True)
    streamed = [chunk.tokens.float().clone() for chunk in source.chunks(range(len(plans)))]
    assert torch.cat(streamed).flatten().tolist() == expected(corpora["old"])[2]


# ------------------------------------------------------------------ add racing searches
def test_add_during_a_search_is_seen_by_the_next_search(monkeypatch):
    """An ``add`` between a search's start and its chunk plan must not leave that plan cached for later searches."""
    index = lik.Index.build([torch.ones(2, 4)] * 3, dtype=torch.float32, progress=False)
    real_plan = lik.index.index.plan_chunks

    def plan_while_another_thread_adds(*args, **kwargs):
        plans = real_plan(*args, **kwargs)
        if len(index) == 3:
            index.add([10 * torch.ones(1, 4)])
        return plans

    monkeypatch.setattr("lik.index.index.plan_chunks", plan_while_another_thread_adds)
    index.search(torch.ones(2, 4), 1)
    scores, ids = index.search(torch.ones(2, 4), 1)
    assert len(index) == 4 and ids.tolist() == [3] and scores.tolist() == [80.0]


def test_add_racing_searches_from_other_threads():
    rng = random.Random(SEED)
    index = lik.Index.build([torch.ones(1, 4)], dtype=torch.float32, progress=False, chunk_tokens=3)
    adds = 300 if LONG else 40
    errors, stop = [], threading.Event()

    def searcher():
        while not stop.is_set():
            try:
                before = len(index)
                scores, ids = index.search(torch.full((1, 4), 0.25), 1)
                # Document i scores i + 1; a search sees at least the documents present when it started.
                assert int(ids[0]) >= before - 1 and float(scores[0]) == float(ids[0]) + 1
            except Exception as error:  # noqa: BLE001
                errors.append(error)
                return

    threads = [threading.Thread(target=searcher) for _ in range(2)]
    for thread in threads:
        thread.start()
    for number in range(1, adds + 1):
        index.add([(number + 1) * torch.ones(1, 4)])
        time.sleep(rng.uniform(0, 0.002))
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors[0]
    scores, ids = index.search(torch.full((1, 4), 0.25), 1)
    assert len(index) == adds + 1 and ids.tolist() == [adds] and scores.tolist() == [adds + 1.0]
