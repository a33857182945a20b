"""Every kernel launch compiles for Hopper (sm_90) -- checked on a CPU-only machine.

Triton's interpreter accepts code the real compiler rejects (a non-constexpr global, a dtype clash in a
``tl.where``), so CI would not see it. Here each workload runs once under the interpreter with the GPU launch
heuristics, every launch is recorded, and each distinct (kernel, signature, constants, options) is compiled to
a cubin for ``sm_90`` with Triton's own toolchain, no GPU needed. Launches are recorded, not executed: only
the argument types and constants matter here, and the kernels' numbers are tested elsewhere.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

import lik
from lik import _config
from lik.core.budget import SHARED_MEMORY_BY_ARCH

triton_interpreter = pytest.importorskip("triton.runtime.interpreter")

_DTYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.int8: "i8",
    torch.bool: "i1",
    torch.float8_e4m3fn: "fp8e4nv",
}
_OPTIONS = ("num_warps", "num_stages", "maxnreg")


def _record_launches(monkeypatch, workload):
    launches = []

    def record(self, *args, grid, **kwargs):
        launches.append((self.fn, args, dict(kwargs)))

    monkeypatch.setattr(triton_interpreter.InterpretedFunction, "run", record)
    # The GPU heuristics, not the interpreter's small tiles: those are the variants users compile.
    monkeypatch.setattr(_config, "interpreting", lambda: False)
    monkeypatch.setattr(_config, "_arch", lambda device: (9, 0))
    workload()
    monkeypatch.undo()
    return launches


def _describe(fn, args, kwargs) -> dict:
    """The kernel's module and name, its compiler signature, its constants and launch options."""
    params = list(inspect.signature(fn).parameters.values())
    values = dict(zip((p.name for p in params), args))
    values.update({k: v for k, v in kwargs.items() if k not in _OPTIONS})
    # Triton specialises what a launch passes unless told not to: an int equal to 1 becomes a constant, an int
    # or a pointer divisible by 16 is marked so (the alignment that lets loads vectorise and pipeline); do the
    # same, so that the compiled code, its pipelining and its shared memory are the ones the GPU would run.
    interpreted = getattr(inspect.getmodule(fn), fn.__name__)  # the interpreter keeps the jit's arguments
    not_specialised = {
        params[i].name if isinstance(i, int) else i for i in interpreted.kwargs.get("do_not_specialize") or ()
    }
    signature, constants, aligned = {}, {}, []
    for p in params:
        value = values[p.name] if p.name in values else p.default  # a constexpr left at its default
        specialised = p.name not in not_specialised
        if "constexpr" in str(p.annotation):
            signature[p.name] = "constexpr"
            constants[p.name] = value
        elif isinstance(value, torch.Tensor):
            signature[p.name] = "*" + _DTYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                aligned.append(p.name)
        elif isinstance(value, bool):
            signature[p.name] = "i1"
        elif isinstance(value, int):
            signature[p.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if specialised and value == 1:
                signature[p.name] = "constexpr"
                constants[p.name] = 1
            elif specialised and value % 16 == 0:
                aligned.append(p.name)
        else:
            signature[p.name] = "fp32"
    return {
        "module": fn.__module__,
        "name": fn.__name__,
        "signature": list(signature.items()),
        "constants": constants,
        "aligned": aligned,
        "options": {k: kwargs[k] for k in _OPTIONS if kwargs.get(k) is not None},
    }


# Runs in a fresh interpreter: once Triton's interpreter has run, it has patched triton.language in-process.
# One JSON line per job: its constants, options, shared memory and (where cuobjdump ships with Triton) stack bytes.
_COMPILER = """
import importlib, json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
SHARED_LIMIT = int(sys.argv[1])
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
for job in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(job["module"]), job["name"])
    signature = dict(job["signature"])  # a list of pairs: the parameter order matters
    names = list(signature)
    constants = {(names.index(k),): v for k, v in job["constants"].items()}
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in job["aligned"]}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=job["options"])
    assert compiled.asm["cubin"], job["name"]
    # A launch needing more shared memory than an sm_90 block may opt into fails at run time (OutOfResources).
    shared = compiled.metadata.shared
    assert shared <= SHARED_LIMIT, (job["name"], job["constants"], job["options"], shared, SHARED_LIMIT)
    stack = None
    if os.path.exists(CUOBJDUMP):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", cubin.name], capture_output=True, text=True)
            stack = int(re.search(r"STACK:(\\d+)", usage.stdout).group(1))
    print(json.dumps(dict(name=job["name"], constants=job["constants"], options=job["options"], shared=shared,
                          stack=stack)), flush=True)
"""


def compile_for_sm90(launches: list, timeout: int = 900) -> list[dict]:
    """Compile each distinct recorded launch for sm_90 in a fresh interpreter (the device's toolchain, no GPU);
    one record per distinct launch (see ``_COMPILER``). Fails the test on any compiler error."""
    assert launches, "the workload launched no kernel"
    jobs = {json.dumps(job, sort_keys=True) for job in (_describe(*launch) for launch in launches)}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILER, str(SHARED_MEMORY_BY_ARCH[(9, 0)])],
        input="[" + ",".join(sorted(jobs)) + "]", env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    built = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(built) == len(jobs)
    return built


