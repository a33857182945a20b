"""On-disk format of a :class:`lik.Index`: safetensors shards, a JSON manifest, checksums, atomic writes.

A saved index is a directory::

    manifest.json          {"format": "lik-index", "version": 1, "d": 128, "dtype": "int8",
                            "num_docs": N, "num_tokens": T, "shards": [{"file", "num_docs", "num_tokens",
                            "bytes", "sha256"}, ...]}
    shard-00000.safetensors  tokens [T_s, d] (dtype), cu_seqlens int64 [N_s + 1], scale fp32 [T_s] (8-bit only)

Documents are numbered in shard order, then in order inside a shard (insertion order). A directory is written
under a temporary name beside its destination and renamed into place only once complete, so an interrupted
build or save never leaves a directory that loads as an index.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "DTYPES",
    "ShardInfo",
    "Manifest",
    "Shard",
    "FileRegion",
    "dtype_name",
    "write_shard",
    "read_manifest",
    "open_shard",
    "atomic_directory",
]

FORMAT_NAME = "lik-index"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "int8": torch.int8,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
EIGHT_BIT = (torch.int8, torch.float8_e4m3fn)
# safetensors dtype tags of the tensors a shard holds.
_SAFETENSORS_TAGS = {
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "I8": torch.int8,
    "F8_E4M3": torch.float8_e4m3fn, "I64": torch.int64,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise TypeError(f"dtype must be one of {sorted(DTYPES)}, got {dtype}")


@dataclass(frozen=True)
class FileRegion:
    """Where the rows of a memory-mapped shard lie in its file (byte offsets of token row 0 and of its scale), so
    that the ``"disk"`` placement can read a chunk's rows straight into a pinned buffer."""

    path: Path
    tokens_offset: int
    row_bytes: int
    scale_offset: int | None

    def skip_rows(self, rows: int) -> "FileRegion":
        """The region of the rows after the first ``rows``."""
        scale = None if self.scale_offset is None else self.scale_offset + 4 * rows
        return FileRegion(self.path, self.tokens_offset + rows * self.row_bytes, self.row_bytes, scale)


@dataclass(frozen=True)
class Shard:
    """One shard's documents: ``tokens [T, d]``, ``cu_seqlens`` int64 ``[n + 1]`` from 0, ``scale`` fp32 ``[T]``;
    ``region``: where ``tokens`` and ``scale`` lie in the shard file, when they are memory-mapped from it."""

    tokens: torch.Tensor
    cu_seqlens: torch.Tensor
    scale: torch.Tensor | None
    region: FileRegion | None = None

    @property
    def num_docs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    def slice_docs(self, start: int, stop: int) -> "Shard":
        """Documents ``[start, stop)`` of this shard (views, offsets rebased to 0)."""
        first, last = int(self.cu_seqlens[start]), int(self.cu_seqlens[stop])
        return Shard(
            self.tokens[first:last],
            self.cu_seqlens[start : stop + 1] - first,
            None if self.scale is None else self.scale[first:last],
            None if self.region is None else self.region.skip_rows(first),
        )


@dataclass(frozen=True)
class ShardInfo:
    file: str
    num_docs: int
    num_tokens: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    d: int
    dtype: torch.dtype
    shards: tuple[ShardInfo, ...]

    @property
    def num_docs(self) -> int:
        return sum(s.num_docs for s in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "d": self.d,
                "dtype": dtype_name(self.dtype),
                "num_docs": self.num_docs,
                "num_tokens": self.num_tokens,
                "shards": [vars(s) for s in self.shards],
            },
            indent=1,
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def write_shard(directory: Path, number: int, shard: Shard) -> ShardInfo:
    """Write ``shard`` as ``shard-NNNNN.safetensors`` in ``directory`` and describe it for the manifest."""
    name = f"shard-{number:05d}.safetensors"
    tensors = {"tokens": shard.tokens.contiguous(), "cu_seqlens": shard.cu_seqlens.to(torch.int64).contiguous()}
    if shard.scale is not None:
        tensors["scale"] = shard.scale.to(torch.float32).contiguous()
    path = directory / name
    save_file(tensors, str(path))
    return ShardInfo(name, shard.num_docs, shard.num_tokens, path.stat().st_size, _sha256(path))


def read_manifest(directory) -> Manifest:
    """Parse and check ``directory/manifest.json``; errors name the path and the bad field."""
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if not directory.is_dir():
        raise FileNotFoundError(f"path: no index directory at {str(directory)!r}")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; {str(directory)!r} is not a saved lik.Index")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise ValueError(f"{path}: not a lik.Index manifest (format field is not {FORMAT_NAME!r})")
    if raw.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format version {raw.get('version')!r}, this lik reads version {FORMAT_VERSION}")
    try:
        dtype = DTYPES[raw["dtype"]]
        d = int(raw["d"])
        shards = tuple(ShardInfo(**s) for s in raw["shards"])
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: malformed manifest ({error!r})") from None
    manifest = Manifest(d, dtype, shards)
    if raw.get("num_docs") != manifest.num_docs or raw.get("num_tokens") != manifest.num_tokens:
        raise ValueError(f"{path}: num_docs / num_tokens do not equal the sums over the shard list")
    return manifest


