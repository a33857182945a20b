"""How index directories are written, replaced and opened so that a crash or a concurrent reader never sees a
half-written index.

Writing (:class:`IndexWriter`): a generation's shards are written into a staging directory
``.NAME.tmp-<id>/gen-<32 hex>/`` beside the destination, each file flushed to disk, then the manifest. Then

* if nothing is at the destination, the staging directory is renamed onto it with a rename that never replaces
  (``renameat2(RENAME_NOREPLACE)`` on Linux, ``renamex_np(RENAME_EXCL)`` on macOS, ``mkdir`` + ``rename`` of an
  empty directory elsewhere): of two writers, the second gets ``FileExistsError`` unless it asked to overwrite;
* if a lik index is there (and ``overwrite=True``), under a lock on the index directory the new generation's
  directory is moved into it and ``manifest.json`` is replaced atomically (``os.replace`` of a flushed file); only
  then are the generations no manifest names any more deleted: directories carrying lik's generation marker, and
  the listed shard files of a replaced version-1 index. Anything else at the destination is refused.

Every instant therefore shows the old manifest with its files or the new one with its files. Staging directories
of writers that died (marker naming a dead process of this host) are removed by the next write to the same name.

Opening (:func:`load_generation`): the manifest is read in one go, then every shard file of its generation is
opened before any is read; if one has vanished because a writer replaced the index meanwhile, the load starts
again from the new manifest. Open files and memory maps keep reading the generation they opened.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import socket
import sys
import uuid
from pathlib import Path
from typing import TypeVar
from collections.abc import Callable, Iterator

from .format import Shard, ShardInfo, shard_file_name, write_shard
from .manifest import (
    MANIFEST_NAME,
    FORMAT_NAME,
    Manifest,
    is_generation_name,
    new_generation,
    parse_manifest,
    read_manifest_bytes,
)

__all__ = ["IndexWriter", "load_generation", "is_lik_index"]

WRITER_MARKER = ".lik-writer"  # in a staging directory: who is writing it ({"pid", "host"})
GENERATION_MARKER = ".lik-generation"  # in every generation directory lik writes: lik may delete it once unused
_V1_SHARD = re.compile(r"shard-\d{5,}\.safetensors")
_MANIFEST_TEMPORARY = re.compile(re.escape(f".{MANIFEST_NAME}.tmp-") + r"[0-9a-f]{12}")
_LOAD_ATTEMPTS = 8
T = TypeVar("T")


# ---------------------------------------------------------------------------------------------- file system steps
def fsync_directory(path) -> None:
    """Make the entries of directory ``path`` (new names, renames) durable. A no-op where directories cannot be
    opened (Windows)."""
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_new_file(path: Path, text: str, durable: bool = True) -> None:
    """Create ``path`` holding ``text`` (refused if it exists); ``durable``: flushed to disk before returning."""
    with open(path, "x", encoding="utf-8") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())


_NO_REPLACE_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, getattr(errno, "ENOTSUP", errno.EINVAL))


def _rename_syscall(source: Path, target: Path) -> bool:
    """Rename without replacing through the OS's own call; ``False`` where there is none."""
    if sys.platform.startswith("linux"):
        name, flag, args = "renameat2", 1, lambda a, b: (-100, a, -100, b)  # AT_FDCWD, RENAME_NOREPLACE
    elif sys.platform == "darwin":
        name, flag, args = "renamex_np", 4, lambda a, b: (a, b)  # RENAME_EXCL
    else:
        return False
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return False
    if function(*args(os.fsencode(source), os.fsencode(target)), ctypes.c_uint(flag)) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_REPLACE_UNSUPPORTED:
        return False
    if code in (errno.EEXIST, errno.ENOTEMPTY):
        raise FileExistsError(code, os.strerror(code), str(target))
    raise OSError(code, os.strerror(code), str(source), None, str(target))


def rename_no_replace(source: Path, target: Path) -> None:
    """Rename directory ``source`` to ``target``; ``FileExistsError`` if anything is at ``target``, which is left
    as it was."""
    if _rename_syscall(source, target):
        return
    if os.name == "nt":
        os.rename(source, target)  # Windows' rename never replaces
        return
    # Claim the name with an empty directory (mkdir fails if it exists), then rename onto that empty directory.
    os.mkdir(target)
    try:
        os.rename(source, target)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.rmdir(target)  # still our empty directory, unless another process filled it (then rmdir fails)
        if error.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise FileExistsError(error.errno, os.strerror(error.errno), str(target)) from None
        raise


@contextlib.contextmanager
def directory_lock(directory: Path) -> Iterator[None]:
    """Exclusive lock of a writer on an index directory (threads and processes; released if the process dies)."""
    try:
        import fcntl
    except ImportError:  # Windows: a lock file in the directory
        import msvcrt

        with open(directory / ".lik-lock", "a+b") as f:
            while True:
                try:
                    msvcrt.locking(f.fileno(), msvcrt.LK_LOCK, 1)
                    break
                except OSError:
                    continue
            try:
                yield
            finally:
                f.seek(0)
                msvcrt.locking(f.fileno(), msvcrt.LK_UNLCK, 1)
        return
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