def _maxsim_workload():
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.float32):
        for n_q, l_q, n_docs, l_d, dim, per_query in [
            (2, 32, 3, 70, 128, False),
            (1, 300, 2, 65, 128, False),
            (2, 20, 2, 40, 96, True),
            (1, 8, 2, 30, 640, False),
            (1, 300, 2, 65, 1000, False),
            (4, 32, 2, 40, 4096, False),
            (1, 300, 2, 256, 128, False),
            (1, 300, 2, 262, 128, False),
        ]:
            Q = torch.randn(n_q, l_q, dim, generator=gen).to(dtype).requires_grad_()
            D = torch.randn(((n_q,) if per_query else ()) + (n_docs, l_d, dim), generator=gen).to(dtype)
            D.requires_grad_()
            q_mask = torch.rand(n_q, l_q, generator=gen) > 0.2
            for backward in ("fast", "deterministic"):
                lik.maxsim(Q, D, q_mask, mask_mode="zero", backward=backward).sum().backward()
            lik.maxsim(Q.detach(), D.detach())
    torch.set_float32_matmul_precision("high")
    try:
        lik.maxsim(torch.randn(2, 32, 128), torch.randn(3, 40, 128))
    finally:
        torch.set_float32_matmul_precision("highest")


def _varlen_workload():
    gen = torch.Generator().manual_seed(1)
    lengths_q, lengths_d = [5, 33, 1], [40, 0, 70]
    for dtype, dim in ((torch.float16, 128), (torch.float32, 128), (torch.float16, 768), (torch.float32, 1000)):
        q = torch.randn(sum(lengths_q), dim, generator=gen).to(dtype).requires_grad_()
        d = torch.randn(sum(lengths_d), dim, generator=gen).to(dtype).requires_grad_()
        cu_q = torch.tensor([0, 5, 38, 39], dtype=torch.int32)
        cu_d = torch.tensor([0, 40, 40, 110], dtype=torch.int32)
        Q = torch.randn(2, 32, dim, generator=gen).to(dtype).requires_grad_()
        for backward in ("fast", "deterministic"):
            lik.maxsim_varlen(q, d, cu_q, cu_d, 33, 70, backward=backward).sum().backward()
            lik.maxsim_packed(Q, d, cu_d, max_seqlen_d=70, backward=backward).sum().backward()
        # Inference of stacked rows (64, 128 and 256 of them): the persistent packed launch.
        for rows in (Q.detach(), torch.randn(325, 1, dim, generator=gen).to(dtype), torch.randn(20, 32, dim).to(dtype)):
            lik.maxsim_packed(rows, d.detach(), cu_d, max_seqlen_d=70)


def _msda_workload():
    gen = torch.Generator().manual_seed(2)
    shapes = torch.tensor([[6, 5], [3, 3]])
    starts = torch.tensor([0, 30])
    for dtype, dim in ((torch.float32, 32), (torch.float16, 256)):
        value = torch.randn(2, 39, 8, dim, generator=gen).to(dtype).requires_grad_()
        loc = torch.rand(2, 7, 8, 2, 4, 2, generator=gen).to(dtype).requires_grad_()
        weights = torch.rand(2, 7, 8, 2, 4, generator=gen).to(dtype).requires_grad_()
        lik.ms_deform_attn(value, shapes, starts, loc, weights).sum().backward()
        torch.use_deterministic_algorithms(True)
        try:  # the bucket-writing backward and the value-gradient gather
            lik.ms_deform_attn(value, shapes, starts, loc, weights).sum().backward()
        finally:
            torch.use_deterministic_algorithms(False)


