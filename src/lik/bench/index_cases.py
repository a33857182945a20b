"""``lik.Index`` cases: exact top-10 search of 1, 32 and 256 queries per placement and dtype, and index builds in
documents per second, each against its floor.

Search corpus: 50 000 documents of 60-140 tokens (uniform, ~5M tokens), d = 128, L2-normalised random data drawn on
the device, stored fp16, int8 or fp8; queries of 32 tokens. Placements: ``gpu`` (resident in device memory) against
one ``lik.maxsim_packed`` call over the whole resident corpus (the same FLOPs, no top-k: the bar of a resident
search), with the roofline max(bytes / bandwidth, FLOPs / matmul rate) of fp16 beside it; ``host`` (pinned host RAM
streamed in chunks) against one pinned host-to-device copy of the corpus bytes. Queries per second is ``Nq / time``.

A ragged cell searches 32 queries of 4 to 32 tokens given as a list (one call) against the bare call of the same
queries padded to 32 tokens.

Build cases: 20 000 documents of 100 tokens (d = 128) from GPU tensors (fp16, into a GPU-resident index) and from CPU
tensors (fp32, into a pinned host index quantized on the GPU); documents per second is ``20 000 / time``. Their floor
is the bytes the build must move: device memory traffic for GPU documents, a pinned host-to-device copy of the
documents and back of the stored bytes for CPU ones. The disk placements (warm and cold page cache) need files and
root; they are ``benchmarks/index_bench.py``'s.
"""

from __future__ import annotations

import torch

from .cases import Case, CaseMethod, floor_record
from .measure import Timer

__all__ = ["index_cases", "SEARCH_DOCS", "BUILD_DOCS", "NQS"]

SEARCH_DOCS, MIN_LEN, MAX_LEN, LQ, K = 50_000, 60, 140, 32, 10
BUILD_DOCS, BUILD_LEN = 20_000, 100
NQS = (1, 32, 256)
DTYPES = ((torch.float16, "fp16"), (torch.int8, "int8"), (torch.float8_e4m3fn, "fp8"))
_cache: dict = {}  # the corpus (drawn once) and the last index built (cases of one index run one after another)


def _timer(device: torch.device) -> Timer:
    return Timer(device, warmup_ms=10.0, rep_ms=50.0 if device.type == "cuda" else 5.0)


def _corpus(device: torch.device, smoke: bool) -> tuple[list[torch.Tensor], list[int]]:
    """The search corpus's documents (views of one fp16 tensor on ``device``; fp32 on a CPU) and their lengths."""
    key = ("corpus", device, smoke)
    if key not in _cache:
        gen = torch.Generator().manual_seed(0)
        docs, dim = (12, 16) if smoke else (SEARCH_DOCS, 128)
        low, high = (1, 9) if smoke else (MIN_LEN, MAX_LEN + 1)
        lengths = torch.randint(low, high, (docs,), generator=gen).tolist()
        tokens = torch.randn(sum(lengths), dim, generator=gen) if smoke else torch.randn(
            sum(lengths), dim, device=device, generator=torch.Generator(device).manual_seed(0))
        tokens = torch.nn.functional.normalize(tokens, dim=-1)
        tokens = tokens.half() if device.type == "cuda" else tokens
        _cache.clear()
        _cache[key] = (list(tokens.split(lengths)), lengths)
    return _cache[key]


def _index(dtype, placement: str, device: torch.device, smoke: bool):
    import lik

    key = ("index", dtype, placement, device, smoke)
    if key not in _cache:
        docs, _ = _corpus(device, smoke)
        for old in [k for k in _cache if k[0] == "index"]:
            del _cache[old]
        _cache[key] = lik.Index.build(docs, dtype=dtype, placement=placement, device=device, progress=False)
    return _cache[key]


def _search_inputs(dtype: torch.dtype, placement: str, n_queries: int, ragged: bool = False):
    def inputs(device: torch.device, smoke: bool) -> dict:
        where = placement if device.type == "cuda" else "host"
        index = _index(dtype, where, device, smoke)
        docs, lengths = _corpus(device, smoke)
        gen = torch.Generator().manual_seed(1)
        nq, lq = (min(n_queries, 3), 3) if smoke else (n_queries, LQ)
        Q = torch.nn.functional.normalize(torch.randn(nq, lq, docs[0].shape[1], generator=gen), dim=-1)
        Q = Q.to(device=device, dtype=torch.float16 if device.type == "cuda" else torch.float32)
        tokens = sum(s.tokens.numel() * s.tokens.element_size() for s in index.segments)
        scales = sum(0 if s.scale is None else s.scale.numel() * 4 for s in index.segments)
        # Ragged: query i keeps its first 4..Lq tokens (a list), against the padded batch's bare call as the floor.
        queries = [q[: n] for q, n in zip(Q, torch.randint(min(4, lq), lq + 1, (nq,), generator=gen).tolist())]
        return dict(index=index, Q=Q, queries=queries if ragged else Q, corpus_bytes=tokens + scales, lengths=lengths,
                    device=device, placement=where, dtype=dtype)

    return inputs


