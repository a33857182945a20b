"""The compressed scan's launches compile for Hopper (sm_90) on a CPU-only machine: the token stream with the
residual loader (a jit function passed as a constexpr, which tests/test_compile_sm90.py's JSON jobs cannot carry)
and the decode kernel, at the H200 heuristic's tiles, within an sm_90 block's shared memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from lik.compression import ResidualCodec
from lik.compression.packing import pack_residual_bits
from lik.core.budget import SHARED_MEMORY_BY_ARCH

pytest.importorskip("triton.runtime.interpreter")

# Runs in a fresh interpreter (the Triton interpreter patches triton.language in-process): compiles each job's
# kernel with the residual loader resolved by name; one JSON line (name, shared bytes) per job.
_COMPILER = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lik.ops.residual.decode import decode_rows
for job in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(job["module"]), job["name"])
    names = [name for name, _ in job["signature"]]
    constants = {(names.index(k),): (decode_rows if v == "decode_rows" else v) for k, v in job["constants"].items()}
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in job["aligned"]}
    source = ASTSource(fn=kernel, signature=dict(job["signature"]), constexprs=constants, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=job["options"])
    assert compiled.asm["cubin"], job["name"]
    print(json.dumps(dict(name=job["name"], constants=job["constants"], shared=compiled.metadata.shared)), flush=True)
"""


def _workload():
    from lik.ops.residual import decode_into, score_residual_packed

    for nbits, dim in ((1, 128), (2, 128), (4, 128), (2, 96)):
        codec = ResidualCodec(
            F.normalize(torch.randn(16, dim), dim=-1).half(), torch.zeros(2**nbits - 1), torch.rand(2**nbits), nbits
        )
        codes = torch.randint(0, 16, (90,), dtype=torch.int32)
        residuals = pack_residual_bits(torch.randint(0, 2**nbits, (90, dim)), nbits)
        cu = torch.tensor([0, 40, 40, 90], dtype=torch.int32)
        for n_q in (1, 4, 8) if (nbits, dim) == (2, 128) else (1,):  # 32, 128 and 256 query rows
            score_residual_packed(torch.randn(n_q, 32, dim).half(), None, codes, residuals, codec, cu)
        decode_into(torch.empty(90, dim, dtype=torch.float16), codes, residuals, codec)
    # fp32 and bf16 queries against fp32 centroids (their own tiles), fp32 products
    codec = ResidualCodec(F.normalize(torch.randn(16, 128), dim=-1), torch.zeros(3), torch.rand(4), 2)
    residuals = pack_residual_bits(torch.randint(0, 4, (90, 128)), 2)
    for dtype in (torch.float32, torch.bfloat16):
        score_residual_packed(torch.randn(4, 32, 128).to(dtype), None, codes, residuals, codec, cu)


@pytest.mark.slow
def test_residual_launches_compile_for_sm90(monkeypatch):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    from test_compile_sm90 import _describe, _record_launches

    launches = _record_launches(monkeypatch, _workload)
    jobs = set()
    for fn, args, kwargs in launches:
        described = _describe(fn, args, {k: v for k, v in kwargs.items() if k != "DECODE"})
        if "DECODE" in kwargs:
            described["constants"]["DECODE"] = "decode_rows"
        jobs.add(json.dumps(described, sort_keys=True))
    names = {json.loads(job)["name"] for job in jobs}
    assert names == {"token_stream_kernel", "decode_kernel"}
    streams = [json.loads(job)["constants"] for job in jobs if json.loads(job)["name"] == "token_stream_kernel"]
    # the H200 heuristic's tiles (not the interpreter's): 32, 128 and 256 query rows against 64-token tiles
    assert {(c["GROUPS"], c["BLOCK_T"]) for c in streams if c["NBITS"] == 2} >= {(1, 64), (4, 64), (8, 64)}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILER],
        input="[" + ",".join(sorted(jobs)) + "]",
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    built = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(built) == len(jobs)
    for record in built:
        assert record["shared"] <= SHARED_MEMORY_BY_ARCH[(9, 0)], record
