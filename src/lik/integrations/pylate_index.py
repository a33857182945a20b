"""lik's exact index as a PyLate index: ``lik.integrations.pylate.Index``.

An end-to-end PyLate index (``is_end_to_end_index`` is True, like PyLate's ``PLAID``): ``__call__`` returns the exact
MaxSim top-k, ``pylate.retrieve.ColBERT(index=...)`` passes it through, and ``get_documents_embeddings`` gives the
stored embeddings to ``pylate.rank.rerank``. It imports PyLate when it is imported (``lik.integrations.pylate``
imports it only when ``Index`` is first used).

On disk, ``<index_folder>/<index_name>/`` holds ``lik/`` (a :class:`lik.Index` directory) and
``documents_ids.json`` (PyLate's document ids in lik's id order, ``null`` for removed documents). Each change
writes the lik index first (atomically), then the id map (atomically); opening the folder reconciles the two, so a
process killed at any point leaves the collection as it was before the call or as after it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import uuid
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from ..index import Index as LikIndex
from ..index.building import as_int
from ..index.manifest import DTYPES
from ..index.placement import PLACEMENTS
from ..index.storage import fsync_directory

try:
    from pylate.indexes.base import Base
    from pylate.rank import RerankResult
except ModuleNotFoundError as error:  # the host, or one of its own dependencies
    raise ImportError(f"lik.integrations.pylate.Index needs PyLate: {error}. Install it with: "
                      'pip install "lik-kernels[pylate]"') from error

__all__ = ["Index"]

MAP_NAME = "documents_ids.json"
MAP_FORMAT = "lik-pylate-ids"
_MAP_TEMPORARY = re.compile(re.escape(f".{MAP_NAME}.tmp-") + r"[0-9a-f]{12}")
CODECS = ("exact",)


def _as_matrix(x, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        tensor = x.detach()
    elif isinstance(x, np.ndarray):
        tensor = torch.from_numpy(np.ascontiguousarray(x))
    elif isinstance(x, (list, tuple)):
        try:
            tensor = torch.as_tensor(np.asarray(x, dtype=np.float32))
        except (TypeError, ValueError) as error:
            raise TypeError(f"{name} must be a [tokens, dim] array ({error})") from None
    else:
        raise TypeError(f"{name} must be a torch.Tensor, a numpy array or a list, got {type(x).__name__}")
    if tensor.dim() != 2:
        raise ValueError(f"{name} must be 2-D [tokens, dim], got shape {list(tensor.shape)}")
    if not tensor.is_floating_point():
        raise TypeError(f"{name} must hold floats, got {tensor.dtype}")
    return tensor


def _matrices(x, name: str) -> list[torch.Tensor]:
    """A batch of embeddings as 2-D tensors: ``[B, L, d]`` (tensor / array), one ``[L, d]`` (one item), or a list."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        if x.ndim == 2:
            return [_as_matrix(x, f"{name}[0]")]
        if x.ndim != 3:
            raise ValueError(f"{name} must be [batch, tokens, dim] or a list of [tokens, dim], got {list(x.shape)}")
        return [_as_matrix(item, f"{name}[{n}]") for n, item in enumerate(x)]
    if isinstance(x, (list, tuple)):
        return [_as_matrix(item, f"{name}[{n}]") for n, item in enumerate(x)]
    raise TypeError(f"{name} must be a torch.Tensor, a numpy array or a list, got {type(x).__name__}")


def _ids(documents_ids, name: str) -> list:
    """PyLate document ids: a str or an int, or an iterable of them (JSON keeps both kinds)."""
    if isinstance(documents_ids, (str, int)) and not isinstance(documents_ids, bool):
        return [documents_ids]
    if not isinstance(documents_ids, Iterable):
        raise TypeError(f"{name} must be a list of str / int ids, got {type(documents_ids).__name__}")
    ids = list(documents_ids)
    for number, document_id in enumerate(ids):
        if isinstance(document_id, np.integer):
            ids[number] = document_id = int(document_id)
        if not isinstance(document_id, (str, int)) or isinstance(document_id, bool):
            raise TypeError(f"{name}[{number}] must be a str or an int, got {type(document_id).__name__}")
    return ids


