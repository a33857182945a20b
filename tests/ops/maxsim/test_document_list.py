"""MaxSim against a list of documents read in place (lik.ops.maxsim.document_list).

The kernels (Triton's interpreter on CPU, compiled under `-m gpu`) read each document through the address table;
scores must equal lik.maxsim on the stacked documents (equal lengths) or lik.maxsim_packed on the joined ones
(ragged) bit for bit, and the float64 reference within fp32 accumulation.
"""

from __future__ import annotations

import pytest
import torch

import lik
from lik import _config
from lik.ops.maxsim.document_list import DocumentList, maxsim_document_list
from lik.ops.maxsim.reference_varlen import maxsim_packed_reference

from .helpers import rel_err

TOL = 2e-6


def _docs(rng, lengths, dim, dtype=torch.float32, device="cpu"):
    return [torch.randn(n, dim, generator=rng).to(device=device, dtype=dtype) for n in lengths]


def _scores(q, documents, start=0, stop=None):
    doc_list = DocumentList.build(documents, q)
    assert doc_list is not None
    with torch.no_grad():
        return maxsim_document_list(q, doc_list, start, stop)


def _reference(q, documents):
    """float64 on the CPU, whatever device the inputs are on."""
    joined = torch.cat([d.cpu().double() for d in documents])
    cu = torch.tensor([0] + [len(d) for d in documents]).cumsum(0).to(torch.int32)
    return maxsim_packed_reference(q.cpu().double(), joined, cu).to(q.device)


@pytest.mark.parametrize("n_q, l_q, dim, length, n_docs", [
    (3, 5, 16, 7, 4), (1, 1, 16, 1, 1), (2, 33, 96, 130, 3), (4, 1, 24, 64, 5),
])
def test_equal_lengths_match_the_stacked_documents(rng, n_q, l_q, dim, length, n_docs):
    q = torch.randn(n_q, l_q, dim, generator=rng)
    documents = _docs(rng, [length] * n_docs, dim)
    got = _scores(q, documents)
    assert got.dtype == torch.float32 and got.shape == (n_q, n_docs)
    assert torch.equal(got, lik.maxsim(q, torch.stack(documents)))
    assert rel_err(got, _reference(q, documents)) < TOL


@pytest.mark.parametrize("lengths", [(7, 0, 33, 1), (0, 5), (1, 2, 3, 130, 64), (9, 9, 0)])
def test_ragged_lengths_match_the_joined_documents(rng, lengths):
    q = torch.randn(3, 4, 24, generator=rng)
    documents = _docs(rng, lengths, 24)
    got = _scores(q, documents)
    cu = torch.tensor((0,) + lengths).cumsum(0).to(torch.int32)
    assert torch.equal(got, lik.maxsim_packed(q, torch.cat(documents), cu))
    assert rel_err(got, _reference(q, documents)) < TOL
    assert not got[:, [i for i, n in enumerate(lengths) if n == 0]].any()  # an empty document scores 0


@pytest.mark.parametrize("lengths", [(5, 5, 5, 5, 5), (5, 9, 1, 0, 7)])
def test_documents_read_only_inside_their_rows(rng, lengths):
    """Documents that are views of one buffer full of NaN and inf elsewhere, lying in the buffer in the reverse of
    their list order (negative offsets from the first), scored in slices: only their own rows are read."""
    dim, gap = 16, 3
    buffer = torch.full((sum(lengths) + gap * (len(lengths) + 1), dim), float("nan"))
    buffer[::2] = float("inf")
    documents, row = [], gap
    for n in reversed(lengths):
        buffer[row:row + n] = torch.randn(n, dim, generator=rng)
        documents.insert(0, buffer[row:row + n])
        row += n + gap
    q = torch.randn(2, 3, dim, generator=rng)
    expected = _reference(q, documents)
    assert rel_err(_scores(q, documents), expected) < TOL and not expected.isnan().any()
    for start, stop in ((0, 2), (1, 4), (3, None), (2, 2)):
        got = _scores(q, documents, start, stop)
        assert got.shape == expected[:, start:stop].shape
        assert rel_err(got, expected[:, start:stop]) < TOL


@pytest.mark.parametrize("forced", [
    # Persistent launches walking several documents (the lookup carried a document ahead), feature chunks in one
    # flat loop and nested per tile, a launch per document.
    _config.MaxSimForwardConfig(group_rows=1, groups=16, block_n=16, block_k=64, programs_per_sm=1),
    _config.MaxSimForwardConfig(group_rows=1, groups=16, block_n=16, block_k=64, programs_per_sm=3),
    _config.MaxSimForwardConfig(group_rows=1, groups=16, block_n=16, block_k=16, programs_per_sm=2),
    _config.MaxSimForwardConfig(group_rows=1, groups=16, block_n=16, block_k=16, programs_per_sm=2, flat_k=False),
    _config.MaxSimForwardConfig(group_rows=1, groups=16, block_n=16, block_k=16),
])
@pytest.mark.parametrize("lengths", [(9,) * 7, (9, 0, 40, 1, 17, 9, 33)])
def test_forced_launch_configs(rng, forced, lengths):
    q = torch.randn(20, 1, 40, generator=rng)
    documents = _docs(rng, lengths, 40)
    with _config.override(maxsim_forward=forced, maxsim_varlen=forced):
        got = _scores(q, documents)
        for start, stop in ((2, 6), (5, 7)):
            assert rel_err(_scores(q, documents, start, stop), got[:, start:stop]) < TOL
    assert rel_err(got, _reference(q, documents)) < TOL


