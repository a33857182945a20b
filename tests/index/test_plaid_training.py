"""lik.Index.build(codec="plaid") training options: ``num_centroids`` (any positive count, overriding ColBERTv2's
rule) and ``train_tokens`` (how many leading tokens the codec is trained on), and their one-line errors."""

from __future__ import annotations

import argparse

import pytest
import torch

import lik
from lik.index import plaid_codec

from .helpers import score_with_reference, unit_docs

D = 16


@pytest.fixture(autouse=True)
def reference_scorer(monkeypatch):
    score_with_reference(monkeypatch)


@pytest.mark.parametrize("num_centroids", [1, 7, 12, 81])
def test_num_centroids_overrides_the_rule(num_centroids):
    docs = unit_docs()
    index = lik.Index.build(docs, codec="plaid", nbits=2, num_centroids=num_centroids)
    assert index.codec.num_centroids == num_centroids  # 7, 12: not powers of two
    # The codes address exactly those centroids and search still works (decoded tokens, exhaustive).
    codes = torch.cat([s.codes for s in index.segments])
    assert int(codes.min()) >= 0 and int(codes.max()) < num_centroids
    scores, ids = index.search(torch.randn(2, 3, D), k=4)
    assert ids.shape == (2, 4) and bool(torch.isfinite(scores).all())


def test_default_centroids_unchanged():
    """Without num_centroids: the quarter-of-the-tokens rule for a tiny corpus (81 tokens -> 20)."""
    assert lik.Index.build(unit_docs(), codec="plaid").codec.num_centroids == 81 // 4


def test_train_tokens_decides_what_trains(monkeypatch):
    """The trainer sees the first documents up to train_tokens (whole batches), the rest streams after it."""
    seen = []
    real = plaid_codec.train_codec

    def spy(sample, cu, nbits, **kwargs):
        seen.append(sample.shape[0])
        return real(sample, cu, nbits, **kwargs)

    monkeypatch.setattr(plaid_codec, "train_codec", spy)
    docs = unit_docs(lengths=(4,) * 50)  # 200 tokens, one document at a time
    # Batches are at most shard_tokens tokens, so shard_tokens=8 makes batches of two documents.
    index = lik.Index.build(docs, codec="plaid", train_tokens=40, shard_tokens=8, num_centroids=5)
    assert seen == [40] and len(index) == 50
    index = lik.Index.build(docs, codec="plaid", train_tokens=10**9, shard_tokens=8)
    assert seen[-1] == 200 and index.codec.num_centroids == 200 // 4
    # The index's documents are all there, whatever trained the codec.
    assert torch.equal(torch.cat([s.cu_seqlens[1:] - s.cu_seqlens[:-1] for s in index.segments]), torch.full((50,), 4))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_centroids": 0}, ValueError, "num_centroids must be a positive integer"),
        ({"num_centroids": -3}, ValueError, "num_centroids must be a positive integer"),
        ({"num_centroids": 2.0}, TypeError, "num_centroids must be a positive integer"),
        ({"num_centroids": True}, TypeError, "num_centroids must be a positive integer"),
        ({"train_tokens": 0}, ValueError, "train_tokens must be a positive integer"),
        ({"train_tokens": "1"}, TypeError, "train_tokens must be a positive integer"),
        ({"num_centroids": 82}, ValueError, "num_centroids=82 exceeds the 81 tokens"),
        ({"codec": "exact", "num_centroids": 8}, ValueError, "num_centroids is for codec='plaid' only"),
        ({"codec": "exact", "train_tokens": 8}, ValueError, "train_tokens is for codec='plaid' only"),
    ],
)
def test_errors_name_the_argument(kwargs, error, match):
    kwargs = {"codec": "plaid", **kwargs}
    with pytest.raises(error, match=match) as raised:
        lik.Index.build(unit_docs(), **kwargs)
    assert "\n" not in str(raised.value)


def test_errors_come_before_any_document_is_read():
    def docs():
        raise AssertionError("a document was read")
        yield

    with pytest.raises(ValueError, match="num_centroids"):
        lik.Index.build(docs(), codec="plaid", num_centroids=0)


def test_cli_flags():
    """``lik index build``'s --num-centroids / --train-tokens / --rescore-dtype as Index.build arguments."""
    args = argparse.Namespace(
        codec="plaid", nbits=None, dtype="float16", num_centroids=300, train_tokens=1 << 22, rescore_dtype="int8"
    )
    assert plaid_codec.codec_flags(args) == {
        "codec": "plaid",
        "nbits": 2,
        "num_centroids": 300,
        "train_tokens": 1 << 22,
        "rescore_dtype": torch.int8,
    }
    older = argparse.Namespace(codec="plaid", nbits=4, dtype="float16")  # a parser without the new flags
    assert plaid_codec.codec_flags(older) == {
        "codec": "plaid",
        "nbits": 4,
        "num_centroids": None,
        "train_tokens": None,
        "rescore_dtype": None,
    }
    bad = [
        ({"num_centroids": 0}, "--num-centroids must be at least 1"),
        ({"train_tokens": -1}, "--train-tokens must be at least 1"),
        ({"rescore_dtype": "float32"}, "--rescore-dtype must be int8 or float16"),
        ({"codec": "exact", "num_centroids": 8}, "--num-centroids 8: only with --codec plaid"),
        (
            {"codec": "exact", "num_centroids": None, "train_tokens": None},
            "--rescore-dtype int8: only with --codec plaid",
        ),
    ]
    for change, match in bad:
        wrong = argparse.Namespace(**{**vars(args), **change})
        with pytest.raises(ValueError, match=match):
            plaid_codec.codec_flags(wrong)
