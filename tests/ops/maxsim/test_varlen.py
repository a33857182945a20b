"""Packed variable-length MaxSim (lik.maxsim_varlen, lik.maxsim_packed, lik.pack / lik.unpack).

Scores and both gradients are compared with the float64 looped reference, through the kernels (Triton's
interpreter on CPU) and through the CPU reference path. `-m gpu` runs the compiled kernels in fp16 / bf16 / fp32.
"""

from __future__ import annotations

import json

import pytest
import torch

import lik
from lik import _config
from lik.ops.maxsim import packing
from lik.ops.maxsim.function import uses_kernels
from lik.ops.maxsim.forward_kernel import maxsim_fwd_kernel as maxsim_varlen_fwd_kernel

from .helpers import rel_err

TOL = 2e-6


@pytest.fixture(params=["kernel", "reference"])
def path(request, monkeypatch):
    """Run each test through the Triton kernels (interpreter) and through the CPU reference path."""
    if request.param == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    return request.param


def _rand_list(rng, lengths, dim, dtype=torch.float32, device="cpu"):
    out = []
    for n in lengths:
        x = torch.randn(n, dim, generator=rng)
        out.append(torch.nn.functional.normalize(x, dim=-1).to(device=device, dtype=dtype))
    return out


def _grads(fn, inputs, grad, **kwargs):
    """Scores and the gradients of ``sum(scores * grad)`` w.r.t. the first two inputs."""
    a, b = (x.detach().clone().requires_grad_() for x in inputs[:2])
    scores = fn(a, b, *inputs[2:], **kwargs)
    ga, gb = torch.autograd.grad(scores, (a, b), grad.to(scores.dtype))
    return scores.detach(), ga, gb


def _check_pairs(rng, q_lens, d_lens, dim, *, backward="fast", hints=True, q_hint=None):
    q, cu_q, max_q = lik.pack(_rand_list(rng, q_lens, dim))
    d, cu_d, max_d = lik.pack(_rand_list(rng, d_lens, dim))
    grad = torch.randn(len(q_lens), generator=rng)
    hint_args = (max_q if q_hint is None else q_hint, max_d) if hints else ()
    s, dq, dd = _grads(lik.maxsim_varlen, (q, d, cu_q, cu_d, *hint_args), grad, backward=backward)
    rs, rdq, rdd = _grads(lik.maxsim_varlen_reference, (q.double(), d.double(), cu_q, cu_d), grad)
    assert s.dtype == torch.float32 and s.shape == (len(q_lens),)
    assert dq.dtype == q.dtype and dd.dtype == d.dtype and dq.shape == q.shape and dd.shape == d.shape
    assert rel_err(s, rs) < TOL and rel_err(dq, rdq) < TOL and rel_err(dd, rdd) < TOL
    # Inputs without gradients take the inference launch (no autograd node, no argmax): the same bits.
    assert torch.equal(lik.maxsim_varlen(q, d, cu_q, cu_d, *hint_args, backward=backward), s)
    return s


def _check_corpus(rng, n_q, l_q, d_lens, dim, *, squeeze=False, masked=True, backward="fast"):
    Q = torch.nn.functional.normalize(torch.randn(n_q, l_q, dim, generator=rng), dim=-1)
    q_mask = torch.rand(n_q, l_q, generator=rng) > 0.3 if masked else None
    if squeeze:
        Q, q_mask = Q[0], (q_mask[0] if masked else None)
    d, cu_d, max_d = lik.pack(_rand_list(rng, d_lens, dim))
    grad = torch.randn((len(d_lens),) if squeeze else (n_q, len(d_lens)), generator=rng)
    s, dq, dd = _grads(lik.maxsim_packed, (Q, d, cu_d, q_mask), grad, backward=backward)
    rs, rdq, rdd = _grads(lik.maxsim_packed_reference, (Q.double(), d.double(), cu_d, q_mask), grad)
    assert s.dtype == torch.float32 and s.shape == rs.shape
    assert rel_err(s, rs) < TOL and rel_err(dq, rdq) < TOL and rel_err(dd, rdd) < TOL
    if masked:
        assert torch.all(dq[~q_mask] == 0)
    with torch.no_grad():  # the inference launch, even for inputs that require gradients
        assert torch.equal(lik.maxsim_packed(Q.requires_grad_(), d, cu_d, q_mask, backward=backward), s)
    return s


