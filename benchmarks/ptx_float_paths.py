"""Does a kernel change leave the float MaxSim kernels untouched? Compare sm_90 PTX of two source trees, offline.

Run from each tree's root with ``TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/ptx_float_paths.py OUT.txt``
(no GPU needed): the float forward launches of a fixed workload (fp16 / fp32; stacked persistent, long documents,
per-query-free short queries, d = 96 / 128 / 1000 streamed, packed corpus and pairs) are recorded through the
interpreter with the sm_90 heuristics, compiled for sm_90 like ``tests/test_compile_sm90.py`` does, and each
kernel's PTX is reduced to its instructions: parameter names, debug sections, line info and register numbers
dropped. ``diff`` the two output files: equal lines mean the same instructions.

``--family backward`` does the same for the training backward's kernels (dQ gather, atomic and sorted dD, the
winner keys) over the sm_90 compile test's MaxSim and packed training workloads; ``--ignore NAME,...`` leaves
constexpr flags a change added out of each line's key (a flag at its old behaviour must give the old PTX).
With ``PTX_DUMP=DIR`` each reduced PTX is also written to ``DIR/<hash>.ptx``, so two variants can be diffed.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.getcwd())

import lik  # noqa: E402
from tests import test_compile_sm90 as compile_test  # noqa: E402

_COMPILE = r"""
import hashlib, importlib, json, os, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
IGNORED = set(sys.argv[1].split(","))
for job in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(job["module"]), job["name"])
    signature = dict(job["signature"]); names = list(signature)
    constants = {(names.index(k),): v for k, v in job["constants"].items()}
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in job["aligned"]}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=job["options"]).asm["ptx"]
    ptx = ptx.split(".section\t.debug")[0].split(".section .debug")[0]
    body = [re.sub(r"%[a-z]*[0-9]*", "%R", line) for line in ptx.splitlines()
            if line.strip() and "param" not in line and ".loc" not in line and ".file" not in line
            and not line.lstrip().startswith("//") and "$L__" not in line]
    key = json.dumps({k: v for k, v in sorted(job["constants"].items()) if k not in IGNORED})
    key += " " + ",".join(t[1:] for _, t in job["signature"] if t.startswith("*"))
    digest = hashlib.sha1("\n".join(body).encode()).hexdigest()[:12]
    if os.environ.get("PTX_DUMP"):
        open(os.path.join(os.environ["PTX_DUMP"], digest + ".ptx"), "w").write("\n".join(body))
    print(digest, len(body), job["name"], key, flush=True)
"""


def _workload():
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.float32):
        for n_q, l_q, n_docs, l_d, dim in [(32, 32, 3, 70, 128), (1, 32, 2, 600, 128), (1, 300, 2, 65, 1000),
                                           (2, 20, 3, 40, 96)]:
            Q = torch.randn(n_q, l_q, dim, generator=gen).to(dtype)
            D = torch.randn(n_docs, l_d, dim, generator=gen).to(dtype)
            lik.maxsim(Q, D)
            q_mask = torch.rand(n_q, l_q, generator=gen) > 0.2
            lik.maxsim(Q, D, q_mask, torch.rand(n_docs, l_d, generator=gen) > 0.2, mask_mode="zero")
    d, cu_d = torch.randn(110, 128).half(), torch.tensor([0, 40, 40, 110], dtype=torch.int32)
    lik.maxsim_packed(torch.randn(2, 32, 128).half(), d, cu_d, max_seqlen_d=70)
    cu_q = torch.tensor([0, 5, 38, 39], dtype=torch.int32)
    lik.maxsim_varlen(torch.randn(39, 128).half(), d, cu_q, cu_d, 33, 70)


def _backward_workload():
    compile_test._maxsim_workload()
    compile_test._varlen_workload()


FAMILIES = {
    "forward": (_workload, {"maxsim_fwd_kernel"}),
    "backward": (_backward_workload, {"maxsim_bwd_dq_kernel", "maxsim_bwd_dd_atomic_kernel",
                                      "maxsim_bwd_dd_sorted_kernel", "winner_keys_kernel"}),
}


def main(out_path: str, family: str = "forward", ignore: str = "LOADER") -> None:
    workload, names = FAMILIES[family]
    launches = compile_test._record_launches(pytest.MonkeyPatch(), workload)
    jobs = sorted({json.dumps(job, sort_keys=True) for job in (compile_test._describe(*launch) for launch in launches)
                   if job["name"] in names})
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, ignore], input="[" + ",".join(jobs) + "]", env=env,
                          capture_output=True, text=True, check=True)
    lines = sorted(done.stdout.splitlines(), key=lambda line: line.split(" ", 2)[2])
    with open(out_path, "w") as out:
        out.write("\n".join(lines) + "\n")
    print(f"{len(lines)} kernels -> {out_path}", hashlib.sha1(done.stdout.encode()).hexdigest()[:8])


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="forward")
    parser.add_argument("--ignore", default="LOADER", help="constexpr names left out of the keys, comma-separated")
    args = parser.parse_args()
    main(args.out, args.family, args.ignore)
