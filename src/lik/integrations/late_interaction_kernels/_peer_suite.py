"""Which tests of late-interaction-kernels 0.4.5's own suite are deliberate differences of
:mod:`lik.integrations.late_interaction_kernels` (each named in its docstring), which are not run, and how the
suite's shim maps the peer's submodules onto lik: the data ``tools/peer_suites.py`` runs the suite with. No
imports: the tool reads the file."""

__all__ = ["SUITE", "NOT_RUN", "DIFFERENCES", "FAILS_WITH_PEER"]

# The peer's sdist, lik's module, the peer's API submodules (name -> lik submodule, "" the package) and its
# reference modules (loaded from the sdist).
SUITE = {
    "sdist": "late_interaction_kernels-0.4.5",
    "lik": "lik.integrations.late_interaction_kernels",
    "aliases": {
        "autograd": ".scoring",
        "varlen": ".scoring",
        "retrieve": ".scoring",
        "fp8": ".fp8",
        "padded": ".padded",
        "topk": ".topk",
        "score_pairs": ".score_pairs",
        "pylate_compat": ".pylate_compat",
        "colpali_compat": ".colpali_compat",
        "fused_head": ".fused_head",
        "plaid": ".plaid",
    },
    "references": ("reference",),
    "version": "0.4.5",
}

# Test files that exercise only the peer's own code: not run.
NOT_RUN = {
    "tests/test_reference_cpu.py": "tests the peer's reference module (loaded from the sdist), not lik",
    "tests/test_utils.py": "tests the peer's internal helpers (_utils)",
    "tests/test_autotune_kwargs.py": "tests the peer's autotuner configuration (_autotune)",
}