# ---------------------------------------------------------------------------------------------- ownership
def _writer_record() -> str:
    return json.dumps({"lik": "index writer", "pid": os.getpid(), "host": socket.gethostname()})


def _writer_is_dead(marker: Path) -> bool:
    """True only if ``marker`` is lik's writer record naming a process of this host that no longer runs."""
    if os.name == "nt":
        return False  # os.kill cannot probe a process there
    try:
        record = json.loads(marker.read_text(encoding="utf-8"))
        pid, host = record["pid"], record["host"]
    except (OSError, ValueError, TypeError, KeyError):
        return False
    if record.get("lik") != "index writer" or type(pid) is not int or pid <= 0 or host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def remove_marked(path, marker: str) -> None:
    """Delete directory ``path`` and its contents, its ownership ``marker`` file last: a crash part-way leaves the
    marker with whatever remains, so the next writer can still prove the rest is lik's and finish the job."""
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(path):
            if entry.name == marker:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, marker))
        with contextlib.suppress(OSError):
            os.rmdir(path)


def _is_empty(path) -> bool:
    with contextlib.suppress(OSError), os.scandir(path) as entries:
        return next(entries, None) is None
    return False


def _only_an_empty_marker(path) -> bool:
    """The directory holds nothing but an empty writer marker: a writer killed between creating its marker and
    writing its record into it."""
    with contextlib.suppress(OSError), os.scandir(path) as entries:
        found = list(entries)
        return (len(found) == 1 and found[0].name == WRITER_MARKER and found[0].is_file(follow_symlinks=False)
                and found[0].stat(follow_symlinks=False).st_size == 0)
    return False


def remove_dead_staging(parent: Path, name: str) -> None:
    """Remove ``.NAME.tmp-*`` directories beside ``NAME`` whose writer marker names a dead process, empty ones (what
    a removal killed between its last two steps leaves) and ones holding only an empty marker (a writer killed
    before its record was written); a live writer whose staging directory vanishes while it sets it up makes
    another."""
    pattern = re.compile(re.escape(f".{name}.tmp-") + r"[0-9a-f]{12}")
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            if pattern.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
                path = entry.path
                if _is_empty(path) or _only_an_empty_marker(path) or _writer_is_dead(Path(path) / WRITER_MARKER):
                    remove_marked(path, WRITER_MARKER)


