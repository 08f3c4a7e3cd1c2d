#!/usr/bin/env bash
# One device call that validates a tree on the H200: build the extension with CUDA, run the whole
# test suite (CPU and GPU tests), the kernel benchmark at the target shape, and compute-sanitizer.
# Logs and results go under $OUT. Each step has its own time limit so the call ends in time.
#   usage: bash benchmarks/device_session.sh            (carry .dsvwheels for diffusers if present)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
date -u; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
if ls .dsvwheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .dsvwheels/*.whl && export PYTHONPATH=/tmp/site
fi
t0=$(date +%s)
MAX_JOBS=16 DSV_BUILD_CUDA=1 timeout ${BUILD_LIMIT:-240} python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1
rc=$?; echo "build rc=$rc in $(( $(date +%s) - t0 )) s"; [ $rc -eq 0 ] || { tail -40 "$OUT/build.log"; exit 1; }
python3 -c "import dsv_ext; print('CUDA kernels:', dsv_ext.has_cuda_kernels())"
DSV_TEST_FAST=1 timeout ${TEST_LIMIT:-170} python3 -m pytest -q -p no:cacheprovider -rf tests > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20; tail -1 "$OUT/tests.log"
timeout ${BENCH_LIMIT:-90} python3 benchmarks/bench_kernels.py --quick --out "$OUT/results" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; grep -v '^{' "$OUT/bench.log" | tail -12
timeout ${SAN_LIMIT:-90} bash tests/run_sanitizer.sh "$OUT/san"; echo "sanitizer rc=$?"
date -u
