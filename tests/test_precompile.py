"""lik.warmup: one call per variant, errors on bad shapes; on the GPU, nothing compiles afterwards and the
warmed call can be captured in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

import lik
from lik.ops.maxsim.forward_kernel import maxsim_fwd_kernel


def test_warmup_counts_calls_per_variant():
    # Without masks: one inference call per shape. With masks and training: (unmasked + masked "exclude" +
    # masked "zero") x (inference + two backwards).
    assert lik.warmup([(1, 5, 16)], device="cpu", masks=False) == 1
    assert lik.warmup([(2, 5, 16)], device="cpu", masks=True, training=True) == 3 * 3


def test_warmup_covers_the_long_document_variant_where_it_differs(monkeypatch):
    from lik import _config
    from lik.precompile import _document_length_buckets

    monkeypatch.setattr(_config, "interpreting", lambda: False)  # the GPU heuristics
    monkeypatch.setattr(_config, "_arch", lambda device: (9, 0))
    cpu = torch.device("cpu")
    assert _document_length_buckets(1, 32, 128, torch.float16, cpu) == [8, _config.LONG_DOCUMENT]
    assert _document_length_buckets(4, 32, 128, torch.float16, cpu) == [8]
    assert _document_length_buckets(1, 1024, 128, torch.float16, cpu) == [8]


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_warmup_covers_the_last_tile_variants_of_8bit_corpora(monkeypatch, dtype):
    """Long queries over an 8-bit corpus compile three variants by the length's remainder after whole document
    tiles (none: whole tiles; at most 32 tokens: whole tiles and narrow ones; more: the clamped loop): warmup adds
    lengths of the same config for the two its first length does not take; nowhere else."""
    from lik import _config
    from lik.core.quantized import loader_of
    from lik.ops.maxsim.forward import last_tiles
    from lik.precompile import _document_lengths

    monkeypatch.setattr(_config, "interpreting", lambda: False)
    monkeypatch.setattr(_config, "_arch", lambda device: (9, 0))
    cpu = torch.device("cpu")
    for shape in [(1, 1024, 128), (2, 512, 96)]:
        lengths, masked = zip(*_document_lengths(*shape, dtype, cpu))
        assert masked == (True, False, False)  # (the whole-tile variants exist unmasked only)
        configs = [_config.maxsim_forward_config(q_len=shape[1], n_queries=shape[0], dim=shape[2], dtype=dtype,
                                                 per_query=False, device=cpu, doc_len=n) for n in lengths]
        variants = [last_tiles(c, n, shape[2], loader_of(dtype), masked=False) for c, n in zip(configs, lengths)]
        assert all(c == configs[0] for c in configs) and variants == [(True, 16), (True, 0), (False, 0)]
    assert _document_lengths(1, 1024, 128, torch.float16, cpu) == [(8, True)]  # float rows: one variant
    assert _document_lengths(4, 32, 128, dtype, cpu) == [(8, True)]  # stacked short queries: persistent


@pytest.mark.parametrize("shape", [(0, 5, 16), (1, -1, 16), (1, 5, 0)])
def test_warmup_rejects_empty_shapes(shape):
    with pytest.raises(ValueError, match="positive"):
        lik.warmup([shape], device="cpu")


def test_cli_parses_shapes(capsys):
    from lik.precompile import main

    with pytest.raises(SystemExit):
        main(["--shape", "1,2"])
    assert "expected Nq,Lq,d" in capsys.readouterr().err


def _variants(kernel) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(c) for c in kernel.cache.values())


@pytest.mark.gpu
def test_after_warmup_no_compile_and_cuda_graph_capture():
    lik.warmup([(4, 32, 128), (1, 32, 128)], dtype=torch.float16, masks=False)
    compiled = _variants(maxsim_fwd_kernel)
    for doc_len in (180, 1024):  # one short query: short and long documents take different tiles
        lik.maxsim(torch.randn(32, 128, device="cuda").half(), torch.randn(20, doc_len, 128, device="cuda").half())
    Q = torch.nn.functional.normalize(torch.randn(4, 30, 128, device="cuda"), dim=-1).half()
    D = torch.nn.functional.normalize(torch.randn(300, 180, 128, device="cuda"), dim=-1).half()
    expected = lik.maxsim(Q, D)
    assert _variants(maxsim_fwd_kernel) == compiled
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = lik.maxsim(Q, D)
    Q.copy_(torch.nn.functional.normalize(torch.randn_like(Q.float()), dim=-1).half())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(captured, lik.maxsim(Q, D))
    assert not torch.allclose(captured, expected)
