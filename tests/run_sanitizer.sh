#!/usr/bin/env bash
# compute-sanitizer memcheck + racecheck over a small-shape run of every CUDA op
# (tests/sanitizer_driver.py); memcheck also over the bad-input fuzz matrix on CUDA tensors
# (its run_fuzz section; racecheck skips it: it adds no new kernels, only inputs).
# Needs a GPU (Firecracker machines: sanitizer works; gVisor: not).
# Usage: tests/run_sanitizer.sh [logdir]   -- exit status 0 only when both tools report 0 errors
#        and every fuzz case passed its check (the driver's exit status).
set -u
cd "$(dirname "$0")/.."
LOG=${1:-/tmp/dsv_sanitizer}
mkdir -p "$LOG"
PY=${PYTHON:-python3}
# precise bounds: every tensor its own cudaMalloc
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
status=0
for tool in memcheck racecheck; do
  extra=""
  [ "$tool" = memcheck ] && extra="--leak-check no"
  [ "$tool" = racecheck ] && extra="--racecheck-report all"
  skip=""
  [ "$tool" = racecheck ] && skip="fuzz"
  DSV_SANITIZER_SKIP=$skip compute-sanitizer --tool "$tool" $extra --error-exitcode 99 \
    "$PY" tests/sanitizer_driver.py >"$LOG/$tool.log" 2>&1
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$LOG/$tool.log" | tail -1)
  echo "sanitizer $tool: rc=$rc ${summary:-no summary line}"
  [ $rc -ne 0 ] && status=1
done
exit $status