def _read_header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path}: truncated shard (no safetensors header)")
        (length,) = struct.unpack("<Q", prefix)
        blob = f.read(length)
    if len(blob) < length:
        raise ValueError(f"{path}: truncated shard (header cut short)")
    try:
        return 8 + length, json.loads(blob)
    except json.JSONDecodeError:
        raise ValueError(f"{path}: corrupt safetensors header") from None


def _map_tensor(path: Path, data_start: int, header: dict, name: str, mmap: bool) -> torch.Tensor:
    entry = header.get(name)
    if entry is None:
        raise ValueError(f"{path}: shard has no {name!r} tensor")
    dtype = _SAFETENSORS_TAGS.get(entry["dtype"])
    if dtype is None:
        raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {entry['dtype']}")
    begin, end = entry["data_offsets"]
    count = end - begin
    if count == 0:
        return torch.empty(entry["shape"], dtype=dtype)
    if mmap:
        # Copy-on-write mapping: pages are read from the file on access, nothing is loaded up front.
        array = np.memmap(path, dtype=np.uint8, mode="c", offset=data_start + begin, shape=(count,))
        raw = torch.from_numpy(array)
    else:
        with open(path, "rb") as f:
            f.seek(data_start + begin)
            raw = torch.frombuffer(bytearray(f.read(count)), dtype=torch.uint8)
    return raw.view(dtype).view(entry["shape"])


def open_shard(directory: Path, info: ShardInfo, manifest: Manifest, *, mmap: bool, verify: bool) -> Shard:
    """Read (or memory-map) one shard and check it against its manifest entry; errors name the file."""
    path = Path(directory) / info.file
    if not path.is_file():
        raise FileNotFoundError(f"{path}: shard listed in the manifest is missing")
    size = path.stat().st_size
    if size != info.bytes:
        kind = "truncated" if size < info.bytes else "larger than recorded"
        raise ValueError(f"{path}: shard is {kind} ({size} bytes, the manifest says {info.bytes})")
    if verify and _sha256(path) != info.sha256:
        raise ValueError(f"{path}: checksum mismatch (sha256 differs from the manifest): the shard is corrupt")
    data_start, header = _read_header(path)
    tokens = _map_tensor(path, data_start, header, "tokens", mmap)
    cu_seqlens = _map_tensor(path, data_start, header, "cu_seqlens", mmap=False)
    scale = _map_tensor(path, data_start, header, "scale", mmap) if manifest.dtype in EIGHT_BIT else None
    if tokens.dtype != manifest.dtype or tokens.dim() != 2 or tokens.shape[1] != manifest.d:
        raise ValueError(
            f"{path}: tokens are {tokens.dtype} {list(tokens.shape)}, "
            f"the manifest says {manifest.dtype} [*, {manifest.d}]"
        )
    if tokens.shape[0] != info.num_tokens or cu_seqlens.numel() != info.num_docs + 1:
        raise ValueError(
            f"{path}: shard holds {cu_seqlens.numel() - 1} documents / {tokens.shape[0]} tokens, "
            f"the manifest says {info.num_docs} / {info.num_tokens}"
        )
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != info.num_tokens or bool((cu_seqlens.diff() < 0).any()):
        raise ValueError(f"{path}: cu_seqlens must start at 0, be non-decreasing and end at the token count")
    if scale is not None and scale.shape != (info.num_tokens,):
        raise ValueError(f"{path}: scale has shape {list(scale.shape)}, expected [{info.num_tokens}]")
    region = None
    if mmap:
        scale_offset = None if scale is None else data_start + header["scale"]["data_offsets"][0]
        region = FileRegion(path, data_start + header["tokens"]["data_offsets"][0],
                            tokens.shape[1] * tokens.element_size(), scale_offset)
    return Shard(tokens, cu_seqlens, scale, region)


@contextlib.contextmanager
def atomic_directory(destination, *, overwrite: bool = False):
    """Yield a temporary directory beside ``destination``; on success rename it to ``destination``.

    On any exception the temporary directory is removed and ``destination`` is untouched.
    """
    destination = Path(destination)
    if destination.exists() and not overwrite:
        raise FileExistsError(f"path: {str(destination)!r} already exists (pass overwrite=True to replace it)")
    destination.parent.mkdir(parents=True, exist_ok=True)
    temporary = destination.parent / f".{destination.name}.tmp-{uuid.uuid4().hex[:12]}"
    temporary.mkdir()
    try:
        yield temporary
        if destination.exists():
            old = destination.parent / f".{destination.name}.old-{uuid.uuid4().hex[:12]}"
            os.rename(destination, old)
            os.rename(temporary, destination)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(temporary, destination)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
