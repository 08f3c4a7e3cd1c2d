#!/usr/bin/env bash
# One device call for the non-attention CUDA ops (topk estimate, predictor loss, profile, rows):
# load (or build) a ctypes library of csrc/cuda/{topk_estimate,tuning,predictor_loss,profile_attention,
# rows}.cu, run their GPU tests through it, time the top-K estimation, optionally run
# compute-sanitizer on their small-shape section, and (in the background) try the full
# extension build to run the tests through torch.ops.dsv as well. Logs under $OUT.
# Usage: benchmarks/device_run_ops.sh "<steps>"   steps: any of tests bench sanitizer ext
# Carry .dsvops (a prebuilt ctypes library, libdsvops.so) to skip the builds.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${1:-"tests bench"}
exec > >(tee -a "$OUT/ops_run.log") 2>&1
date -u
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
ARCH="-gencode=arch=compute_90a,code=sm_90a"
t0=$(date +%s)
case "$STEPS" in *ext*)
  ( MAX_JOBS=16 timeout 420 pip install --no-build-isolation --no-deps -e . > "$OUT/ext_build.log" 2>&1;
    echo "ext build rc=$?" >> "$OUT/ext_build.log" ) &
  EXT_PID=$! ;;
esac
LIB=.dsvops/libdsvops.so
if ! python3 -c "import ctypes; ctypes.CDLL('$LIB')" 2>/dev/null; then
  echo "prebuilt $LIB unusable: building here"
  B=/tmp/dsvops; mkdir -p $B
  for f in topk_estimate tuning predictor_loss profile_attention rows; do
    nvcc -std=c++17 -O3 $ARCH -Xcompiler -fPIC -Icsrc -lineinfo -c csrc/cuda/$f.cu -o $B/$f.o &
  done
  wait
  nvcc -shared $B/*.o -o $B/libdsvops.so -lcudart && LIB=$B/libdsvops.so
fi
echo "lib: $LIB ($(( $(date +%s) - t0 )) s)"
export DSV_OPS_LIB=$(readlink -f $LIB)
case "$STEPS" in *tests*)
  for f in topk_estimate rows predictor_loss profile_attention; do
    timeout 100 python3 -m pytest -q -p no:cacheprovider -rfs tests/test_${f}.py tests/test_${f}_cuda.py \
      > "$OUT/t_$f.log" 2>&1
    echo "test_${f}_cuda rc=$? $(tail -1 $OUT/t_$f.log)"
    grep -E "^(FAILED|ERROR)|^E  " "$OUT/t_$f.log" | head -12
  done ;;
esac
case "$STEPS" in *bench*)
  timeout 150 python3 benchmarks/bench_topk.py --shapes 65536:0.1,131072:0.2,32768:0.1,65536:0.05 \
    --heads 24 --group 64 --other-ops 65536:4096:128 --json "$OUT/bench_topk.json" ;;
esac
case "$STEPS" in *sanitizer*)
  for tool in memcheck racecheck; do
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 100 compute-sanitizer --tool $tool --kernel-name kns=dsv_ --error-exitcode 99 \
      python3 -c "import sys; sys.path.insert(0, 'tests'); import sanitizer_driver as d; d.run_ops_kernels()" \
      > "$OUT/san_$tool.log" 2>&1
    echo "sanitizer $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $OUT/san_$tool.log | tail -1)"
  done ;;
esac
case "$STEPS" in *ext*)
  wait $EXT_PID; tail -3 "$OUT/ext_build.log"
  if python3 -c "import dsv_ext, sys; sys.exit(0 if dsv_ext.ops.has_cuda_kernels() else 1)"; then
    DSV_OPS_LIB= timeout 120 python3 -m pytest -q -p no:cacheprovider -rfs tests/test_topk_estimate*.py \
      tests/test_rows*.py tests/test_predictor_loss*.py tests/test_profile_attention*.py \
      > "$OUT/ops_tests_ext.log" 2>&1
    echo "ext tests rc=$?"; tail -2 "$OUT/ops_tests_ext.log"
  fi ;;
esac
echo "total $(( $(date +%s) - t0 )) s"
date -u
