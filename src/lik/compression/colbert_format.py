"""Reading an index directory written by ColBERT (``colbert-ai`` 0.2.x, PLAID / ColBERTv2)::

    metadata.json            {"config": {"dim", "nbits", ...}, "num_chunks", "num_partitions", "num_embeddings",
                              "avg_doclen"}   (plan.json, written first, has the same config and num_chunks)
    centroids.pt             fp16 [K, d]
    buckets.pt               (bucket_cutoffs [2**nbits - 1], bucket_weights [2**nbits])
    avg_residual.pt          a scalar or [1]
    {i}.codes.pt             int32 [n_i]                 (i = 0 .. num_chunks - 1)
    {i}.residuals.pt         uint8 [n_i, d * nbits // 8]
    doclens.{i}.json         [len of each passage of chunk i]
    {i}.metadata.json        {"passage_offset", "num_passages", "num_embeddings", "embedding_offset"}
    ivf.pid.pt               (pids of each centroid's list, concatenated [+ padding], list lengths [K]) (optional)

Every ``.pt`` file is read with ``torch.load(weights_only=True)`` (tensors and tuples only, no code runs). Anything
missing, of the wrong type, shape or dtype, or inconsistent with the other files raises a one-line error naming
the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .codec import ResidualCodec

__all__ = ["PlaidIndex", "is_colbert_index", "load_colbert_index"]


@dataclass
class PlaidIndex:
    """The contents of a PLAID index directory (colbert-ai's or fast-plaid's: the same codec, other files).

    Attributes:
        codec: the :class:`ResidualCodec` (centroids as stored, fp16).
        codes: int32 ``[T]``, every token's centroid, documents in order.
        residuals: uint8 ``[T, d * nbits // 8]``.
        doclens: int64 ``[N]``, tokens per document (``codes`` is the concatenation in this order).
        ivf: int32 / int64 passage ids of each centroid's list, concatenated (``None`` without ``ivf.pid.pt``);
            ColBERT pads the tail, so only ``ivf[:ivf_lengths.sum()]`` is meaningful.
        ivf_lengths: int64 ``[K]`` or ``None``.
        metadata: the parsed ``metadata.json`` (or ``plan.json``).
        source: ``"colbert"`` or ``"fast-plaid"``, the writer whose layout was read.
    """

    path: Path
    codec: ResidualCodec
    codes: torch.Tensor
    residuals: torch.Tensor
    doclens: torch.Tensor
    ivf: torch.Tensor | None
    ivf_lengths: torch.Tensor | None
    metadata: dict = field(repr=False)
    source: str = "colbert"

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """int64 ``[N + 1]`` document offsets into ``codes`` / ``residuals``."""
        return torch.cat([torch.zeros(1, dtype=torch.int64), self.doclens.cumsum(0)])

    def decompress(self, dtype: torch.dtype = torch.float16, device=None) -> torch.Tensor:
        """Every token decoded, ``dtype`` ``[T, d]`` on ``device`` (the codec's by default), in ``cu_seqlens``
        order: with :attr:`cu_seqlens` a packed corpus any exact lik search takes (a decompressed copy, so
        ``2 * d`` bytes a token in fp16, where the codes take ``4 + d * nbits / 8``)."""
        codec = self.codec if device is None else self.codec.to(device)
        return codec.decompress(self.codes, self.residuals, dtype=dtype)


def is_colbert_index(path) -> bool:
    """Whether ``path`` looks like a colbert-ai index (a config file, ``centroids.pt`` and ``buckets.pt``)."""
    p = Path(path)
    has_config = (p / "metadata.json").is_file() or (p / "plan.json").is_file()
    return p.is_dir() and has_config and (p / "centroids.pt").is_file() and (p / "buckets.pt").is_file()


def _need(path: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (a colbert-ai index directory has it)")
    return path


def _json(path: Path):
    try:
        with open(_need(path), encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({str(error).splitlines()[0]})") from None


def _pt(path: Path):
    try:
        return torch.load(_need(path), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:  # a truncated zip, a pickle with code in it, bytes that are no pickle at all
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{path}: not a readable torch file ({first[:200]})") from None


def _tensor(path: Path, value, dims: int, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != dims:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{path}: expected {what} ({dims}-D tensor), got {got}")
    return value


def _int(path: Path, data: dict, key: str, low: int = 0) -> int:
    value = data.get(key) if isinstance(data, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{path}: field {key!r} must be an integer >= {low}, got {value!r:.80}")
    return value


def _config(directory: Path) -> tuple[Path, dict]:
    source = directory / "metadata.json"
    if not source.is_file():
        source = directory / "plan.json"
        if not source.is_file():
            raise FileNotFoundError(f"{directory / 'metadata.json'}: missing (a colbert-ai index directory has it)")
    data = _json(source)
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict):
        raise ValueError(f"{source}: field 'config' is missing or not an object")
    return source, data


def read_chunks(directory: Path, num_chunks: int, codec: ResidualCodec, load, suffix: str, centroids_name: str):
    """The ``{i}.codes``, ``{i}.residuals`` and ``doclens.{i}.json`` of every chunk (colbert-ai's and fast-plaid's
    layout; ``load`` reads one ``{i}.codes{suffix}`` / ``{i}.residuals{suffix}`` file), each checked against the
    codec; returns int32 codes ``[T]``, uint8 residuals ``[T, packed_dim]`` and int64 document lengths."""
    codes, residuals, doclens = [], [], []
    for i in range(num_chunks):
        codes_path, residuals_path = directory / f"{i}.codes{suffix}", directory / f"{i}.residuals{suffix}"
        doclens_path = directory / f"doclens.{i}.json"
        c = _tensor(codes_path, load(codes_path), 1, "codes [n]")
        r = _tensor(residuals_path, load(residuals_path), 2, f"residuals [n, {codec.packed_dim}]")
        lens = _json(doclens_path)
        if c.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{codes_path}: expected int32 or int64 codes, got {c.dtype}")
        if c.numel() and (int(c.min()) < 0 or int(c.max()) >= codec.num_centroids):
            raise ValueError(f"{codes_path}: codes outside [0, {codec.num_centroids}) ({centroids_name}'s rows)")
        if r.dtype != torch.uint8 or tuple(r.shape) != (c.shape[0], codec.packed_dim):
            raise ValueError(
                f"{residuals_path}: expected uint8 [{c.shape[0]}, {codec.packed_dim}], got {r.dtype} {list(r.shape)}"
            )
        if not isinstance(lens, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in lens
        ):
            raise ValueError(f"{doclens_path}: expected a list of non-negative integers")
        if sum(lens) != c.shape[0]:
            raise ValueError(
                f"{doclens_path}: lengths sum to {sum(lens)}, but {codes_path.name} has {c.shape[0]} codes"
            )
        codes.append(c.to(torch.int32))
        residuals.append(r)
        doclens.append(torch.tensor(lens, dtype=torch.int64))
    return torch.cat(codes), torch.cat(residuals), torch.cat(doclens)


def load_colbert_index(path) -> PlaidIndex:
    """Read a colbert-ai index directory into CPU tensors (see the module docstring for the files).

    Example::

        >>> index = load_colbert_index("experiments/msmarco/indexes/msmarco.2bits")  # doctest: +SKIP
        >>> tokens = index.codec.decompress(index.codes, index.residuals)  # fp32 [T, d], ColBERT's CPU decode
    """
    directory = Path(os.fspath(path))
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: not a directory (a colbert-ai index is one)")
    source, meta = _config(directory)
    config = meta["config"]
    dim, nbits = _int(source, config, "dim", 1), _int(source, config, "nbits", 1)
    if nbits not in (1, 2, 4) or dim % 8:
        raise ValueError(f"{source}: config dim {dim} / nbits {nbits} is not a ColBERT residual layout")
    num_chunks = _int(source, meta, "num_chunks", 1)

    centroids_path = directory / "centroids.pt"
    centroids = _tensor(centroids_path, _pt(centroids_path), 2, "centroids [K, d]")
    if centroids.shape[1] != dim or not centroids.dtype.is_floating_point:
        raise ValueError(
            f"{centroids_path}: expected floating centroids [K, {dim}], got {centroids.dtype} {list(centroids.shape)}"
        )
    buckets_path = directory / "buckets.pt"
    buckets = _pt(buckets_path)
    if not isinstance(buckets, (tuple, list)) or len(buckets) != 2:
        raise ValueError(f"{buckets_path}: expected a pair (bucket_cutoffs, bucket_weights)")
    cutoffs = _tensor(buckets_path, buckets[0], 1, f"bucket_cutoffs [{2**nbits - 1}]")
    weights = _tensor(buckets_path, buckets[1], 1, f"bucket_weights [{2**nbits}]")
    avg_path = directory / "avg_residual.pt"
    avg_residual = _pt(avg_path) if avg_path.is_file() else None  # search does not need it
    try:
        codec = ResidualCodec(centroids, cutoffs, weights, nbits, avg_residual=avg_residual)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{buckets_path}: {error}") from None

    codes_all, residuals_all, doclens_all = read_chunks(directory, num_chunks, codec, _pt, ".pt", "centroids.pt")
    if "num_embeddings" in meta and _int(source, meta, "num_embeddings") != codes_all.shape[0]:
        raise ValueError(f"{source}: num_embeddings {meta['num_embeddings']} but the chunks hold {codes_all.shape[0]}")

    ivf = ivf_lengths = None
    ivf_path = directory / "ivf.pid.pt"
    if ivf_path.is_file():
        pair = _pt(ivf_path)
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"{ivf_path}: expected a pair (ivf, ivf_lengths)")
        ivf = _tensor(ivf_path, pair[0], 1, "ivf [P]")
        ivf_lengths = _tensor(ivf_path, pair[1], 1, f"ivf_lengths [{codec.num_centroids}]").to(torch.int64)
        if ivf_lengths.shape[0] != codec.num_centroids or int(ivf_lengths.sum()) > ivf.shape[0]:
            raise ValueError(
                f"{ivf_path}: ivf_lengths must have {codec.num_centroids} entries summing to at most {ivf.shape[0]}"
            )
        used = ivf[: int(ivf_lengths.sum())]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= doclens_all.shape[0]):
            raise ValueError(f"{ivf_path}: passage ids outside [0, {doclens_all.shape[0]})")
    return PlaidIndex(directory, codec, codes_all, residuals_all, doclens_all, ivf, ivf_lengths, meta)
