"""maxsim_from_hidden's forward: the reference against its definition (float64), the kernel (Triton's interpreter on
CPU) against the reference, with the nasty cases."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lik.ops.fused_head import maxsim_from_hidden, maxsim_from_hidden_reference
from lik.ops.fused_head.forward import FusedHeadConfig, forced_config

from .helpers import definition, problem

TOL = dict(rtol=2e-5, atol=2e-5)


def _kernel(p, **kw):
    return maxsim_from_hidden(p["Q"], p["H"], p["W"], p["b"], p["q_mask"], p["d_mask"], **kw)


@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
@pytest.mark.parametrize("per_query", [False, True])
def test_reference_is_the_definition(rng, mask_mode, per_query):
    p = problem(rng, per_query=per_query, dtype=torch.float64)
    expected = definition(**p, mask_mode=mask_mode)
    got = maxsim_from_hidden_reference(**p, mask_mode=mask_mode, budget_bytes=4096)  # several chunks
    torch.testing.assert_close(got, expected)
    assert got.dtype == torch.float64 and torch.isfinite(got).all()
    assert (got[:, 1] == 0).all()  # the fully masked document


@pytest.mark.parametrize("mask_mode", ["exclude", "zero"])
@pytest.mark.parametrize("normalize,bias", [(True, True), (False, False), (True, False)])
def test_kernel_matches_reference(rng, mask_mode, normalize, bias):
    p = problem(rng, bias=bias)
    got = _kernel(p, normalize=normalize, mask_mode=mask_mode)
    expected = definition(**p, normalize=normalize, mask_mode=mask_mode)
    assert got.dtype == torch.float32 and got.shape == (3, 4)
    torch.testing.assert_close(got.double(), expected, **TOL)
    assert torch.isfinite(got).all() and (got[:, 1] == 0).all()


def test_per_query_documents_and_2d_query(rng):
    p = problem(rng, per_query=True, l_d=19)
    torch.testing.assert_close(_kernel(p).double(), definition(**p), **TOL)
    q = problem(rng, n_q=1, l_d=19, masks=False)
    got = maxsim_from_hidden(q["Q"][0], q["H"], q["W"], q["b"])
    assert got.shape == (4,)
    torch.testing.assert_close(got.double(), definition(q["Q"][0], q["H"], q["W"], q["b"]), **TOL)


@pytest.mark.parametrize("cfg", [FusedHeadConfig(16, 32, 16), FusedHeadConfig(32, 16, 64),
                                 FusedHeadConfig(16, 16, 32, min_split_rows=16, target_programs=64)])
def test_other_tiles(rng, cfg):
    p = problem(rng, n_q=5, l_q=7)  # 35 query rows: several row blocks (the last config: one per program)
    with forced_config(cfg):
        got = _kernel(p)
    torch.testing.assert_close(got.double(), definition(**p), **TOL)


def test_packed_equals_padded(rng):
    p = problem(rng, n_docs=4, l_d=21, masks=False, bias=True)
    lengths = [21, 0, 1, 17]
    rows = torch.cat([p["H"][i, :n] for i, n in enumerate(lengths)])
    cu = torch.tensor([0, 21, 21, 22, 39], dtype=torch.int32)
    d_mask = torch.arange(21)[None, :] < torch.tensor(lengths)[:, None]
    for mask_mode in ("exclude", "zero"):
        # packed documents have no masked token, only an end: both modes score as "exclude" does the padded view
        expected = definition(p["Q"], p["H"], p["W"], p["b"], d_mask=d_mask)
        got = maxsim_from_hidden(p["Q"], rows, p["W"], p["b"], cu_seqlens=cu, mask_mode=mask_mode)
        torch.testing.assert_close(got.double(), expected, **TOL)
        ref = maxsim_from_hidden_reference(p["Q"].double(), rows.double(), p["W"].double(), p["b"].double(),
                                           cu_seqlens=cu, mask_mode=mask_mode)
        torch.testing.assert_close(ref, expected)
        assert (got[:, 1] == 0).all()


@pytest.mark.parametrize("n_q,l_q,n_docs,l_d", [(0, 5, 3, 4), (2, 0, 3, 4), (2, 5, 0, 4), (2, 5, 3, 0),
                                                (1, 1, 1, 1)])
def test_empty_and_unit_sizes(rng, n_q, l_q, n_docs, l_d):
    p = problem(rng, n_q=n_q, l_q=l_q, n_docs=n_docs, l_d=l_d, masks=False)
    got = _kernel(p)
    assert got.shape == (n_q, n_docs) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), definition(**p), **TOL)
    if n_q * l_q * n_docs * l_d == 0:
        assert (got == 0).all()


def test_nan_in_a_valid_token_and_all_masked(rng):
    p = problem(rng, masks=False)
    p["H"][2, 20, 3] = float("nan")
    got = _kernel(p)
    assert torch.isnan(got[:, 2]).all() and torch.isfinite(got[:, [0, 1, 3]]).all()
    torch.testing.assert_close(got[:, [0, 1, 3]].double(), definition(**p)[:, [0, 1, 3]], **TOL)
    d_mask = torch.zeros(4, 37, dtype=torch.bool)
    assert (maxsim_from_hidden(p["Q"], p["H"], p["W"], p["b"], d_mask=d_mask) == 0).all()
    q_mask = torch.zeros(3, 5, dtype=torch.bool)
    assert (maxsim_from_hidden(p["Q"], p["H"], p["W"], p["b"], q_mask=q_mask) == 0).all()


def test_zero_projection_row(rng):
    """A hidden row projecting to 0 is divided by F.normalize's eps (so it stays 0 and scores 0)."""
    p = problem(rng, masks=False, bias=False)
    p["H"][0, 3] = 0
    p["Q"] = -p["Q"].abs()  # every other similarity in document 0 is likely negative: the zero row wins
    p["H"][0] = p["H"][0].abs()
    p["W"] = p["W"].abs()
    got = _kernel(p)
    torch.testing.assert_close(got.double(), definition(**p), **TOL)


def test_non_contiguous_views(rng):
    p = problem(rng, masks=True)
    views = dict(
        Q=p["Q"].transpose(1, 2).contiguous().transpose(1, 2),
        H=p["H"].permute(1, 0, 2).contiguous().permute(1, 0, 2),
        W=p["W"].t().contiguous().t(),
        b=torch.stack([p["b"], p["b"]], 1)[:, 0],
        q_mask=p["q_mask"].t().contiguous().t(),
        d_mask=p["d_mask"].t().contiguous().t(),
    )
    assert not views["H"].is_contiguous() and not views["W"].is_contiguous()
    torch.testing.assert_close(_kernel(views).double(), definition(**p), **TOL)


def test_unfused_parity_in_float32(rng):
    """The kernel against the unfused path a user runs (projection, normalisation, lik.maxsim)."""
    p = problem(rng, n_docs=2, l_d=20, masks=False)
    unfused = F.normalize(F.linear(p["H"], p["W"], p["b"]), dim=-1)
    import lik

    torch.testing.assert_close(_kernel(p), lik.maxsim(p["Q"], unfused), **TOL)
