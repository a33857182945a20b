#!/usr/bin/env bash
# The GPU suite (`pytest -m gpu`) spread over every visible GPU: its time is Triton compiling kernels on the CPU,
# so pytest-xdist workers (LIK_GPU_WORKERS, default up to 8 per GPU and one per CPU core) each take one GPU
# (tests/conftest.py; LIK_TEST_GPUS=0,1 limits them to those GPUs). Tests that need two GPUs in one process (marker multi_gpu) run afterwards without workers.
#   PYTHON=.venv/bin/python bash tools/test_gpu.sh [pytest args...]
set -u
PYTHON=${PYTHON:-python3}
gpus=${LIK_TEST_GPUS:-$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | paste -sd, -)}
if [ -z "$gpus" ]; then
  echo "tools/test_gpu.sh: no NVIDIA GPU visible (nvidia-smi lists none)" >&2
  exit 2
fi
n_gpus=$(( $(tr -cd , <<<"$gpus" | wc -c) + 1 ))
workers=${LIK_GPU_WORKERS:-$(( $(nproc) < 8 * n_gpus ? $(nproc) : 8 * n_gpus ))}
if [ "$workers" -gt 1 ]; then
  LIK_TEST_GPUS=$gpus "$PYTHON" -m pytest -q -p no:cacheprovider -m "gpu and not multi_gpu" -n "$workers" "$@"
else
  "$PYTHON" -m pytest -q -p no:cacheprovider -m "gpu and not multi_gpu" "$@"
fi
first=$?
"$PYTHON" -m pytest -q -p no:cacheprovider -m "gpu and multi_gpu" "$@"
second=$?
# pytest exits 5 when a selection is empty (a run limited to files without multi-GPU tests)
[ "$second" -eq 5 ] && second=0
exit $(( first != 0 ? first : second ))
