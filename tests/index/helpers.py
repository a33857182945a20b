"""Ragged corpora on an exact grid (multiples of 1/4, small d), so every path gives identical fp32 scores and ties
are frequent; their padded equivalents for :func:`lik.search`; and tools to look into and tamper with a saved
index."""

from __future__ import annotations

import contextlib
import hashlib
import json
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

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
        shards.append({"file": name, "num_docs": len(part), "num_tokens": int(lengths.sum()), "bytes": len(data),
                       "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {"format": "lik-index", "version": 1, "d": docs[0].shape[1], "dtype": "float32",
                "num_docs": len(docs), "num_tokens": sum(s["num_tokens"] for s in shards), "shards": shards}
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
