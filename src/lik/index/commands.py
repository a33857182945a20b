"""``lik index build | info`` and ``lik search``: the command-line face of :class:`lik.Index`.

Every input file is untrusted: ``.pt`` files are read with ``torch.load(weights_only=True, mmap=True)`` (tensors,
lists and dicts, never code; sizes come from the file, so a declared shape cannot allocate memory the file does
not hold), safetensors headers are checked by the ``safetensors`` library, and every layout is validated before
a document reaches the index. A mistake is reported as one :class:`CommandError` line naming the file or flag.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import time
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch

from .building import progress_bar
from .format import DTYPES, MANIFEST_NAME, read_manifest
from .index import Index
from .plaid_codec import codec_flags, describe
from .storage import is_lik_index

__all__ = [
    "CommandError", "UsageError", "EMBEDDING_LAYOUTS", "run_index", "run_search", "read_embeddings", "read_queries",
    "format_rate", "one_line", "percentile",
]

EMBEDDING_LAYOUTS = """\
embedding files (.safetensors, or .pt / .pth written by torch.save) hold one of these layouts:
  packed        'tokens' [T, d] float and 'cu_seqlens' [N + 1] integers (0, ..., T, non-decreasing):
                document i is tokens[cu_seqlens[i]:cu_seqlens[i + 1]]
  padded        'embeddings' [N, L, d] float and optionally 'mask' [N, L], bool or 0/1 integers (a Hugging
                Face attention_mask): document i is the positions of row i where the mask is 1
  one tensor    a single [N, L, d] tensor (a .pt holding just the tensor, or a .safetensors file with one
                tensor): all L positions of each row
  per document  one [L_i, d] tensor per document: a .pt list, or named tensors (a .pt dict, or a .safetensors
                file) in key order, numeric keys numerically
