"""How much 8-bit scoring changes rankings: lik int8 / fp8 beside flash-maxsim's int8x8 and late-interaction-kernels'
fp8, per query against fp32 scores of the same embeddings.

Two steps, because the lent GPU has no network and no encoder weights:

    python benchmarks/quantized_fidelity.py embed --out .carry/fidelity.safetensors   # CPU: MiniLM token embeddings
    python3 benchmarks/quantized_fidelity.py score --data .carry/fidelity.safetensors --out $OUT   # GPU
    python benchmarks/quantized_fidelity.py score --device cpu --data ... --out DIR   # CPU, peers emulated

On the CPU lik runs its reference (the scores the kernels give, by contract) and the peers' kernels, which need a
GPU, are replaced by their quantizers as shipped plus their scoring arithmetic evaluated in PyTorch
(``_emulated``); on a GPU the peers' real kernels run beside that emulation (flash-maxsim's int8x8 kernel, which has no
query mask, gets each query at the padded width with zero rows past its length: exact, and one compile).

``embed`` encodes real English passages with the demo's all-MiniLM-L6-v2 encoder (``lik.demo.MiniLMEncoder``,
d = 384, content tokens only, at most ``--max-tokens``): the demo corpus plus paragraphs of the Python standard
library's docstrings, deduplicated; the queries are the first sentences of randomly chosen passages (each query's
source passage stays in the corpus). ``score`` also builds synthetic ColPali-like data (d = 128, 1 030-token pages
from topic clusters; 24-token queries drawn near one page's tokens). Per query and method: Spearman's rank
correlation of all document scores with the fp32 scores, top-10 and top-100 overlap, max |score error|.
Writes ``quantized_fidelity.json`` and prints a table (mean and worst query).
"""

from __future__ import annotations

import argparse
import json
import os
import random

import torch


def _passages(limit: int, seed: int) -> list[str]:
    import importlib
    import pkgutil
    import sys

    from lik.demo import load_corpus

    texts = list(load_corpus())
    seen = set(texts)
    for info in sorted(pkgutil.iter_modules(), key=lambda m: m.name):
        skipped = ("antigravity", "this")
        if info.name.startswith("_") or info.name not in sys.stdlib_module_names or info.name in skipped:
            continue
        try:
            module = importlib.import_module(info.name)
        except Exception:
            continue
        for obj in [module, *vars(module).values()]:
            doc = getattr(obj, "__doc__", None)
            if not isinstance(doc, str):
                continue
            for para in doc.split("\n\n"):
                para = " ".join(para.split())
                if 60 <= len(para) <= 400 and para not in seen and sum(c.isalpha() for c in para) > 0.7 * len(para):
                    seen.add(para)
                    texts.append(para)
    random.Random(seed).shuffle(texts)
    return texts[:limit]


def embed(args) -> None:
    from safetensors.torch import save_file

    import lik.demo as demo

    demo.MAX_TOKENS = args.max_tokens + 2  # [CLS] and [SEP] are dropped by the encoder's mask
    passages = _passages(args.passages, args.seed)
    rng = random.Random(args.seed + 1)
    queries = [p.split(". ")[0][:120] for p in rng.sample(passages, args.queries)]
    encoder = demo.MiniLMEncoder()
    out = {}
    for name, texts in (("doc", passages), ("query", queries)):
        emb = encoder.encode(texts)
        lengths = emb.mask.sum(1)
        # content tokens of each text, packed
        out[f"{name}_tokens"] = emb.tokens[emb.mask].half().contiguous()
        out[f"{name}_lengths"] = lengths.to(torch.int64)
    save_file(out, args.out)
    print(f"{len(passages)} passages ({int(out['doc_lengths'].sum())} tokens), {len(queries)} queries -> {args.out}")


def _padded(tokens, lengths):
    lengths = lengths.clamp_min(0)
    n, width = len(lengths), int(lengths.max())
    padded = torch.zeros(n, width, tokens.shape[-1], dtype=tokens.dtype, device=tokens.device)
    mask = torch.arange(width, device=tokens.device)[None, :] < lengths[:, None]
    padded[mask] = tokens
    return padded, mask