class Index(Base):
    """lik's exact MaxSim search as a PyLate index: ``pylate.retrieve.ColBERT(index=Index(...))`` returns the exact
    top-k (no candidate generation, no compression), on the GPU, in host RAM or on disk.

    Args:
        index_folder, index_name: the collection lives in ``<index_folder>/<index_name>/`` (created if needed);
            an existing collection there is opened.
        override: start the collection empty (an existing one is replaced by the next ``add_documents``). Only a
            collection of this class (or an empty folder) is ever replaced: any other folder raises
            ``FileExistsError``.
        codec: ``"exact"`` (tokens stored as ``dtype``). lik's compressed (PLAID) codec does not exist yet:
            anything else raises ``ValueError``.
        placement: where the index is searched: ``"gpu"``, ``"host"``, ``"disk"`` or ``"auto"`` (lik.Index.load).
        dtype: how tokens are stored: float16 (default), bfloat16, float32, or int8 / float8_e4m3fn (quantized per
            token, and so are the queries; the scores are MaxSim of the dequantized operands).
        device: where queries are scored (default: the current CUDA device, else CPU).
        batch_size: queries scored per lik search call.
        show_progress: progress bars while documents are added.

    Example:
        >>> from pylate import retrieve
        >>> index = Index(index_folder="indexes", index_name="lik", override=True)
        >>> index.add_documents(["a", "b"], [torch.randn(30, 128), torch.randn(12, 128)])
        >>> retrieve.ColBERT(index=index).retrieve(torch.randn(1, 32, 128), k=1)   # [[{"id": ..., "score": ...}]]

    Each ``add_documents`` / ``remove_documents`` call writes a new generation of the lik index (every shard): add
    documents in large batches. Removed documents stay in the shards until :meth:`compact`. One process writes
    a collection at a time.
    """

    is_end_to_end_index = True

    def __init__(self, index_folder: str = "indexes", index_name: str = "lik", override: bool = False,
                 codec: str = "exact", placement: str = "auto", dtype: torch.dtype = torch.float16, device=None,
                 batch_size: int = 512, show_progress: bool = True) -> None:
        if codec not in CODECS:
            raise ValueError(f"codec must be one of {CODECS}, got {codec!r}: lik's compressed (PLAID) codec does not "
                             "exist yet")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        if dtype not in DTYPES.values():
            raise TypeError(f"dtype must be one of torch.{', torch.'.join(DTYPES)}, got {dtype!r}")
        self.batch_size = as_int(batch_size, "batch_size")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        self.codec, self.placement, self.dtype, self.device = codec, placement, dtype, device
        self.progress = None if show_progress else False
        self.path = Path(index_folder) / index_name
        self._index: LikIndex | None = None
        self._names: list = []  # PyLate id of each lik id (None: removed)
        self._positions: dict = {}  # PyLate id -> lik id, for the live documents
        exists = self._check_folder()
        if override or not exists:
            self.path.mkdir(parents=True, exist_ok=True)
            self._write_map()  # empty: the collection is empty from now on, whatever lik/ still holds
        else:
            self._open()

    # ------------------------------------------------------------------ the folder
    def _check_folder(self) -> bool:
        """True if a collection of this class is at ``path``; raises if something else is."""
        if not os.path.lexists(self.path):
            return False
        if not self.path.is_dir() or self.path.is_symlink():
            raise FileExistsError(f"index_name: {str(self.path)!r} exists and is not a folder")
        if (self.path / MAP_NAME).is_file():
            return True
        if any(not _MAP_TEMPORARY.fullmatch(entry.name) for entry in os.scandir(self.path)):
            raise FileExistsError(f"index_name: {str(self.path)!r} exists and is not a lik PyLate index (no "
                                  f"{MAP_NAME}); choose another index_name, or remove it yourself")
        return False

    def _read_map(self) -> list:
        path = self.path / MAP_NAME
        try:
            raw = json.loads(path.read_bytes().decode("utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError) as error:
            raise ValueError(f"{path}: not valid JSON ({error})") from None
        is_map = isinstance(raw, dict) and raw.get("format") == MAP_FORMAT and raw.get("version") == 1
        names = raw.get("ids") if is_map else None
        if not isinstance(names, list):
            raise ValueError(f"{path}: not a lik PyLate id map (format {MAP_FORMAT!r}, version 1, a list 'ids')")
        seen = set()
        for number, name in enumerate(names):
            if name is not None and (not isinstance(name, (str, int)) or isinstance(name, bool) or name in seen):
                raise ValueError(f"{path}: ids[{number}] must be a str, an int or null, each id once; got {name!r:.80}")
            seen.add(name)
        return names

    def _write_map(self) -> None:
        """Replace the id map atomically (a flushed temporary file renamed over it)."""
        for entry in os.scandir(self.path):  # what a writer killed before its rename left
            if _MAP_TEMPORARY.fullmatch(entry.name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
        temporary = self.path / f".{MAP_NAME}.tmp-{uuid.uuid4().hex[:12]}"
        with open(temporary, "x", encoding="utf-8") as f:
            json.dump({"format": MAP_FORMAT, "version": 1, "ids": self._names}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, self.path / MAP_NAME)
        fsync_directory(self.path)

    def _open(self) -> None:
        """Load the lik index and its id map, and reconcile them after a write that was cut short: documents the
        map does not name (an add killed before the map was written) are removed again; names of documents the
        index removed (a removal killed before the map was written) are dropped."""
        names = self._read_map()
        if not names:
            return
        index = LikIndex.load(self.path / "lik", placement=self.placement, device=self.device)
        if len(names) > index.num_ids:
            raise ValueError(f"{self.path / MAP_NAME}: names {len(names)} documents, the index at "
                             f"{self.path / 'lik'} has {index.num_ids}: the two do not belong together")
        names += [None] * (index.num_ids - len(names))
        live = set(index.live_ids().tolist())
        names = [name if number in live else None for number, name in enumerate(names)]
        orphans = [number for number in live if names[number] is None]
        if orphans:
            index.remove(orphans)
        self._index, self._names = index, names
        self._positions = {name: number for number, name in enumerate(names) if name is not None}

    def _commit(self) -> None:
        """Write the lik index, then the id map (see the module docstring)."""
        self._index.save(self.path / "lik", overwrite=True, progress=self.progress)
        self._write_map()

    # ------------------------------------------------------------------ PyLate's index interface
    def add_documents(self, documents_ids, documents_embeddings, batch_size: int = 2000) -> Index:
        """Add documents: ``documents_ids`` (str / int ids, new to the collection) and their embeddings (a list of
        ``[tokens, dim]`` tensors / arrays, or ``[batch, tokens, dim]``). ``batch_size`` is accepted for PyLate's
        signature: documents stream into the index one shard at a time whatever its value. Returns ``self``."""
        names = _ids(documents_ids, "documents_ids")
        docs = _matrices(documents_embeddings, "documents_embeddings")
        as_int(batch_size, "batch_size")
        if len(names) != len(docs):
            raise ValueError(f"documents_ids has {len(names)} ids but documents_embeddings has {len(docs)} documents")
        if len(set(names)) != len(names):
            raise ValueError("documents_ids: the same id appears twice")
        known = [name for name in names if name in self._positions]
        if known:
            raise ValueError(f"documents_ids: {known[0]!r} is already in the index (remove_documents it first)")
        width = self._index.d if self._index is not None else (docs[0].shape[1] if docs else None)
        for number, doc in enumerate(docs):
            if doc.shape[1] != width:
                raise ValueError(f"documents_embeddings[{number}] has dim {doc.shape[1]}, the index has {width}")
        if not docs:
            return self
        if self._index is None:
            self._index = LikIndex.build(docs, dtype=self.dtype, out=self.path / "lik", overwrite=True,
                                         progress=self.progress, placement=self.placement, device=self.device)
            self._names = []
        else:
            self._index.add(docs, progress=self.progress)
            self._index.save(self.path / "lik", overwrite=True, progress=self.progress)
        first = len(self._names)
        self._names += names
        self._positions.update((name, first + number) for number, name in enumerate(names))
        self._write_map()
        return self

    def remove_documents(self, documents_ids) -> Index:
        """Remove documents by id (all must be in the collection: ``KeyError`` otherwise, and nothing is removed).
        Searches never return them again; their tokens stay in the shards until :meth:`compact`."""
        names = _ids(documents_ids, "documents_ids")
        unknown = [name for name in names if name not in self._positions]
        if unknown:
            raise KeyError(f"documents_ids: {unknown[0]!r} is not in the index")
        if not names:
            return self
        self._index.remove([self._positions[name] for name in names])
        for name in set(names):
            self._names[self._positions.pop(name)] = None
        self._commit()
        return self

    def compact(self) -> Index:
        """Drop removed documents from the shards (ids are unchanged) and write the collection."""
        if self._index is not None:
            self._index.compact()
            self._commit()
        return self

    def __len__(self) -> int:
        return len(self._positions)

    def __call__(self, queries_embeddings, k: int = 10, subset=None) -> list[list[RerankResult]]:
        """Exact MaxSim top-``k`` of each query: a list, per query, of ``{"id": ..., "score": float}`` by descending
        score (ties to the earlier added document), as PyLate's ``PLAID`` returns; fewer than ``k`` when fewer
        documents are there.

        Args:
            queries_embeddings: ``[Nq, Lq, dim]`` (tensor / array), one ``[Lq, dim]`` query, or a list of queries
                (their lengths may differ: every token of each query counts).
            k: results per query (positive).
            subset: ids to search among: one list for every query, or one list per query. Ids not in the
                collection are ignored.
        """
        if self._index is None or not self._positions:
            raise ValueError("The index is empty. Please add documents before querying.")
        k = as_int(k, "k")
        if k < 1:
            raise ValueError(f"k must be positive, got {k}")
        queries = _matrices(queries_embeddings, "queries_embeddings")
        for number, query in enumerate(queries):
            if query.shape[1] != self._index.d:
                raise ValueError(f"queries_embeddings[{number}] has dim {query.shape[1]}, the index has "
                                 f"{self._index.d}")
        if subset is not None and not isinstance(subset, (list, tuple)):
            raise TypeError(f"subset must be a list of ids or a list of lists of ids, got {type(subset).__name__}")
        if subset is not None and subset and isinstance(subset[0], (list, tuple)):
            if len(subset) != len(queries):
                raise ValueError(f"subset has {len(subset)} lists for {len(queries)} queries")
            return [self._search([query], k, self._doc_ids(ids))[0] for query, ids in zip(queries, subset)]
        doc_ids = None if subset is None else self._doc_ids(subset)
        results = []
        for start in range(0, len(queries), self.batch_size):
            results += self._search(queries[start : start + self.batch_size], k, doc_ids)
        return results

    def _doc_ids(self, subset) -> list[int]:
        return [self._positions[name] for name in _ids(subset, "subset") if name in self._positions]

    def _search(self, queries: list[torch.Tensor], k: int, doc_ids) -> list[list[RerankResult]]:
        """One lik search of ``queries``, padded to the longest with a mask (a padded token adds nothing)."""
        available = len(self._positions) if doc_ids is None else len(set(doc_ids))
        k = min(k, available)
        if k == 0:
            return [[] for _ in queries]
        longest = max(query.shape[0] for query in queries)
        Q = torch.zeros(len(queries), longest, self._index.d, dtype=torch.float32)
        q_mask = torch.zeros(len(queries), longest, dtype=torch.bool)
        for number, query in enumerate(queries):
            Q[number, : query.shape[0]] = query
            q_mask[number, : query.shape[0]] = True
        device = self._index.device
        scores, ids = self._index.search(Q.to(device), k, q_mask.to(device), doc_ids=doc_ids)
        return [[RerankResult(id=self._names[i], score=s) for i, s in zip(row_ids, row_scores)]
                for row_ids, row_scores in zip(ids.tolist(), scores.tolist())]

    def get_documents_embeddings(self, documents_ids) -> list:
        """The stored embeddings (float32 CPU tensors ``[tokens, dim]``) of ``documents_ids``, in its shape: a list
        of lists of ids (what ``pylate.retrieve`` and ``rank.rerank`` use) gives a list of lists, a flat list a
        list. ``KeyError`` for an id not in the collection."""
        nested = isinstance(documents_ids, (list, tuple)) and any(isinstance(g, (list, tuple)) for g in documents_ids)
        groups = [_ids(group, f"documents_ids[{n}]") for n, group in enumerate(documents_ids)] if nested else [
            _ids(documents_ids, "documents_ids")]
        flat = [name for group in groups for name in group]
        unknown = [name for name in flat if name not in self._positions]
        if unknown:
            raise KeyError(f"documents_ids: {unknown[0]!r} is not in the index")
        tokens = [t.float() for t in self._index.get([self._positions[name] for name in flat])] if flat else []
        out, start = [], 0
        for group in groups:
            out.append(tokens[start : start + len(group)])
            start += len(group)
        return out if nested else out[0]
