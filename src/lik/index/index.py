"""``lik.Index``: a ragged packed corpus, saved as safetensors shards, searched exactly where it lives."""

from __future__ import annotations

import threading
from pathlib import Path
from collections.abc import Iterable

import torch
import torch.distributed as dist

from .building import as_int, shards_from
from .distributed import gather_top_k
from .documents import IdSpace, check_ids, compact_segments, rank_counts, read_documents
from .format import Shard, dtype_name, open_shard, open_shard_file
from .placement import PLACEMENTS, ResidentSource, StreamedSource, coalesce, plan_chunks
from ..compression import is_colbert_index, is_fast_plaid_index, load_plaid_index
from .plaid_codec import CodecTrainer, check_codec, read_codec
from .plaid_search import residual_scorer, search_candidates, search_mode
from .rescore import check_rescore_dtype, describe_copy, rescore_count, rescore_top
from .search import check_queries, search_buckets, select_chunks
from .state import State as _State
from .state import auto_placement as _auto_placement
from .state import check_shard as _check_shard
from .state import resolve_device as _resolve_device
from .state import place_all as _place_all
from .state import place_segment as _place_segment
from .state import write_index as _write
from .storage import load_generation

__all__ = ["Index", "DEFAULT_SHARD_TOKENS", "DEFAULT_CHUNK_TOKENS"]

DEFAULT_SHARD_TOKENS = 1 << 22  # tokens per shard file (1 GiB of fp16 at d = 128)
DEFAULT_CHUNK_TOKENS = 1 << 20  # tokens scored per maxsim_packed call
_LOAD_OPTIONS = {"placement", "device", "chunk_tokens", "verify"}


