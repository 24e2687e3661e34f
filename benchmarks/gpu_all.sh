#!/usr/bin/env bash
# The GPU suite and both GPU benchmarks in one go (a CUDA machine; OUT=dir for the logs).
#   bash benchmarks/gpu_all.sh [OUT]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/gpu}
mkdir -p "$out"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
rc=0
timeout ${SUITE_TIMEOUT:-360} $PY -m pytest -q -rs -p no:cacheprovider tests/gpu tests/ops/test_fused_cuda.py \
    tests/ops/test_triton_attn.py tests/ops/test_no_host_sync.py 2>&1 | tee "$out/suite.log" || rc=1
timeout ${BENCH_TIMEOUT:-200} $PY benchmarks/gpu_kernel.py --json "$out/kernel.json" 2>&1 | tee "$out/kernel.md" || rc=1
timeout ${BENCH_TIMEOUT:-200} $PY benchmarks/gpu_e2e.py --json "$out/e2e.json" 2>&1 | tee "$out/e2e.md" || rc=1
exit $rc