def _chamfer_workload():
    """The nearest-neighbour launches (Chamfer's backward is PyTorch ops). Called below the autograd layer: the
    recorded launches write nothing, and MaxSim's winner buffer would reach a gather as garbage indices."""
    from lik.ops.chamfer.kernel import nearest_indices

    gen = torch.Generator().manual_seed(3)
    xl, yl = torch.tensor([70, 3]), torch.tensor([5, 90])
    for dim in (3, 40, 1000):
        x = torch.randn(2, 70, dim, generator=gen)
        y = torch.randn(2, 90, dim, generator=gen)
        for norm in (1, 2):
            nearest_indices(x, y, xl, yl, norm)
            nearest_indices(x, y, xl, yl, norm, both_ways=True)  # Chamfer's one pass (direct route)
        # What a GPU with TF32 takes (split operands), and the forced dot route.
        for cfg in (
            _config.NearestConfig("core", "tf32x3"),
            _config.NearestConfig("dot", "tf32x3"),
            _config.NearestConfig("dot", "ieee"),
        ):
            with _config.override(nearest=cfg):
                nearest_indices(x, y, xl, yl, 2)


def _quantize_workload():
    """``lik.quantize``'s int8 launches, and float8's through the launcher (CPU float8 runs the reference)."""
    from lik.ops.quantization.kernel import quantize_rows

    gen = torch.Generator().manual_seed(4)
    for dim in (3, 200, 20000):
        lik.quantize(torch.randn(5, dim, generator=gen), torch.int8)
    for dim in (128, 96):
        for in_dtype in (torch.float16, torch.bfloat16):
            quantize_rows(torch.randn(5, dim, generator=gen).to(in_dtype), torch.float8_e4m3fn)


def _quantized_workload():
    """8-bit corpora. The launchers are called directly: CPU float8 scoring runs the reference (the interpreter's
    float8 conversion is unreliable), and here launches are only recorded, never run. One short query over 70- and
    600-token documents takes the persistent loop (int8: with each document's whole-tile max); the long queries
    over 256 and 262 tokens take the whole-tile loop (float8: scales loaded before each product), the second with a
    narrow tail."""
    from lik.ops.maxsim.forward import maxsim_forward
    from lik.ops.maxsim.packed_forward import packed_forward
    from lik.ops.maxsim.packing import PackedInputs
    from lik.ops.maxsim.validation import MaxSimInputs

    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.int8, torch.float8_e4m3fn):
        for n_q, l_q, n_docs, l_d, dim, per_query in [
            (2, 32, 3, 70, 128, False),
            (32, 32, 3, 70, 128, False),
            (1, 32, 3, 70, 128, False),
            (1, 32, 2, 600, 128, False),
            (1, 300, 2, 65, 128, False),
            (2, 20, 2, 40, 96, True),
            (1, 8, 2, 30, 16, False),
            (1, 300, 2, 65, 1000, False),
            (4, 32, 2, 40, 4096, False),
            (1, 300, 2, 256, 128, False),
            (1, 300, 2, 262, 128, False),
        ]:
            Q = torch.randn(n_q, l_q, dim, generator=gen)
            D, d_scale = lik.quantize(
                torch.randn(((n_q,) if per_query else ()) + (n_docs, l_d, dim), generator=gen), dtype
            )
            q_mask = torch.rand(n_q, l_q, generator=gen) > 0.2
            d_mask = torch.rand(D.shape[:-1], generator=gen) > 0.2
            maxsim_forward(MaxSimInputs.build(Q, D, d_scale=d_scale), store_argmax=False)
            inputs = MaxSimInputs.build(Q, D, q_mask, d_mask, "zero", d_scale=d_scale)
            maxsim_forward(inputs, store_argmax=False)
        lengths_q, cu_q = [5, 33, 1], torch.tensor([0, 5, 38, 39], dtype=torch.int32)
        cu_d = torch.tensor([0, 40, 40, 110], dtype=torch.int32)
        for dim in (128, 768):
            q = torch.randn(sum(lengths_q), dim, generator=gen)
            d, d_scale = lik.quantize(torch.randn(110, dim, generator=gen), dtype)
            Q = torch.randn(2, 32, dim, generator=gen)
            pairs = PackedInputs.build_pairs(
                q, d, cu_q, cu_d, 33, 70, read_values=False, allow_float64=False, d_scale=d_scale
            )
            packed_forward(pairs, store_argmax=False)
            corpus = PackedInputs.build_corpus(
                Q, d, cu_d, None, 70, read_values=False, allow_float64=False, d_scale=d_scale
            )
            packed_forward(corpus, store_argmax=False)