def _colpali_like(device, n_pages=1000, n_queries=64, page_len=1030, q_len=24, dim=128, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    centers = torch.nn.functional.normalize(torch.randn(64, dim, device=device, generator=gen), dim=-1)
    topic = torch.randint(0, 64, (n_pages, page_len), device=device, generator=gen)
    pages = centers[topic] + 0.6 * torch.randn(n_pages, page_len, dim, device=device, generator=gen) / dim**0.5 * 4
    pages = torch.nn.functional.normalize(pages, dim=-1)
    target = torch.randint(0, n_pages, (n_queries,), device=device, generator=gen)
    picks = torch.randint(0, page_len, (n_queries, q_len), device=device, generator=gen)
    noise = torch.randn(n_queries, q_len, dim, device=device, generator=gen)
    queries = pages[target[:, None], picks] + 0.5 * noise / dim**0.5 * 4
    return torch.nn.functional.normalize(queries, dim=-1), pages


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.double().argsort().argsort().double()
    rb = b.double().argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def _masked_maxsim(sim: torch.Tensor, q_mask: torch.Tensor, d_mask: torch.Tensor) -> torch.Tensor:
    """``sum_s max_t sim[n, s, b, t]`` over valid tokens (masked documents tokens never win, masked query rows add
    0), for ``sim [Nq, Lq, B, Ld]``."""
    sim = sim.masked_fill(~d_mask[None, None], float("-inf")).amax(-1)
    return torch.where(q_mask[:, :, None] & torch.isfinite(sim), sim, 0.0).sum(1)


def _emulated(Q_int, q_scale, D_int, d_scale, q_mask, d_mask, chunk: int = 128) -> torch.Tensor:
    """A peer kernel's arithmetic on the CPU: ``(float32(Q_int . D_int) * q_scale[s]) * d_scale[t]`` in fp32, max
    over valid document tokens, sum over valid query tokens. The dot products of 8-bit values are exact here
    (float64 sums of exact products, rounded once to fp32), as int8 kernels are; fp8 kernels round their running
    sums, which this does not model."""
    q64 = Q_int.double()
    rows = []
    for start in range(0, D_int.shape[0], chunk):
        docs = slice(start, start + chunk)
        dots = torch.einsum("nsk,btk->nsbt", q64, D_int[docs].double()).float()
        sim = dots * q_scale.float()[:, :, None, None] * d_scale[docs].float()[None, None]
        rows.append(_masked_maxsim(sim, q_mask, d_mask[docs]))
    return torch.cat(rows, dim=1)


def _methods(Q, q_mask, D, d_mask, *, emulate_peers: bool):
    """``name -> scores [Nq, B]`` of each 8-bit method on fp16 Q [Nq, Lq, d] and D [B, Ld, d] (masks: real tokens).

    lik's rows run ``lik.maxsim`` (the kernels on a GPU, the reference on the CPU: the same numbers by contract).
    The peers' "(emulated)" rows run their own quantizers as shipped and their kernels' scoring arithmetic, read
    from their source, evaluated by ``_emulated`` (any device); without ``emulate_peers`` (a GPU) their real kernels
    run too."""
    import lik

    out = {}
    for tag, dtype in (("lik int8", torch.int8), ("lik fp8", torch.float8_e4m3fn)):
        D_q, d_scale = lik.quantize(D, dtype)
        out[tag] = lambda D_q=D_q, d_scale=d_scale: lik.maxsim(Q, D_q, q_mask, d_mask, d_scale=d_scale)
    try:
        import flash_maxsim as fm

        # Scales are rounded to fp16 by its quantizers and widened to fp32 in its kernel.
        D_i, d_sc = fm.quantize_int8_symmetric(D)
        Q_i, q_sc = fm.quantize_query_int8(Q)
        out["flash-maxsim int8x8 (emulated)"] = lambda: _emulated(Q_i, q_sc, D_i, d_sc.squeeze(-1), q_mask, d_mask)
        if not emulate_peers:
            lengths = d_mask.sum(1).to(torch.int32)
            # Its int8x8 kernel takes one 2-D query and no query mask. Each query is passed at the padded width
            # with zero rows past its length: a zero row quantizes to zeros and adds max(0) = 0 to every score
            # (exactly), and one width means one compile and autotune instead of one per query length.
            Q_zero = torch.where(q_mask[..., None], Q, torch.zeros((), dtype=Q.dtype, device=Q.device))

            def flash():
                rows = []
                for i in range(Q_zero.shape[0]):
                    Q_int, q_scale = fm.quantize_query_int8(Q_zero[i])
                    rows.append(fm.flash_maxsim_int8x8(Q_zero[i], D_i, d_sc, Q_int, q_scale, doc_lengths=lengths))
                return torch.stack(rows)

            out["flash-maxsim int8x8"] = flash
    except ImportError:
        pass
    try:
        from late_interaction_kernels import fp8 as lk8

        Q_f, q_sc8 = lk8.quantize_fp8_per_token(Q)
        D_f, d_sc8 = lk8.quantize_fp8_per_token(D)
        out["late-interaction-kernels fp8 (emulated)"] = lambda: _emulated(Q_f, q_sc8, D_f, d_sc8, q_mask, d_mask)
        if not emulate_peers:
            out["late-interaction-kernels fp8"] = lambda: lk8.maxsim_inference_fp8(
                Q_f, D_f, scale_Q=q_sc8, scale_D=d_sc8, q_mask=q_mask, d_mask=d_mask)
    except ImportError:
        pass
    return out


def _compare(name, exact, methods, rows):
    for method, fn in methods.items():
        row = {"data": name, "method": method}
        try:
            got = fn().float()
            per_query = []
            for i in range(exact.shape[0]):
                e, g = exact[i], got[i]

                def top(s, k):
                    return set(s.topk(min(k, s.numel())).indices.tolist())

                per_query.append((_spearman(e, g), len(top(e, 10) & top(g, 10)) / min(10, e.numel()),
                                  len(top(e, 100) & top(g, 100)) / min(100, e.numel()), float((e - g).abs().max())))
            cols = list(zip(*per_query))
            row.update(spearman_mean=sum(cols[0]) / len(cols[0]), spearman_min=min(cols[0]),
                       top10_mean=sum(cols[1]) / len(cols[1]), top10_min=min(cols[1]),
                       top100_mean=sum(cols[2]) / len(cols[2]), top100_min=min(cols[2]), max_abs_err=max(cols[3]))
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)


