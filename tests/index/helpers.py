"""Ragged corpora on an exact grid (multiples of 1/4, small d), so every path gives identical fp32 scores and ties
are frequent; their padded equivalents for :func:`lik.search`; and tools to look into and tamper with a saved
index."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import struct
import threading
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import lik

from lik.index import format as index_format
from lik.index import plaid_search
from lik.index import storage
from lik.ops.residual import check_residual_inputs, maxsim_residual_reference

LENGTHS = (5, 0, 3, 7, 1, 4, 0, 2, 6, 3)


def grid_docs(rng: torch.Generator, lengths=LENGTHS, dim: int = 6) -> list[torch.Tensor]:
    return [torch.randint(-4, 5, (n, dim), generator=rng).float() / 4 for n in lengths]


def grid_queries(rng: torch.Generator, n_q: int = 3, l_q: int = 4, dim: int = 6) -> torch.Tensor:
    return torch.randint(-4, 5, (n_q, l_q, dim), generator=rng).float() / 4


def padded(docs: list[torch.Tensor], fill: float = float("nan")) -> tuple[torch.Tensor, torch.Tensor]:
    """``(D [B, Lmax, d], d_mask [B, Lmax])``, ``fill`` (NaN: masked positions must never count) in the padding."""
    longest = max(1, max(doc.shape[0] for doc in docs))
    D = torch.full((len(docs), longest, docs[0].shape[1]), fill, dtype=docs[0].dtype)
    mask = torch.zeros(len(docs), longest, dtype=torch.bool)
    for i, doc in enumerate(docs):
        D[i, : doc.shape[0]] = doc
        mask[i, : doc.shape[0]] = True
    return D, mask


# ------------------------------------------------------------------ the plaid codec's corpora
PLAID_LENGTHS = (5, 0, 3, 7, 1, 4, 9, 2, 6, 3, 8, 1, 0, 5, 4, 7, 2, 6, 3, 5)  # 81 tokens


def unit_docs(seed: int = 0, lengths=PLAID_LENGTHS, dim: int = 16) -> list[torch.Tensor]:
    """Random unit-norm documents (fp32 ``[n, dim]`` each) for the plaid codec, which trains on them."""
    g = torch.Generator().manual_seed(seed)
    return [F.normalize(torch.randn(n, dim, generator=g), dim=-1) for n in lengths]


def score_with_reference(monkeypatch) -> None:
    """The plaid search's residual scorer replaced by its PyTorch reference (the kernel is slow through the
    interpreter)."""

    def reference(Q, q_mask, codes, residuals, codec, cu_seqlens):
        inputs = check_residual_inputs(Q, codes, residuals, codec, cu_seqlens, q_mask)
        return inputs.finish(maxsim_residual_reference(inputs))

    monkeypatch.setattr(plaid_search, "score_residual_packed", reference)


# ------------------------------------------------------------------ saved indexes on disk
def read_json(path):
    return json.loads(Path(path).read_text())


def shard_paths(index_dir) -> list[Path]:
    """The shard files a saved index's manifest names, in order (either layout)."""
    manifest = read_json(Path(index_dir) / "manifest.json")
    data = Path(index_dir) / manifest["generation"] if "generation" in manifest else Path(index_dir)
    return [data / s["file"] for s in manifest["shards"]]


def index_files(index_dir) -> list[Path]:
    """The manifest and every shard file of a saved index."""
    return [Path(index_dir) / "manifest.json", *shard_paths(index_dir)]


def record_shard(index_dir, number: int) -> None:
    """Make the manifest's size and checksum of shard ``number`` match the file again (after a test rewrote it),
    so that only the header checks stand between the file and a load."""
    path = Path(index_dir) / "manifest.json"
    manifest = read_json(path)
    data = shard_paths(index_dir)[number].read_bytes()
    manifest["shards"][number].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    path.write_text(json.dumps(manifest))


def safetensors_bytes(entries: dict, data: bytes) -> bytes:
    """A safetensors file of a hand-written header (``{name: {dtype, shape, data_offsets}}``) and data area."""
    header = json.dumps(entries).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data


def write_version_1(path, docs: list[torch.Tensor], shard_docs: int = 3) -> None:
    """A float32 index in the layout lik wrote before generations: shards beside a version-1 manifest."""
    path = Path(path)
    path.mkdir(parents=True)
    shards = []
    for number, first in enumerate(range(0, len(docs), shard_docs)):
        part = docs[first : first + shard_docs]
        lengths = torch.tensor([0] + [doc.shape[0] for doc in part])
        name = f"shard-{number:05d}.safetensors"
        save_file({"tokens": torch.cat(part).float().contiguous(), "cu_seqlens": lengths.cumsum(0)}, str(path / name))
        data = (path / name).read_bytes()
        shards.append(
            {
                "file": name,
                "num_docs": len(part),
                "num_tokens": int(lengths.sum()),
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )
    manifest = {
        "format": "lik-index",
        "version": 1,
        "d": docs[0].shape[1],
        "dtype": "float32",
        "num_docs": len(docs),
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "shards": shards,
    }
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1))


# ------------------------------------------------------------------ CUDA streams and events on CPU
class FakeEvent:
    def __init__(self):
        self.recorded = False

    def record(self, stream=None):
        self.recorded = True

    def synchronize(self):
        assert self.recorded, "waited on an event that was never recorded"