def _stream_workload():
    """The token stream (inference over a packed corpus of short documents) for every tile lik.config.packed picks:
    one 32-token query, 128 and 256 stacked rows, a split 300-token query; fp16, bf16, fp32 (IEEE and TF32) and
    8-bit corpora; a query mask and a width below the resident tile. The launcher is called directly: on the CPU,
    bf16 and float8 scoring run the reference."""
    from lik.ops.maxsim.packed_forward import packed_forward
    from lik.ops.maxsim.packing import PackedInputs

    gen = torch.Generator().manual_seed(7)
    cu_d = torch.tensor([0, 40, 40, 110, 111], dtype=torch.int32)
    cases = [(1, 32, 128, False), (4, 32, 128, False), (8, 32, 128, False), (1, 300, 128, False), (2, 32, 96, True)]
    for n_q, l_q, dim, masked in cases:
        q_mask = (torch.rand(n_q, l_q, generator=gen) > 0.2) if masked else None
        Q = torch.randn(n_q, l_q, dim, generator=gen)
        d = torch.randn(111, dim, generator=gen)
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn):
            rows, d_scale = lik.quantize(d, dtype) if dtype in _config.EIGHT_BIT_DTYPES else (d.to(dtype), None)
            queries = Q if d_scale is not None else Q.to(dtype)
            corpus = PackedInputs.build_corpus(
                queries, rows, cu_d, q_mask, 70, read_values=False, allow_float64=False, d_scale=d_scale
            )
            packed_forward(corpus, store_argmax=False)
    torch.set_float32_matmul_precision("high")
    try:
        lik.maxsim_packed(torch.randn(2, 32, 128), torch.randn(111, 128), cu_d, max_seqlen_d=70)
    finally:
        torch.set_float32_matmul_precision("highest")


def _contrastive_workload():
    """lik.contrastive_loss forward and backward: MaxSim's training launches and the cross-entropy kernel, one
    program (ColBERT's batch) and many (scores past SINGLE_PROGRAM_SCORES), labels and the diagonal."""
    gen = torch.Generator().manual_seed(8)
    for dtype, n_q, n_docs, labelled in (
        (torch.float16, 4, 6, True),
        (torch.float16, 160, 256, False),
        (torch.float32, 3, 3, False),
    ):
        Q = torch.randn(n_q, 8, 64, generator=gen).to(dtype).requires_grad_()
        D = torch.randn(n_docs, 20, 64, generator=gen).to(dtype).requires_grad_()
        labels = torch.randint(0, n_docs, (n_q,), generator=gen) if labelled else None
        for backward in ("fast", "deterministic"):
            lik.contrastive_loss(Q, D, labels, temperature=0.05, backward=backward).backward()


def _msda_v2_workload():
    """lik.ms_deform_attn_v2 forward and backward (atomic and deterministic), both methods, points per level that
    differ (the point-table path) and, for "discrete", that are equal."""
    gen = torch.Generator().manual_seed(9)
    shapes = torch.tensor([[6, 5], [3, 3]])
    starts = torch.tensor([0, 30])
    for dtype, dim in ((torch.float32, 32), (torch.float16, 256)):
        for counts, method in (([3, 2], "default"), ([3, 2], "discrete"), ([4, 4], "discrete")):
            value = torch.randn(2, 39, 8, dim, generator=gen).to(dtype).requires_grad_()
            loc = torch.rand(2, 7, 8, sum(counts), 2, generator=gen).to(dtype).requires_grad_()
            weights = torch.rand(2, 7, 8, sum(counts), generator=gen).to(dtype).requires_grad_()
            for deterministic in (False, True):
                torch.use_deterministic_algorithms(deterministic)
                try:
                    lik.ms_deform_attn_v2(value, shapes, starts, loc, weights, counts, method).sum().backward()
                finally:
                    torch.use_deterministic_algorithms(False)


