#!/usr/bin/env bash
# The GPU suite (`pytest -m gpu`) spread over the visible GPUs: its time is Triton compiling kernels on the CPU, so
# pytest-xdist workers each take one GPU (tests/conftest.py). The GPUs are LIK_TEST_GPUS, else CUDA_VISIBLE_DEVICES,
# else all that nvidia-smi lists; workers LIK_GPU_WORKERS, else up to 8 per GPU and one per CPU core. Tests that
# need two GPUs in one process (marker multi_gpu) run afterwards without workers.
#   PYTHON=.venv/bin/python bash tools/test_gpu.sh [pytest args...]
set -u
PYTHON=${PYTHON:-python3}
listed=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | paste -sd, -)
gpus=${LIK_TEST_GPUS:-${CUDA_VISIBLE_DEVICES:-$listed}}
if [ -z "$gpus" ]; then
  echo "tools/test_gpu.sh: no NVIDIA GPU visible (nvidia-smi lists none)" >&2
  exit 2
fi
n_gpus=$(( $(tr -cd , <<<"$gpus" | wc -c) + 1 ))
workers=${LIK_GPU_WORKERS:-$(( $(nproc) < 8 * n_gpus ? $(nproc) : 8 * n_gpus ))}
if [ "$workers" -gt 1 ]; then
  LIK_TEST_GPUS=$gpus "$PYTHON" -m pytest -q -p no:cacheprovider -m "gpu and not multi_gpu" -n "$workers" "$@"
else
  CUDA_VISIBLE_DEVICES=$gpus "$PYTHON" -m pytest -q -p no:cacheprovider -m "gpu and not multi_gpu" "$@"
fi
first=$?
CUDA_VISIBLE_DEVICES=$gpus "$PYTHON" -m pytest -q -p no:cacheprovider -m "gpu and multi_gpu" "$@"
second=$?
# pytest exits 5 when its selection is empty: fine for one pass (arguments naming only some tests), not for both
if [ "$first" -eq 5 ] && [ "$second" -eq 5 ]; then exit 5; fi
[ "$first" -eq 5 ] && first=0
[ "$second" -eq 5 ] && second=0
exit $(( first != 0 ? first : second ))
