#!/usr/bin/env bash
# The GPU suite and both GPU benchmarks in one go, on a CUDA machine, logs under OUT:
#   bash benchmarks/gpu_all.sh [OUT]
# Order: the op tests (fast), the kernel table, the end-to-end table, then the multi-process
# suite (tests/gpu). Each step has a time limit (seconds, from the environment); STEPS picks
# steps (default: "ops kernel e2e suite"), KERNEL_ARGS and E2E_ARGS pass options to gpu_kernel.py and
# gpu_e2e.py (e.g. E2E_ARGS=--square-flash, KERNEL_ARGS="--sections prefill"), OPS_K and
# SUITE_K select tests (pytest -k). On one
# H200 (2026-11-27) the op tests took over 130 s (Triton compiles every variant) and the suite
# over 400 s: on a borrowed GPU with 10-minute calls, run it in two calls (STEPS).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/gpu}
mkdir -p "$out"
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export PYTHONUNBUFFERED=1
rc=0
steps=" ${STEPS:-ops kernel e2e suite} "
step() {  # step NAME LIMIT LOG CMD...
    [[ $steps == *" $1 "* ]] || return 0
    local limit=$2 log=$3
    shift 3
    timeout "$limit" "$@" 2>&1 | tee "$out/$log" || rc=1
}
step ops "${OPS_TIMEOUT:-300}" ops.log $PY -m pytest -q -rs -p no:cacheprovider tests/ops/test_fused_cuda.py \
    tests/ops/test_triton_attn.py tests/ops/test_no_host_sync.py tests/ops/test_causal_cuda.py -k "${OPS_K:-}"
step kernel "${KERNEL_TIMEOUT:-240}" kernel.md $PY benchmarks/gpu_kernel.py --json "$out/kernel.json" ${KERNEL_ARGS:-}
step e2e "${E2E_TIMEOUT:-300}" e2e.md $PY benchmarks/gpu_e2e.py --json "$out/e2e.json" ${E2E_ARGS:-}
# -v: a line per test as it ends (with -q a long first test leaves the log empty until then)
step suite "${SUITE_TIMEOUT:-600}" suite.log $PY -m pytest -v -rs -p no:cacheprovider tests/gpu -k "${SUITE_K:-}"
exit $rc