# Empty queries and documents, length 1, a query longer than one interpreter row group (32), odd dims.
PAIRS = [
    ([1], [1], 1),
    ([3, 0, 5, 17, 1], [7, 4, 0, 40, 1], 24),
    ([40, 2, 33], [3, 70, 16], 16),
    ([0, 0], [5, 0], 8),
]


@pytest.mark.parametrize("q_lens,d_lens,dim", PAIRS)
@pytest.mark.parametrize("backward", ["fast", "deterministic"])
def test_pairs_match_reference(rng, path, q_lens, d_lens, dim, backward):
    _check_pairs(rng, q_lens, d_lens, dim, backward=backward)


def test_pairs_without_hints_read_cu_seqlens(rng, path):
    _check_pairs(rng, [4, 9, 0], [6, 1, 3], 20, hints=False)


@pytest.mark.parametrize("q_hint", [0, 1, 8])
def test_query_hint_below_truth_is_still_exact(rng, q_hint):
    """max_seqlen_q only sizes the grid: programs loop over the chunks a too-small hint leaves out."""
    _check_pairs(rng, [40, 2, 70], [3, 9, 16], 16, q_hint=q_hint)


@pytest.mark.parametrize(
    "n_q,l_q,d_lens,dim,squeeze",
    [
        (1, 5, [7, 0, 1, 33], 24, True),  # 2-D query, empty and length-1 documents
        (3, 5, [4, 17, 0, 2], 16, False),  # several short queries stacked in one tile
        (2, 40, [3, 20], 8, False),  # query longer than one row group: exact partial sums
    ],
)
@pytest.mark.parametrize("backward", ["fast", "deterministic"])
def test_corpus_matches_reference(rng, path, n_q, l_q, d_lens, dim, squeeze, backward):
    _check_corpus(rng, n_q, l_q, d_lens, dim, squeeze=squeeze, backward=backward)


def test_corpus_without_query_mask(rng, path):
    _check_corpus(rng, 2, 6, [5, 9], 16, masked=False)


def test_corpus_equals_padded_maxsim(rng, path):
    """A packed corpus scores exactly like the padded one with a document mask ("exclude")."""
    docs = _rand_list(rng, [5, 0, 12, 1], 16)
    d, cu_d, max_d = lik.pack(docs)
    padded = torch.nn.utils.rnn.pad_sequence(docs, batch_first=True)
    d_mask = torch.arange(max_d)[None, :] < torch.tensor([len(x) for x in docs])[:, None]
    Q = torch.randn(2, 7, 16, generator=rng)
    packed = lik.maxsim_packed(Q, d, cu_d, max_seqlen_d=max_d)
    torch.testing.assert_close(packed, lik.maxsim(Q, padded, None, d_mask), rtol=1e-6, atol=1e-6)


def test_wide_embeddings_split_over_k_chunks(rng):
    """block_k below the embedding width: the tile loop reloads the query per k chunk."""
    forced = _config.MaxSimForwardConfig(group_rows=16, groups=1, block_n=16, block_k=16)
    with _config.override(maxsim_varlen=forced):
        _check_pairs(rng, [5, 18], [9, 3], 40)
        _check_corpus(rng, 2, 5, [9, 3], 40)


