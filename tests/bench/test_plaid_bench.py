"""benchmarks/plaid_bench.py's CPU parts: argument errors, the synthetic corpus (deterministic chunks, lengths,
unit fp16 tokens, queries copied from their document, the streamed pass equal to the in-memory one), recall@10
with ties, duplicates and padding, the report, and a run with every system skipped. The GPU test runs the smoke
size with fast-plaid and lik on the device."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
import torch

from tests.scripts import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("benchmarks/plaid_bench.py", "plaid_bench")


@pytest.fixture
def reference_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors then run lik's PyTorch reference: the data is tested


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tokens", "0"], "--tokens"),
        (["--nbits", "3"], "--nbits"),
        (["--nbits", "two"], "--nbits"),
        (["--min-len", "50", "--max-len", "40"], "--min-len"),
        (["--candidates", "5"], "--candidates"),
        (["--n-probe", "0"], "--n-probe"),
        (["--queries", "0"], "--queries"),
        (["--noise", "-1"], "--noise"),
        (["--chunk-tokens", "100"], "--chunk-tokens"),
        (["--quick", "--scale"], "not allowed with"),
    ],
)
def test_argument_errors(script, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_sizes(script):
    assert (script.parse_args([]).tokens, script.parse_args([]).nbits) == (5_000_000, [2, 4])
    assert script.parse_args(["--quick"]).tokens == 1_000_000
    scale = script.parse_args(["--scale"])
    assert (scale.tokens, scale.nbits) == (1_000_000_000, [2])
    assert script.parse_args(["--scale", "--tokens", "7", "--nbits", "4,1"]).nbits == [4, 1]


def _corpus(script, *extra):
    args = script.parse_args(["--smoke", "--tokens", "2000", "--chunk-tokens", "300", *extra])
    return args, script.Corpus(args, "cpu")


def test_corpus_chunks(script):
    args, corpus = _corpus(script)
    parts = list(corpus.chunks())
    assert len(parts) == corpus.num_chunks > 1 and sum(c.numel() - 1 for _, _, c in parts) == corpus.num_docs
    assert [first for first, _, _ in parts] == [n * corpus.docs_per_chunk for n in range(corpus.num_chunks)]
    for _, tokens, cu in parts:
        lengths = cu.diff()
        assert int(lengths.min()) >= args.min_len and int(lengths.max()) <= args.max_len
        assert tokens.dtype == torch.float16 and tokens.shape == (int(cu[-1]), 128)
        torch.testing.assert_close(tokens.float().norm(dim=1), torch.ones(tokens.shape[0]), atol=2e-3, rtol=0)
    again = script.Corpus(args, "cpu").chunk(1)
    assert torch.equal(again[0], parts[1][1]) and torch.equal(again[1], parts[1][2])
    other = script.Corpus(
        script.parse_args(["--smoke", "--tokens", "2000", "--chunk-tokens", "300", "--seed", "1"]), "cpu"
    ).chunk(1)
    assert not torch.equal(other[0][:10], parts[1][1][:10])


def test_queries_come_from_their_documents(script, reference_kernels):
    args, corpus = _corpus(script, "--queries", "12")
    Q, exact, tokens, cu = script.ground_truth(args, corpus, "cpu")
    assert Q.shape == (12, args.q_len, 128) and Q.dtype == torch.float16
    assert exact.shape == (12, corpus.num_docs) and corpus.num_tokens == tokens.shape[0] == int(cu[-1])
    source = corpus.query_docs()
    # The source document scores best for most queries (the q-noise is small; clusters may share a topic).
    assert float((exact.argmax(dim=1) == source).float().mean()) >= 0.75
    dense = torch.nn.utils.rnn.pad_sequence(list(tokens.float().split(cu.diff().tolist())), batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(int(n), dtype=torch.bool) for n in cu.diff()], batch_first=True)
    sims = torch.einsum("qsd,btd->qbst", Q.float(), dense).masked_fill(~mask[None, :, None, :], float("-inf"))
    torch.testing.assert_close(exact, sims.amax(-1).sum(-1), atol=1e-4, rtol=1e-5)


def test_streamed_pass_equals_in_memory(script, reference_kernels):
    args, corpus = _corpus(script, "--queries", "6")
    Q, exact, _, _ = script.ground_truth(args, corpus, "cpu")
    args.scale = True
    streamed = script.Corpus(args, "cpu")
    Q2, exact2, tokens, cu = script.ground_truth(args, streamed, "cpu")
    assert tokens is None and cu is None and streamed.num_tokens == corpus.num_tokens
    assert torch.equal(Q, Q2)
    torch.testing.assert_close(exact, exact2)


def test_recall(script):
    exact = torch.tensor([[5.0, 4.0, 4.0] + [1.0] * 8 + [3.0] * 9])
    top = [0, 1, 2] + list(range(11, 18))
    other_tie = [0, 1, 2] + list(range(12, 19))
    worse = [0, 1, 2] + list(range(11, 17)) + [3]
    duplicated = [0, 0, 1, 2] + list(range(11, 17))
    padded = [0, 1, 2, -1, -1, -1, -1, -1, -1, -1]
    ids = torch.tensor([top, other_tie, worse, duplicated, padded])
    per_query = [script.recall_at_k(ids[i : i + 1], exact) for i in range(5)]
    assert per_query == [1.0, 1.0, 0.9, 0.9, 0.3]
    assert script.recall_at_k(ids, exact.expand(5, -1)) == pytest.approx(sum(per_query) / 5)
    assert script.recall_at_k(torch.tensor([top + [4, 5]]), exact) == 1.0  # only the first k count


def test_report_and_lik_without_codec(script, monkeypatch):
    meta = dict(corpus="c", device="cpu", torch="t", fast_plaid=None, commit="x", queries=256)
    rows = [
        {
            "system": "a",
            "bytes": 360_000_000,
            "build_s": 11.6,
            "batch_ms": 768.0,
            "one_query_ms": 4.1,
            "recall_at_10": 0.953,
        },
        {"system": "b", "note": "skipped: why"},
    ]
    table = script.markdown(rows, meta).splitlines()
    assert table[2].startswith("| system | bytes | build s | 256 queries ms |")
    assert table[4] == "| a | 0.360 GB | 11.6 | 768.0 | 4.10 | 0.953 |"
    assert table[5] == "| b | skipped: why | | | | |"
    monkeypatch.setattr(script, "lik_has_plaid", lambda: False)
    args, corpus = _corpus(script)
    names = dict(script.systems(args, corpus, None, None, None, pathlib.Path("."), "cpu"))
    assert "codec" in names["lik plaid 2-bit"] and "codec" in names["lik plaid 4-bit"]
    assert names["fast-plaid 4-bit (8 probes, 4096 full scores)"].startswith("skipped: ")  # no CUDA here
    assert callable(names["lik exact fp16"])


def test_run_with_every_system_skipped(script, reference_kernels, tmp_path, capsys):
    assert script.main(["--smoke", "--skip", "lik,fast-plaid", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "plaid_bench.json").read_text())
    assert [row["note"] for row in report["rows"]] == ["--skip"] * 5
    assert report["meta"]["args"]["tokens"] == 3000 and report["meta"]["queries"] == 8
    assert capsys.readouterr().out.rstrip().endswith(report["markdown"].splitlines()[-1])


@pytest.mark.gpu
def test_smoke_on_the_gpu(script, tmp_path):
    # Every system at smoke size on the device: fast-plaid (when installed) and lik retrieve sensibly.
    assert script.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "plaid_bench.json").read_text())["rows"]
    measured = {row["system"]: row for row in rows if "note" not in row}
    assert measured["lik exact fp16"]["recall_at_10"] == 1.0
    for name, row in measured.items():
        assert row["recall_at_10"] > 0.5 and row["bytes"] > 0 and row["batch_ms"] > 0, name
    if importlib.util.find_spec("fast_plaid") is not None:
        assert any(name.startswith("fast-plaid") for name in measured)
