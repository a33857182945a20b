"""Kernel variants for documents read through the address table (equal pages), and host passes (device host)."""
import dataclasses, json, statistics, sys, time
from itertools import repeat
from operator import attrgetter
import numpy as np
import torch, triton
import lik
from lik import _config
from lik.ops.maxsim import forward as fwd
from lik.ops.maxsim.document_list import DocumentList, maxsim_document_list
from lik.ops.maxsim.packed_forward import packed_forward
from lik.ops.maxsim.packing import PackedInputs

out = {}
dim = 128
pages = [torch.nn.functional.normalize(torch.randn(1030, dim, device="cuda"), dim=-1).bfloat16() for _ in range(1000)]
stacked = torch.stack(pages)
cu = torch.arange(0, 1001, device="cuda", dtype=torch.int32) * 1030
for n_rows in (325, 2554):
    q = torch.nn.functional.normalize(torch.randn(n_rows, 1, dim, device="cuda"), dim=-1).bfloat16()
    built = DocumentList.build(pages, q)
    with torch.no_grad():
        maxsim_document_list(q, built)
    cfg = _config.maxsim_forward_config(q_len=1, n_queries=n_rows, dim=dim, dtype=q.dtype, per_query=False,
                                        device=q.device, doc_len=1030, argmax=False)
    print(n_rows, cfg, flush=True)
    table = built.table
    def packed_table():
        stand_in = pages[0].as_strided((1030 * 1000, dim), (0, 0))
        return packed_forward(PackedInputs(q, stand_in, None, cu, None, 1, False, True), False, table)[0]
    def stages(k):
        def run():
            old = fwd.TABLE_LOOKUP_STAGES
            fwd.TABLE_LOOKUP_STAGES = k
            try:
                return maxsim_document_list(q, built)
            finally:
                fwd.TABLE_LOOKUP_STAGES = old
        return run
    def nonpersistent_table():
        with _config.override(maxsim_forward=dataclasses.replace(cfg, programs_per_sm=0)):
            return maxsim_document_list(q, built)
    def nonpersistent_strided():
        with _config.override(maxsim_forward=dataclasses.replace(cfg, programs_per_sm=0)):
            return lik.maxsim(q, stacked)
    methods = {"strided_persistent": lambda: lik.maxsim(q, stacked), "table_persistent_+2": stages(2),
               "table_persistent_+0": stages(0), "table_persistent_+1": stages(1), "table_persistent_+3": stages(3),
               "table_nonpersistent": nonpersistent_table, "strided_nonpersistent": nonpersistent_strided,
               "table_packed": packed_table,
               "strided_packed": lambda: lik.maxsim_packed(q, stacked.view(-1, dim), cu, max_seqlen_d=1030)}
    with torch.no_grad():
        ref = methods["strided_persistent"]()
        for name, fn in methods.items():
            assert torch.equal(fn(), ref), name
        times = {name: [] for name in methods}
        for _ in range(5):
            for name, fn in methods.items():
                times[name].append(triton.testing.do_bench(fn, warmup=5, rep=100))
    out[n_rows] = {"config": str(cfg), "times": times}
    print(" | ".join(f"{k} {statistics.median(v):.4f}" for k, v in times.items()), flush=True)

# Host passes over 1 000 GPU pages on this host (us, median of 200).
def t(f, n=200):
    f(); ts = []
    for _ in range(n):
        s = time.perf_counter(); f(); ts.append(time.perf_counter() - s)
    return statistics.median(ts) * 1e6
nb, dt = attrgetter("nbytes"), attrgetter("dtype")
host = {
    "get_device": t(lambda: set(map(torch.Tensor.get_device, pages))),
    "is_contiguous": t(lambda: all(map(torch.Tensor.is_contiguous, pages))),
    "nbytes": t(lambda: np.fromiter(map(nb, pages), np.int64, 1000)),
    "numel": t(lambda: np.fromiter(map(torch.Tensor.numel, pages), np.int64, 1000)),
    "data_ptr": t(lambda: np.fromiter(map(torch.Tensor.data_ptr, pages), np.int64, 1000)),
    "dim": t(lambda: set(map(torch.Tensor.dim, pages))),
    "dtype": t(lambda: set(map(dt, pages))),
    "size1": t(lambda: set(map(torch.Tensor.size, pages, repeat(1)))),
    "stride0": t(lambda: set(map(torch.Tensor.stride, pages, repeat(0)))),
    "cat_host": t(lambda: torch.cat(pages), 50),
    "build": t(lambda: DocumentList.build(pages, q)),
    "check": t(lambda: DocumentList.build(pages, q).check()),
    "copy_pageable_8KB": t(lambda: torch.from_numpy(np.zeros(1000, np.int64)).to("cuda", non_blocking=True)),
    "copy_pinned_8KB": t(lambda: torch.empty(1000, dtype=torch.int64, pin_memory=True).copy_(torch.from_numpy(np.zeros(1000, np.int64))).to("cuda", non_blocking=True)),
}
torch.cuda.synchronize()
out["host_us"] = host
print(json.dumps(host, indent=0))
json.dump(out, open(sys.argv[1], "w"), indent=1)
