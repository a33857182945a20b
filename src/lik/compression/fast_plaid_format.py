"""Reading an index directory written by fast-plaid (1.x, PyLate's default index; its Rust ``create_index``)::

    metadata.json            {"num_chunks", "nbits", "num_partitions", "num_embeddings", "avg_doclen",
                              "num_documents"}   (no "dim": the centroids' width)
    centroids.npy            [K, d]
    bucket_cutoffs.npy       [2**nbits - 1]     bucket_weights.npy   [2**nbits]
    avg_residual.npy         [d]                 (per dimension, where ColBERT keeps a scalar)
    {i}.codes.npy            int64 [n_i]         {i}.residuals.npy    uint8 [n_i, d * nbits // 8]
    doclens.{i}.json         [len of each document of chunk i]
    ivf.npy                  int64 document ids of each centroid's list, concatenated (no padding)
    ivf_lengths.npy          int32 [K]          (both optional: ``compress_only`` indexes have none)

fast-plaid's codec is ColBERT's: the same bucket quantiles, the same bit packing (LSB-first bits per dimension,
bytes high bit first) and the same lookup tables, and its decode is ``normalize(centroid + weight)``. Its
loader casts the centroids and bucket tables to fp16 and decodes in fp16; lik keeps the fp16 values and decodes
in fp32 (so lik's tokens are fast-plaid's up to its fp16 rounding). Its cache files (``merged_*.npy``,
``*.manifest.json``), ``embeddings.npy``, ``buffer.npy`` and ``metadata.db`` are not read. Arrays are read with
``numpy.load(allow_pickle=False)``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from .codec import ResidualCodec
from .colbert_format import (PlaidIndex, _int, _json, _need, _tensor, is_colbert_index, load_colbert_index,
                             read_chunks)

__all__ = ["is_fast_plaid_index", "load_fast_plaid_index", "load_plaid_index"]


def is_fast_plaid_index(path) -> bool:
    """Whether ``path`` looks like a fast-plaid index (``metadata.json``, ``centroids.npy``, ``bucket_weights.npy``)."""
    p = Path(path)
    names = ("metadata.json", "centroids.npy", "bucket_weights.npy")
    return p.is_dir() and all((p / name).is_file() for name in names)


def _npy(path: Path) -> torch.Tensor:
    try:
        array = np.load(_need(path), allow_pickle=False)
    except FileNotFoundError:
        raise
    except Exception as error:  # truncated, not .npy, an object array (pickle)
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{path}: not a readable .npy array ({first[:200]})") from None
    if not isinstance(array, np.ndarray) or array.dtype.kind not in "fiu":
        raise ValueError(f"{path}: expected a numeric array, got {getattr(array, 'dtype', type(array).__name__)}")
    return torch.from_numpy(np.ascontiguousarray(array))


def load_fast_plaid_index(path) -> PlaidIndex:
    """Read a fast-plaid index directory into CPU tensors (see the module docstring for the files).

    Returns a :class:`lik.compression.PlaidIndex` with ``source="fast-plaid"``: fp16 centroids and bucket
    tables (what fast-plaid searches with), int32 codes, ``avg_residual`` per dimension.
    """
    directory = Path(os.fspath(path))
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: not a directory (a fast-plaid index is one)")
    meta_path = directory / "metadata.json"
    meta = _json(meta_path)
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path}: expected a JSON object")
    nbits, num_chunks = _int(meta_path, meta, "nbits", 1), _int(meta_path, meta, "num_chunks", 1)
    if nbits not in (1, 2, 4):
        raise ValueError(f"{meta_path}: field 'nbits' must be 1, 2 or 4, got {nbits}")

    centroids_path = directory / "centroids.npy"
    centroids = _tensor(centroids_path, _npy(centroids_path), 2, "centroids [K, d]")
    if not centroids.dtype.is_floating_point or centroids.shape[1] % 8 or centroids.shape[0] == 0:
        raise ValueError(
            f"{centroids_path}: expected floating centroids [K, d] with d a multiple of 8, got "
            f"{centroids.dtype} {list(centroids.shape)}"
        )
    tables = {}
    for name, size in (("bucket_cutoffs", 2**nbits - 1), ("bucket_weights", 2**nbits)):
        table_path = directory / f"{name}.npy"
        tables[name] = _tensor(table_path, _npy(table_path), 1, f"{name} [{size}]")
        if tables[name].shape[0] != size or not tables[name].dtype.is_floating_point:
            raise ValueError(
                f"{table_path}: expected {size} floats for nbits={nbits}, got {tables[name].dtype} "
                f"{list(tables[name].shape)}"
            )
    avg_path = directory / "avg_residual.npy"
    avg_residual = _npy(avg_path) if avg_path.is_file() else None
    try:
        codec = ResidualCodec(
            centroids.half(),
            tables["bucket_cutoffs"].half(),
            tables["bucket_weights"].half(),
            nbits,
            avg_residual=avg_residual,
        )
    except (TypeError, ValueError) as error:
        raise ValueError(f"{directory / 'bucket_cutoffs.npy'}: {error}") from None

    codes_all, residuals_all, doclens_all = read_chunks(directory, num_chunks, codec, _npy, ".npy", "centroids.npy")
    if "num_embeddings" in meta and _int(meta_path, meta, "num_embeddings") != codes_all.shape[0]:
        raise ValueError(
            f"{meta_path}: num_embeddings {meta['num_embeddings']} but the chunks hold {codes_all.shape[0]}"
        )

    ivf = ivf_lengths = None
    ivf_path, lengths_path = directory / "ivf.npy", directory / "ivf_lengths.npy"
    if ivf_path.is_file() or lengths_path.is_file():
        ivf = _tensor(ivf_path, _npy(ivf_path), 1, "ivf [P]").to(torch.int64)
        ivf_lengths = _tensor(lengths_path, _npy(lengths_path), 1, "ivf_lengths [K]").to(torch.int64)
        # fast-plaid's lengths are a bincount with its centroid-count estimate as minlength: fewer entries than
        # centroids when the last ones hold no token, more when the estimate exceeds the centroids trained.
        if int(ivf_lengths.sum()) != ivf.shape[0] or bool((ivf_lengths < 0).any()):
            raise ValueError(
                f"{lengths_path}: lengths must be non-negative and sum to {ivf.shape[0]} (ivf.npy's length)"
            )
        if bool(ivf_lengths[codec.num_centroids :].any()):
            raise ValueError(f"{lengths_path}: non-empty lists for centroids that centroids.npy lacks")
        ivf_lengths = torch.nn.functional.pad(ivf_lengths, (0, max(0, codec.num_centroids - ivf_lengths.shape[0])))
        ivf_lengths = ivf_lengths[: codec.num_centroids]
        if ivf.numel() and (int(ivf.min()) < 0 or int(ivf.max()) >= doclens_all.shape[0]):
            raise ValueError(f"{ivf_path}: document ids outside [0, {doclens_all.shape[0]})")
    return PlaidIndex(directory, codec, codes_all, residuals_all, doclens_all, ivf, ivf_lengths, meta, "fast-plaid")


def load_plaid_index(path) -> PlaidIndex:
    """Read a colbert-ai or a fast-plaid index directory, whichever ``path`` holds.

    Example::

        >>> index = load_plaid_index("pylate-index/fast_plaid_index")  # doctest: +SKIP
        >>> index.source, index.codec.nbits, index.doclens.shape
        ('fast-plaid', 4, torch.Size([26000]))
    """
    if is_fast_plaid_index(path):
        return load_fast_plaid_index(path)
    if is_colbert_index(path):
        return load_colbert_index(path)
    raise ValueError(
        f"{os.fspath(path)}: neither a colbert-ai index (metadata.json, centroids.pt, buckets.pt) nor a "
        "fast-plaid one (metadata.json, centroids.npy, bucket_weights.npy)"
    )
