"""The training-loop check: losses of a contrastive model trained through ``lik.maxsim`` track float32."""

from __future__ import annotations

import pytest
import torch

import lik
from lik import _config
from lik.bench.convergence import ConvergenceSetup, compare, synthetic_batches, train

SMALL = ConvergenceSetup(steps=12, batch=4, q_len=4, doc_len=8, d_in=16, dim=8, signal_dims=8)


def test_kernels_track_the_float32_reference_on_cpu():
    if not _config.interpreting():
        pytest.skip("runs the kernels through TRITON_INTERPRET=1")
    result = compare(SMALL, torch.device("cpu"))
    assert set(result["runs"]) == {"lik-fast-float32", "lik-deterministic-float32"}
    for run in result["runs"].values():
        assert len(run["losses"]) == SMALL.steps
        assert run["max_abs_diff"] < 1e-3


def test_the_comparison_can_fail_and_is_well_conditioned():
    """Scores 1% off are caught by the 1e-3 bound; scores 1e-6 off (rounding) stay far inside it, so the loop
    does not amplify rounding into a false alarm."""
    batches = synthetic_batches(SMALL, torch.device("cpu"))
    reference = train(lik.maxsim_reference, batches, SMALL)

    def deviation(factor):
        losses = train(lambda q, d: factor * lik.maxsim_reference(q, d), batches, SMALL)
        return max(abs(a - b) for a, b in zip(losses, reference))

    assert deviation(1.01) > 1e-3
    assert deviation(1 + 1e-6) < 1e-4


def test_planted_positives_are_learned():
    setup = ConvergenceSetup(steps=120)
    losses = train(lik.maxsim_reference, synthetic_batches(setup, torch.device("cpu")), setup)
    assert losses[0] > 3.0 and max(losses[-10:]) < 0.5  # from ~log(32) to near 0


@pytest.mark.gpu
def test_two_hundred_steps_track_float32_on_gpu():
    result = compare(ConvergenceSetup(), torch.device("cuda"))
    assert result["reference_float32"][0] > 3.0 and result["reference_float32"][-1] < 0.5
    for run in result["runs"].values():
        assert run["max_abs_diff"] < 1e-3
