"""``lik.Index`` search cases: exact top-10 search of 32 queries per placement, against its floor.

The corpus: 10 000 documents of 1-599 tokens (uniform, ~3M tokens), d = 128, fp16 (and int8 in the full run);
queries 32 x 32 tokens, L2-normalised random data. Placements: ``gpu`` (resident in device memory) against one
``lik.maxsim_packed`` call over the whole resident corpus (the same FLOPs, no chunking, no top-k merge); ``host``
(pinned host RAM streamed in chunks) against one pinned host-to-device copy of the corpus bytes. Both floors are
measured in the same process. The disk placements (warm and cold page cache) need files and root; they are
``benchmarks/index_bench.py``'s.
"""

from __future__ import annotations

import torch

from .cases import Case, CaseMethod
from .measure import Timer

__all__ = ["index_cases"]

DOCS, MEAN_LEN, NQ, LQ, K = 10_000, 300, 32, 32, 10
_corpus: dict = {}


def _documents(smoke: bool) -> list[torch.Tensor]:
    """The corpus's documents as CPU fp32 tensors (drawn once per process)."""
    if smoke not in _corpus:
        gen = torch.Generator().manual_seed(0)
        docs, mean = (12, 6) if smoke else (DOCS, MEAN_LEN)
        dim = 16 if smoke else 128
        lengths = torch.randint(1, 2 * mean, (docs,), generator=gen).tolist()
        _corpus[smoke] = [torch.nn.functional.normalize(torch.randn(n, dim, generator=gen), dim=-1) for n in lengths]
    return _corpus[smoke]


def _timer(device: torch.device) -> Timer:
    return Timer(device, warmup_ms=10.0, rep_ms=50.0 if device.type == "cuda" else 5.0)


def _inputs(dtype: torch.dtype, placement: str):
    def inputs(device: torch.device, smoke: bool) -> dict:
        import lik

        docs = _documents(smoke)
        gen = torch.Generator().manual_seed(1)
        nq, lq = (2, 3) if smoke else (NQ, LQ)
        Q = torch.nn.functional.normalize(torch.randn(nq, lq, docs[0].shape[1], generator=gen), dim=-1)
        Q = Q.to(device=device, dtype=torch.float16 if dtype in (torch.int8, torch.float8_e4m3fn) else dtype)
        if smoke and device.type != "cuda":
            Q = Q.float()
        where = placement if device.type == "cuda" else "host"
        index = lik.Index.build(iter(docs), dtype=dtype, placement=where, device=device, progress=False)
        tokens = sum(s.tokens.numel() * s.tokens.element_size() for s in index.segments)
        scales = sum(0 if s.scale is None else s.scale.numel() * 4 for s in index.segments)
        return dict(index=index, Q=Q, corpus_bytes=tokens + scales, lengths=[len(d) for d in docs], device=device,
                    placement=where)

    return inputs


def _floor(s: dict, ceilings) -> dict | None:
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
        what = "one maxsim_packed call over the resident corpus"
    else:
        pinned = torch.empty(s["corpus_bytes"], dtype=torch.uint8).pin_memory()
        target = torch.empty(s["corpus_bytes"], dtype=torch.uint8, device=device)
        ms = timer.median_ms(lambda: target.copy_(pinned, non_blocking=True))
        what = "a pinned host-to-device copy of the corpus"
    return {"floor_ms": ms, "bound": what, "bytes": s["corpus_bytes"]}


def _search(s: dict):
    return lambda: s["index"].search(s["Q"], K)


def index_cases() -> list[Case]:
    """The index cases, in table order."""
    cases = []
    for dtype, tag, quick in ((torch.float16, "fp16", True), (torch.int8, "int8", False)):
        for placement in ("gpu", "host"):
            cases.append(Case(
                "index", f"index/{tag}-{placement}", f"{tag}, {placement}: 10 000 docs, 32 queries, k 10",
                _inputs(dtype, placement), {"lik": CaseMethod(_search)}, floor=_floor, quick=quick,
                params={"dtype": tag, "placement": placement, "docs": DOCS, "nq": NQ, "k": K},
            ))
    return cases
