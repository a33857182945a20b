"""Test setup: without a CUDA GPU the real kernels run through Triton's CPU interpreter.

The variable must be set before Triton is imported, so it is set here rather than in each test.
`pytest -m gpu` on a CUDA machine compiles the kernels for real.
"""

import os
import zlib

import pytest

# `make test-gpu` spreads pytest-xdist workers over the GPUs listed in LIK_TEST_GPUS (compilation, on the CPU,
# bounds the GPU suite): each worker sees one GPU, chosen before CUDA starts, so "cuda" and "cuda:0" are that GPU.
_worker, _gpus = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("LIK_TEST_GPUS")
if _worker and _gpus:
    _ids = _gpus.split(",")
    os.environ["CUDA_VISIBLE_DEVICES"] = _ids[int(_worker.removeprefix("gw")) % len(_ids)]

import torch  # noqa: E402 (after the worker's GPU is chosen)

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
