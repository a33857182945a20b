"""Shard files of a :class:`lik.Index`: safetensors files of one packed segment each, checked before use.

A saved index is a directory (see :mod:`lik.index.manifest` for the manifest and :mod:`lik.index.storage` for how
directories are written and replaced)::

    manifest.json
    gen-<32 hex>/shard-00000.safetensors   tokens [T_s, d] (dtype), cu_seqlens int64 [N_s + 1],
                                           scale fp32 [T_s] (8-bit only)
    gen-<32 hex>/shard-00000.safetensors   (compressed) residuals uint8 [T_s, d * nbits / 8], codes int32 [T_s],
                                           cu_seqlens int64 [N_s + 1]
                                           exact_tokens [T_s, d] (float16 / int8), exact_scale fp32 [T_s]
                                           (int8): the copy kept for rescoring, when the manifest names one
    gen-<32 hex>/codec.safetensors         (compressed) the codec (see lik.index.plaid_codec)

Documents are numbered in shard order, then in order inside a shard (insertion order). A shard's safetensors
header is parsed here, not by the ``safetensors`` library, so that ``"disk"`` can memory-map the token bytes and
read rows straight from the file; every header is validated as the safetensors format demands (offsets in order,
contiguous, inside the file, byte counts equal to shape times dtype size) whether or not checksums are verified.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from .manifest import (  # noqa: F401 (re-exported: the manifest's names were defined here before)
    DTYPES,
    EIGHT_BIT,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    dtype_name,
    read_manifest,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "DTYPES",
    "EIGHT_BIT",
    "ShardInfo",
    "Manifest",
    "Shard",
    "FileRegion",
    "ShardFile",
    "dtype_name",
    "shard_file_name",
    "write_shard",
    "read_manifest",
    "open_shard_file",
    "open_shard",
    "fsync_file",
]

# The safetensors library refuses larger headers too.
MAX_HEADER_BYTES = 100_000_000
# Every safetensors dtype tag with its size in bytes (a header naming another tag is refused).
_TAG_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
              "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_TAG_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "I8": torch.int8,
               "F8_E4M3": torch.float8_e4m3fn, "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8}


@dataclass(frozen=True)
class FileRegion:
    """Where the rows of a memory-mapped shard lie in its file (byte offsets of token row 0 and of its scale), so
    that the ``"disk"`` placement can read a chunk's rows straight into a pinned buffer. ``handle`` is the shard
    file opened when the index was loaded: reads go to that file even after a writer replaced the index."""

    path: Path
    handle: ShardFile
    tokens_offset: int
    row_bytes: int
    scale_offset: int | None

    def skip_rows(self, rows: int) -> FileRegion:
        """The region of the rows after the first ``rows``."""
        scale = None if self.scale_offset is None else self.scale_offset + 4 * rows
        return FileRegion(self.path, self.handle, self.tokens_offset + rows * self.row_bytes, self.row_bytes, scale)


@dataclass(frozen=True)
class Shard:
    """One shard's documents: ``tokens [T, d]``, ``cu_seqlens`` int64 ``[n + 1]`` from 0, ``scale`` fp32 ``[T]``;
    ``region``: where ``tokens`` and ``scale`` lie in the shard file, when they are memory-mapped from it.

    A compressed (PLAID) shard keeps its packed residuals, uint8 ``[T, d * nbits / 8]``, as ``tokens`` and its
    centroid codes, int32 ``[T]``, as ``scale`` (also :attr:`codes`): both are per-token rows of fixed width, so
    chunking, placement, streaming and compaction treat them as they treat an 8-bit shard's tokens and scales.
    ``copy``: a compressed shard's exact copy of the same documents (float16, or int8 with scales; same
    ``cu_seqlens``), kept in host memory or on disk for rescoring, or ``None``."""

    tokens: torch.Tensor
    cu_seqlens: torch.Tensor
    scale: torch.Tensor | None
    region: FileRegion | None = None
    copy: Shard | None = None

    @property
    def num_docs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def codes(self) -> torch.Tensor | None:
        """A compressed shard's int32 centroid codes ``[T]`` (the ``scale`` slot)."""
        return self.scale

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    def slice_docs(self, start: int, stop: int) -> Shard:
        """Documents ``[start, stop)`` of this shard (views, offsets rebased to 0)."""
        first, last = int(self.cu_seqlens[start]), int(self.cu_seqlens[stop])
        return Shard(
            self.tokens[first:last],
            self.cu_seqlens[start : stop + 1] - first,
            None if self.scale is None else self.scale[first:last],
            None if self.region is None else self.region.skip_rows(first),
            None if self.copy is None else self.copy.slice_docs(start, stop),
        )


def _sha256(handle) -> str:
    digest = hashlib.sha256()
    handle.seek(0)
    for block in iter(lambda: handle.read(1 << 22), b""):
        digest.update(block)
    return digest.hexdigest()


