"""The compressed (PLAID) codec of a :class:`lik.Index`: its arguments, its training during a build, its file.

A ``codec="plaid"`` index stores each token as ColBERTv2 does: the id of its nearest centroid (int32) and its
residual's per-dimension buckets packed ``nbits`` to a dimension (uint8 ``[d * nbits / 8]``), exactly as
:class:`lik.compression.ResidualCodec` packs them. The codec itself is one safetensors file in the generation
directory, listed in the manifest with its size and sha256 (``codec.safetensors``)::

    centroids       float16 / float32 [K, d]
    bucket_cutoffs  float32 [2**nbits - 1]
    bucket_weights  float32 [2**nbits]
    avg_residual    float32 [1] (ColBERT's), [d] (fast-plaid's) or [0] (unknown)

Training (:class:`CodecTrainer`): the first batches of a build are held back until :data:`TRAIN_TOKENS` tokens
(or the end of the documents) are in hand; :func:`lik.compression.train_codec` then runs ColBERTv2's plan over
them (a sample of those documents, ``16 * sqrt(120 * n)`` of ``n``, at most all of them, centroids
``2 ** floor(log2(16 * sqrt(estimated tokens)))``, held-out 5% for the buckets, k-means on the build's device);
below about 4 000 tokens the centroids are a quarter of the tokens instead, so that k-means has data for each.
Documents added later, by :meth:`lik.Index.add` or to a loaded index, are compressed with that codec as it is.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..compression import ResidualCodec, train_codec
from ..compression.sampling import num_partitions
from .format import _header, _map_tensor, _sha256, fsync_file
from .manifest import EIGHT_BIT, CodecInfo, Manifest, dtype_name

__all__ = [
    "CODECS",
    "NBITS",
    "TRAIN_TOKENS",
    "CODEC_FILE",
    "check_codec",
    "CodecTrainer",
    "write_codec",
    "read_codec",
    "codec_figures",
    "codec_flags",
    "describe",
]

CODECS = ("exact", "plaid")
NBITS = (1, 2, 4)
# Tokens the codec is trained on (ColBERTv2's sample of them): 1 Mi tokens at d = 128 are 512 MB of fp32 on the
# build's device, and give k-means a few hundred tokens per centroid at ColBERT's centroid count.
TRAIN_TOKENS = 1 << 20
CODEC_FILE = "codec.safetensors"


def check_codec(codec, nbits, dtype, **plaid_options) -> tuple[str, int | None, torch.dtype]:
    """``(codec, nbits, dtype)`` of :meth:`lik.Index.build` checked: one-line errors naming the argument.
    ``dtype`` ``None`` means float16; a plaid index takes a float ``dtype`` (the one it scores in).
    ``plaid_options``: the build's plaid-only arguments (``num_centroids``, ``train_tokens``, ...), refused with
    ``codec="exact"`` unless ``None``."""
    if not isinstance(codec, str) or codec not in CODECS:
        raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")
    dtype = torch.float16 if dtype is None else dtype
    if codec == "exact":
        if nbits is not None:
            raise ValueError(f"nbits is for codec='plaid' only, got nbits={nbits!r} with codec='exact'")
        for name, value in plaid_options.items():
            if value is not None:
                raise ValueError(f"{name} is for codec='plaid' only, got {name}={value!r} with codec='exact'")
        return codec, None, dtype
    nbits = 2 if nbits is None else nbits
    if isinstance(nbits, bool) or not isinstance(nbits, int) or nbits not in NBITS:
        raise ValueError(f"nbits must be 1, 2 or 4, got {nbits!r}")
    if dtype in EIGHT_BIT:
        raise ValueError(
            f"dtype must be float16, bfloat16 or float32 for codec='plaid' (the dtype it scores in; "
            f"its tokens are residual codes), got {dtype}"
        )
    return codec, nbits, dtype


def _positive(value, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive integer or None, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer or None, got {value}")
    return int(value)


class CodecTrainer:
    """A codec to come: trained by :func:`lik.compression.train_codec` on the first ``train_tokens`` tokens a
    build sees (default :data:`TRAIN_TOKENS`), on ``device``, with
    ``num_centroids`` centroids (default ColBERTv2's rule on those tokens; any positive count, a power of two or
    not). ``codec`` is ``None`` until then. Both arguments are checked here, before any document is read
    (one-line errors naming them)."""

    def __init__(
        self, nbits: int, device, train_tokens: int | None = None, seed: int = 0, num_centroids: int | None = None
    ):
        self.nbits, self.device, self.seed = nbits, device, seed
        train_tokens = _positive(train_tokens, "train_tokens")
        self.train_tokens = TRAIN_TOKENS if train_tokens is None else train_tokens
        self.num_centroids = _positive(num_centroids, "num_centroids")
        self.codec: ResidualCodec | None = None

    def train(self, tokens: list[torch.Tensor], lengths: list[int]) -> ResidualCodec:
        device = torch.device("cpu") if self.device is None else torch.device(self.device)
        sample = torch.cat([t.to(device, torch.float32) for t in tokens])
        if sample.shape[0] == 0:
            raise ValueError("docs: the first documents hold no token; a plaid codec needs tokens to train on")
        if not bool(torch.isfinite(sample).all()):
            raise ValueError("docs must be finite (no NaN or inf) for codec='plaid'")
        if sample.shape[1] % 8:
            raise ValueError(f"docs: codec='plaid' needs d to be a multiple of 8, got d={sample.shape[1]}")
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
        num_centroids = self.num_centroids
        if num_centroids is not None and num_centroids > sample.shape[0]:
            # k-means needs a token per centroid at least; the count is known only now (the documents stream).
            raise ValueError(
                f"num_centroids={num_centroids} exceeds the {sample.shape[0]} tokens the codec is "
                "trained on (raise train_tokens or lower num_centroids)"
            )
        if num_centroids is None and num_partitions(sample.shape[0]) > sample.shape[0] // 4:
            # A small corpus (under ~4 000 tokens): ColBERT's count would leave k-means a token or two per
            # centroid; four a centroid at least.
            num_centroids = max(1, sample.shape[0] // 4)
        self.codec = train_codec(sample, cu, self.nbits, num_centroids=num_centroids, seed=self.seed)
        return self.codec


def write_codec(path: Path, codec: ResidualCodec) -> CodecInfo:
    """Write ``codec`` to the new file ``path`` (flushed) and describe it for the manifest."""
    avg = codec.avg_residual
    avg = torch.zeros(0) if avg is None else torch.as_tensor(avg, dtype=torch.float32).reshape(-1)
    centroids = codec.centroids if codec.centroids.dtype in (torch.float16, torch.float32) else codec.centroids.float()
    tensors = {
        "centroids": centroids.cpu().contiguous(),
        "bucket_cutoffs": codec.bucket_cutoffs.cpu().float(),
        "bucket_weights": codec.bucket_weights.cpu().float(),
        "avg_residual": avg.cpu().float(),
    }
    save_file(tensors, str(path))
    fsync_file(path)
    with open(path, "rb") as handle:
        sha = _sha256(handle)
    return CodecInfo("plaid", codec.nbits, codec.num_centroids, path.name, path.stat().st_size, sha)


def read_codec(directory, manifest: Manifest, device, verify: bool = True) -> ResidualCodec:
    """The codec of the compressed index at ``directory`` on ``device``, checked against ``manifest`` (size,
    header, shapes; sha256 with ``verify``). Errors name the file."""
    info = manifest.codec
    path = manifest.data_directory(directory) / info.file
    root, real = os.path.realpath(directory), os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise ValueError(f"{path}: codec file resolves outside the index directory; refusing to read it")
    try:
        handle = open(real, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: codec file listed in the manifest is missing") from None
    with handle:
        size = os.fstat(handle.fileno()).st_size
        if size != info.bytes:
            raise ValueError(f"{path}: codec file has {size} bytes, the manifest says {info.bytes}")
        start, entries = _header(handle, path, size)
        k, d, nbits = info.num_centroids, manifest.d, info.nbits
        expected = {
            "centroids": (("F16", "F32"), [k, d]),
            "bucket_cutoffs": (("F32",), [2**nbits - 1]),
            "bucket_weights": (("F32",), [2**nbits]),
        }
        for name, (tags, shape) in expected.items():
            entry = entries.get(name)
            if entry is None or entry[0] not in tags or entry[1] != shape:
                got = None if entry is None else f"{entry[0]} {entry[1]}"
                raise ValueError(f"{path}: tensor {name!r} must be {'/'.join(tags)} {shape}, got {got}")
        avg = entries.get("avg_residual")
        if avg is None or avg[0] != "F32" or avg[1] not in ([0], [1], [d]):
            raise ValueError(f"{path}: tensor 'avg_residual' must be F32 [0], [1] or [{d}]")
        if verify and _sha256(handle) != info.sha256:
            raise ValueError(f"{path}: checksum mismatch (sha256 differs from the manifest): the codec is corrupt")
        t = {
            name: _map_tensor(handle, path, start, entries[name], mmap=False).clone()
            for name in [*expected, "avg_residual"]
        }
    avg = t["avg_residual"]
    try:
        return ResidualCodec(
            t["centroids"].to(device),
            t["bucket_cutoffs"],
            t["bucket_weights"],
            nbits,
            avg_residual=None if avg.numel() == 0 else avg[0] if avg.numel() == 1 else avg,
        )
    except (ValueError, TypeError) as error:
        raise ValueError(f"{path}: {error}") from None


def codec_figures(codec: ResidualCodec | None, num_tokens: int) -> dict:
    """What ``lik index info`` shows of a codec: nbits, centroids, bytes per token (code and residual) and in all
    (codes, residuals and the codec's own tensors)."""
    if codec is None:
        return {"codec": "exact"}
    per_token = 4 + codec.packed_dim
    own = codec.centroids.nbytes + codec.bucket_cutoffs.nbytes + codec.bucket_weights.nbytes
    return {
        "codec": "plaid",
        "nbits": codec.nbits,
        "centroids": codec.num_centroids,
        "bytes_per_token": per_token,
        "codec_bytes": own,
        "total_bytes": per_token * num_tokens + own,
    }


def codec_flags(args, error=ValueError) -> dict:
    """``lik index build``'s ``--codec`` / ``--nbits`` (absent from an older parser: exact) as keyword arguments of
    :meth:`lik.Index.build`; ``error`` (a ``ValueError`` class) naming the flag for a bad combination."""
    codec, nbits = getattr(args, "codec", "exact") or "exact", getattr(args, "nbits", None)
    if codec not in CODECS:
        raise error(f"--codec must be one of {', '.join(CODECS)}, got {codec!r}")
    # --num-centroids / --train-tokens / --rescore-dtype (absent from an older parser: defaults).
    extra = {name: getattr(args, name, None) for name in ("num_centroids", "train_tokens", "rescore_dtype")}
    if codec == "exact":
        if nbits is not None:
            raise error(f"--nbits {nbits}: only with --codec plaid")
        for name, value in extra.items():
            if value is not None:
                raise error(f"--{name.replace('_', '-')} {value}: only with --codec plaid")
        return {}
    for name in ("num_centroids", "train_tokens"):
        if extra[name] is not None and extra[name] < 1:
            raise error(f"--{name.replace('_', '-')} must be at least 1, got {extra[name]}")
    if extra["rescore_dtype"] not in (None, "int8", "float16"):
        raise error(f"--rescore-dtype must be int8 or float16, got {extra['rescore_dtype']!r}")
    extra["rescore_dtype"] = {None: None, "int8": torch.int8, "float16": torch.float16}[extra["rescore_dtype"]]
    if nbits is not None and nbits not in NBITS:
        raise error(f"--nbits must be 1, 2 or 4, got {nbits}")
    if args.dtype in ("int8", "float8_e4m3fn"):
        raise error(
            f"--dtype {args.dtype}: --codec plaid stores residual codes; its --dtype is the dtype it "
            "scores in (float16, bfloat16 or float32)"
        )
    return {"codec": "plaid", "nbits": 2 if nbits is None else nbits, **extra}


def describe(directory, index, manifest: Manifest, verify: bool) -> dict:
    """What ``lik index info`` prints of the index at ``directory`` (loaded as ``index``, with ``manifest``)."""
    codec_bytes = 0 if manifest.codec is None else manifest.codec.bytes
    return {
        "path": str(directory),
        "documents": len(index),
        "tokens": manifest.num_tokens,
        "d": index.d,
        "dtype": str(index.dtype).removeprefix("torch."),
        "shards": len(manifest.shards),
        "bytes": sum(s.bytes for s in manifest.shards) + codec_bytes,
        **codec_figures(index.codec, manifest.num_tokens),
        **({} if getattr(index, "rescore_dtype", None) is None else {"rescore_dtype": dtype_name(index.rescore_dtype)}),
        "checked": "sha256 checksums" if verify else "sizes (--verify checks checksums)",
    }