# (node id pattern, reason); a pattern without '::' covers a whole file, which is then not run.
DIFFERENCES = [
    (
        "tests/test_retrieve_cpu.py::test_suppress_norm_warn_env_var_silences_warning",
        "lik prints no warning for unnormalised inputs (the peer's autograd._maybe_warn_unnormalized)",
    ),
    (
        "tests/test_retrieve_cpu.py::test_unnormalized_warn_fires_once_direct",
        "lik prints no warning for unnormalised inputs (the peer's autograd._maybe_warn_unnormalized)",
    ),
    (
        "tests/test_retrieve_cpu.py::test_norm_check_runs_once_even_when_normalized",
        "lik prints no warning for unnormalised inputs (the peer's autograd._maybe_warn_unnormalized)",
    ),
    (
        "tests/test_retrieve.py::test_unnormalized_input_warns_once",
        "lik prints no warning for unnormalised inputs (the peer's autograd._maybe_warn_unnormalized)",
    ),
    (
        "tests/test_forward.py::test_chunked_backward_matches_unchunked*",
        "tests the peer's kernels or internals (not part of the API lik replaces)",
    ),
    (
        "tests/test_forward.py::test_kd_over_ceil_still_warns",
        "tests the peer's kernels or internals (not part of the API lik replaces)",
    ),
    ("tests/test_backward_lowmem.py*", "tests the peer's kernels or internals (not part of the API lik replaces)"),
    ("tests/test_backward_unified.py*", "tests the peer's kernels or internals (not part of the API lik replaces)"),
    ("tests/test_compile_cache.py*", "tests the peer's kernels or internals (not part of the API lik replaces)"),
    ("tests/test_public_api.py*", "the mps backend is not covered"),
    (
        "tests/test_robustness.py::test_no_grad_does_not_save_argmax_buffer",
        "lik keeps the winners as int16 when Ld < 32 768 (half the peer's int32 buffer): no_grad does skip the "
        "save, but the saving is below the test's int32-sized threshold",
    ),
    (
        "tests/test_plaid.py::test_residual_backward_rejects_empty_docs",
        "plaid.maxsim_residual gives an empty document a zero gradient (the peer raises ValueError in training)",
    ),
    (
        "tests/test_pylate_compat_fallback.py*",
        "patch_pylate / patch_colpali_engine are lik's switches: no names rebound, no _ORIGINAL, patched_* or "
        "package_at_least; they act on every device and host version",
    ),
    (
        "tests/test_pylate_compat_warnings.py*",
        "patch_pylate / patch_colpali_engine are lik's switches: no names rebound, no _ORIGINAL, patched_* or "
        "package_at_least; they act on every device and host version",
    ),
    (
        "tests/test_pylate_compat.py::test_*_uses_patched_scores",
        "patch_pylate / patch_colpali_engine are lik's switches: no names rebound, no _ORIGINAL, patched_* or "
        "package_at_least; they act on every device and host version",
    ),
    (
        "tests/test_pylate_compat.py::test_unpatch_restores_original",
        "patch_pylate / patch_colpali_engine are lik's switches: no names rebound, no _ORIGINAL, patched_* or "
        "package_at_least; they act on every device and host version",
    ),
    (
        "tests/test_pylate_compat.py::test_patch_pylate_is_noop_on_native_pylate",
        "patch_pylate / patch_colpali_engine are lik's switches: no names rebound, no _ORIGINAL, patched_* or "
        "package_at_least; they act on every device and host version",
    ),
    (
        "tests/test_colpali_compat.py::test_patch_and_unpatch_round_trip",
        "patch_pylate / patch_colpali_engine are lik's switches: no names rebound, no _ORIGINAL, patched_* or "
        "package_at_least; they act on every device and host version",
    ),
    (
        "tests/test_colpali_compat.py::test_double_patch_is_idempotent",
        "patch_pylate / patch_colpali_engine are lik's switches: no names rebound, no _ORIGINAL, patched_* or "
        "package_at_least; they act on every device and host version",
    ),
    (
        "tests/test_colpali_compat.py::test_lik_disable_falls_through",
        "patch_pylate / patch_colpali_engine are lik's switches: no names rebound, no _ORIGINAL, patched_* or "
        "package_at_least; they act on every device and host version",
    ),
    (
        "tests/test_colpali_compat.py::test_patched_score_multi_vector_matches_original_cuda",
        "patch_pylate / patch_colpali_engine are lik's switches: no names rebound, no _ORIGINAL, patched_* or "
        "package_at_least; they act on every device and host version",
    ),
    (
        "tests/test_colpali_compat.py::test_patch_colpali_engine_is_noop_on_native_colpali",
        "patch_pylate / patch_colpali_engine are lik's switches: no names rebound, no _ORIGINAL, patched_* or "
        "package_at_least; they act on every device and host version",
    ),
    (
        "tests/test_pylate_compat.py::test_lik_disable_env_falls_back",
        "LIK_DISABLE (the peer's variable) is not read: the patched call still scores with lik, compared at atol 1e-5 "
        "with PyLate's unpatched auto backend (flash-maxsim where it is installed)",
    ),
    (
        "tests/test_pylate_compat.py::test_patched_with_both_masks_matches_pylate",
        "its reference is PyLate's unpatched auto backend, flash-maxsim where installed, which reads each mask as a "
        "prefix length (mask.sum); lik keeps PyLate's mask-by-multiplication for any mask pattern",
    ),
    (
        "tests/test_pylate_compat.py::test_patched_kd_matches_pylate",
        "its reference is PyLate's unpatched auto backend, flash-maxsim where installed, which reads each mask as a "
        "prefix length (mask.sum); lik keeps PyLate's mask-by-multiplication for any mask pattern",
    ),
    (
        "tests/test_padded.py::test_pack_padded_async_assert_*",
        "pack_padded refuses a length past the padding with ValueError on the host, not a device-side assert",
    ),
    (
        "tests/test_varlen.py::test_varlen_too_small_max_seqlen_asserts",
        "max_seqlen_* are hints in lik: a small one costs speed, never tokens (no device-side assert)",
    ),
]

# (node id pattern, reason): tests that fail against the peer itself whatever scores it computes.
FAILS_WITH_PEER = []
