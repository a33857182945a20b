"""Test setup: without a CUDA GPU the real kernels run through Triton's CPU interpreter.

The variable must be set before Triton is imported, so it is set here rather than in each test.
`pytest -m gpu` on a CUDA machine compiles the kernels for real.
"""

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def rng(request):
    """A generator seeded from the test's id: inputs differ between tests, and a failure reproduces.

    Set LIK_TEST_SEED to draw other inputs (e.g. in a soak loop)."""
    seed = zlib.crc32(request.node.nodeid.encode()) ^ int(os.environ.get("LIK_TEST_SEED", "0"))
    return torch.Generator().manual_seed(seed)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