@pytest.mark.parametrize("forced", [
    # One program walks every document; several programs, strided; more programs than documents.
    _config.MaxSimForwardConfig(group_rows=1, groups=16, block_n=16, block_k=32, programs_per_sm=1),
    _config.MaxSimForwardConfig(group_rows=4, groups=4, block_n=16, block_k=32, programs_per_sm=7),
    _config.MaxSimForwardConfig(group_rows=4, groups=4, block_n=16, block_k=32, programs_per_sm=60),
])
def test_persistent_corpus_walks_documents_of_every_length(rng, monkeypatch, forced):
    """Stacked query rows in inference walk a packed corpus in a persistent launch: empty documents (first, inner,
    last), documents shorter than a tile, one token, several tiles, a NaN in one; scores equal the reference and the
    training launch (a program per document), and only the inference launch is persistent."""
    from lik.core import forward_launch

    persistent = []
    launch = forward_launch.launch
    monkeypatch.setattr(forward_launch, "launch", lambda *a, **k: persistent.append(k["PERSISTENT"]) or launch(*a, **k))
    lengths = [0, 9, 1, 40, 0, 17, 33, 5, 0]
    with _config.override(maxsim_varlen=forced):
        _check_corpus(rng, 5, 3, lengths, 24)
        assert persistent == [False, True]  # (the training launch, then the inference one)
        Q = torch.randn(5, 3, 24, generator=rng)
        d, cu_d, _ = lik.pack(_rand_list(rng, lengths, 24))
        d[cu_d[3] + 21, 4] = float("nan")  # document 3's second tile
        scores = lik.maxsim_packed(Q, d, cu_d)
        reference = lik.maxsim_packed_reference(Q.double(), d.double(), cu_d)
    assert torch.equal(scores.isnan(), reference.isnan()) and scores[:, 3].isnan().all()
    clean = [i for i in range(len(lengths)) if i != 3]
    assert rel_err(scores[:, clean], reference[:, clean]) < TOL
    assert not scores[:, [0, 4, 8]].any()  # empty documents score 0


def test_deterministic_over_many_short_documents(rng):
    """1-3 token documents and an empty one: each packed row finds its own document (binary search)."""
    lengths = [1, 2, 3, 0, 1, 2, 3, 1, 1, 2, 3, 2, 1, 1, 3]
    _check_pairs(rng, [2] * len(lengths), lengths, 16, backward="deterministic")
    _check_corpus(rng, 2, 3, lengths, 16, backward="deterministic")


@pytest.mark.parametrize("workspace", [6, 12, 1 << 20])
def test_deterministic_corpus_sorts_a_few_documents_per_pass(rng, path, workspace):
    """A sort workspace of 1 or 2 documents' winners (Nq 2 x Lq 3 each): the corpus is sorted in passes, and each
    pass stores only its own documents' rows (the others hold other passes' results)."""
    forced = _config.MaxSimBackwardConfig(block_rows=16, block_k=16, sort_workspace_entries=workspace)
    with _config.override(maxsim_backward=forced):
        _check_corpus(rng, 2, 3, [4, 0, 7, 1, 5], 24, backward="deterministic")


@pytest.mark.parametrize("backward", ["fast", "deterministic"])
def test_backward_launches_do_not_depend_on_packed_lengths(monkeypatch, backward):
    """The backward kernels see no stride or size that follows the packed lengths: batches of other pair counts
    and token totals (odd and even, at an odd width) launch the same specialisations, so a GPU compiles once."""
    from lik import _config as config
    from tests import test_compile_sm90 as compile_test

    def launches(q_lens, d_lens):
        q, cu_q, max_q = lik.pack([torch.randn(n, 24) for n in q_lens])
        d, cu_d, max_d = lik.pack([torch.randn(n, 24) for n in d_lens])
        Q = torch.randn(2, 5, 24)

        def workload():
            for a, b, fn in ((q, d, lambda a, b: lik.maxsim_varlen(a, b, cu_q, cu_d, max_q, max_d, backward=backward)),
                             (Q, d, lambda a, b: lik.maxsim_packed(a, b, cu_d, None, max_d, backward=backward))):
                a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
                fn(a, b).sum().backward()

        jobs = [compile_test._describe(*launch) for launch in compile_test._record_launches(monkeypatch, workload)]
        return sorted(json.dumps(job, sort_keys=True) for job in jobs if "bwd" in job["name"] or "keys" in job["name"])

    if not config.interpreting():
        pytest.skip("records launches through Triton's interpreter")
    first = launches([3, 5, 1], [7, 4, 9])  # Tq 9, Td 20
    assert first and first == launches([2, 5, 1, 6], [7, 4, 9, 13])  # Tq 14, Td 33


def test_kernels_really_run_under_interpreter():
    assert uses_kernels(torch.zeros(1))


