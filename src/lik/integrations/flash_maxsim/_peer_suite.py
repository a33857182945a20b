"""Which tests of flash-maxsim 0.3.0's own suite are deliberate differences of :mod:`lik.integrations.flash_maxsim`
(each named in its docstring), which fail against the peer itself, and how the suite's shim maps the peer's
submodules onto lik: the data ``tools/peer_suites.py`` runs the suite with. No imports: the tool reads the file."""

__all__ = ["SUITE", "NOT_RUN", "DIFFERENCES", "FAILS_WITH_PEER"]

# The peer's sdist, lik's module, the peer's API submodules (name -> lik submodule, "" the package) and its
# reference modules (loaded from the sdist).
SUITE = {
    "sdist": "flash_maxsim-0.3.0",
    "lik": "lik.integrations.flash_maxsim",
    "aliases": {
        "flash_maxsim": "",
        "flash_maxsim_varlen": "",
        "flash_maxsim_batched_train": "",
        "flash_maxsim_quant": "",
        "flash_maxsim_rerank": "",
        "flash_maxsim_topk": "",
        "flash_maxsim_advanced": "",
        "flash_maxsim_pairs_dense": "",
        "warmup": "",
        "flash_maxsim_contrastive": ".contrastive",
    },
    "references": ("naive",),
    "version": "0.3.0",
}

# Test files that exercise only the peer's own code: not run.
NOT_RUN = {}

# (node id pattern, reason); a pattern without '::' covers a whole file, which is then not run.
DIFFERENCES = [
    (
        "tests/test_flash_maxsim.py::test_chamfer_backward",
        "flash_chamfer is not covered (lik.chamfer_distance has PyTorch3D's contract)",
    ),
    ("tests/test_flash_maxsim.py::test_sparse_maxsim*", "flash_maxsim_sparse is not covered"),
    ("tests/test_sparse_dd.py*", "flash-maxsim's sparse_dd backward is not covered"),
    (
        "tests/test_splitd_int8_warmup.py::test_int8_train_gradient_quality",
        "flash_maxsim_int8_batched_train is not covered (lik's 8-bit scoring is inference only)",
    ),
    ("tests/test_invgrid_correctness.py", "flash-maxsim's invgrid backward proposal is not covered"),
    (
        "tests/test_backward.py",
        "its ColPali-size check (51 200 maxima over 1 024 float16 tokens) bounds the gradients' distance to a float32 "
        "einsum at 0.1: a near-tie won by the other token there costs a whole token (~0.27) in one row",
    ),
]

# (node id pattern, signature, reason): tests that fail against the peer itself whatever scores it computes, known
# by the signature their failure's text holds (any other failure of theirs is UNEXPECTED).
FAILS_WITH_PEER = [
    (
        "tests/test_flash_maxsim.py::test_correctness",
        "did not match",
        "torch.allclose of flash-maxsim's float16 maxsim_naive and its float32 scores raises 'Half did not match "
        "Float', whatever the scores",
    ),
    (
        "tests/test_flash_maxsim.py::test_variable_lengths",
        "did not match",
        "torch.allclose of flash-maxsim's float16 maxsim_naive and its float32 scores raises 'Half did not match "
        "Float', whatever the scores",
    ),
    (
        "tests/test_flash_maxsim.py::test_varlen_correctness",
        "did not match",
        "torch.allclose of flash-maxsim's float16 maxsim_naive and its float32 scores raises 'Half did not match "
        "Float', whatever the scores",
    ),
    (
        "tests/test_flash_maxsim.py::test_large_embedding_dim*",
        "did not match",
        "torch.allclose of flash-maxsim's float16 maxsim_naive and its float32 scores raises 'Half did not match "
        "Float', whatever the scores",
    ),
    (
        "tests/test_batched_train.py",
        "'bool' object has no attribute 'requires_grad'",
        "the script's bench_training_step reads .requires_grad of every argument it is given and is given "
        "shared_docs=True: AttributeError after the first timed step, whatever the scores (its correctness section "
        "ran before)",
    ),
]
