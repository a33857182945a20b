#!/usr/bin/env bash
# Everything a device run needs, in one command from the repository root, all outputs under $OUT:
#   bash benchmarks/device_run.sh [lik bench flags...]      (default flags: --quick, every table)
# 1. installs the peer wheels carried in .whl/ into /tmp/site (no index, no network); without them the peers'
#    columns read n/a and the run says why;
# 2. runs the GPU tests (tools/test_gpu.sh: pytest -m gpu)   -> $OUT/pytest_gpu.log   (LIK_SKIP_TESTS=1: skipped)
# 3. runs the benchmark                                       -> $OUT/results.json, bench.md, bench.log, plots.tar
# The benchmark shares LIK_DEADLINE_S (default 470) seconds less what the tests took between its tables, so one
# call fits the device's 600 s limit; cells left out are listed as skipped in results.json and bench.md.
# The plots are packed into one file (plots.tar: one PNG per table) because a device call returns at most 8 files.
# LIK_COMMIT=<sha> records the commit where the copy has no .git.
set -u
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/pip.log" 2>&1 || echo "peer wheels did not install (see $OUT/pip.log): their columns will read n/a"
export PYTHONPATH=/tmp/site:src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
if [ "${LIK_SKIP_TESTS:-0}" != 1 ]; then
  bash tools/test_gpu.sh > "$OUT/pytest_gpu.log" 2>&1
  echo "pytest -m gpu: exit $? ($(tail -n 1 "$OUT/pytest_gpu.log"))"
fi
[ $# -eq 0 ] && set -- --quick
BUDGET=$(( ${LIK_DEADLINE_S:-470} - SECONDS ))
python3 -u -m lik.bench --time-budget-s "$BUDGET" "$@" --out "$OUT" --plots "$OUT/plots" 2>&1 | tee "$OUT/bench.log"
status=${PIPESTATUS[0]}
if [ -d "$OUT/plots" ]; then
  tar -cf "$OUT/plots.tar" -C "$OUT/plots" . && rm -rf "$OUT/plots"
fi
exit "$status"