float16 / bfloat16 / float32 / float64 values. .pt files are read with torch.load(weights_only=True, mmap=True):
tensors, lists and dicts only, never code; torch's legacy pre-1.6 format is refused (torch.save it again).
"""

SUFFIXES = (".safetensors", ".pt", ".pth")
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


class CommandError(ValueError):
    """A mistake in a file the command read or wrote: reported as one line, exit status 1."""


class UsageError(CommandError):
    """A mistake on the command line itself (a flag's value, a path it names): one line, exit status 2."""


def one_line(text: str, limit: int = 400) -> str:
    """``text`` on one line, at most ``limit`` characters; torch's weights-only refusal is cut to its reason
    (never its advice to load the file with ``weights_only=False``)."""
    reason = re.search(r"WeightsUnpickler error:\s*(.*?)(\n\s*\n|$)", text, flags=re.S)
    if reason:
        text = reason.group(1)
    elif text.startswith("Weights only load failed"):
        paragraphs = [p for p in re.split(r"\n\s*\n", text)[1:] if p.strip()]
        text = " ".join(p for p in paragraphs if not p.startswith("Check the documentation")) or text
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_rate(count: float, seconds: float, unit: str) -> str:
    """``count`` per second with an SI prefix chosen for the size: "850 tokens/s", "12.3 k tokens/s", "4.56 M ..."."""
    rate = count / max(seconds, 1e-9)
    prefix, scale = next(((p, s) for p, s in (("G ", 1e9), ("M ", 1e6), ("k ", 1e3)) if rate >= s), ("", 1.0))
    rate /= scale
    digits = 2 if rate < 10 else 1 if rate < 100 else 0
    return f"{rate:.{digits}f} {prefix}{unit}/s"


# ---------------------------------------------------------------------------------------------- reading files
def _tensor(value, path: Path, what: str, dims: str, dtypes=FLOATS) -> torch.Tensor:
    """``value`` if it is a dense CPU tensor with the dimensions ``dims`` names and one of ``dtypes``."""
    if not isinstance(value, torch.Tensor):
        raise CommandError(f"{path}: {what} is {type(value).__name__}, expected a tensor {dims}")
    if value.layout != torch.strided or value.is_nested or value.device.type != "cpu":
        raise CommandError(f"{path}: {what} is a {value.layout} tensor on {value.device}, expected a dense tensor")
    if value.dim() != dims.count(",") + 1:
        raise CommandError(f"{path}: {what} has shape {list(value.shape)}, expected {dims}")
    if value.dtype not in dtypes:
        names = "/".join(str(t).removeprefix("torch.") for t in dtypes)
        raise CommandError(f"{path}: {what} has dtype {str(value.dtype).removeprefix('torch.')}, expected {names}")
    if dtypes is FLOATS and value.shape[-1] < 1:
        raise CommandError(f"{path}: {what} has shape {list(value.shape)}: the embedding width d must be >= 1")
    return value.detach()


def _mask(value, path: Path, shape: torch.Size) -> torch.Tensor:
    mask = _tensor(value, path, "'mask'", "[N, L]", (torch.bool, *INTEGERS))
    if mask.shape != shape:
        raise CommandError(f"{path}: 'mask' has shape {list(mask.shape)}, 'embeddings' needs {list(shape)}")
    if mask.dtype != torch.bool:
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            raise CommandError(f"{path}: 'mask' holds {int(mask[bad][0])}: an integer mask must be 0/1 (1 = token)")
        mask = mask != 0
    return mask


def _cu_seqlens(value, path: Path, total: int) -> list[int]:
    cu = _tensor(value, path, "'cu_seqlens'", "[N + 1]", INTEGERS)
    if cu.numel() == 0:
        raise CommandError(f"{path}: 'cu_seqlens' is empty, expected [N + 1] offsets starting at 0")
    offsets = cu.tolist()
    if offsets[0] != 0:
        raise CommandError(f"{path}: 'cu_seqlens' starts at {offsets[0]}, it must start at 0")
    cu = cu.to(torch.int64)
    decreasing = torch.nonzero(cu[1:] < cu[:-1])
    if decreasing.numel():
        i = int(decreasing[0]) + 1
        raise CommandError(f"{path}: 'cu_seqlens' decreases at position {i} ({offsets[i - 1]} -> {offsets[i]})")
    if offsets[-1] != total:
        raise CommandError(f"{path}: 'cu_seqlens' ends at {offsets[-1]}, 'tokens' has {total} rows")
    return offsets


def _padded_rows(batch: torch.Tensor, mask: torch.Tensor | None, path: Path, what: str) -> Iterator[torch.Tensor]:
    if batch.shape[1] == 0:
        raise CommandError(f"{path}: {what} has shape {list(batch.shape)}: no token positions (L = 0)")
    for i in range(batch.shape[0]):
        yield batch[i] if mask is None else batch[i][mask[i]]


def _key_order(key: str):
    return (0, int(key), "") if key.isdigit() else (1, 0, key)


def _from_named(path: Path, keys: list, get, shape_of) -> Iterator[torch.Tensor]:
    """The documents of named tensors (a safetensors file, or a dict from a .pt file)."""
    if not all(isinstance(key, str) for key in keys):
        raise CommandError(f"{path}: dictionary keys must be strings")
    names = set(keys)
    if names & {"tokens", "cu_seqlens"}:
        if names != {"tokens", "cu_seqlens"}:
            raise CommandError(f"{path}: a packed file holds exactly 'tokens' and 'cu_seqlens', found {sorted(names)}")
        tokens = _tensor(get("tokens"), path, "'tokens'", "[T, d]")
        offsets = _cu_seqlens(get("cu_seqlens"), path, tokens.shape[0])
        for start, stop in zip(offsets[:-1], offsets[1:]):
            yield tokens[start:stop]
        return
    if names & {"embeddings", "mask"}:
        if "embeddings" not in names or not names <= {"embeddings", "mask"}:
            raise CommandError(f"{path}: a padded file holds 'embeddings' and optionally 'mask', found {sorted(names)}")
        embeddings = get("embeddings")
        if isinstance(embeddings, (list, tuple)) and "mask" not in names:  # {"embeddings": [docs]}
            yield from _from_list(path, embeddings, "'embeddings'")
            return
        batch = _tensor(embeddings, path, "'embeddings'", "[N, L, d]")
        mask = _mask(get("mask"), path, batch.shape[:2]) if "mask" in names else None
        yield from _padded_rows(batch, mask, path, "'embeddings'")
        return
    if len(keys) == 1 and shape_of(keys[0]) is not None and len(shape_of(keys[0])) == 3:
        yield from _padded_rows(_tensor(get(keys[0]), path, repr(keys[0]), "[N, L, d]"), None, path, repr(keys[0]))
        return
    for key in sorted(keys, key=_key_order):
        yield _tensor(get(key), path, f"tensor {key!r}", "[L, d]")


def _from_list(path: Path, items, what: str) -> Iterator[torch.Tensor]:
    for number, item in enumerate(items):
        yield _tensor(item, path, f"{what} item {number}", "[L, d]")


def _read_safetensors(path: Path) -> Iterator[torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:  # the library validates the header against the file
        keys = list(f.keys())
        if not keys:
            raise CommandError(f"{path}: holds no tensors")
        yield from _from_named(path, keys, f.get_tensor, lambda key: f.get_slice(key).get_shape())


def _read_pickle(path: Path) -> Iterator[torch.Tensor]:
    if not zipfile.is_zipfile(path):
        raise CommandError(f"{path}: not a torch.save zip file (torch's legacy pre-1.6 format is refused: "
                           "torch.save the data again)")
    data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if isinstance(data, dict):
        yield from _from_named(path, list(data), data.__getitem__,
                               lambda key: data[key].shape if isinstance(data[key], torch.Tensor) else None)
    elif isinstance(data, torch.Tensor):
        if data.dim() != 3:
            raise CommandError(f"{path}: a single tensor must be [N, L, d], got shape {list(data.shape)} (save "
                               "one document as a list [tensor], N one-token documents as [N, 1, d])")
        yield from _padded_rows(_tensor(data, path, "the tensor", "[N, L, d]"), None, path, "the tensor")
    elif isinstance(data, (list, tuple)):
        yield from _from_list(path, data, "list")
    else:
        raise CommandError(f"{path}: holds a {type(data).__name__}; expected a list of [L, d] tensors, an "
                           "[N, L, d] tensor or a dict (see --help for the layouts)")


def read_embeddings(path) -> Iterator[torch.Tensor]:
    """Yield the ``[L_i, d]`` documents of one embedding file, in one of :data:`EMBEDDING_LAYOUTS`.

    Any failure, whatever raised it (safetensors, the unpickler, a malformed layout), is a :class:`CommandError`
    naming ``path``. Example: ``docs = list(read_embeddings("corpus.safetensors"))``.
    """
    path = Path(path)
    if not path.is_file():
        raise CommandError(f"{path}: no such file")
    if path.suffix not in SUFFIXES:
        raise CommandError(f"{path}: embedding files must be .safetensors, .pt or .pth")
    width = None
    try:
        for doc in _read_safetensors(path) if path.suffix == ".safetensors" else _read_pickle(path):
            if width is not None and doc.shape[1] != width:
                raise CommandError(f"{path}: documents of different widths (d={width} and d={doc.shape[1]})")
            width = doc.shape[1]
            yield doc
    except CommandError:
        raise
    except pickle.UnpicklingError as error:
        raise CommandError(f"{path}: refused by torch.load(weights_only=True): {one_line(str(error), 240)}") from error
    except Exception as error:  # a hostile file can make any reader fail in any way: the file is to blame
        raise CommandError(f"{path}: cannot be read ({type(error).__name__}: {one_line(str(error), 240)})") from error


def read_queries(path) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries of a file as ``(Q [Nq, Lq, d] float32, q_mask [Nq, Lq] bool)``, ragged queries padded."""
    queries = list(read_embeddings(path))
    if not queries:
        raise CommandError(f"{path}: holds no queries")
    longest = max(max(q.shape[0] for q in queries), 1)
    Q = torch.zeros(len(queries), longest, queries[0].shape[1])
    mask = torch.zeros(len(queries), longest, dtype=torch.bool)
    for i, q in enumerate(queries):
        Q[i, : q.shape[0]] = q
        mask[i, : q.shape[0]] = True
    return Q, mask


def _documents(paths: list[str]) -> Iterator[torch.Tensor]:
    width, first = None, None
    for path in paths:
        for doc in read_embeddings(path):
            if width is None:
                width, first = doc.shape[1], path
            elif doc.shape[1] != width:
                raise CommandError(f"{path}: documents have d={doc.shape[1]}, those of {first} have d={width}")
            yield doc
    if width is None:
        raise CommandError(f"{', '.join(map(str, paths))}: no documents to index")


# ---------------------------------------------------------------------------------------------- checks
def _input_files(paths: list[str], flag: str = "") -> None:
    for path in map(Path, paths):
        if not path.is_file() or not os.access(path, os.R_OK):
            raise UsageError(f"{flag}{path}: {'not a readable file' if path.exists() else 'no such file'}")
        if path.suffix not in SUFFIXES:
            raise UsageError(f"{flag}{path}: embedding files must be .safetensors, .pt or .pth")


def _index_directory(path: str) -> Path:
    if not Path(path).is_dir():
        raise UsageError(f"{path}: no such index directory")
    return Path(path)


def _check_build_target(args) -> None:
    """Refuse, before reading anything, an --out that this build must not replace."""
    out, flag = Path(args.out), f"--out {args.out}"
    if out.is_symlink():
        raise UsageError(f"{flag}: is a symbolic link; name the index directory itself")
    if out.exists():
        if not out.is_dir():
            raise UsageError(f"{flag}: is a file, not an index directory")
        if not args.overwrite:
            raise UsageError(f"{flag}: already exists (pass --overwrite to replace the index there)")
        with os.scandir(out) as entries:
            empty = next(entries, None) is None
        if not empty and not is_lik_index(out):
            raise UsageError(f"{flag}: is not a lik index (no lik {MANIFEST_NAME}); --overwrite replaces an index, "
                             "never another directory")
        for path in args.embeddings:
            if Path(path).resolve().is_relative_to(out.resolve()):
                raise UsageError(f"{flag}: holds the input {path}, which replacing the index would delete")
        return
    ancestor = out.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}: cannot be created ({ancestor} is not a writable directory)")


def _check_output(args) -> Path | None:
    """Refuse, before the search, an --output that is not a new (or, with --overwrite, a replaceable) file."""
    if args.output is None:
        return None
    out, flag = Path(args.output), f"--output {args.output}"
    if out.is_symlink():
        raise UsageError(f"{flag}: is a symbolic link; name the file itself")
    if out.exists():
        if not out.is_file():
            raise UsageError(f"{flag}: exists and is not a regular file")
        if not args.overwrite:
            raise UsageError(f"{flag}: already exists (pass --overwrite to replace it)")
    parent = out.absolute().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}: {parent} is not a writable directory")
    resolved = out.resolve()
    if resolved.is_relative_to(Path(args.index).resolve()) or is_lik_index(resolved.parent):
        raise UsageError(f"{flag}: lies inside an index directory; write the results elsewhere")
    if resolved == Path(args.queries).resolve():
        raise UsageError(f"{flag}: is the --queries file")
    return out


def _save_atomically(results: dict, out: Path, overwrite: bool) -> None:
    """Write ``results`` beside ``out`` and move it into place whole; without ``overwrite`` never replace a file."""
    temporary = out.absolute().parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        try:
            with open(temporary, "xb") as f:
                torch.save(results, f)
                f.flush()
                os.fsync(f.fileno())
        except OSError as error:
            raise CommandError(f"--output {out}: cannot be written ({error.strerror or error})") from error
        if overwrite:
            os.replace(temporary, out)
            return
        try:
            os.link(temporary, out)  # fails, replacing nothing, if a file appeared at `out` during the search
        except OSError as error:
            if isinstance(error, FileExistsError) or os.path.lexists(out):
                raise CommandError(f"--output {out}: a file appeared there during the search; nothing written "
                                   "(pass --overwrite to replace it)") from None
            os.replace(temporary, out)  # a file system without hard links: a narrow window instead of none
    finally:
        temporary.unlink(missing_ok=True)


def _load_index(path: Path, **options) -> Index:
    try:
        return Index.load(path, **options)
    except Exception as error:  # a damaged or hostile index can fail in any way: the index is to blame
        message = one_line(str(error))
        if not isinstance(error, (ValueError, OSError)):
            message = f"{type(error).__name__}: {message}"
        raise CommandError(message if str(path) in message else f"{path}: {message}") from error


# ---------------------------------------------------------------------------------------------- commands
def run_index(args: argparse.Namespace) -> int:
    if args.index_command == "info":
        directory = _index_directory(args.path)
        index = _load_index(directory, placement="disk", device="cpu", verify=args.verify)
        print(json.dumps(describe(directory, index, read_manifest(directory), args.verify), indent=1))
        return 0
    if args.shard_tokens < 1:
        raise UsageError(f"--shard-tokens must be at least 1, got {args.shard_tokens}")
    compression = codec_flags(args, UsageError)
    _input_files(args.embeddings)
    _check_build_target(args)
    start = time.perf_counter()
    try:
        index = Index.build(_documents(args.embeddings), dtype=DTYPES[args.dtype], out=args.out, **compression,
                            shard_tokens=args.shard_tokens, overwrite=args.overwrite, placement="disk", device="cpu")
    except FileExistsError as error:  # --out was checked above: someone wrote there meanwhile (said in flags)
        what = ("something other than a lik index, or another writer's index, took its place" if args.overwrite
                else "it appeared (pass --overwrite to replace an index)")
        raise CommandError(f"--out {args.out}: changed during the build, nothing replaced: {what}") from error
    seconds = time.perf_counter() - start
    tokens = sum(s.num_tokens for s in index.segments)
    what = args.dtype if index.codec is None else f"plaid {index.codec.nbits}-bit"
    print(f"built {args.out}: {len(index)} documents, {tokens} tokens, d={index.d}, {what} "
          f"in {seconds:.2f} s ({format_rate(len(index), seconds, 'documents')})")
    return 0


def run_search(args: argparse.Namespace) -> int:
    if args.k < 0:
        raise UsageError(f"--k must be at least 0, got {args.k}")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.device is not None:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            raise UsageError(f"--device {args.device}: not a device name (cpu, cuda, cuda:1, ...)") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise UsageError(f"--device {args.device}: no CUDA device is available")
    if args.placement == "gpu" and not torch.cuda.is_available():
        raise UsageError("--placement gpu: no CUDA device is available")
    directory = _index_directory(args.index)
    _input_files([args.queries], "--queries ")
    output = _check_output(args)

    index = _load_index(directory, placement=args.placement, device=args.device)
    Q, q_mask = read_queries(args.queries)
    if Q.shape[-1] != index.d:
        raise CommandError(f"{args.queries}: queries have d={Q.shape[-1]}, the index {directory} has d={index.d}")
    if args.k > len(index):
        raise UsageError(f"--k {args.k} is larger than the index ({len(index)} documents)")
    device = index.device
    if Q.shape[0]:  # one untimed call first: kernel compilation and first-touch are not a query's latency
        index.search(Q[: args.batch_size].to(device), args.k, q_mask[: args.batch_size].to(device))[1].cpu()
    scores, ids, latencies = [], [], []
    start = time.perf_counter()
    for first in progress_bar(range(0, Q.shape[0], args.batch_size), progress=None, desc="search", unit="batch"):
        batch = slice(first, first + args.batch_size)
        called = time.perf_counter()
        s, i = index.search(Q[batch].to(device), args.k, q_mask[batch].to(device))
        scores.append(s.cpu())
        ids.append(i.cpu())  # (the copy to the host waits for the results: the call's whole latency)
        latencies.append(time.perf_counter() - called)
    seconds = time.perf_counter() - start
    scores, ids = torch.cat(scores), torch.cat(ids)
    if output is not None:
        _save_atomically({"scores": scores, "ids": ids}, output, args.overwrite)
    else:
        for number, (row_scores, row_ids) in enumerate(zip(scores.tolist(), ids.tolist())):
            hits = ", ".join(f"{i} ({s:.4f})" for s, i in zip(row_scores, row_ids))
            print(f"query {number}: {hits}")
    tokens = sum(s.num_tokens for s in index.segments)
    print(f"searched {Q.shape[0]} queries x {len(index)} documents ({tokens} tokens, placement "
          f"{index.placement}, {device}) in {seconds:.3f} s: {format_rate(Q.shape[0], seconds, 'queries')}, "
          f"{format_rate(Q.shape[0] * tokens, seconds, 'document tokens')}")
    if latencies:
        print(f"{Q.shape[0] / seconds:.1f} queries/s; latency of a call of up to {args.batch_size} queries: "
              f"p50 {percentile(latencies, 50) * 1e3:.3f} ms, p99 {percentile(latencies, 99) * 1e3:.3f} ms "
              f"({len(latencies)} calls)")
    return 0


def percentile(values, q: float) -> float:
    """The ``q``-th percentile of ``values`` (linear interpolation between the nearest ranks, as numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