def fsync_file(path) -> None:
    """Flush ``path``'s data to the disk (a crash after this returns keeps the file whole)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def shard_file_name(number: int) -> str:
    return f"shard-{number:05d}.safetensors"


def write_shard(path: Path, shard: Shard) -> ShardInfo:
    """Write ``shard`` to the new file ``path``, flush it to disk and describe it for the manifest."""
    cu = shard.cu_seqlens.to(torch.int64).contiguous()
    if shard.tokens.dtype == torch.uint8:  # compressed: residuals and codes
        tensors = {"residuals": shard.tokens.contiguous(), "codes": shard.scale.to(torch.int32).contiguous(),
                   "cu_seqlens": cu}
    else:
        tensors = {"tokens": shard.tokens.contiguous(), "cu_seqlens": cu}
    if shard.scale is not None and shard.tokens.dtype != torch.uint8:
        tensors["scale"] = shard.scale.to(torch.float32).contiguous()
    if shard.copy is not None:
        tensors["exact_tokens"] = shard.copy.tokens.cpu().contiguous()
        if shard.copy.scale is not None:
            tensors["exact_scale"] = shard.copy.scale.cpu().to(torch.float32).contiguous()
    path = Path(path)
    save_file(tensors, str(path))
    fsync_file(path)
    with open(path, "rb") as handle:
        sha = _sha256(handle)
    return ShardInfo(path.name, shard.num_docs, shard.num_tokens, path.stat().st_size, sha)


class ShardFile(io.FileIO):
    """A shard file opened (unbuffered, read only) when an index is loaded, closed when nothing refers to it."""

    def __del__(self):
        self.close()


def open_shard_file(directory, manifest: Manifest, info: ShardInfo) -> ShardFile:
    """Open one shard of the index at ``directory`` (unbuffered, read only). Refuses a file whose real path is
    outside the index directory (a link that escapes it)."""
    root = os.path.realpath(directory)
    path = manifest.data_directory(directory) / info.file
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root or real == root:
        raise ValueError(f"{path}: shard file resolves outside the index directory ({real!r}); refusing to read it")
    try:
        # Non-blocking open: a FIFO planted in the directory must not hang the load; only regular files are read.
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: shard listed in the manifest is missing") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path}: is not a regular file, not a shard")
    handle = ShardFile(fd, "rb")
    handle.name = str(path)  # for messages (a file opened from a descriptor is named by its number)
    return handle


def _header(handle, path: Path, size: int) -> tuple[int, dict]:
    """``(data_start, {name: (tag, shape, begin, end)})`` of a safetensors file, validated against its size."""
    handle.seek(0)
    prefix = handle.read(8)
    if len(prefix) < 8:
        raise ValueError(f"{path}: truncated shard (no safetensors header)")
    (length,) = struct.unpack("<Q", prefix)
    if length > min(size - 8, MAX_HEADER_BYTES):
        raise ValueError(f"{path}: safetensors header length {length} exceeds the file ({size} bytes)")
    blob = handle.read(length)
    if len(blob) < length:
        raise ValueError(f"{path}: truncated shard (header cut short)")
    try:
        raw = json.loads(blob.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
    entries = {}
    for name, entry in raw.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"{path}: safetensors header entry {name!r} is not {{dtype, shape, data_offsets}}")
        tag, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(tag, str) or tag not in _TAG_BYTES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {tag!r:.40}")
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise ValueError(f"{path}: tensor {name!r} has a malformed shape {shape!r:.80}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(n) is int for n in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise ValueError(f"{path}: tensor {name!r} has malformed data_offsets {offsets!r:.80}")
        if math.prod(shape) * _TAG_BYTES[tag] != offsets[1] - offsets[0]:
            raise ValueError(f"{path}: tensor {name!r}: shape {shape} of {tag} needs "
                             f"{math.prod(shape) * _TAG_BYTES[tag]} bytes, its data_offsets span "
                             f"{offsets[1] - offsets[0]}")
        entries[name] = (tag, shape, offsets[0], offsets[1])
    # As the safetensors format demands: the tensors tile the data area in order, without gaps or overlaps.
    data_start, end = 8 + length, 0
    for name, (_, _, begin, stop) in sorted(entries.items(), key=lambda item: (item[1][2], item[1][3])):
        if begin != end:
            raise ValueError(f"{path}: tensor {name!r} data_offsets start at {begin}, expected {end} "
                             "(overlapping or with a gap)")
        end = stop
    if data_start + end != size:
        raise ValueError(f"{path}: the tensors' data ends at byte {data_start + end}, the file has {size} bytes")
    return data_start, entries


def _map_tensor(handle, path: Path, data_start: int, entry, mmap: bool) -> torch.Tensor:
    tag, shape, begin, end = entry
    dtype = _TAG_DTYPES[tag]
    count = end - begin
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    if mmap:
        # Copy-on-write mapping of the opened file: pages are read on access, and stay this file's pages.
        raw = torch.from_numpy(np.memmap(handle, dtype=np.uint8, mode="c", offset=data_start + begin,
                                         shape=(count,)))
    else:
        handle.seek(data_start + begin)
        data = handle.read(count)
        if len(data) != count:
            raise ValueError(f"{path}: truncated shard (tensor data cut short)")
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(dtype).view(shape)


def _entry(entries: dict, name: str, path: Path, tags, what: str):
    entry = entries.get(name)
    if entry is None:
        raise ValueError(f"{path}: shard has no {name!r} tensor")
    if entry[0] not in tags:
        raise ValueError(f"{path}: tensor {name!r} is {entry[0]}, expected {what}")
    return entry


def open_shard(handle, path: Path, info: ShardInfo, manifest: Manifest, *, mmap: bool, verify: bool,
               header_only: bool = False) -> Shard | None:
    """Check one shard, opened by :func:`open_shard_file`, against its manifest entry and its own header, then
    read (or memory-map) it.

    ``path``: the shard's path, for messages. ``verify``: also compare the file's sha256 with the manifest.
    ``header_only``: check the size and header against the manifest and read nothing else (returns ``None``).
    Errors name the file.
    """
    path = Path(path)
    size = os.fstat(handle.fileno()).st_size
    if size != info.bytes:
        kind = "truncated" if size < info.bytes else "larger than recorded"
        raise ValueError(f"{path}: shard is {kind} ({size} bytes, the manifest says {info.bytes})")
    data_start, entries = _header(handle, path, size)
    codec = manifest.codec
    if codec is None:
        tag = next(t for t, dtype in _TAG_DTYPES.items() if dtype == manifest.dtype)
        width, tokens_entry = manifest.d, _entry(entries, "tokens", path, (tag,),
                                                 f"{tag} (the manifest says {dtype_name(manifest.dtype)})")
    else:
        width, tokens_entry = manifest.d * codec.nbits // 8, _entry(entries, "residuals", path, ("U8",), "U8")
    cu_entry = _entry(entries, "cu_seqlens", path, ("I64", "I32"), "an integer tensor (I64)")
    if tokens_entry[1] != [info.num_tokens, width] or cu_entry[1] != [info.num_docs + 1]:
        raise ValueError(
            f"{path}: shard holds {'tokens' if codec is None else 'residuals'} {tokens_entry[1]} and cu_seqlens "
            f"{cu_entry[1]}; the manifest says {info.num_docs} documents / {info.num_tokens} tokens of d={manifest.d}"
            + ("" if codec is None else f" at {codec.nbits} bits")
        )
    scale_entry = None
    if codec is not None:
        scale_entry = _entry(entries, "codes", path, ("I32",), "I32")
        if scale_entry[1] != [info.num_tokens]:
            raise ValueError(f"{path}: codes has shape {scale_entry[1]}, expected [{info.num_tokens}]")
    elif manifest.dtype in EIGHT_BIT:
        scale_entry = _entry(entries, "scale", path, ("F32",), "F32")
        if scale_entry[1] != [info.num_tokens]:
            raise ValueError(f"{path}: scale has shape {scale_entry[1]}, expected [{info.num_tokens}]")
    rescore = None if codec is None else codec.rescore
    copy_entries = None
    if rescore is not None:
        tag = next(t for t, dtype in _TAG_DTYPES.items() if dtype == rescore)
        copy_entries = [_entry(entries, "exact_tokens", path, (tag,), f"{tag} (the manifest's rescore_dtype)")]
        if rescore in EIGHT_BIT:
            copy_entries.append(_entry(entries, "exact_scale", path, ("F32",), "F32"))
        if copy_entries[0][1] != [info.num_tokens, manifest.d] or any(e[1] != [info.num_tokens]
                                                                        for e in copy_entries[1:]):
            raise ValueError(f"{path}: the rescoring copy has shapes {[e[1] for e in copy_entries]}, expected "
                             f"[{info.num_tokens}, {manifest.d}] (and [{info.num_tokens}] scales)")
    if header_only:
        return None
    if verify and _sha256(handle) != info.sha256:
        raise ValueError(f"{path}: checksum mismatch (sha256 differs from the manifest): the shard is corrupt")
    cu_seqlens = _map_tensor(handle, path, data_start, cu_entry, mmap=False).to(torch.int64)
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != info.num_tokens or bool((cu_seqlens.diff() < 0).any()):
        raise ValueError(f"{path}: cu_seqlens must start at 0, be non-decreasing and end at the token count")
    tokens = _map_tensor(handle, path, data_start, tokens_entry, mmap)
    scale = None if scale_entry is None else _map_tensor(handle, path, data_start, scale_entry, mmap)
    # Codes index the centroids inside the scoring kernels, which do not check them: a damaged one is refused here
    # (reads the codes, 4 bytes a token, also when checksums are not verified).
    if codec is not None and scale.numel() and bool((scale.min() < 0) | (scale.max() >= codec.num_centroids)):
        raise ValueError(f"{path}: codes outside [0, {codec.num_centroids}) (the codec's centroids): corrupt shard")
    region = None
    if mmap:
        scale_offset = None if scale_entry is None else data_start + scale_entry[2]
        region = FileRegion(path, handle, data_start + tokens_entry[2], width * tokens.element_size(),
                            scale_offset)
    copy = None
    if copy_entries is not None:
        parts = [_map_tensor(handle, path, data_start, entry, mmap) for entry in copy_entries]
        copy = Shard(parts[0], cu_seqlens, parts[1] if len(parts) > 1 else None)
    return Shard(tokens, cu_seqlens, scale, region, copy)
