#!/usr/bin/env bash
# One device call: build the sparse-attention kernels into a ctypes library (plus the topk
# estimate when it compiles), run the atomics microbenchmark, the GPU tests, optionally the
# sanitizer, and the kernel benchmark. Logs under $OUT.
# Usage: benchmarks/device_run.sh "<bench args>" "<steps: micro tests sanitizer bench>"
# (No process substitution: `wait` would wait for it too and never return.)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
BENCH_ARGS=${1:-"--quick"}
STEPS=${2:-"micro tests bench"}
date -u
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
ARCH="-gencode=arch=compute_90a,code=sm_90a"
FL="-std=c++17 -O3 $ARCH -Xcompiler -fPIC -Icsrc -lineinfo --split-compile=0"
B=/tmp/dsvb; mkdir -p $B
t0=$(date +%s)
timeout 150 nvcc $FL -c csrc/cuda/sparse_attention_fwd.cu -o $B/fwd.o & p1=$!
timeout 150 nvcc $FL -c csrc/cuda/sparse_attention_bwd.cu -o $B/bwd.o & p2=$!
timeout 150 nvcc $FL -c csrc/cuda/topk_estimate.cu -o $B/topk.o 2> $B/topk.err & p3=$!
p4=$p3
case "$STEPS" in *micro*) timeout 100 nvcc -O3 $ARCH benchmarks/atomic_microbench.cu -o $B/amb & p4=$! ;; esac
gcc -O2 -fPIC -Icsrc -c csrc/cpu/status.c -o $B/status.o
wait $p1 $p2 $p3 $p4
echo "build: $(( $(date +%s) - t0 )) s"
LIBOBJ="$B/fwd.o $B/bwd.o $B/status.o"
if [ -s $B/topk.o ] && nvcc -shared $LIBOBJ $B/topk.o -o $B/libdsvattn.so -lcudart && \
   python3 -c "import ctypes; ctypes.CDLL('$B/libdsvattn.so')"; then
  echo "lib: attention + topk"
else
  echo "lib: attention only"; nvcc -shared $LIBOBJ -o $B/libdsvattn.so -lcudart
fi
export DSV_ATTN_LIB=$B/libdsvattn.so
case "$STEPS" in *micro*) timeout 30 $B/amb ;; esac
case "$STEPS" in *tests*)
  timeout ${TEST_TIMEOUT:-90} python3 -m pytest -q -p no:cacheprovider tests/test_sparse_attention_cuda.py -rf --maxfail=5 \
     > $OUT/tests.log 2>&1; tail -15 $OUT/tests.log ;;
esac
case "$STEPS" in *sanitizer*) timeout 200 tests/run_sanitizer.sh $OUT/san ;; esac
case "$STEPS" in *bench*)
  timeout ${BENCH_TIMEOUT:-120} python3 benchmarks/bench_kernels.py $BENCH_ARGS --out $OUT/results 2>&1 | tee $OUT/bench.log | grep -v '^{' ;;
esac
date -u
