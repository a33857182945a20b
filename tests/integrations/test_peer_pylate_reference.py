"""What late-interaction-kernels' tests/test_pylate_compat.py compares lik with, reproduced on the CPU.

Its mask and distillation tests take ``pylate.scores.colbert_scores`` / ``colbert_kd_scores`` *before* the patch
as the reference. On a CUDA machine with flash-maxsim installed, PyLate 1.6's ``auto`` backend sends those calls to
flash-maxsim, which reads a mask as a prefix length (``mask.sum(-1)``), not as PyLate's mask-by-multiplication. Here
lik's flash-maxsim compatibility module (flash-maxsim's lengths semantics) stands in for flash-maxsim and PyLate's
flash backend is let through on the CPU: with random masks that reference moves by several percent (the suite's
8 % failures), while lik's PyLate switch matches PyLate's own ``torch`` code. ``LIK_DISABLE`` (the peer's variable)
is not read by lik's switch.
"""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("pylate")

import pylate.scores._flash_backend as flash_backend  # noqa: E402
from pylate.scores import colbert_kd_scores, colbert_scores  # noqa: E402

import lik.integrations.flash_maxsim as lik_flash_maxsim  # noqa: E402
import lik.integrations.pylate as lik_pylate  # noqa: E402


def _l2(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x, dim=-1)


def _random_mask(*shape: int, generator: torch.Generator) -> torch.Tensor:
    # The suite's masks: ~20 % padding scattered anywhere, the first token always valid.
    mask = (torch.rand(*shape, generator=generator) > 0.2).float()
    mask[..., 0] = 1
    return mask


def _prefix_reading(Q, D, q_mask, d_mask, zero_masked_queries: bool = True):
    """MaxSim as PyLate's flash backend has flash-maxsim compute it: only the first ``mask.sum()`` tokens of each
    side take part (``D`` shared ``[B, Ld, d]`` or per query ``[Nq, B, Ld, d]``); its inference path for shared
    documents also zeroes the masked query rows (``zero_masked_queries``), the distillation path does not."""
    sims = torch.einsum("ash,bth->abst", Q, D) if D.dim() == 3 else torch.einsum("ash,abth->abst", Q, D)
    d_len = d_mask.sum(-1).long()
    d_keep = torch.arange(D.shape[-2]) < d_len[..., None]
    d_keep = d_keep[None, :, None, :] if D.dim() == 3 else d_keep[:, :, None, :]
    best = sims.masked_fill(~d_keep, float("-inf")).amax(-1)
    q_keep = torch.arange(Q.shape[1]) < q_mask.sum(-1).long()[:, None]
    q_keep = q_keep & (q_mask != 0) if zero_masked_queries else q_keep
    return (best * q_keep[:, None, :]).sum(-1)


@pytest.fixture
def flash_backend_on_cpu(monkeypatch):
    """PyLate's flash backend, run on the CPU by lik's flash-maxsim compatibility module in flash-maxsim's place."""
    monkeypatch.setitem(sys.modules, "flash_maxsim", lik_flash_maxsim)
    monkeypatch.setattr(flash_backend, "_inputs_supported", lambda Q, D: True)
    lik_pylate.disable()
    yield flash_backend
    lik_pylate.disable()


def test_both_masks_reference_is_flash_prefix_reading(flash_backend_on_cpu):
    g = torch.Generator().manual_seed(0)
    Q, D = _l2(torch.randn(3, 12, 32, generator=g)), _l2(torch.randn(5, 40, 32, generator=g))
    q_mask, d_mask = _random_mask(3, 12, generator=g), _random_mask(5, 40, generator=g)

    pylate_torch = colbert_scores(Q, D, q_mask, d_mask, backend="torch")
    flash_reference = flash_backend_on_cpu.colbert_scores_flash(Q, D, q_mask, d_mask)
    with lik_pylate.enabled():
        patched = colbert_scores(Q, D, queries_mask=q_mask, documents_mask=d_mask)

    torch.testing.assert_close(patched, pylate_torch, atol=1e-5, rtol=0)
    torch.testing.assert_close(flash_reference, _prefix_reading(Q, D, q_mask, d_mask), atol=1e-5, rtol=0)
    relative = (flash_reference - pylate_torch).abs().max() / pylate_torch.abs().max().clamp(min=1)
    assert relative > 5e-3  # the suite's tolerance: its failure, whoever scores after the patch


def test_kd_reference_is_flash_prefix_reading(flash_backend_on_cpu):
    g = torch.Generator().manual_seed(1)
    Q, D = _l2(torch.randn(3, 12, 32, generator=g)), _l2(torch.randn(3, 4, 24, 32, generator=g))
    q_mask, d_mask = _random_mask(3, 12, generator=g), _random_mask(3, 4, 24, generator=g)

    pylate_torch = colbert_kd_scores(Q, D, q_mask, d_mask, backend="torch")
    flash_reference = flash_backend_on_cpu.colbert_kd_scores_flash(Q, D, q_mask, d_mask).detach()
    with lik_pylate.enabled():
        patched = colbert_kd_scores(Q, D, queries_mask=q_mask, documents_mask=d_mask)

    torch.testing.assert_close(patched, pylate_torch, atol=1e-5, rtol=0)
    expected = _prefix_reading(Q, D, q_mask, d_mask, zero_masked_queries=False)
    torch.testing.assert_close(flash_reference, expected, atol=1e-5, rtol=0)
    relative = (flash_reference - pylate_torch).abs().max() / pylate_torch.abs().max().clamp(min=1)
    assert relative > 5e-3


def test_prefix_masks_agree_with_every_reading(flash_backend_on_cpu):
    # Where the masks are prefixes (and each document's best similarity positive, as PyLate's zeros take part in
    # its max), the two readings coincide: the difference is the mask pattern, nothing else.
    g = torch.Generator().manual_seed(2)
    Q, D = _l2(torch.randn(2, 16, 32, generator=g)), _l2(torch.randn(4, 24, 32, generator=g))
    q_mask = (torch.arange(16) < torch.tensor([[9], [16]])).float()
    d_mask = (torch.arange(24) < torch.tensor([[15], [24], [17], [20]])).float()
    pylate_torch = colbert_scores(Q, D, q_mask, d_mask, backend="torch")
    flash_reference = flash_backend_on_cpu.colbert_scores_flash(Q, D, q_mask, d_mask)
    torch.testing.assert_close(flash_reference, pylate_torch, atol=1e-5, rtol=0)


def test_lik_disable_is_not_read(monkeypatch):
    monkeypatch.setenv("LIK_DISABLE", "1")
    g = torch.Generator().manual_seed(3)
    Q, D = _l2(torch.randn(2, 8, 16, generator=g)).half(), _l2(torch.randn(3, 10, 16, generator=g)).half()
    assert colbert_scores(Q, D).dtype == torch.float16  # PyLate's own code sums in the input dtype
    with lik_pylate.enabled():
        assert colbert_scores(Q, D).dtype == torch.float32  # lik's, LIK_DISABLE notwithstanding