def _knn_workload():
    """lik.knn_points' launches (its backward is PyTorch ops on the indices): 1, 8 and 32 neighbours, both norms,
    3-D points and 64-wide features, fp32 and fp16. tests/ops/knn/test_knn_compile.py also checks the spills."""
    from lik.ops.knn import kernel

    gen = torch.Generator().manual_seed(10)
    l1, l2 = torch.tensor([70, 3]), torch.tensor([5, 90])
    exact_distances = kernel.exact_distances
    # Recorded launches write nothing: the products route's exact distances would gather at garbage indices.
    kernel.exact_distances = lambda p1, p2, idx, valid, norm: idx.float() * 0
    try:
        for dim, dtype in ((3, torch.float32), (64, torch.float32), (64, torch.float16)):
            p1 = torch.randn(2, 70, dim, generator=gen).to(dtype)
            p2 = torch.randn(2, 90, dim, generator=gen).to(dtype)
            for K in (1, 8, 32):
                for norm in (1, 2):
                    lik.knn_points(p1, p2, l1, l2, norm=norm, K=K)
    finally:
        kernel.exact_distances = exact_distances


def _soft_workload():
    """lik.maxsim's soft reductions forward and backward: reduction="smooth" (tau) and "topk" (top_k), masks,
    fp16 / bf16 / fp32 and a width past the resident tile."""
    gen = torch.Generator().manual_seed(11)
    options = (dict(reduction="smooth", tau=0.1), dict(reduction="topk", top_k=4))
    for dtype, dim in ((torch.float16, 128), (torch.bfloat16, 96), (torch.float32, 128), (torch.float16, 1000)):
        for kw in options:
            Q = torch.randn(4, 32, dim, generator=gen).to(dtype).requires_grad_()
            D = torch.randn(5, 70, dim, generator=gen).to(dtype).requires_grad_()
            q_mask = torch.rand(4, 32, generator=gen) > 0.2
            d_mask = torch.rand(5, 70, generator=gen) > 0.2
            lik.maxsim(Q, D, q_mask, d_mask, **kw).sum().backward()
            lik.maxsim(Q.detach(), D.detach(), **kw)


def _fused_head_workload():
    """lik.maxsim_from_hidden's backward launches (MaxSim's dQ gather and dD scatter / sorted gather over the
    recomputed fp32 rows); its forward's are tests/ops/fused_head/test_compile_sm90.py's. Called below autograd
    with real winners: a recorded forward would leave them unwritten."""
    from lik.ops.fused_head.backward import fused_head_backward
    from lik.ops.fused_head.validation import FusedHeadInputs

    gen = torch.Generator().manual_seed(12)
    for dtype, per_query in ((torch.float16, False), (torch.bfloat16, False), (torch.float32, True)):
        Q = torch.randn(4, 32, 128, generator=gen).to(dtype)
        H = torch.randn(*((4,) if per_query else ()), 6, 40, 768, generator=gen).to(dtype)
        W = torch.randn(128, 768, generator=gen).to(dtype)
        inputs = FusedHeadInputs.build(Q, H, W, torch.randn(128, generator=gen).to(dtype), None, None)
        argmax = torch.randint(0, 40, (4, 6, 32), generator=gen, dtype=torch.int32)
        grad = torch.randn(4, 6, generator=gen)
        for deterministic in (False, True):
            fused_head_backward(inputs, argmax, grad, (True, True, True, True), deterministic)


WORKLOADS = {
    "maxsim": _maxsim_workload,
    "varlen": _varlen_workload,
    "msda": _msda_workload,
    "chamfer": _chamfer_workload,
    "quantize": _quantize_workload,
    "quantized": _quantized_workload,
    "stream": _stream_workload,
    "contrastive": _contrastive_workload,
    "msda_v2": _msda_v2_workload,
    "knn": _knn_workload,
    "soft": _soft_workload,
    "fused_head": _fused_head_workload,
}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_launch_compiles_for_sm90(monkeypatch, name):
    if not _config.interpreting():
        pytest.skip("records launches through Triton's interpreter (TRITON_INTERPRET=1)")
    compile_for_sm90(_record_launches(monkeypatch, WORKLOADS[name]))