def is_lik_index(path: Path) -> bool:
    """A directory whose manifest declares itself a lik index (whether or not its shards are sound)."""
    try:
        raw = json.loads(read_manifest_bytes(path).decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(raw, dict) and raw.get("format") == FORMAT_NAME


def _is_empty_directory(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and _is_empty(path)


def _refuse(path: Path, overwrite: bool) -> None:
    """Raise unless a write to ``path`` may go ahead: nothing there, an empty directory, or (with ``overwrite``)
    a lik index."""
    if not os.path.lexists(path):
        return
    if not overwrite:
        raise FileExistsError(f"path: {str(path)!r} already exists (pass overwrite=True to replace it)")
    if not (_is_empty_directory(path) or is_lik_index(path)):
        raise FileExistsError(f"path: {str(path)!r} exists and is not a lik index; overwrite=True replaces only "
                              "an index (remove it yourself to use this path)")


def _collect_garbage(directory: Path, current: Manifest, replaced: Manifest | None) -> None:
    """Delete what no manifest names any more (called under the directory lock, after the manifest swap): other
    generation directories that carry lik's marker, temporary manifests and writer markers of commits that did not
    finish, and the listed shard files of a replaced version-1 index."""
    for entry in os.scandir(directory):
        if entry.is_dir(follow_symlinks=False):
            if entry.name != current.generation and is_generation_name(entry.name) and (
                    os.path.isfile(os.path.join(entry.path, GENERATION_MARKER)) or _is_empty(entry.path)):
                remove_marked(entry.path, GENERATION_MARKER)
        elif entry.name == WRITER_MARKER or _MANIFEST_TEMPORARY.fullmatch(entry.name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
    if replaced is not None and replaced.generation is None:  # the version-1 layout: files beside the manifest
        for info in replaced.shards:
            path = directory / info.file
            if _V1_SHARD.fullmatch(info.file) and path.is_file() and not path.is_symlink():
                with contextlib.suppress(OSError):
                    os.unlink(path)


# ---------------------------------------------------------------------------------------------- the writer
class IndexWriter:
    """A transaction writing one generation of an index to ``destination``.

    Example::

        with IndexWriter(path, overwrite=False) as writer:
            for shard in shards:
                writer.write_shard(shard)
            manifest = writer.commit(d, dtype)

    Leaving the block without :meth:`commit` (an exception, an interrupt) removes the staging directory and
    leaves ``destination`` as it was. ``overwrite`` is checked when the writer starts and again at the commit.
    """

    def __init__(self, destination, *, overwrite: bool = False):
        self.destination = Path(destination)
        self.overwrite = bool(overwrite)
        _refuse(self.destination, self.overwrite)
        self.generation = new_generation()
        self.infos: list[ShardInfo] = []
        self.staging: Path | None = None

    def __enter__(self) -> IndexWriter:
        parent = self.destination.parent
        parent.mkdir(parents=True, exist_ok=True)
        remove_dead_staging(parent, self.destination.name)
        for _ in range(8):
            staging = parent / f".{self.destination.name}.tmp-{uuid.uuid4().hex[:12]}"
            os.mkdir(staging)
            self.staging = staging
            try:
                _write_new_file(staging / WRITER_MARKER, _writer_record(), durable=False)  # only a hint for cleanup
                os.mkdir(staging / self.generation)
                _write_new_file(staging / self.generation / GENERATION_MARKER, "", durable=False)  # the name is all
            except FileNotFoundError:
                # Another writer's cleanup took it before its record was in: start again elsewhere.
                self.__exit__()
                continue
            except BaseException:
                self.__exit__()
                raise
            return self
        raise OSError(f"path: cannot create a staging directory beside {str(self.destination)!r}")

    def __exit__(self, *exc) -> None:
        if self.staging is not None:
            remove_marked(self.staging, WRITER_MARKER)
            self.staging = None

    def write_shard(self, shard: Shard) -> ShardInfo:
        """Write the next shard file of the new generation (flushed to disk)."""
        info = write_shard(self.staging / self.generation / shard_file_name(len(self.infos)), shard)
        self.infos.append(info)
        return info

    def write_file(self, name: str, write):
        """Write one more file of the new generation: ``write(path)`` creates and flushes it (a compressed index's
        codec, :func:`lik.index.plaid_codec.write_codec`); returns what ``write`` returns."""
        return write(self.staging / self.generation / name)

    def commit(self, d: int, dtype, *, removed=(), compacted=(), codec=None) -> Manifest:
        """Publish the shards written so far as the index at ``destination``; returns its manifest.
        ``removed`` / ``compacted``: the id ranges of removed documents (see :mod:`lik.index.manifest`);
        ``codec``: the :class:`~lik.index.manifest.CodecInfo` of a compressed index's codec file."""
        manifest = Manifest(d, dtype, tuple(self.infos), self.generation, tuple(removed), tuple(compacted),
                            codec=codec)
        fsync_directory(self.staging / self.generation)
        _write_new_file(self.staging / MANIFEST_NAME, manifest.to_json())
        fsync_directory(self.staging)
        for _ in range(3):
            try:
                rename_no_replace(self.staging, self.destination)
            except FileExistsError:
                if not self.overwrite:
                    raise FileExistsError(
                        f"path: {str(self.destination)!r} already exists (it appeared while this index was being "
                        "written; nothing was replaced: pass overwrite=True to replace it)") from None
                _refuse(self.destination, overwrite=True)
                if not _is_empty_directory(self.destination):
                    if self._replace(manifest):
                        return manifest
                    continue  # the index vanished meanwhile: start again
                with contextlib.suppress(OSError):  # fails, harmlessly, if someone filled it meanwhile
                    os.rmdir(self.destination)
                continue
            self.staging = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.destination / WRITER_MARKER)
            fsync_directory(self.destination.parent)
            return manifest
        raise FileExistsError(f"path: {str(self.destination)!r} keeps changing; nothing was replaced")

    def _replace(self, manifest: Manifest) -> bool:
        """Swap ``manifest`` into the lik index at ``destination`` and delete what it no longer names; ``False``
        if ``destination`` vanished before anything was moved."""
        destination = self.destination
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(directory_lock(destination))
            except FileNotFoundError:
                return False
            if not is_lik_index(destination):  # checked again under the lock: nothing else is ever replaced
                _refuse(destination, overwrite=True)
            try:
                replaced = parse_manifest(read_manifest_bytes(destination), destination / MANIFEST_NAME)
            except (OSError, ValueError):
                replaced = None  # a damaged index is replaced all the same; only marked generations are removed
            os.rename(self.staging / self.generation, destination / self.generation)
            fsync_directory(destination)
            temporary = destination / f".{MANIFEST_NAME}.tmp-{uuid.uuid4().hex[:12]}"
            _write_new_file(temporary, manifest.to_json())
            os.replace(temporary, destination / MANIFEST_NAME)
            fsync_directory(destination)
            _collect_garbage(destination, manifest, replaced)
        remove_marked(self.staging, WRITER_MARKER)
        self.staging = None
        return True


# ---------------------------------------------------------------------------------------------- the reader
def load_generation(directory, open_files: Callable[[Manifest], T]) -> tuple[Manifest, T]:
    """Read the manifest of the index at ``directory`` and ``open_files(manifest)`` (which must open every shard
    file before reading any); if a file is missing because a writer replaced the index meanwhile, start again."""
    directory = Path(directory)
    for attempt in range(_LOAD_ATTEMPTS):
        text = read_manifest_bytes(directory)
        manifest = parse_manifest(text, directory / MANIFEST_NAME)
        try:
            return manifest, open_files(manifest)
        except FileNotFoundError:
            if attempt + 1 == _LOAD_ATTEMPTS:
                raise
            try:
                changed = read_manifest_bytes(directory) != text
            except FileNotFoundError:
                changed = False
            if not changed:
                raise
    raise AssertionError("unreachable")