class Index:
    """An exact MaxSim search index over ragged documents (ids in insertion order: ``0, 1, ...``).

    Example:
        >>> docs = [torch.randn(n, 128) for n in (300, 57, 0, 512)]
        >>> index = lik.Index.build(docs, dtype=torch.int8)
        >>> index.save("my-index")
        >>> index = lik.Index.load("my-index", placement="auto")
        >>> scores, ids = index.search(torch.randn(32, 128), k=2)      # fp32 [2], int64 [2]
        >>> scores, ids = index.search(torch.randn(4, 32, 128), k=2, doc_ids=[0, 3])   # [4, 2] each

    Compressed: ``lik.Index.build(docs, codec="plaid", nbits=2)`` stores each token as a centroid code and 2-bit
    residual buckets (ColBERTv2 / PLAID, about 36 bytes a token at d = 128 instead of 256 in fp16), searched
    exhaustively or by candidate generation (``search(..., n_probe=, candidates=)``); see ``docs/search.md``.
    ``lik.Index.load`` also opens a colbert-ai or fast-plaid index directory.

    Several GPUs: in each process of a ``torch.distributed`` group, ``Index.load(path, shard=rank,
    num_shards=world_size)``; ``search`` then merges the ranks' top-k with collectives and returns the same
    global result on every rank.

    Removal: :meth:`remove` marks documents removed (search never returns them; ``save`` keeps the marks) and
    :meth:`compact` drops them from the shards. Ids never change: a removed id is not reused, and after
    ``compact`` every remaining document keeps its id (``add`` continues after the highest id ever given).

    Threads: any number of threads may search while one thread calls :meth:`add`, :meth:`remove` or
    :meth:`compact` (concurrent writes are serialised by a lock). A search sees the documents present when it
    started; one that starts after a write returned sees its change. Searches of a streamed index (``"host"`` /
    ``"disk"`` on a GPU) share its device buffers and run one at a time.
    """

    def __init__(self, d: int, dtype: torch.dtype, segments=(), *, placement="host", device="cpu",
                 first_id=0, total_docs=None, shard=0, num_shards=1, chunk_tokens=None, codec=None,
                 rescore_dtype=None):
        dtype_name(dtype)
        self.d, self.dtype = int(d), dtype
        # A compressed index's lik.compression.ResidualCodec (on ``device``); None for exact tokens. rescore_dtype:
        # the dtype of its shards' exact copies (lik.index.rescore), None without.
        self.codec, self.rescore_dtype = None if codec is None else codec.to(device), rescore_dtype
        self.placement, self.device = placement, torch.device(device)
        self.first_id, self.shard, self.num_shards = first_id, shard, num_shards
        # None: DEFAULT_CHUNK_TOKENS for streamed placements and the CPU, whole shards for a GPU-resident index.
        self._chunk_tokens_given = chunk_tokens is not None
        self.chunk_tokens = as_int(DEFAULT_CHUNK_TOKENS if chunk_tokens is None else chunk_tokens, "chunk_tokens")
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be positive, got {self.chunk_tokens}")
        self._whole_docs = total_docs  # a rank's index knows the whole index's size from the manifest
        self._write_lock = threading.Lock()
        self._state = _State(segments, total_docs)

    @property
    def segments(self) -> list[Shard]:
        """The packed segments this process holds, in id order (a snapshot: ``add`` does not change it)."""
        return list(self._state.segments)

    @segments.setter
    def segments(self, segments) -> None:
        self._state = _State(segments, self._whole_docs)

    # ------------------------------------------------------------------ building and saving
    @classmethod
    def build(cls, docs: Iterable[torch.Tensor], *, dtype: torch.dtype | None = None, codec: str = "exact",
              nbits: int | None = None, num_centroids: int | None = None, train_tokens: int | None = None,
              rescore_dtype: torch.dtype | None = None, out=None, shard_tokens: int = DEFAULT_SHARD_TOKENS,
              overwrite: bool = False, progress: bool | None = None, **load_options) -> Index:
        """An index of ``docs``: a list or any iterable of ``[L_i, d]`` float tensors (``L_i`` may be 0) and / or
        :class:`lik.index.DocumentBatch` es (encoder batches: padded with a mask or lengths, or packed).

        ``dtype``: float16 (default) / bfloat16 / float32 (stored as is) or int8 / float8_e4m3fn (quantized per
        token with :func:`lik.quantize`). ``codec="plaid"``: tokens compressed to a centroid code and ``nbits``
        (1, 2 or 4; default 2) residual bits a dimension (:mod:`lik.index.plaid_codec`: the codec is trained on the
        first ``train_tokens`` tokens, default 1 Mi, with ``num_centroids`` centroids, default ColBERTv2's rule on
        those tokens, and later ``add`` s reuse it; ``rescore_dtype`` ``torch.int8`` / ``torch.float16`` also keeps
        an exact copy of the tokens for ``search(..., rescore=)``, :mod:`lik.index.rescore`); ``dtype`` is then the
        float dtype queries and decoded tokens are scored in; ``d`` a multiple of 8. Documents are converted in
        batches where they are (CPU documents of an 8-bit or compressed index on the CUDA ``device`` when there is
        one), one copy per batch. With ``out``, shards are written to that directory as they fill (never more than
        one shard in memory) and the saved index is loaded with ``load_options``; without, the index is held in
        host memory (``placement="gpu"``: on the device, built there). ``overwrite`` as in :meth:`save`. Example
        (encoder batches of embeddings and their masks):
        ``lik.Index.build(lik.index.DocumentBatch.padded(e, mask=m) for e, m in batches)``."""
        codec, nbits, dtype = check_codec(codec, nbits, dtype, num_centroids=num_centroids,
                                          train_tokens=train_tokens, rescore_dtype=rescore_dtype)
        rescore_dtype = check_rescore_dtype(rescore_dtype)
        dtype_name(dtype)
        shard_tokens = as_int(shard_tokens, "shard_tokens")
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
        unknown = set(load_options) - _LOAD_OPTIONS
        if unknown:
            raise TypeError(f"Index.build got unexpected keyword arguments {sorted(unknown)}")
        placement = load_options.get("placement", "auto")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        device = _resolve_device(load_options.get("device"), "auto" if out is not None else placement)
        trainer = None if codec == "exact" else CodecTrainer(nbits, device, train_tokens, num_centroids=num_centroids)
        if out is not None:
            shards = shards_from(docs, None, dtype, shard_tokens, progress, device, codec=trainer,
                                 rescore=rescore_dtype)
            _write(Path(out), shards, dtype, overwrite, None, codec=trainer and (lambda: trainer.codec),
                   rescore=rescore_dtype)
            return cls.load(out, **load_options)
        # An index built for the GPU keeps its converted batches there (they cross to the host only to be saved).
        segments = list(shards_from(docs, None, dtype, shard_tokens, progress, device, resident=placement == "gpu",
                                    codec=trainer, rescore=rescore_dtype))
        if not segments:
            raise ValueError("docs is empty: pass at least one document (an index needs its width d)")
        if placement in ("auto", "disk"):  # nothing is on disk yet: "disk" means host memory until saved
            placement = "host" if placement == "disk" else _auto_placement(segments, device)
        d = segments[0].tokens.shape[1] if trainer is None else trainer.codec.dim
        index = cls(d, dtype, placement=placement, device=device, chunk_tokens=load_options.get("chunk_tokens"),
                    codec=None if trainer is None else trainer.codec, rescore_dtype=rescore_dtype)
        cuda = placement == "gpu" or device.type == "cuda"
        index.segments = _place_all(segments, placement, index.device) if cuda else segments
        return index

    def add(self, docs: Iterable[torch.Tensor], *, progress: bool | None = None) -> Index:
        """Append ``docs`` (ids continue from :attr:`num_ids`, which is ``len(self)`` until documents are removed);
        returns ``self``. All or nothing: if a document is refused, none of ``docs`` is added. Safe while other
        threads search (see the class docstring). A compressed index compresses them with its codec as it is."""
        if self.num_shards > 1:
            raise ValueError("add: this index is one shard of a distributed index; add to the full index and save")
        with self._write_lock:
            placement = "host" if self.placement == "disk" else self.placement
            added = [_place_segment(segment, placement, self.device)
                     for segment in shards_from(docs, self.d, self.dtype, DEFAULT_SHARD_TOKENS, progress, self.device,
                                                  codec=self.codec, rescore=self.rescore_dtype)]
            state = self._state
            self._state = _State(state.segments + tuple(added), None,
                                 state.ids.with_added(sum(s.num_docs for s in added)))
        return self

    def remove(self, ids) -> Index:
        """Mark documents ``ids`` (a 1-D integer sequence or tensor) removed; returns ``self``.

        Searches never return a removed document (top-``k`` still returns ``k`` live documents when there are
        that many), ``len`` no longer counts it, its id is never given again. Its tokens stay in the shards until
        :meth:`compact`; :meth:`save` writes the marks. Removing an id again does nothing; an id never given
        raises ``ValueError``. Example: ``index.remove([3, 17]).save("my-index", overwrite=True)``.
        """
        if self.num_shards > 1:
            raise ValueError("remove: this index is one shard of a distributed index; remove from the full index "
                             "and save")
        with self._write_lock:
            state = self._state
            ids = state.ids.with_removed(check_ids(ids, state.ids.num_ids, "ids"))
            self._state = _State(state.segments, state.num_docs, ids, state._source)
        return self

    def compact(self) -> Index:
        """Drop the removed documents' tokens from the segments; returns ``self``. Every remaining document keeps
        its id (searches return the same ids as before), and ids removed before are never given again.

        Segments holding removed documents are rewritten in memory (on the GPU for ``"gpu"``, in host memory
        otherwise); :meth:`save` writes the compacted shards, atomically as ever. Example:
        ``index.remove([3, 17]).compact().save("my-index", overwrite=True)``.
        """
        if self.num_shards > 1:
            raise ValueError("compact: this index is one shard of a distributed index")
        with self._write_lock:
            state = self._state
            if state.ids.removed.numel():
                placement = "host" if self.placement == "disk" else self.placement
                kept = [s if any(s is t for t in state.segments) else _place_segment(s, placement, self.device)
                        for s in compact_segments(state.segments, state.ids.removed_positions())]
                self._state = _State(kept, None, state.ids.compacted())
        return self

    @property
    def num_ids(self) -> int:
        """Ids given so far: the next added document gets this id (``len(self)`` plus the removed documents)."""
        return self._state.ids.num_ids

    def live_ids(self) -> torch.Tensor:
        """The ids of the live documents (not removed), ascending: CPU int64 ``[len(self)]``."""
        return self._state.ids.live_ids()

    def get(self, ids) -> list[torch.Tensor]:
        """The tokens of live documents ``ids`` (a 1-D integer sequence, in that order; repeats allowed) as CPU
        tensors ``[L_i, d]``: the stored values (dtype of a float index; fp32 token times scale for an 8-bit one;
        fp32 decoded tokens, ``codec.decompress``, for a compressed one).

        Example: ``index.get([0, 3])[1].shape`` is ``[L_3, d]``.
        """
        state = self._state
        ids = check_ids(ids, state.ids.num_ids, "ids", keep_order=True)
        codec = None if self.codec is None else self.codec.to("cpu")
        decode = None if codec is None else lambda residuals, codes: codec.decompress(codes, residuals)
        return read_documents(state.segments, self.first_id, state.ids, ids, decode=decode)

    def save(self, path, *, overwrite: bool = False, progress: bool | None = None) -> None:
        """Write the index to directory ``path``.

        Crash-safe: ``path`` holds either nothing / the index it held before, or the complete new index, whenever
        the process stops. ``overwrite=False`` refuses an existing ``path``, also one that appears while the
        shards are written (``FileExistsError``); ``overwrite=True`` replaces a lik index (only: anything else at
        ``path`` is refused and left as it is). See ``docs/index-durability.md``.
        """
        if self.num_shards > 1:
            raise ValueError("save: this index is one shard of a distributed index")
        state = self._state
        cpu = (Shard(s.tokens.cpu(), s.cu_seqlens, None if s.scale is None else s.scale.cpu(), copy=s.copy)
               for s in state.segments)
        _write(Path(path), cpu, self.dtype, overwrite, self.d, progress=progress, ranges=state.ids.ranges(),
               codec=self.codec, rescore=self.rescore_dtype)

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path, *, placement: str = "auto", shard: int | None = None, num_shards: int | None = None,
             device=None, verify: bool = True, chunk_tokens: int | None = None) -> Index:
        """Open a saved index.

        Args:
            placement: ``"gpu"`` (resident on the device), ``"host"`` (pinned RAM, streamed to the GPU),
                ``"disk"`` (memory-mapped, streamed through pinned buffers) or ``"auto"`` (the fastest that fits).
            shard, num_shards: load only documents ``[N * shard // num_shards, N * (shard + 1) // num_shards)``
                (one process per GPU: ``shard=rank, num_shards=world_size``).
            device: where queries are scored (default: the current CUDA device, else CPU).
            verify: check the sha256 of each shard this process reads against the manifest. Without it, the
                manifest and every shard header are still validated; only flipped bits inside tensor data pass.

        The manifest and its shard files are read as one generation, also while another process replaces the
        index; a loaded index keeps reading the files it opened. A colbert-ai or fast-plaid index directory
        (:func:`lik.compression.load_plaid_index`) loads as a compressed index held in memory (``"disk"``
        means host memory there); ``save`` writes it as a lik index, its own directory is never written.
        """
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        shard, num_shards = _check_shard(shard, num_shards)
        device = _resolve_device(device, placement)
        directory = Path(path)
        if not (directory / "manifest.json").exists() and (is_colbert_index(directory)
                                                            or is_fast_plaid_index(directory)):
            return cls._from_plaid(directory, placement, shard, num_shards, device, chunk_tokens)
        manifest, (pieces, handles) = load_generation(
            directory, lambda m: _open_range(directory, m, shard, num_shards, verify))
        total = manifest.num_docs
        if placement == "auto":
            placement = _auto_placement(pieces, device)
        codec = None if manifest.codec is None else read_codec(directory, manifest, device, verify)
        index = cls(manifest.d, manifest.dtype, placement=placement, device=device,
                    first_id=total * shard // num_shards, total_docs=total, shard=shard, num_shards=num_shards,
                    chunk_tokens=chunk_tokens, codec=codec, rescore_dtype=codec and manifest.codec.rescore)
        index._state = _State(_place_all(pieces, placement, index.device), total, IdSpace.from_manifest(manifest))
        if placement != "disk":  # the data was copied out of the files
            for handle in handles:
                handle.close()
        index.path = directory
        return index

    @classmethod
    def _from_plaid(cls, directory: Path, placement, shard, num_shards, device, chunk_tokens) -> Index:
        """A colbert-ai / fast-plaid directory as a compressed index (documents in its order, ids from 0)."""
        plaid = load_plaid_index(directory)
        cu = plaid.cu_seqlens
        total = cu.numel() - 1
        lo, hi = total * shard // num_shards, total * (shard + 1) // num_shards
        whole = Shard(plaid.residuals, cu, plaid.codes.to(torch.int32))
        piece = whole.slice_docs(lo, hi)
        placement = "host" if placement == "disk" else placement
        if placement == "auto":
            placement = _auto_placement([piece], device)
        index = cls(plaid.codec.dim, torch.float16, placement=placement, device=device, first_id=lo,
                    total_docs=total, shard=shard, num_shards=num_shards, chunk_tokens=chunk_tokens,
                    codec=plaid.codec)
        index._state = _State(_place_all([piece], placement, index.device), total)
        index.path = directory
        return index

    # ------------------------------------------------------------------ searching
    def __len__(self) -> int:
        """Live documents in the whole index (all shards, also on a rank that holds one shard; removed ones are
        not counted)."""
        return self._state.ids.num_live

    @property
    def local_range(self) -> tuple[int, int]:
        """Stored documents ``[first, stop)`` this process holds, counted in shard order (their ids, unless
        :meth:`compact` dropped documents before them)."""
        return self.first_id, self.first_id + sum(s.num_docs for s in self._state.segments)

    def _chunk_source(self):
        return self._state.source(self._make_source)

    def _make_source(self, segments):
        segments = coalesce(segments) if self.device.type == "cuda" and self.placement == "gpu" else segments
        first_ids, first = [], self.first_id
        for segment in segments:
            first_ids.append(first)
            first += segment.num_docs
        if self.device.type == "cuda" and self.placement in ("host", "disk"):
            plans = plan_chunks(segments, first_ids, self.chunk_tokens)
            return StreamedSource(segments, plans, self.device, staged=self.placement == "disk")
        # Resident on a GPU, a chunk only bounds the [Nq, documents] scores (a few MB for a whole shard):
        # one call per shard saves the per-chunk launches and merges (BENCHMARKS.md, "lik.Index search").
        chunk_tokens = self.chunk_tokens
        if self.device.type == "cuda" and not self._chunk_tokens_given:
            chunk_tokens = max([chunk_tokens] + [s.num_tokens for s in segments])
        return ResidentSource(segments, plan_chunks(segments, first_ids, chunk_tokens), self.device)

    @torch.no_grad()
    def search(self, Q, k: int, q_mask: torch.Tensor | None = None, *, doc_ids=None,
               cu_seqlens_q: torch.Tensor | None = None, n_probe: int | None = None, candidates: int | None = None,
               rescore: int | None = None):
        """Exact top-``k`` MaxSim search (of the decoded tokens, for a compressed index).

        Args:
            Q: ``[Lq, d]`` or ``[Nq, Lq, d]`` float queries (cast to a float index's dtype; quantized per token
                for an 8-bit index); queries of different lengths: a list of ``[Lq_i, d]`` tensors, or packed
                ``[sum Lq_i, d]`` with ``cu_seqlens_q`` (scored in dense buckets of similar length, as
                :func:`lik.search` scores them).
            k: results per query, ``0 <= k <= len(self)`` (or the number of live ``doc_ids``).
            q_mask: optional bool ``[Lq]`` / ``[Nq, Lq]``, True for real query tokens (dense ``Q`` only).
            doc_ids: optional ids to restrict the search to (any order, duplicates and removed ids ignored).
            cu_seqlens_q: int32 / int64 ``[Nq + 1]`` offsets of packed queries (a CPU tensor costs no sync).
            n_probe, candidates: a compressed index only (:mod:`lik.index.plaid_search`): both ``None`` (default)
                scans every document up to 32 Mi tokens held and generates candidates beyond; either given
                generates candidates: ``n_probe`` centroids per query token (default 8), ``candidates`` documents
                per query and per chunk scored in full (default ``max(k, 4096)``; a GPU-resident index is one
                chunk). Fewer than ``k`` candidates: the rest of the row is score ``-inf``, id ``-1``.
            rescore: an index built with ``rescore_dtype`` only (:mod:`lik.index.rescore`): the best ``rescore``
                documents of each query (default ``max(k, 32)`` with a copy; ``0``: off) rescored exactly from
                the copy, the top ``k`` of those scores returned.

        Returns:
            ``(scores, ids)``: fp32 and int64, ``[k]`` for 2-D ``Q``, ``[Nq, k]`` for 3-D or ragged ``Q``, on
            ``Q``'s device; descending score, ties to the lower id, NaN last (as :func:`lik.search`).

        Example:
            >>> scores, ids = index.search([torch.randn(32, 128), torch.randn(9, 128)], k=10)   # [2, 10] each
        """
        if self.codec is None and (n_probe is not None or candidates is not None):
            raise ValueError("n_probe / candidates apply to a compressed index (codec='plaid'); this one is exact")
        queries, squeeze, n_queries, where = check_queries(Q, q_mask, cu_seqlens_q, self.d, self.dtype)
        state = self._state  # one view of the documents for the whole search, whatever add() does meanwhile
        doc_ids = check_ids(doc_ids, state.ids.num_ids, "doc_ids")
        # Chunks and ranks count stored positions: removed documents are left out of what is scored.
        positions = None if doc_ids is None else state.ids.live_positions(doc_ids)
        available = len(self) if doc_ids is None else positions.numel()
        k = as_int(k, "k")
        if not 0 <= k <= available:
            what = "documents in the index" if doc_ids is None else "distinct live doc_ids"
            raise ValueError(f"k must be in [0, {available}] ({available} {what}), got k={k}")
        if n_queries == 0:  # no query: nothing to score or to gather
            empty = torch.empty(0, k, dtype=torch.float32, device=where)
            return empty, empty.to(torch.int64)
        source = state.source(self._make_source)
        selection = state.live_selection(source) if doc_ids is None else select_chunks(source.plans, positions)
        local_docs = sum(source.plans[n].num_docs if local is None else local.numel() for n, local in selection)
        rescored = rescore_count(rescore, k, self.rescore_dtype)
        best = max(k, rescored)  # with rescoring, the best `rescored` documents first
        mode = None if self.codec is None else search_mode(
            n_probe, candidates, best, sum(s.num_tokens for s in state.segments), self.codec.num_centroids)
        with source.lock:
            if mode is None:
                scorer = None if self.codec is None else residual_scorer(self.codec)
                scores, ids = search_buckets(queries, n_queries, source, selection, min(best, local_docs), scorer)
            else:
                scores, ids = search_candidates(queries, n_queries, source, selection, min(best, local_docs),
                                                self.codec, *mode)
        if rescored:
            scores, ids = rescore_top(queries, n_queries, state.segments, self.first_id, ids, min(k, local_docs),
                                      source.device)
        if self.num_shards > 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError("this index is one shard of several: initialise torch.distributed to search it")
            world = dist.get_world_size()
            if world != self.num_shards:
                raise RuntimeError(f"the index was loaded with num_shards={self.num_shards}, the world has {world} "
                                   "ranks")
            counts = rank_counts(world, positions, state.ids.removed_positions(), k, state.num_docs)
            scores, ids = gather_top_k(scores, ids, k, counts)
        scores, ids = scores.to(where), ids.to(where)
        padded = mode is not None or rescored or self.num_shards > 1  # candidates and rank merges pad with -1
        ids = torch.where(ids >= 0, state.ids.ids_of(ids.clamp(min=0)), -1) if padded else state.ids.ids_of(ids)
        return (scores[0], ids[0]) if squeeze else (scores, ids)

    def __repr__(self) -> str:
        where = f"shard {self.shard}/{self.num_shards}, " if self.num_shards > 1 else ""
        tokens = sum(s.num_tokens for s in self._state.segments)
        codec = "" if self.codec is None else f"codec=plaid, nbits={self.codec.nbits}, " + describe_copy(
            self.rescore_dtype)
        return (f"lik.Index({len(self)} documents, {where}{tokens} tokens held, d={self.d}, {codec}"
                f"dtype={dtype_name(self.dtype)}, placement={self.placement!r}, device={str(self.device)!r})")


def _open_range(directory: Path, manifest, shard: int, num_shards: int, verify: bool):
    """Open every shard file of ``manifest`` (so that a concurrent replace shows before anything is read), check
    every header against the manifest, and map documents ``[lo, hi)`` of this rank. Returns the pieces and the
    open files they read from."""
    total = manifest.num_docs
    lo, hi = total * shard // num_shards, total * (shard + 1) // num_shards
    handles = []
    try:
        for info in manifest.shards:
            handles.append(open_shard_file(directory, manifest, info))
        pieces, kept, first = [], [], 0
        data = manifest.data_directory(directory)
        for info, handle in zip(manifest.shards, handles):
            start, stop = max(lo, first), min(hi, first + info.num_docs)
            wanted = start < stop
            piece = open_shard(handle, data / info.file, info, manifest, mmap=True, verify=verify and wanted,
                               header_only=not wanted)
            if wanted:
                pieces.append(piece.slice_docs(start - first, stop - first))
                kept.append(handle)
            else:
                handle.close()
            first += info.num_docs
    except BaseException:
        for handle in handles:
            handle.close()
        raise
    return pieces, kept