class FakeStream:
    def __init__(self, device=None):
        pass

    def wait_event(self, event):
        assert event.recorded, "a stream waited on an event that was never recorded"


def install_fake_cuda(monkeypatch) -> None:
    """Stand-ins for CUDA streams, events and pinned memory, so a streamed source runs its plumbing on CPU."""
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self.clone())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None, raising=False)


# ------------------------------------------------------------------ which index a directory holds
def contents(index) -> tuple:
    """What a loaded index holds: its size, every live document's length and every token value (removed documents,
    compacted or not, are not there)."""
    documents = index.get(index.live_ids())
    if not documents:
        return len(index), [], []
    return len(index), [d.shape[0] for d in documents], torch.cat([d.float() for d in documents]).flatten().tolist()


def expected(docs) -> tuple:
    return len(docs), [d.shape[0] for d in docs], torch.cat(docs).flatten().tolist()


def which(path, corpora, **load) -> str | None:
    """``"old"`` / ``"new"``: the corpus the index at ``path`` loads as (``None``: nothing there)."""
    if not path.exists():
        return None
    found = contents(lik.Index.load(path, **load))
    names = [name for name, docs in corpora.items() if found == expected(docs)]
    assert names, f"{path} loads as neither corpus"
    return names[0]


def assert_clean(parent, name="ix", allow_version_1_leftovers=False):
    """Only the index remains: no staging directories beside it, one generation and its manifest inside."""
    left = sorted(os.listdir(parent))
    assert left == [name], f"left beside the index: {left}"
    generation = read_json(parent / name / "manifest.json")["generation"]
    inside = set(os.listdir(parent / name)) - {generation, "manifest.json"}
    if allow_version_1_leftovers:
        inside = {n for n in inside if not (n.startswith("shard-") and n.endswith(".safetensors"))}
    assert not inside, f"left behind in the index: {sorted(inside)}"
    assert sorted(os.listdir(parent / name / generation)) == sorted(
        [".lik-generation", *(p.name for p in shard_paths(parent / name))]
    )


# ------------------------------------------------------------------ interrupted and racing writes
# Each call of these is one step of a write: a kill before any of them is a crash between two steps.
STEPS = [
    (os, "mkdir"),
    (os, "rename"),
    (os, "replace"),
    (os, "unlink"),
    (os, "rmdir"),
    (os, "fsync"),
    (storage, "rename_no_replace"),
    (index_format, "save_file"),
]


@contextlib.contextmanager
def at_each_step(on_step):
    """Call ``on_step(name)`` before each step; a shard file it returns True for is left half written."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in STEPS]

    def wrap(name, real):
        def step(*args, **kwargs):
            if name == "save_file":
                result = real(*args, **kwargs)
                if on_step(name):
                    with open(args[1], "r+b") as f:  # a torn write: the shard cut short when the process died
                        f.truncate(os.path.getsize(args[1]) // 2)
                    os.kill(os.getpid(), signal.SIGKILL)
                return result
            on_step(name)
            return real(*args, **kwargs)

        return step

    for owner, name, real in saved:
        setattr(owner, name, wrap(name, real))
    try:
        yield
    finally:
        for owner, name, real in saved:
            setattr(owner, name, real)


def count_steps(operation) -> int:
    steps = []
    with at_each_step(lambda name: steps.append(name)):
        operation()
    return len(steps)


def fork(child) -> int:
    """Run ``child()`` in a forked process; returns its pid. The child ends with ``os._exit`` (never returns)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12 warns of threads; the child uses none
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            child()
            code = 0
        finally:
            os._exit(code)
    return pid


def killed_at(step: int, operation) -> bool:
    """Run ``operation`` in a child killed just before its ``step``-th step; False if it finished first."""

    def on_step(name):
        on_step.count += 1
        if on_step.count == step and name != "save_file":
            os.kill(os.getpid(), signal.SIGKILL)
        return on_step.count == step

    on_step.count = 0

    def child():
        with at_each_step(on_step):
            operation()

    _, status = os.waitpid(fork(child), 0)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True
    assert os.WEXITSTATUS(status) == 0, "the write failed in the child"
    return False


def kill_points(total: int) -> list[int]:
    return list(range(1, total + 2))  # every step, and once after the last


def race_at_commit(monkeypatch, writers: int = 2):
    """Hold every writer at its commit until all have arrived, so that they race there."""
    barrier = threading.Barrier(writers)
    real = storage.rename_no_replace

    def rename(source, target):
        barrier.wait(timeout=30)
        return real(source, target)

    monkeypatch.setattr(storage, "rename_no_replace", rename)


def appear_while_writing(monkeypatch, make):
    """Run ``make()`` (which puts something at the destination) once the next writer has written a shard, after
    its checks at the start."""
    real = index_format.save_file

    def save_file(*args, **kwargs):
        monkeypatch.setattr(index_format, "save_file", real)
        result = real(*args, **kwargs)
        make()
        return result

    monkeypatch.setattr(index_format, "save_file", save_file)


def run_threads(*targets):
    outcomes = [None] * len(targets)

    def run(number, target):
        try:
            target()
            outcomes[number] = "ok"
        except Exception as error:  # noqa: BLE001 (the outcome is the test's subject)
            outcomes[number] = error

    threads = [threading.Thread(target=run, args=(n, t)) for n, t in enumerate(targets)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return outcomes
