"""``lik bench`` with one more method: the bare float8 long-query loop, timed in the benchmark's own rounds (GPU).

The bare loop (``tokens_as_rows_probe.probe`` in lik's orientation, ``probe_harness.bare_page_max``) is lik's
float8 tile loop with none of its features: a 2-D grid, contiguous rows, no masks, whole 128-token tiles only. It
is the fastest float8 schedule measured for a long query in Triton, so its time in the same rounds as lik's fp16
and fp8 methods (same rotation, same input sets, same thermal history) is the ceiling of what lik's fp8 launch
could reach there. It runs only where it applies: one 2-D query of a multiple of 128 tokens against documents of
a multiple of 128 tokens (``forward/visual``, ``forward/colpali``). Same flags as ``benchmarks/run.py``::

    PYTHONPATH=/tmp/site:src:benchmarks python3 benchmarks/run_with_bare_loop.py --suite forward \\
        --shapes forward/visual,forward/colpali --methods lik,lik-fp8,bare-fp8-loop --rounds 6 --out $OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from lik.bench import main, methods  # noqa: E402


def _prepare(shape, Q: torch.Tensor, D: torch.Tensor) -> tuple:
    import lik

    D_q, d_scale = lik.quantize(D, torch.float8_e4m3fn)
    Q_q, q_scale = lik.quantize(Q, torch.float8_e4m3fn)
    return Q_q, D_q, q_scale, d_scale


def _build(shape):
    from tokens_as_rows_probe import probe

    return lambda Q_q, D_q, q_scale, d_scale: probe(Q_q, q_scale, D_q, d_scale, False)


BARE_FP8_LOOP = methods.Method(
    "bare-fp8-loop", ("forward",), _build, needs_cuda=True, storage="fp8", prepare=_prepare,
    applies=lambda shape: shape.nq == 1 and shape.lq % 128 == 0 and shape.ld % 128 == 0,
)

if __name__ == "__main__":
    methods.METHODS = (*methods.METHODS, BARE_FP8_LOOP)
    sys.exit(main(sys.argv[1:]))
