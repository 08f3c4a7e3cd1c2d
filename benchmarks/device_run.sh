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
# the extension's flags (setup.py): DSV_WGMMA, else the library's tuning has wgmma=0 (mma.sync only)
FL="-std=c++17 -O3 $ARCH --expt-relaxed-constexpr -DDSV_WGMMA -Xcompiler -fPIC -Icsrc -lineinfo --split-compile=0"
B=/tmp/dsvb; mkdir -p $B
t0=$(date +%s)
# the attention library: forward, the backward's files and the per-device tuning, one job each
pids=""
for f in csrc/cuda/sparse_attention_*.cu csrc/cuda/tuning.cu; do
  timeout 300 nvcc $FL -c $f -o $B/attn_$(basename $f .cu).o & pids="$pids $!"
done
timeout 150 nvcc $FL -c csrc/cuda/topk_estimate.cu -o $B/topk.o 2> $B/topk.err & p3=$!
p4=$p3
case "$STEPS" in *micro*) timeout 100 nvcc -O3 $ARCH csrc/dev/atomic_microbench.cu -o $B/amb & p4=$! ;; esac
gcc -O2 -fPIC -Icsrc -c csrc/cpu/status.c -o $B/status.o
wait $pids $p3 $p4
echo "build: $(( $(date +%s) - t0 )) s"
LIBOBJ="$(ls $B/attn_*.o) $B/status.o"
if [ -s $B/topk.o ] && nvcc -shared $LIBOBJ $B/topk.o -o $B/libdsvattn.so -lcudart && \
   python3 -c "import ctypes; ctypes.CDLL('$B/libdsvattn.so')"; then
  echo "lib: attention + topk"
else
  echo "lib: attention only"; nvcc -shared $LIBOBJ -o $B/libdsvattn.so -lcudart
fi
export DSV_ATTN_LIB=$B/libdsvattn.so
case "$STEPS" in *micro*) timeout 30 $B/amb ;; esac
case "$STEPS" in *tests*)
  timeout ${TEST_TIMEOUT:-90} python3 -m pytest -q -p no:cacheprovider tests/test_sparse_attention.py tests/test_sparse_attention_cuda.py -rf --maxfail=5 \
     > $OUT/tests.log 2>&1; tail -15 $OUT/tests.log ;;
esac
case "$STEPS" in *sanitizer*) timeout 200 tests/run_sanitizer.sh $OUT/san ;; esac
case "$STEPS" in *bench*)
  timeout ${BENCH_TIMEOUT:-120} python3 benchmarks/bench_kernels.py $BENCH_ARGS --out $OUT/results 2>&1 | tee $OUT/bench.log | grep -v '^{' ;;
esac
date -u
