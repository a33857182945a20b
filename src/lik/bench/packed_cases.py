"""Packed (variable-length) MaxSim cases: ragged corpora and ragged pairs, against padded einsum and the peers'
packed paths.

* ``packed/corpus-<dist>``: one query of Lq = 32 against a ragged corpus of 1 000 documents of at most 512 tokens,
  for three length distributions (``uniform`` 256-512, ``hotpotqa`` lognormal mean ~120, ``ragged`` lognormal
  mean ~70). Methods: ``lik`` (``lik.maxsim_packed``), ``flash-maxsim`` (``flash_maxsim_packed``),
  ``late-interaction-kernels`` (``maxsim_varlen`` with one packed query), ``einsum-padded`` (fp16 einsum over
  zero-padded documents, the PyLate formula).
* ``packed/pairs``: 5 000 ragged (query, document) pairs, Lq uniform 8-32, documents ``hotpotqa``. Methods:
  ``lik`` (``lik.maxsim_varlen``), ``flash-maxsim`` (``flash_maxsim_varlen``), ``late-interaction-kernels``
  (``score_pairs_packed``), ``einsum-padded``.

d = 128, fp16, L2-normalised random data, lengths drawn once with a fixed seed. The floor counts the real,
unpadded tokens: every token read once, the scores written once, the FLOPs of the real products.
"""

from __future__ import annotations

import math

import torch

from .cases import Case, CaseMethod, floor_record

__all__ = ["packed_cases", "doc_lengths"]

DIM, LQ, MAX_LD = 128, 32, 512