def score(args) -> None:
    from safetensors.torch import load_file

    import lik

    device = args.device
    emulate = device == "cpu"
    data = load_file(args.data)
    D, d_mask = _padded(data["doc_tokens"].to(device), data["doc_lengths"].to(device))
    Q, q_mask = _padded(data["query_tokens"].to(device), data["query_lengths"].to(device))
    rows = []
    exact = lik.maxsim(Q.float(), D.float(), q_mask, d_mask)  # fp32 operands, fp32 (IEEE) products
    _compare(f"MiniLM, {D.shape[0]} passages, {Q.shape[0]} queries, d {D.shape[-1]}", exact,
             _methods(Q, q_mask, D, d_mask, emulate_peers=emulate), rows)
    Qc, Dc = _colpali_like(device, n_pages=args.pages)
    ones_q = torch.ones(Qc.shape[:2], dtype=torch.bool, device=device)
    ones_d = torch.ones(Dc.shape[:2], dtype=torch.bool, device=device)
    exact = lik.maxsim(Qc, Dc)
    _compare(f"ColPali-like, {Dc.shape[0]} pages x {Dc.shape[1]}, {Qc.shape[0]} queries", exact,
             _methods(Qc.half(), ones_q, Dc.half(), ones_d, emulate_peers=emulate), rows)
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else device, "torch": torch.__version__}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "quantized_fidelity.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"{'method':30} {'Spearman mean/min':>18} {'top-10 mean/min':>16} {'top-100 mean/min':>17} {'max err':>8}")
    for r in rows:
        if "error" not in r:
            print(f"{r['method']:30} {r['spearman_mean']:.5f}/{r['spearman_min']:.5f} "
                  f"{r['top10_mean']:.3f}/{r['top10_min']:.2f}"
                  f"    {r['top100_mean']:.3f}/{r['top100_min']:.2f}   {r['max_abs_err']:.4f}  ({r['data'][:12]})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="step", required=True)
    e = sub.add_parser("embed")
    e.add_argument("--out", required=True)
    e.add_argument("--passages", type=int, default=2000)
    e.add_argument("--queries", type=int, default=100)
    e.add_argument("--max-tokens", type=int, default=32)
    e.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("score")
    s.add_argument("--data", required=True)
    s.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    s.add_argument("--device", default="cuda")
    s.add_argument("--pages", type=int, default=1000, help="ColPali-like pages")
    args = parser.parse_args()
    embed(args) if args.step == "embed" else score(args)


if __name__ == "__main__":
    main()
