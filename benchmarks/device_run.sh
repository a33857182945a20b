#!/usr/bin/env bash
# Everything a device run needs, in one command from the repository root, all outputs under $OUT:
#   bash benchmarks/device_run.sh [lik bench flags...]      (default flags: --suite all)
# 1. installs the peer wheels carried in .whl/ into /tmp/site (no index, no network);
# 2. runs the GPU tests (tools/test_gpu.sh: pytest -m gpu)  -> $OUT/pytest_gpu.log
# 3. runs the benchmark                                      -> $OUT/results.json, table.txt, bench.png, bench.log
# Set LIK_SKIP_TESTS=1 to skip step 2, LIK_COMMIT=<sha> to record the commit where the copy has no .git.
# The benchmark starts no new shape once LIK_DEADLINE_S (default 500) seconds of this script have passed, so
# one call fits the device's 600 s limit; shapes left out are listed as skipped in results.json.
set -u
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/pip.log" 2>&1 || echo "peer wheels did not install (see $OUT/pip.log); peers will be recorded as unavailable"
export PYTHONPATH=/tmp/site:src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
if [ "${LIK_SKIP_TESTS:-0}" != 1 ]; then
  bash tools/test_gpu.sh > "$OUT/pytest_gpu.log" 2>&1
  echo "pytest -m gpu: exit $? ($(tail -n 1 "$OUT/pytest_gpu.log"))"
fi
[ $# -eq 0 ] && set -- --suite all
BUDGET=$(( ${LIK_DEADLINE_S:-500} - SECONDS ))
python3 -u benchmarks/run.py --time-budget-s "$BUDGET" "$@" --out "$OUT" 2>&1 | tee "$OUT/bench.log"
exit "${PIPESTATUS[0]}"
