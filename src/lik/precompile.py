"""``lik.warmup``: compile, before serving, the kernel variants that some query shapes will need.

A variant is fixed by the query-length bucket, how many short queries are stacked in a tile, ``d``, the dtype,
the masks, whether a gradient is needed, for one short query whether documents are long (at least
``lik.config.LONG_DOCUMENT`` tokens: larger document tiles) and, for an 8-bit corpus scored by long queries,
whether its length is a multiple of the document tile; batch sizes and document lengths are otherwise runtime
values. Warming up with one short and (where it differs) one long document, each at a ragged and a whole number
of tiles where that makes a variant, therefore covers every corpus those queries will meet, and afterwards
``lik.maxsim`` neither compiles nor synchronises with the host, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Iterable

import torch

from ._device import cdiv
from .config.maxsim import LONG_DOCUMENT, maxsim_forward_config
from .core.forward_launch import last_tiles
from .core.quantized import loader_of
from .ops.maxsim import maxsim
from .ops.quantization import quantize

__all__ = ["warmup", "main"]

_DTYPES = {
    "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
}
_8BIT = (torch.int8, torch.float8_e4m3fn)


def warmup(
    shapes: Iterable[tuple[int, int, int]],
    *,
    dtype: torch.dtype = torch.float16,
    device: torch.device | str | None = None,
    masks: bool = True,
    training: bool = False,
) -> int:
    """Run ``lik.maxsim`` once per variant the given query shapes need, so later calls do not compile.

    Args:
        shapes: ``(Nq, Lq, d)`` triples: ``Nq`` queries of ``Lq`` tokens (use ``Nq = 1`` for 2-D queries).
        dtype: embedding dtype (float16, bfloat16 or float32), or the corpus dtype of 8-bit scoring (int8,
            float8_e4m3fn): the variants :func:`lik.maxsim` runs for a float query against a
            :func:`lik.quantize`-d corpus (the query quantization included); inference only.
        device: a CUDA device (default: the current one).
        masks: also compile the variants with query and document masks.
        training: also compile the argmax forward and both backward kernels.

    Returns:
        The number of calls made.

    Example:
        >>> lik.warmup([(1, 32, 128), (32, 32, 128)], dtype=torch.float16)
    """
    if dtype in _8BIT and training:
        raise ValueError(f"training=True: 8-bit scoring ({dtype}) is inference only")
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    calls = 0
    for n_queries, q_len, dim in shapes:
        if min(n_queries, q_len, dim) <= 0:
            raise ValueError(f"shapes must be positive (Nq, Lq, d) triples, got {(n_queries, q_len, dim)}")
        Q = torch.randn(n_queries, q_len, dim, device=device)
        Q = Q if dtype in _8BIT else Q.to(dtype)
        for doc_len, masked_variants in _document_lengths(n_queries, q_len, dim, dtype, device):
            D = torch.randn(1, doc_len, dim, device=device)
            d_scale = None
            if dtype in _8BIT:
                D, d_scale = quantize(D, dtype)
            else:
                D = D.to(dtype)
            calls += _warm_one(Q, D, masks and masked_variants, training, d_scale)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return calls


def _document_length_buckets(n_queries, q_len, dim, dtype, device) -> list[int]:
    """One document length per forward variant: long documents get their own tiles for some query shapes."""
    config = functools.partial(
        maxsim_forward_config, q_len=q_len, n_queries=n_queries, dim=dim, dtype=dtype, per_query=False, device=device
    )
    return [8] if config(doc_len=8) == config(doc_len=LONG_DOCUMENT) else [8, LONG_DOCUMENT]


def _document_lengths(n_queries, q_len, dim, dtype, device) -> list[tuple[int, bool]]:
    """The document lengths to warm up with, each with whether its masked variants are to be warmed too: one per
    :func:`_document_length_buckets` bucket and, where the forward reads an unmasked 8-bit corpus by whole tiles
    (long queries: ``lik.core.forward_launch.last_tiles``, which the launch asks too), lengths of the same config
    for its other variants (a whole number of tiles, one token past it, one token short of it), unmasked only."""
    loader = loader_of(dtype)
    config = functools.partial(maxsim_forward_config, q_len=q_len, n_queries=n_queries, dim=dim, dtype=dtype,
                               per_query=False, device=device)
    lengths = []
    for doc_len in _document_length_buckets(n_queries, q_len, dim, dtype, device):
        cfg = config(doc_len=doc_len)
        lengths.append((doc_len, True))
        seen = {last_tiles(cfg, doc_len, dim, loader, masked=False)}
        tiles = max(1, cdiv(doc_len, cfg.block_n)) * cfg.block_n
        for other in (tiles, tiles + 1, tiles - 1):
            variant = last_tiles(cfg, other, dim, loader, masked=False)
            if variant not in seen and config(doc_len=other) == cfg:
                seen.add(variant)
                lengths.append((other, False))
    return lengths


def _warm_one(Q: torch.Tensor, D: torch.Tensor, masks: bool, training: bool, d_scale: torch.Tensor | None) -> int:
    calls = 0
    mask_options = [(None, None)]
    if masks:
        mask_options.append((torch.ones(Q.shape[:2], dtype=torch.bool, device=Q.device),
                             torch.ones(D.shape[:2], dtype=torch.bool, device=D.device)))
    for q_mask, d_mask in mask_options:
        for mask_mode in ("exclude", "zero") if q_mask is not None else ("exclude",):
            with torch.no_grad():
                maxsim(Q, D, q_mask, d_mask, mask_mode=mask_mode, d_scale=d_scale)
            calls += 1
            if training:
                for backward in ("fast", "deterministic"):
                    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
                    maxsim(Qg, Dg, q_mask, d_mask, mask_mode=mask_mode, backward=backward).sum().backward()
                    calls += 1
    return calls


def _shape(text: str) -> tuple[int, int, int]:
    try:
        n_queries, q_len, dim = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected Nq,Lq,d (e.g. 32,32,128), got {text!r}") from None
    return n_queries, q_len, dim


def main(argv: list[str] | None = None) -> int:
    """``lik warmup --shape Nq,Lq,d [--shape ...] [--dtype fp16] [--training] [--no-masks]``."""
    parser = argparse.ArgumentParser(prog="lik warmup", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=_shape, action="append", required=True, help="Nq,Lq,d (repeatable)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="fp16")
    parser.add_argument("--training", action="store_true", help="also compile the backward kernels")
    parser.add_argument("--no-masks", action="store_true", help="skip the masked variants")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("lik warmup: no CUDA GPU here; the CPU path has nothing to compile")
        return 1
    start = time.perf_counter()
    calls = warmup(args.shape, dtype=_DTYPES[args.dtype], masks=not args.no_masks, training=args.training)
    print(f"lik warmup: {calls} calls over {len(args.shape)} shapes in {time.perf_counter() - start:.1f} s")
    return 0
