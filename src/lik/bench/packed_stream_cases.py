"""Packed-corpus scoring at scale: the token stream against the document loop, each against its floor.

* ``packed-stream/short-<dtype>-nq<N>``: 50 000 documents of 60-140 tokens (uniform, ~5.0M tokens), ``N`` = 1, 32
  or 256 queries of 32 tokens;
* ``packed-stream/colpali-<dtype>-nq<N>``: 5 000 pages of 1 030 tokens (5.15M tokens), ``N`` = 1, 32 or 256.

d = 128, L2-normalised random data; dtype fp16, int8 or fp8 (the corpus quantized by ``lik.quantize``, the
queries too, outside the timed call). Methods: ``lik`` (``lik.maxsim_packed`` as the heuristic of
``lik.config.packed`` chooses), ``lik-stream`` (the token stream forced, with its heuristic tiles) and ``lik-loop``
(the document loop forced). The check compares each method with the document loop's scores. The floor: every
token (and 8-bit scale) read once, the scores written once, the real products at the run's fp16 matmul rate
(for 8-bit corpora too, as the packed tables state it; an int8 / fp8 rate would halve the compute term).
"""

from __future__ import annotations

import torch

from .cases import Case, CaseMethod, floor_record

__all__ = ["packed_stream_cases"]

DIM, LQ = 128, 32
SHORT_DOCS, SHORT_MIN, SHORT_MAX = 50_000, 60, 140
PAGES, PAGE_LEN = 5_000, 1_030
_DTYPES = {"fp16": torch.float16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
_corpora: dict = {}


def _corpus(kind: str, device: torch.device, smoke: bool) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The fp16 (smoke: fp32) corpus and its offsets, drawn on the device once per process."""
    key = (kind, str(device), smoke)
    if key not in _corpora:
        gen = torch.Generator().manual_seed(0)
        if kind == "short":
            n, lo, hi = (6, 3, 9) if smoke else (SHORT_DOCS, SHORT_MIN, SHORT_MAX)
            lengths = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
        else:
            lengths = [7] * 4 if smoke else [PAGE_LEN] * PAGES
        dim = 16 if smoke else DIM
        dev_gen = torch.Generator(device=device).manual_seed(0)
        rows = torch.randn(sum(lengths), dim, device=device, generator=dev_gen)
        rows = torch.nn.functional.normalize(rows, dim=-1).to(torch.float32 if smoke else torch.float16)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lengths).cumsum(0)
        _corpora.clear()  # (one corpus resident at a time: 1.3 GB each in fp16)
        _corpora[key] = (rows, cu.to(device), lengths)
    return _corpora[key]


def _inputs(kind: str, tag: str, nq: int):
    def inputs(device: torch.device, smoke: bool) -> dict:
        import lik

        rows, cu, lengths = _corpus(kind, device, smoke)
        dim = rows.shape[1]
        gen = torch.Generator(device=device).manual_seed(1)
        Q = torch.randn(nq, 4 if smoke else LQ, dim, device=device, generator=gen)
        Q = torch.nn.functional.normalize(Q, dim=-1).to(rows.dtype)
        d, q, d_scale, q_scale = rows, Q, None, None
        dtype = _DTYPES[tag]
        if dtype != torch.float16:
            d, d_scale = lik.quantize(rows, dtype)
            q, q_scale = lik.quantize(Q, dtype)
        return dict(
            q=q,
            d=d,
            cu=cu,
            q_scale=q_scale,
            d_scale=d_scale,
            longest=max(lengths),
            tokens=sum(lengths),
            docs=len(lengths),
            device=device,
        )

    return inputs


def _call(s: dict):
    import lik

    return lambda: lik.maxsim_packed(
        s["q"], s["d"], s["cu"], max_seqlen_d=s["longest"], q_scale=s["q_scale"], d_scale=s["d_scale"]
    )


def _forced(stream: bool):
    def build(s: dict):
        from ..config import override
        from ..config.packed import PackedStreamConfig, packed_stream_tiles

        q = s["q"]
        cfg = PackedStreamConfig(stream=False)
        if stream:
            cfg = packed_stream_tiles(
                q_len=q.shape[1], n_queries=q.shape[0], dim=q.shape[2], dtype=s["d"].dtype, device=s["device"]
            )
        call = _call(s)

        def forced():
            with override(packed_stream=cfg):
                return call()

        return forced

    return build


def _floor(s: dict, ceilings) -> dict:
    q, d = s["q"], s["d"]
    n_rows, lq, dim = q.shape[0] * q.shape[1], q.shape[1], q.shape[2]
    scale_bytes = 0 if s["d_scale"] is None else 4.0 * (s["tokens"] + n_rows)
    nbytes = (
        d.element_size() * dim * (s["tokens"] + n_rows)
        + scale_bytes
        + 4.0 * (s["docs"] + 1)
        + 4.0 * q.shape[0] * s["docs"]
    )
    return floor_record(2.0 * q.shape[0] * lq * s["tokens"] * dim, nbytes, ceilings)


def _reference(s: dict) -> torch.Tensor:
    return _forced(False)(s)()


def packed_stream_cases() -> list[Case]:
    """The cases, in table order: short documents, then ColPali pages (Nq 1, 32, 256 each), per dtype."""
    methods = {
        "lik": CaseMethod(_call),
        "lik-stream": CaseMethod(_forced(True)),
        "lik-loop": CaseMethod(_forced(False)),
    }
    cases = []
    for kind, label, counts in (
        ("short", "50 000 docs of 60-140 tokens", (1, 32, 256)),
        ("colpali", "5 000 pages of 1 030 tokens", (1, 32, 256)),
    ):
        for tag in _DTYPES:
            for nq in counts:
                cases.append(
                    Case(
                        "packed-stream",
                        f"packed-stream/{kind}-{tag}-nq{nq}",
                        f"{label}, {tag}, Nq {nq}",
                        _inputs(kind, tag, nq),
                        methods,
                        floor=_floor,
                        reference=_reference,
                        tolerance=1e-3,
                        quick=tag == "fp16" and nq == 32,
                        params={"corpus": kind, "dtype": tag, "nq": nq, "lq": LQ},
                    )
                )
    return cases