def _search_floor(s: dict, ceilings) -> dict | None:
    device, index = s["device"], s["index"]
    if device.type != "cuda":
        return None
    timer = _timer(device)
    if s["placement"] == "gpu":
        import lik

        tokens = torch.cat([seg.tokens for seg in index.segments])
        scale = None if index.segments[0].scale is None else torch.cat([seg.scale for seg in index.segments])
        cu = torch.tensor([0] + s["lengths"]).cumsum(0).to(device=device, dtype=torch.int32)
        longest = max(s["lengths"])
        ms = timer.median_ms(lambda: lik.maxsim_packed(s["Q"], tokens, cu, max_seqlen_d=longest, d_scale=scale))
        record = {"floor_ms": ms, "bound": "one maxsim_packed call over the resident corpus",
                  "bytes": s["corpus_bytes"]}
        if s["dtype"] == torch.float16:  # (the run measures the fp16 matmul rate only)
            flops = 2.0 * s["Q"].shape[0] * s["Q"].shape[1] * tokens.shape[0] * tokens.shape[1]
            record["roofline_ms"] = floor_record(flops, s["corpus_bytes"], ceilings)["floor_ms"]
        return record
    key = ("pinned", s["corpus_bytes"], device)
    if key not in _cache:
        _cache[key] = (torch.empty(s["corpus_bytes"], dtype=torch.uint8).pin_memory(),
                       torch.empty(s["corpus_bytes"], dtype=torch.uint8, device=device))
    pinned, target = _cache[key]
    ms = timer.median_ms(lambda: target.copy_(pinned, non_blocking=True))
    return {"floor_ms": ms, "bound": "a pinned host-to-device copy of the corpus", "bytes": s["corpus_bytes"]}


def _search(s: dict):
    return lambda: s["index"].search(s["queries"], K)


def _build_inputs(dtype: torch.dtype, source: str):
    def inputs(device: torch.device, smoke: bool) -> dict:
        n, length, dim = (8, 5, 16) if smoke else (BUILD_DOCS, BUILD_LEN, 128)
        gen = torch.Generator().manual_seed(2)
        tokens = torch.nn.functional.normalize(torch.randn(n * length, dim, generator=gen), dim=-1)
        on_gpu = source == "gpu" and device.type == "cuda"
        tokens = tokens.to(device).half() if on_gpu else tokens
        size = torch.empty(0, dtype=dtype).element_size()
        stored = n * length * (dim * size + (4 if size == 1 else 0))  # (8-bit rows carry an fp32 scale)
        return dict(docs=list(tokens.split(length)), dtype=dtype, device=device, on_gpu=on_gpu,
                    in_bytes=tokens.numel() * tokens.element_size(), out_bytes=stored)

    return inputs


def _build_floor(s: dict, ceilings) -> dict | None:
    device = s["device"]
    if device.type != "cuda":
        return None
    if s["on_gpu"]:
        record = floor_record(0.0, 2 * s["in_bytes"] + s["out_bytes"], ceilings)
        record["bound"] = "device memory traffic: the documents read, concatenated, stored"
        return record
    timer = _timer(device)
    host = torch.empty(s["in_bytes"] + s["out_bytes"], dtype=torch.uint8).pin_memory()
    target = torch.empty_like(host, device=device)
    ms = timer.median_ms(lambda: target.copy_(host, non_blocking=True))
    return {"floor_ms": ms, "bound": "a pinned copy of the documents' and the stored bytes", "bytes": host.numel()}


def _build(s: dict):
    import lik

    placement = "gpu" if s["on_gpu"] else "host"
    return lambda: lik.Index.build(s["docs"], dtype=s["dtype"], placement=placement, device=s["device"],
                                   progress=False)


def index_cases() -> list[Case]:
    """The index cases, in table order: searches (per dtype, placement, Nq), then builds."""
    cases = []
    for dtype, tag in DTYPES:
        for placement in ("gpu", "host"):
            for n_queries in NQS:
                quick = placement == "gpu" and (tag == "fp16" or n_queries == 32) or (
                    tag == "fp16" and n_queries == 32)
                cases.append(Case(
                    "index", f"index/{tag}-{placement}-nq{n_queries}",
                    f"{tag}, {placement}: 50 000 docs (5M tokens), {n_queries} queries, k {K}",
                    _search_inputs(dtype, placement, n_queries), {"lik": CaseMethod(_search)}, floor=_search_floor,
                    quick=quick, params={"dtype": tag, "placement": placement, "docs": SEARCH_DOCS, "nq": n_queries,
                                         "k": K},
                ))
    cases.append(Case(
        "index", "index/fp16-gpu-ragged32", f"fp16, gpu: 50 000 docs (5M tokens), 32 queries of 4-32 tokens, k {K}",
        _search_inputs(torch.float16, "gpu", 32, ragged=True), {"lik": CaseMethod(_search)}, floor=_search_floor,
        params={"dtype": "fp16", "placement": "gpu", "docs": SEARCH_DOCS, "nq": 32, "k": K, "ragged": True},
    ))
    for dtype, tag in DTYPES:
        for source in ("gpu", "cpu"):
            into = "GPU-resident" if source == "gpu" else "pinned host"
            cases.append(Case(
                "index", f"index/build-{tag}-from-{source}",
                f"build {tag} from {source.upper()} tensors into a {into} index: 20 000 docs of {BUILD_LEN}",
                _build_inputs(dtype, source), {"lik": CaseMethod(_build)}, floor=_build_floor,
                quick=tag == "int8" or (tag == "fp16" and source == "gpu"),
                params={"dtype": tag, "source": source, "docs": BUILD_DOCS, "build": True},
            ))
    return cases
