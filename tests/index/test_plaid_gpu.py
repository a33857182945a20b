"""A compressed lik.Index on the GPU at a million tokens: streamed build (codec trained on the GPU), exhaustive and
candidate search, both checked against float64 MaxSim of the decoded tokens. Prints the build's docs/s and the
searches' times (``pytest -m gpu -s``)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import lik

pytestmark = pytest.mark.gpu

N_DOCS, DOC_LEN, D, N_CLUSTERS, N_QUERIES = 10_000, 100, 128, 1024, 64


def _corpus(device):
    """Clustered unit tokens (a topic per document, tokens around a few of its centres): ``[T, d]`` fp16, cu."""
    g = torch.Generator(device=device).manual_seed(0)
    centres = F.normalize(torch.randn(N_CLUSTERS, D, device=device, generator=g), dim=-1)
    lengths = torch.randint(DOC_LEN // 2, DOC_LEN * 3 // 2 + 1, (N_DOCS,), device=device, generator=g)
    cu = torch.zeros(N_DOCS + 1, dtype=torch.int64, device=device)
    cu[1:] = lengths.cumsum(0)
    doc_of = torch.repeat_interleave(torch.arange(N_DOCS, device=device), lengths)
    topic = torch.randint(0, N_CLUSTERS, (N_DOCS, 4), device=device, generator=g)
    pick = topic[doc_of, torch.randint(0, 4, (doc_of.numel(),), device=device, generator=g)]
    # Noise of norm 0.8 against unit centres, like text embeddings' topical clusters (and benchmarks/plaid_bench.py):
    # noise of norm ~4 made the tokens nearly uniform, where no IVF probe or 2-bit code keeps the ranking.
    noise = torch.randn(doc_of.numel(), D, device=device, generator=g) * (0.8 / D**0.5)
    tokens = F.normalize(centres[pick] + noise, dim=-1)
    return tokens.half(), cu


def _batches(tokens, cu, docs_per_batch=1000):
    for a in range(0, N_DOCS, docs_per_batch):
        b = min(a + docs_per_batch, N_DOCS)
        t0, t1 = int(cu[a]), int(cu[b])
        yield lik.index.DocumentBatch.packed(tokens[t0:t1], (cu[a : b + 1] - t0).cpu())


def _recall(ids, want) -> float:
    hits = sum(len(set(a) & set(b)) for a, b in zip(ids.tolist(), want.tolist()))
    return hits / want.numel()


def test_million_token_plaid_index_on_the_gpu():
    device = torch.device("cuda")
    tokens, cu = _corpus(device)
    torch.cuda.synchronize()
    start = time.perf_counter()
    index = lik.Index.build(_batches(tokens, cu), codec="plaid", nbits=2, placement="gpu", progress=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    total = tokens.shape[0]
    print(
        f"\nplaid build: {N_DOCS} docs, {total} tokens, {index.codec.num_centroids} centroids in {seconds:.2f} s: "
        f"{N_DOCS / seconds:.0f} docs/s, {total / seconds / 1e6:.2f} M tokens/s"
    )
    assert len(index) == N_DOCS and index.codec.nbits == 2

    # Queries: 32 tokens near one document's tokens each (its source should rank first, its topic's next).
    g = torch.Generator(device=device).manual_seed(1)
    source = torch.randint(0, N_DOCS, (N_QUERIES,), device=device, generator=g)
    lengths = (cu[source + 1] - cu[source]).unsqueeze(1)
    rows = cu[source].unsqueeze(1) + (torch.rand(N_QUERIES, 32, device=device, generator=g) * lengths).long()
    Q = F.normalize(
        tokens[rows].float() + (0.3 / D**0.5) * torch.randn(N_QUERIES, 32, D, device=device, generator=g), dim=-1
    ).half()

    # The float64 reference: MaxSim of the decoded tokens (the residual op's float64 reference path).
    codes = torch.cat([s.codes for s in index.segments])
    residuals = torch.cat([s.tokens for s in index.segments])
    ref = lik.maxsim_residual(Q.double(), codes, residuals, index.codec, cu)
    want = ref.topk(10, dim=1).indices

    for _ in range(2):  # warm
        index.search(Q, 10)
    torch.cuda.synchronize()
    start = time.perf_counter()
    scores, ids = index.search(Q, 10)
    torch.cuda.synchronize()
    scan_ms = (time.perf_counter() - start) * 1e3
    assert _recall(ids, want) >= 0.95
    assert (ids[:, 0] == source).float().mean() >= 0.9
    # Every returned score is the reference score of that document, up to fp16 products.
    torch.testing.assert_close(scores.double(), ref.gather(1, ids), atol=0.08, rtol=0.0)

    for _ in range(2):
        index.search(Q, 10, n_probe=8, candidates=1024)
    torch.cuda.synchronize()
    start = time.perf_counter()
    c_scores, c_ids = index.search(Q, 10, n_probe=8, candidates=1024)
    torch.cuda.synchronize()
    candidate_ms = (time.perf_counter() - start) * 1e3
    recall = _recall(c_ids, ids)
    print(
        f"plaid search, {N_QUERIES} queries x 32 tokens: exhaustive {scan_ms:.2f} ms, candidates (8 probes, 1024) "
        f"{candidate_ms:.2f} ms, recall@10 of candidates against the scan {recall:.3f}"
    )
    assert recall >= 0.8
    valid = c_ids >= 0
    torch.testing.assert_close(c_scores[valid].double(), ref.gather(1, c_ids.clamp(min=0))[valid], atol=0.08, rtol=0.0)

    # The same index streamed from pinned host memory scores the same.
    host = lik.Index(
        index.d,
        index.dtype,
        [s.__class__(s.tokens.cpu(), s.cu_seqlens, s.scale.cpu()) for s in index.segments],
        placement="host",
        device=device,
        codec=index.codec,
        chunk_tokens=1 << 18,
    )
    h_scores, h_ids = host.search(Q, 10)
    assert _recall(h_ids, ids) >= 0.99
    torch.testing.assert_close(h_scores, scores, atol=1e-3, rtol=0.0)
    # Candidates per streamed chunk (4 chunks, each its own IVF in host memory).
    hc_scores, hc_ids = host.search(Q, 10, n_probe=8, candidates=1024)
    assert _recall(hc_ids, ids) >= 0.8
    valid = hc_ids >= 0
    torch.testing.assert_close(
        hc_scores[valid].double(), ref.gather(1, hc_ids.clamp(min=0))[valid], atol=0.08, rtol=0.0
    )


def test_rescoring_from_an_int8_copy_on_the_gpu(tmp_path):
    """A million-token index with num_centroids given and an int8 copy: rescoring the compressed top 64 from the
    copy returns the exact int8 index's scores, at a recall@10 (against it) no lower than the compressed search's;
    the copy kept in host memory (placement "gpu" and "host") or read from disk gives the same results."""
    device = torch.device("cuda")
    tokens, cu = _corpus(device)
    index = lik.Index.build(
        _batches(tokens, cu),
        codec="plaid",
        nbits=2,
        placement="gpu",
        progress=False,
        num_centroids=3000,
        rescore_dtype=torch.int8,
    )
    assert index.codec.num_centroids == 3000 and all(not s.copy.tokens.is_cuda for s in index.segments)
    exact = lik.Index.build(_batches(tokens, cu), dtype=torch.int8, placement="gpu", progress=False)
    g = torch.Generator(device=device).manual_seed(2)
    source = torch.randint(0, N_DOCS, (N_QUERIES,), device=device, generator=g)
    lengths = (cu[source + 1] - cu[source]).unsqueeze(1)
    rows = cu[source].unsqueeze(1) + (torch.rand(N_QUERIES, 32, device=device, generator=g) * lengths).long()
    # fp16 queries: the int8 copy and the exact int8 index quantize the same values.
    noise = (0.3 / D**0.5) * torch.randn(N_QUERIES, 32, D, device=device, generator=g)
    Q = F.normalize(tokens[rows].float() + noise, dim=-1)
    Q = Q.half()
    want_scores, want = exact.search(Q, 10)
    plain = index.search(Q, 10, rescore=0)[1]
    for _ in range(2):
        index.search(Q, 10, rescore=64)
    torch.cuda.synchronize()
    start = time.perf_counter()
    scores, ids = index.search(Q, 10, rescore=64)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3
    print(
        f"\nplaid + int8 rescoring of 64, {N_QUERIES} queries: {ms:.2f} ms, recall@10 against exact int8 "
        f"{_recall(ids, want):.3f} (without rescoring {_recall(plain, want):.3f})"
    )
    assert _recall(ids, want) >= max(0.95, _recall(plain, want))
    same = ids == want
    torch.testing.assert_close(scores[same], want_scores[same], atol=1e-3, rtol=0.0)
    index.save(tmp_path / "ix")
    for placement in ("host", "disk"):
        loaded = lik.Index.load(tmp_path / "ix", placement=placement, device=device)
        got_scores, got = loaded.search(Q, 10, rescore=64)
        assert _recall(got, ids) >= 0.99, placement
        torch.testing.assert_close(got_scores, scores, atol=1e-3, rtol=0.0)