def test_non_contiguous_inputs(rng, path):
    q, cu_q, max_q = lik.pack(_rand_list(rng, [3, 6], 32))
    d, cu_d, max_d = lik.pack(_rand_list(rng, [5, 2], 32))
    q_view, d_view = q[:, ::2], d.t().contiguous().t()[:, 1::2]  # strided rows and columns
    assert not q_view.is_contiguous() and not d_view.is_contiguous()
    expected = lik.maxsim_varlen(q_view.contiguous(), d_view.contiguous(), cu_q, cu_d, max_q, max_d)
    torch.testing.assert_close(lik.maxsim_varlen(q_view, d_view, cu_q, cu_d, max_q, max_d), expected)
    Q = torch.randn(2, 4, 32, generator=rng)[..., ::2]
    expected = lik.maxsim_packed(Q.contiguous(), d_view.contiguous(), cu_d)
    torch.testing.assert_close(lik.maxsim_packed(Q, d_view, cu_d), expected)


@pytest.mark.parametrize(
    "q_lens,d_lens,dim",
    [([], [], 8), ([0, 0], [3, 4], 8), ([2, 3], [0, 0], 8), ([2, 3], [1, 4], 0)],
)
def test_empty_pairs(path, q_lens, d_lens, dim):
    q = torch.randn(sum(q_lens), dim, requires_grad=True)
    d = torch.randn(sum(d_lens), dim, requires_grad=True)
    cu_q = torch.tensor([0, *torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    cu_d = torch.tensor([0, *torch.tensor(d_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    s = lik.maxsim_varlen(q, d, cu_q, cu_d)
    assert s.shape == (len(q_lens),) and torch.all(s == 0)
    dq, dd = torch.autograd.grad(s.sum(), (q, d), allow_unused=True)
    assert dq is None or torch.all(dq == 0)
    assert dd is None or torch.all(dd == 0)


@pytest.mark.parametrize("n_q,l_q,d_lens", [(0, 4, [3]), (2, 0, [3]), (2, 4, []), (2, 4, [0, 0])])
def test_empty_corpus_inputs(path, n_q, l_q, d_lens):
    Q = torch.randn(n_q, l_q, 8, requires_grad=True)
    d = torch.randn(sum(d_lens), 8, requires_grad=True)
    cu_d = torch.tensor([0, *torch.tensor(d_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    s = lik.maxsim_packed(Q, d, cu_d)
    assert s.shape == (n_q, len(d_lens)) and torch.all(s == 0)


def test_nan_reaches_only_its_pair(path):
    q, cu_q, _ = lik.pack([torch.ones(2, 4), torch.ones(3, 4)])
    d, cu_d, _ = lik.pack([torch.ones(3, 4), torch.ones(2, 4)])
    d[1, 2] = float("nan")
    s = lik.maxsim_varlen(q, d, cu_q, cu_d)
    assert torch.isnan(s[0]) and s[1] == 12


@pytest.mark.parametrize("backward", ["fast", "deterministic"])
def test_ties_go_to_the_lowest_index(path, backward):
    q = torch.ones(1, 4, requires_grad=True)
    d = torch.ones(20, 4, requires_grad=True)
    cu_q = torch.tensor([0, 1], dtype=torch.int32)
    cu_d = torch.tensor([0, 20], dtype=torch.int32)
    (dd,) = torch.autograd.grad(lik.maxsim_varlen(q, d, cu_q, cu_d, backward=backward).sum(), (d,))
    assert torch.all(dd[0] == 1) and torch.all(dd[1:] == 0)


def test_int64_cu_seqlens_and_integer_mask(rng, path):
    q, cu_q, max_q = lik.pack(_rand_list(rng, [3, 2], 8))
    d, cu_d, max_d = lik.pack(_rand_list(rng, [4, 5], 8))
    expected = lik.maxsim_varlen(q, d, cu_q, cu_d)
    torch.testing.assert_close(lik.maxsim_varlen(q, d, cu_q.long(), cu_d.long()), expected)
    Q = torch.randn(3, 8, generator=rng)
    mask = torch.tensor([1, 0, 1])
    torch.testing.assert_close(lik.maxsim_packed(Q, d, cu_d, mask), lik.maxsim_packed(Q, d, cu_d, mask.bool()))


def test_float64_uses_the_reference_and_returns_float64(rng):
    q, cu_q, _ = lik.pack(_rand_list(rng, [3, 2], 8, torch.float64))
    d, cu_d, _ = lik.pack(_rand_list(rng, [4, 5], 8, torch.float64))
    assert lik.maxsim_varlen(q, d, cu_q, cu_d).dtype == torch.float64
    assert lik.maxsim_packed(q[:3], d, cu_d).dtype == torch.float64


def test_hints_skip_the_value_reads(rng, monkeypatch):
    """With every hint given, cu_seqlens values are never read (on a GPU: no host synchronisation)."""
    q, cu_q, max_q = lik.pack(_rand_list(rng, [3, 2], 8))
    d, cu_d, max_d = lik.pack(_rand_list(rng, [4, 5], 8))

    def forbidden(_):
        raise AssertionError("cu_seqlens values were read")

    monkeypatch.setattr(packing, "cu_seqlens_stats", forbidden)
    lik.maxsim_varlen(q, d, cu_q, cu_d, max_q, max_d)
    lik.maxsim_packed(q[:3], d, cu_d, max_seqlen_d=max_d)
    with pytest.raises(AssertionError, match="values were read"):
        lik.maxsim_varlen(q, d, cu_q, cu_d, max_q)


def test_unchecked_bad_offsets_stay_in_bounds(rng):
    """Hints given, so nothing checks the values: the kernel clamps offsets instead of reading out of bounds."""
    q, _, _ = lik.pack(_rand_list(rng, [3, 2], 8))
    d, _, _ = lik.pack(_rand_list(rng, [4, 5], 8))
    bad = torch.tensor([0, 100, -7], dtype=torch.int32)
    q.requires_grad_()
    s = lik.maxsim_varlen(q, d, bad, bad, 3, 5)
    assert s.shape == (2,) and torch.isfinite(s).all()
    s.sum().backward()


def _cu(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(cu_seqlens_q=_cu(1, 3, 5)), ValueError, "cu_seqlens_q must start at 0"),
        (dict(cu_seqlens_q=_cu(0, 6, 5)), ValueError, "cu_seqlens_q must be non-decreasing"),
        (dict(cu_seqlens_d=_cu(0, 4, 8)), ValueError, "cu_seqlens_d must end at the packed row count 9"),
        (dict(cu_seqlens_d=_cu(0, 9)), ValueError, "cu_seqlens_q has 2 sequences but cu_seqlens_d has 1"),
        (dict(cu_seqlens_q=_cu(0, 3, 5).float()), TypeError, "cu_seqlens_q must be int32"),
        (dict(cu_seqlens_q=_cu(0, 3, 5)[None]), ValueError, "cu_seqlens_q must be 1-D"),
        (dict(cu_seqlens_q=_cu()), ValueError, "cu_seqlens_q must be 1-D"),
        (dict(cu_seqlens_q=[0, 3, 5]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
        (dict(cu_seqlens_q=_cu(0, 3, 2**32 + 5, dtype=torch.int64)), ValueError, "non-decreasing|end at"),
        (dict(q=torch.randn(1, 5, 8)), ValueError, "q must be"),
        (dict(d=torch.randn(9, 7)), ValueError, "embedding dim 7"),
        (dict(d=torch.randn(9, 8).half()), TypeError, "d has dtype"),
        (dict(q=torch.randn(5, 8).int()), TypeError, "q must have dtype"),
        (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q must be a non-negative int"),
        (dict(backward="atomic"), ValueError, "backward must be one of"),
    ],
)
def test_varlen_validation(path, kwargs, error, match):
    args = dict(q=torch.randn(5, 8), d=torch.randn(9, 8), cu_seqlens_q=_cu(0, 3, 5), cu_seqlens_d=_cu(0, 4, 9))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        lik.maxsim_varlen(**args)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(cu_seqlens_d=_cu(0, 5, 4)), ValueError, "cu_seqlens_d must be non-decreasing"),
        (dict(Q=torch.randn(5)), ValueError, "Q must be"),
        (dict(q_mask=torch.ones(4, dtype=torch.bool)), ValueError, "q_mask must have shape"),
        (dict(q_mask=torch.ones(3)), TypeError, "q_mask must be a bool"),
        (dict(max_seqlen_d=2.5), ValueError, "max_seqlen_d must be a non-negative int"),
    ],
)
def test_packed_validation(path, kwargs, error, match):
    args = dict(Q=torch.randn(3, 8), d=torch.randn(9, 8), cu_seqlens_d=_cu(0, 4, 9))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        lik.maxsim_packed(**args)


def test_pack_unpack_round_trip(rng):
    tensors = _rand_list(rng, [5, 0, 1, 7], 6)
    packed, cu, max_len = lik.pack(tensors)
    assert packed.shape == (13, 6) and cu.dtype == torch.int32 and cu.tolist() == [0, 5, 5, 6, 13]
    assert max_len == 7
    back = lik.unpack(packed, cu)
    assert len(back) == 4 and all(torch.equal(a, b) for a, b in zip(back, tensors))
    assert back[0].data_ptr() == packed.data_ptr()  # views, not copies
    assert lik.unpack(packed, cu.long())[3].shape == (7, 6)


@pytest.mark.parametrize(
    "tensors,error,match",
    [
        ([], ValueError, "at least one tensor"),
        (torch.randn(3, 4), TypeError, "list or tuple"),
        ([torch.randn(3, 4), torch.randn(3)], ValueError, r"tensors\[1\] must be \[L, dim\]"),
        ([torch.randn(3, 4), torch.randn(3, 5)], ValueError, "one dim, dtype and device"),
        ([torch.randn(3, 4), torch.randn(3, 4).half()], ValueError, "one dim, dtype and device"),
        ([torch.randn(3, 4), "x"], TypeError, r"tensors\[1\] must be a torch.Tensor"),
    ],
)
def test_pack_validation(tensors, error, match):
    with pytest.raises(error, match=match):
        lik.pack(tensors)


def test_unpack_validation():
    with pytest.raises(ValueError, match="cu_seqlens must end at the packed row count 5"):
        lik.unpack(torch.randn(5, 2), _cu(0, 2, 4))
    with pytest.raises(ValueError, match="non-decreasing"):
        lik.unpack(torch.randn(5, 2), _cu(0, 3, 2, 5))


# ------------------------------------------------------------------------------------------------------------
# GPU: real compilation, tensor cores, atomics (`pytest -m gpu` on the device)
# ------------------------------------------------------------------------------------------------------------

GPU_TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}


def _gpu_lists(n, low, high, dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=gen).tolist()
    tensors = [torch.nn.functional.normalize(torch.randn(k, dim, generator=gen), dim=-1).to(dtype) for k in lengths]
    # Packed on the CPU and sent in one copy each rather than thousands of small ones (packing CUDA tensors has its
    # own test: test_gpu_pack_matches_cpu_pack).
    packed, cu_seqlens, max_len = lik.pack(tensors)
    return packed.cuda(), cu_seqlens.cuda(), max_len


@pytest.mark.gpu
def test_gpu_pack_matches_cpu_pack():
    gen = torch.Generator().manual_seed(12)
    tensors = [torch.randn(k, 96, generator=gen).half() for k in (5, 0, 1, 300, 0, 17)]
    packed, cu_seqlens, max_len = lik.pack([t.cuda() for t in tensors])
    want = lik.pack(tensors)
    assert packed.is_cuda and cu_seqlens.is_cuda and max_len == want[2] == 300
    assert torch.equal(packed.cpu(), want[0]) and torch.equal(cu_seqlens.cpu(), want[1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("backward", ["fast", "deterministic"])
def test_gpu_pairs_match_reference(dtype, backward):
    q, cu_q, max_q = _gpu_lists(300, 0, 40, 128, dtype, 1)
    d, cu_d, max_d = _gpu_lists(300, 0, 600, 128, dtype, 2)
    grad = torch.randn(300, device="cuda")
    s, dq, dd = _grads(lik.maxsim_varlen, (q, d, cu_q, cu_d, max_q, max_d), grad, backward=backward)
    rs, rdq, rdd = _grads(lik.maxsim_varlen_reference, (q.double(), d.double(), cu_q, cu_d), grad)
    tol = GPU_TOL[dtype]
    assert rel_err(s, rs) < tol and rel_err(dq, rdq) < tol and rel_err(dd, rdd) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n_q,l_q", [(1, 32), (8, 32), (2, 300)])
@pytest.mark.parametrize("backward", ["fast", "deterministic"])
def test_gpu_corpus_matches_reference(dtype, n_q, l_q, backward):
    d, cu_d, max_d = _gpu_lists(200, 0, 512, 128, dtype, 3)
    gen = torch.Generator(device="cuda").manual_seed(4)
    Q = torch.nn.functional.normalize(torch.randn(n_q, l_q, 128, device="cuda", generator=gen), dim=-1).to(dtype)
    q_mask = torch.rand(n_q, l_q, device="cuda", generator=gen) > 0.2
    grad = torch.randn(n_q, 200, device="cuda", generator=gen)
    s, dq, dd = _grads(lik.maxsim_packed, (Q, d, cu_d, q_mask, max_d), grad, backward=backward)
    rs, rdq, rdd = _grads(lik.maxsim_packed_reference, (Q.double(), d.double(), cu_d, q_mask), grad)
    tol = GPU_TOL[dtype]
    assert rel_err(s, rs) < tol and rel_err(dq, rdq) < tol and rel_err(dd, rdd) < tol


@pytest.mark.gpu
def test_gpu_deterministic_backward_is_bitwise_repeatable():
    q, cu_q, max_q = _gpu_lists(500, 1, 32, 128, torch.float16, 5)
    d, cu_d, max_d = _gpu_lists(500, 1, 300, 128, torch.float16, 6)
    grad = torch.randn(500, device="cuda")
    runs = [_grads(lik.maxsim_varlen, (q, d, cu_q, cu_d, max_q, max_d), grad, backward="deterministic")
            for _ in range(3)]
    Q = q[:32].reshape(1, 32, 128)
    corpus = [_grads(lik.maxsim_packed, (Q, d, cu_d, None, max_d), grad[None], backward="deterministic")
              for _ in range(3)]
    for results in (runs, corpus):
        for other in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@pytest.mark.gpu
def test_gpu_no_recompile_when_pair_count_or_lengths_change():
    def compiled():
        caches = getattr(maxsim_varlen_fwd_kernel, "device_caches", None)
        if caches is not None:
            return sum(len(entry[0]) for entry in caches.values())
        return sum(len(c) for c in maxsim_varlen_fwd_kernel.cache.values())

    # Query lengths stay in one power-of-two bucket (17-32): the bucket picks the row tile, a constexpr.
    q, cu_q, max_q = _gpu_lists(100, 17, 32, 128, torch.float16, 7)
    d, cu_d, max_d = _gpu_lists(100, 1, 512, 128, torch.float16, 8)
    lik.maxsim_varlen(q, d, cu_q, cu_d, max_q, max_d)
    before = compiled()
    for n, seed in [(7, 9), (5000, 10), (1, 11)]:
        q, cu_q, max_q = _gpu_lists(n, 17, 32, 128, torch.float16, seed)
        d, cu_d, max_d = _gpu_lists(n, 1, 512, 128, torch.float16, seed + 100)
        lik.maxsim_varlen(q, d, cu_q, cu_d, max_q, max_d)
    assert compiled() == before


@pytest.mark.parametrize("backward", ["fast", "deterministic"])
def test_torch_compile_traces_without_graph_break(rng, backward):
    """``torch.compile(fullgraph=True)`` with the ``max_seqlen`` hints (without them the offsets are read on the
    host, which no graph can hold): pairs and corpus, training and inference, one graph each (custom operators
    to Dynamo) with eager's bits. ``aot_eager`` traces forward and backward as inductor would (CI has no GPU)."""
    q, cu_q, max_q = lik.pack(_rand_list(rng, [3, 0, 9, 5], 16))
    d, cu_d, max_d = lik.pack(_rand_list(rng, [7, 4, 0, 12], 16))
    Q = torch.randn(2, 6, 16, generator=rng)
    q_mask = torch.rand(2, 6, generator=rng) > 0.3
    calls = {
        "pairs": (lambda a, b: lik.maxsim_varlen(a, b, cu_q, cu_d, max_q, max_d, backward=backward), (q, d),
                  torch.randn(4, generator=rng)),
        "corpus": (lambda a, b: lik.maxsim_packed(a, b, cu_d, q_mask, max_d, backward=backward), (Q, d),
                   torch.randn(2, 4, generator=rng)),
    }
    for name, (fn, inputs, grad) in calls.items():
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        got = _grads(compiled, inputs, grad)
        want = _grads(fn, inputs, grad)
        for g, w in zip(got, want):
            assert torch.equal(g, w), name
        with torch.no_grad():
            assert torch.equal(compiled(*inputs), want[0]), name