def test_empty_documents_and_nan(rng):
    q = torch.randn(2, 3, 16, generator=rng)
    assert torch.equal(_scores(q, _docs(rng, (0, 0, 0), 16)), torch.zeros(2, 3))
    documents = _docs(rng, (4, 4, 4), 16)
    documents[1][2, 5] = float("nan")
    got = _scores(q, documents)
    assert got[:, 1].isnan().all() and not got[:, [0, 2]].isnan().any()
    torch.testing.assert_close(got, _reference(q, documents).float(), equal_nan=True)


def test_fp16_documents(rng):
    q = torch.randn(2, 5, 32, generator=rng).half()
    documents = _docs(rng, (6, 6), 32, torch.float16)
    assert torch.equal(_scores(q, documents), lik.maxsim(q, torch.stack(documents)))


def test_lists_that_cannot_be_read_in_place(rng):
    """``build`` declines (the caller joins) what the table cannot address safely or the kernels do not run."""
    q = torch.randn(2, 3, 16, generator=rng)
    documents = _docs(rng, (4, 4), 16)
    unaligned = torch.randn(4 * 16 + 1, generator=rng)[1:].view(4, 16)  # 4 bytes past an aligned address
    declined = {
        "no documents": ([], q),
        "float64": ([d.double() for d in documents], q.double()),
        "bfloat16 on the CPU (reference only)": ([d.bfloat16() for d in documents], q.bfloat16()),
        "zero-wide rows": ([torch.zeros(4, 0)], torch.zeros(2, 3, 0)),
        "strided": ([documents[0], documents[1].t().contiguous().t()], q),
        "unaligned": ([documents[0], unaligned], q),
        "first document's dtype differs from the queries'": ([d.half() for d in documents], q),
        "on the meta device": ([documents[0], torch.empty(4, 16, device="meta")], q),
    }
    for why, (docs, rows) in declined.items():
        assert DocumentList.build(docs, rows) is None, why
    assert DocumentList.build(documents, q) is not None


@pytest.mark.parametrize("bad, error, message", [
    (torch.randn(1, 4, 16), ValueError, r"docs\[1\] must be a \[L, d\] tensor, got torch.Size\(\[1, 4, 16\]\)"),
    (torch.empty(0), ValueError, r"docs\[1\] must be a \[L, d\] tensor, got torch.Size\(\[0\]\)"),
    (torch.randn(4, 16).half(), TypeError, r"docs\[1\] has dtype torch.float16; every item must have dtype "
                                           r"torch.float32"),
    (torch.randn(8, 8), ValueError, r"docs: every item must have the same embedding width, got \[8, 16\]"),
])
def test_bad_documents_are_named(rng, bad, error, message):
    """What only makes the numbers wrong is checked after the launch, and raised before any score is returned."""
    q = torch.randn(2, 3, 16, generator=rng)
    doc_list = DocumentList.build([torch.randn(4, 16, generator=rng), bad, torch.randn(5, 16, generator=rng)], q,
                                  "docs")
    with pytest.raises(error, match=message), torch.no_grad():
        maxsim_document_list(q, doc_list)
    with pytest.raises(ValueError, match=r"docs has embedding width 8 but the queries have 16"), torch.no_grad():
        maxsim_document_list(q, DocumentList.build([torch.randn(8, 8), torch.randn(2, 8)], q, "docs"))


def test_inference_only(rng):
    q = torch.randn(2, 3, 16, generator=rng)
    documents = _docs(rng, (4, 4), 16)
    for rows, docs in ((q.requires_grad_(), documents), (q.detach(), [documents[0], documents[1].requires_grad_()])):
        with pytest.raises(ValueError, match="inference only"):
            maxsim_document_list(rows, DocumentList.build(docs, rows))
    with torch.no_grad():  # the same lists score under no_grad
        maxsim_document_list(q, DocumentList.build(docs, q))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_matches_stacked_and_joined(rng, dtype):
    q = torch.randn(300, 1, 128, generator=rng).to("cuda", dtype)
    for lengths in ((1030,) * 40, (1030, 512, 1, 0, 700) * 8):
        documents = _docs(rng, lengths, 128, dtype, "cuda")
        got = _scores(q, documents)
        if len(set(lengths)) == 1:
            expected = lik.maxsim(q, torch.stack(documents))
        else:
            cu = torch.tensor((0,) + lengths, device="cuda").cumsum(0).to(torch.int32)
            expected = lik.maxsim_packed(q, torch.cat(documents), cu)
        assert torch.equal(got, expected), lengths
        assert rel_err(got, _reference(q, documents)) < (1e-5 if dtype == torch.float32 else 2e-3)


@pytest.mark.gpu
def test_gpu_documents_gigabytes_apart(rng):
    """Offsets past 2**31 elements (64-bit address arithmetic from the table), below the origin and above it."""
    elements = 5 * 2**30 // 2  # 5 GiB of bfloat16
    buffer = torch.empty(elements, device="cuda", dtype=torch.bfloat16)
    length, dim = 300, 128
    pieces = [buffer[at:at + length * dim].view(length, dim) for at in (2**31 + 4096, 0, elements - length * dim)]
    for piece in pieces:
        piece.copy_(torch.randn(length, dim, generator=rng).to(piece))
    q = torch.randn(64, 1, dim, generator=rng).to("cuda", torch.bfloat16)
    assert torch.equal(_scores(q, pieces), lik.maxsim(q, torch.stack(pieces)))
    del buffer, pieces