def doc_lengths(dist: str, n: int, gen: torch.Generator, max_len: int = MAX_LD) -> list[int]:
    """Document lengths in ``[1, max_len]`` for a named distribution."""
    if dist == "uniform":
        return torch.randint(max_len // 2, max_len + 1, (n,), generator=gen).tolist()
    # Lognormal: mean = exp(mu + sigma^2 / 2); sigma sets how ragged the corpus is.
    mean, sigma = {"hotpotqa": (120.0, 0.6), "ragged": (70.0, 1.0)}[dist]
    mu = math.log(mean) - sigma**2 / 2
    x = torch.exp(mu + sigma * torch.randn(n, generator=gen))
    return x.round().clamp(1, max_len).long().tolist()


def _rows(n: int, dim: int, device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    x = torch.nn.functional.normalize(torch.randn(n, dim, generator=gen), dim=-1)
    return x.to(device=device, dtype=dtype)


def _offsets(lengths: list[int], device: torch.device) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return cu.to(device)


def _padded(packed: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(list(torch.split(packed, lengths)), batch_first=True)


def _corpus_inputs(dist: str):
    def inputs(device: torch.device, smoke: bool) -> dict:
        gen = torch.Generator().manual_seed(0)
        dim, lq, n = (16, 4, 6) if smoke else (DIM, LQ, 1000)
        dtype = torch.float32 if smoke else torch.float16
        lengths = doc_lengths(dist, n, gen, max_len=12 if smoke else MAX_LD)
        d = _rows(sum(lengths), dim, device, dtype, gen)
        return dict(Q=_rows(lq, dim, device, dtype, gen), d=d, cu_d=_offsets(lengths, device), d_lens=lengths,
                    max_d=max(lengths), D_pad=_padded(d, lengths), lq=lq, dim=dim)

    return inputs


def _pair_inputs(device: torch.device, smoke: bool) -> dict:
    gen = torch.Generator().manual_seed(1)
    dim, lq, n = (16, 4, 5) if smoke else (DIM, LQ, 5000)
    dtype = torch.float32 if smoke else torch.float16
    q_lens = torch.randint(max(1, lq // 4), lq + 1, (n,), generator=gen).tolist()
    d_lens = doc_lengths("hotpotqa", n, gen, max_len=12 if smoke else MAX_LD)
    q, d = _rows(sum(q_lens), dim, device, dtype, gen), _rows(sum(d_lens), dim, device, dtype, gen)
    return dict(q=q, d=d, cu_q=_offsets(q_lens, device), cu_d=_offsets(d_lens, device), max_q=max(q_lens),
                max_d=max(d_lens), Q_pad=_padded(q, q_lens), D_pad=_padded(d, d_lens), q_lens=q_lens, d_lens=d_lens,
                dim=dim)


def _corpus_floor(s: dict, ceilings) -> dict:
    products, tokens = s["lq"] * sum(s["d_lens"]), s["lq"] + sum(s["d_lens"])
    n = len(s["d_lens"])
    nbytes = s["d"].element_size() * s["dim"] * tokens + 4.0 * n + 4.0 * (n + 1)
    return floor_record(2.0 * products * s["dim"], nbytes, ceilings)


def _pair_floor(s: dict, ceilings) -> dict:
    products = sum(a * b for a, b in zip(s["q_lens"], s["d_lens"]))
    n = len(s["q_lens"])
    tokens = sum(s["q_lens"]) + sum(s["d_lens"])
    nbytes = s["d"].element_size() * s["dim"] * tokens + 4.0 * n + 2 * 4.0 * (n + 1)
    return floor_record(2.0 * products * s["dim"], nbytes, ceilings)


def _corpus_methods() -> dict[str, CaseMethod]:
    def lik_packed(s):
        import lik

        return lambda: lik.maxsim_packed(s["Q"], s["d"], s["cu_d"], max_seqlen_d=s["max_d"])

    def flash(s):
        from flash_maxsim import flash_maxsim_packed

        return lambda: flash_maxsim_packed(s["Q"], s["d"], s["cu_d"], s["max_d"])

    def late_interaction(s):
        from late_interaction_kernels import maxsim_varlen

        lq = s["Q"].shape[0]
        cu_q = torch.tensor([0, lq], dtype=torch.int32, device=s["Q"].device)
        return lambda: maxsim_varlen(s["Q"], s["d"], cu_q, s["cu_d"], lq, s["max_d"])[0]

    def einsum_padded(s):
        return lambda: torch.einsum("sk,btk->bst", s["Q"], s["D_pad"]).max(dim=-1).values.float().sum(dim=-1)

    return {
        "lik": CaseMethod(lik_packed),
        "flash-maxsim": CaseMethod(flash, module="flash_maxsim", needs_cuda=True),
        "late-interaction-kernels": CaseMethod(late_interaction, module="late_interaction_kernels", needs_cuda=True),
        "einsum-padded": CaseMethod(einsum_padded),
    }


def _pair_methods() -> dict[str, CaseMethod]:
    def lik_varlen(s):
        import lik

        return lambda: lik.maxsim_varlen(s["q"], s["d"], s["cu_q"], s["cu_d"], s["max_q"], s["max_d"])

    def flash(s):
        from flash_maxsim import flash_maxsim_varlen

        return lambda: flash_maxsim_varlen(s["q"], s["d"], s["cu_q"], s["cu_d"], s["max_q"], s["max_d"])

    def late_interaction(s):
        from late_interaction_kernels.score_pairs import score_pairs_packed

        index = torch.arange(len(s["q_lens"]), dtype=torch.int32, device=s["q"].device)
        return lambda: score_pairs_packed(s["q"], s["d"], s["cu_q"], s["cu_d"], index, index,
                                          max_seqlen_q=s["max_q"], max_seqlen_d=s["max_d"])

    def einsum_padded(s):
        return lambda: torch.einsum("nsk,ntk->nst", s["Q_pad"], s["D_pad"]).max(dim=-1).values.float().sum(dim=-1)

    return {
        "lik": CaseMethod(lik_varlen),
        "flash-maxsim": CaseMethod(flash, module="flash_maxsim", needs_cuda=True),
        "late-interaction-kernels": CaseMethod(late_interaction, module="late_interaction_kernels", needs_cuda=True),
        "einsum-padded": CaseMethod(einsum_padded),
    }


def _corpus_reference(s: dict) -> torch.Tensor:
    import lik

    return lik.maxsim_packed_reference(s["Q"].double(), s["d"].double(), s["cu_d"])


def _pair_reference(s: dict) -> torch.Tensor:
    import lik

    return lik.maxsim_varlen_reference(s["q"].double(), s["d"].double(), s["cu_q"], s["cu_d"])


def packed_cases() -> list[Case]:
    """The packed cases, in table order."""
    cases = [
        Case("packed", f"packed/corpus-{dist}", f"corpus {dist}, B 1 000, Lq 32", _corpus_inputs(dist),
             _corpus_methods(), floor=_corpus_floor, reference=_corpus_reference, params={"dist": dist})
        for dist in ("uniform", "hotpotqa", "ragged")
    ]
    cases.append(Case("packed", "packed/pairs", "pairs, 5 000, Lq 8-32", _pair_inputs, _pair_methods(),
                      floor=_pair_floor, reference=_pair_reference))
    return cases
