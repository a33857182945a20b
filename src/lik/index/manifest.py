"""The manifest of a saved :class:`lik.Index`: its fields, their validation, and the rule for the names it holds.

``manifest.json`` (version 2)::

    {"format": "lik-index", "version": 2, "generation": "gen-<32 hex>", "d": 128, "dtype": "int8",
     "num_docs": N, "num_tokens": T,
     "shards": [{"file": "shard-00000.safetensors", "num_docs", "num_tokens", "bytes", "sha256"}, ...]}

Shard ``file`` s live in the generation's subdirectory ``<index>/<generation>/``. Version 1 (lik before
generations) kept them in the index directory itself and has no ``generation``; it is still read. Every name a
manifest holds is a plain file name (no separator, no ``..``), so nothing outside the index directory is read.

Version 3 is written only by an index that has removed documents (a lik that reads versions 1 and 2 only then
refuses it, instead of returning removed documents); it adds, in document ids (insertion order)::

    "num_ids": I,                    ids given so far (the next document added gets id I)
    "removed": [[start, stop], ...], ids removed whose tokens the shards still hold (search skips them)
    "compacted": [[start, stop], ...] ids removed and no longer stored (the shards skip them)
    "ids_sha256": "<64 hex>"          sha256 of these three (see ids_digest): a damaged list is refused

Ranges are half-open, sorted, disjoint, and the two lists share no id; ``num_ids`` is ``num_docs`` plus the ids
in ``compacted``. The stored documents (shard order) have the ids of ``[0, num_ids)`` outside ``compacted``, in
increasing order.

Version 4 is written by a compressed index (a lik that reads versions 1 to 3 only refuses it); it has every
version-3 field and ``"codec"``, the residual codec's file in the generation directory (see
:mod:`lik.index.plaid_codec`)::

    "codec": {"name": "plaid", "nbits": 2, "num_centroids": K, "file": "codec.safetensors", "bytes", "sha256",
              "rescore_dtype": "int8"}   (optional: the dtype of the exact copy each shard keeps for rescoring)

Its shards hold ``residuals`` uint8 ``[T_s, d * nbits / 8]`` and ``codes`` int32 ``[T_s]`` instead of ``tokens``;
``dtype`` is then the float dtype queries and decoded tokens are scored in.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "MANIFEST_NAME",
    "DTYPES",
    "EIGHT_BIT",
    "ShardInfo",
    "CodecInfo",
    "IdRanges",
    "Manifest",
    "dtype_name",
    "new_generation",
    "ids_digest",
    "is_generation_name",
    "check_plain_name",
    "parse_manifest",
    "read_manifest_bytes",
    "read_manifest",
]

FORMAT_NAME = "lik-index"
FORMAT_VERSION = 4  # the newest written: an exact index without removed documents is written as version 2
READABLE_VERSIONS = (1, 2, 3, 4)
MANIFEST_NAME = "manifest.json"
# A manifest lists one short entry per shard: this bounds what a hostile file makes a load read into memory.
MAX_MANIFEST_BYTES = 1 << 28
INT64_MAX = (1 << 63) - 1
DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "int8": torch.int8,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
EIGHT_BIT = (torch.int8, torch.float8_e4m3fn)
_GENERATION = re.compile(r"gen-[0-9a-f]{32}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_ID_FIELDS = ("num_ids", "removed", "compacted", "ids_sha256")


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise TypeError(f"dtype must be one of {sorted(DTYPES)}, got {dtype}")


def ids_digest(num_ids: int, removed, compacted) -> str:
    """The sha256 that guards a version-3 manifest's id fields (nothing else ties them to the shards' bytes)."""
    text = json.dumps([num_ids, [list(r) for r in removed], [list(r) for r in compacted]], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def new_generation() -> str:
    """A fresh generation name: ``gen-`` and 32 random hex digits (never reused, so a reader's files never change)."""
    return f"gen-{uuid.uuid4().hex}"


def is_generation_name(name: str) -> bool:
    return _GENERATION.fullmatch(name) is not None


def check_plain_name(name, where: str) -> str:
    """``name`` if it is a plain file name inside a directory; else ``ValueError`` naming ``where``."""
    if not isinstance(name, str):
        raise ValueError(f"{where} must be a file name (a string), got {type(name).__name__}")
    if name in ("", ".", "..") or any(c in name for c in "/\\\0") or ":" in name or name != name.strip():
        raise ValueError(f"{where} must be a plain file name inside the index directory, got {name!r}")
    return name


@dataclass(frozen=True)
class ShardInfo:
    file: str
    num_docs: int
    num_tokens: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class CodecInfo:
    """The compressed codec of a version-4 index: ``name`` ("plaid"), ``nbits`` (1, 2, 4), ``num_centroids`` and
    the codec file (a plain name in the generation directory) with its size and sha256; ``rescore``: the dtype
    (float16 or int8) of the exact copy of the tokens every shard keeps for rescoring, or ``None``."""

    name: str
    nbits: int
    num_centroids: int
    file: str
    bytes: int
    sha256: str
    rescore: torch.dtype | None = None


IdRanges = tuple[tuple[int, int], ...]  # sorted, disjoint half-open ranges [start, stop) of document ids


@dataclass(frozen=True)
class Manifest:
    """``generation``: the subdirectory holding the shard files (``None``: a version-1 index, files beside the
    manifest). ``removed`` / ``compacted``: id ranges of removed documents still stored / no longer stored;
    ``num_ids``: ids given so far (``None``: ``num_docs`` plus the compacted ids)."""

    d: int
    dtype: torch.dtype
    shards: tuple[ShardInfo, ...]
    generation: str | None = None
    removed: IdRanges = ()
    compacted: IdRanges = ()
    num_ids: int | None = None
    codec: CodecInfo | None = None

    def __post_init__(self):
        if self.num_ids is None:
            object.__setattr__(self, "num_ids", self.num_docs + sum(b - a for a, b in self.compacted))

    @property
    def num_docs(self) -> int:
        return sum(s.num_docs for s in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    def data_directory(self, directory) -> Path:
        """Where this manifest's shard files lie, for an index at ``directory``."""
        return Path(directory) if self.generation is None else Path(directory) / self.generation

    def to_json(self) -> str:
        if self.generation is None:
            raise ValueError("a manifest is written with its generation (the version-1 layout is read only)")
        fields = {
            "format": FORMAT_NAME,
            "version": 2,
            "generation": self.generation,
            "d": self.d,
            "dtype": dtype_name(self.dtype),
            "num_docs": self.num_docs,
            "num_tokens": self.num_tokens,
        }
        if self.removed or self.compacted or self.num_ids != self.num_docs or self.codec is not None:
            fields.update(version=3 if self.codec is None else 4, num_ids=self.num_ids,
                          removed=[list(r) for r in self.removed], compacted=[list(r) for r in self.compacted],
                          ids_sha256=ids_digest(self.num_ids, self.removed, self.compacted))
        if self.codec is not None:
            fields["codec"] = {name: value for name, value in vars(self.codec).items() if name != "rescore"}
            if self.codec.rescore is not None:
                fields["codec"]["rescore_dtype"] = dtype_name(self.codec.rescore)
        text = json.dumps({**fields, "shards": [vars(s) for s in self.shards]}, indent=1)
        # One range per line, not one number per line: a long removal list stays readable and small.
        return re.sub(r"\[\n\s*(\d+),\n\s*(\d+)\n\s*\]", r"[\1, \2]", text)


def _count(raw: dict, key: str, where: str, path, low: int = 0) -> int:
    if key not in raw:
        raise ValueError(f"{path}: field {where}{key!r} is missing")
    value = raw[key]
    if type(value) is not int or not low <= value <= INT64_MAX:
        raise ValueError(f"{path}: field {where}{key!r} must be an integer in [{low}, 2**63), got {value!r:.80}")
    return value


def _file_and_sha(raw: dict, field, path) -> tuple[str, str]:
    """A shard's or the codec's ``file`` (a plain name in the index directory) and ``sha256`` (64 lowercase hex
    digits); ``field(key)`` is the field's name in the one-line errors."""
    if "file" not in raw:
        raise ValueError(f"{path}: field {field('file')} is missing")
    file = check_plain_name(raw["file"], f"{path}: field {field('file')}")
    sha = raw.get("sha256")
    if not isinstance(sha, str) or _SHA256.fullmatch(sha) is None:
        raise ValueError(f"{path}: field {field('sha256')} must be 64 lowercase hex digits, got {sha!r:.80}")
    return file, sha


def _shard_info(raw, number: int, path) -> ShardInfo:
    where = f"shards[{number}]."
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: field 'shards[{number}]' must be an object, got {type(raw).__name__}")
    file, sha = _file_and_sha(raw, lambda key: f"{where}{key!r}", path)
    return ShardInfo(file, _count(raw, "num_docs", where, path), _count(raw, "num_tokens", where, path),
                     _count(raw, "bytes", where, path), sha)


def _codec_info(raw: dict, path) -> CodecInfo:
    codec = raw.get("codec")
    if not isinstance(codec, dict):
        raise ValueError(f"{path}: field 'codec' must be an object, got {type(codec).__name__}")
    if codec.get("name") != "plaid":
        raise ValueError(f"{path}: field 'codec.name' must be 'plaid', got {codec.get('name')!r:.40}")
    if codec.get("nbits") not in (1, 2, 4) or type(codec.get("nbits")) is not int:
        raise ValueError(f"{path}: field 'codec.nbits' must be 1, 2 or 4, got {codec.get('nbits')!r:.40}")
    file, sha = _file_and_sha(codec, lambda key: f"'codec.{key}'", path)
    rescore = codec.get("rescore_dtype")
    if rescore is not None and rescore not in ("float16", "int8"):
        raise ValueError(f"{path}: field 'codec.rescore_dtype' must be 'float16' or 'int8', got {rescore!r:.40}")
    return CodecInfo("plaid", codec["nbits"], _count(codec, "num_centroids", "codec.", path, low=1), file,
                     _count(codec, "bytes", "codec.", path), sha, None if rescore is None else DTYPES[rescore])


def _id_ranges(raw: dict, key: str, num_ids: int, path) -> IdRanges:
    """A list of sorted, disjoint ``[start, stop)`` id ranges inside ``[0, num_ids)``."""
    value = raw.get(key)
    if not isinstance(value, list):
        raise ValueError(f"{path}: field {key!r} must be a list of [start, stop] id ranges, got {value!r:.80}")
    ranges, end = [], 0
    for number, pair in enumerate(value):
        if (not isinstance(pair, list) or len(pair) != 2 or not all(type(n) is int for n in pair)
                or not end <= pair[0] < pair[1] <= num_ids):
            raise ValueError(f"{path}: field '{key}[{number}]' must be [start, stop] with {end} <= start < stop <= "
                             f"num_ids ({num_ids}), sorted and disjoint; got {pair!r:.80}")
        ranges.append((pair[0], pair[1]))
        end = pair[1]
    return tuple(ranges)


def _overlap(first: IdRanges, second: IdRanges) -> tuple[int, int] | None:
    """A range of ``first`` that shares an id with one of ``second`` (both sorted and disjoint), else ``None``."""
    j = 0
    for start, stop in first:
        while j < len(second) and second[j][1] <= start:
            j += 1
        if j < len(second) and second[j][0] < stop:
            return start, stop
    return None


def _removals(raw: dict, num_docs: int, path) -> dict:
    """The version-3 fields: ``num_ids``, ``removed``, ``compacted``, checked against each other and the shards."""
    num_ids = _count(raw, "num_ids", "", path)
    removed = _id_ranges(raw, "removed", num_ids, path)
    compacted = _id_ranges(raw, "compacted", num_ids, path)
    if (both := _overlap(removed, compacted)) is not None:
        raise ValueError(f"{path}: ids {list(both)} are both in field 'removed' and in field 'compacted'")
    dropped = sum(b - a for a, b in compacted)
    if num_ids != num_docs + dropped:
        raise ValueError(f"{path}: field 'num_ids' ({num_ids}) must equal num_docs ({num_docs}) plus the ids in "
                         f"'compacted' ({dropped})")
    if raw.get("ids_sha256") != ids_digest(num_ids, removed, compacted):
        raise ValueError(f"{path}: field 'ids_sha256' does not match num_ids / removed / compacted: the manifest is "
                         "corrupt")
    return {"num_ids": num_ids, "removed": removed, "compacted": compacted}


def parse_manifest(text: bytes, path) -> Manifest:
    """Check every field of a manifest's bytes (type, range, consistency); errors are ``ValueError`` s naming
    ``path`` and the field. Nothing here touches a shard: :func:`lik.index.format.open_shard` cross-checks each
    shard's own header against its entry."""
    try:
        raw = json.loads(text.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError, and ints past Python's digit limit
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    except RecursionError:
        raise ValueError(f"{path}: not a lik.Index manifest (nested too deeply)") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise ValueError(f"{path}: not a lik.Index manifest (format field is not {FORMAT_NAME!r})")
    version = raw.get("version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise ValueError(f"{path}: format version {version!r:.40}, this lik reads versions {READABLE_VERSIONS}")
    generation = None
    if version >= 2:
        generation = raw.get("generation")
        if not isinstance(generation, str) or not is_generation_name(generation):
            raise ValueError(f"{path}: field 'generation' must be 'gen-' and 32 hex digits, got {generation!r:.80}")
    dtype = raw.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"{path}: malformed manifest: field 'dtype' must be one of {sorted(DTYPES)}, "
                         f"got {dtype!r:.40}")
    d = _count(raw, "d", "", path, low=1)
    shards = raw.get("shards")
    if not isinstance(shards, list):
        raise ValueError(f"{path}: field 'shards' must be a list, got {type(shards).__name__}")
    infos = tuple(_shard_info(s, number, path) for number, s in enumerate(shards))
    seen = set()
    for number, info in enumerate(infos):
        if info.file in seen:
            raise ValueError(f"{path}: field 'shards[{number}].file' names {info.file!r} a second time")
        seen.add(info.file)
    manifest = Manifest(d, DTYPES[dtype], infos, generation)
    for key, total in (("num_docs", manifest.num_docs), ("num_tokens", manifest.num_tokens)):
        if _count(raw, key, "", path) != total:
            raise ValueError(f"{path}: num_docs / num_tokens do not equal the sums over the shard list "
                             f"(field {key!r} is {raw[key]}, the shards sum to {total})")
    if version >= 4:
        codec = _codec_info(raw, path)
        if codec.file in seen:
            raise ValueError(f"{path}: field 'codec.file' names the shard file {codec.file!r}")
        if DTYPES[dtype] in EIGHT_BIT:
            raise ValueError(f"{path}: field 'dtype' of a compressed index must be a float dtype, got {dtype!r}")
        manifest = Manifest(d, DTYPES[dtype], infos, generation, **_removals(raw, manifest.num_docs, path),
                            codec=codec)
    elif "codec" in raw:
        raise ValueError(f"{path}: field 'codec' belongs to format version 4, the manifest says {version}")
    elif version >= 3:
        manifest = Manifest(d, DTYPES[dtype], infos, generation, **_removals(raw, manifest.num_docs, path))
    elif present := [key for key in _ID_FIELDS if key in raw]:
        # Only version 3 has them: a version digit damaged from 3 must not bring removed documents back.
        raise ValueError(f"{path}: field {present[0]!r} belongs to format version 3, the manifest says {version}")
    return manifest


def read_manifest_bytes(directory) -> bytes:
    """The bytes of ``directory/manifest.json``, read in one go (a writer replaces the file atomically)."""
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if not directory.is_dir():
        raise FileNotFoundError(f"path: no index directory at {str(directory)!r}")
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: missing; {str(directory)!r} is not a saved lik.Index") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: is a directory, not a lik.Index manifest") from None
    if len(text) > MAX_MANIFEST_BYTES:
        raise ValueError(f"{path}: larger than {MAX_MANIFEST_BYTES} bytes, not a lik.Index manifest")
    return text


def read_manifest(directory) -> Manifest:
    """Parse and check ``directory/manifest.json``; errors name the path and the bad field."""
    return parse_manifest(read_manifest_bytes(directory), Path(directory) / MANIFEST_NAME)
