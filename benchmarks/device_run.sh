#!/usr/bin/env bash
# One device call: build the sparse-attention kernels into a ctypes library (plus the topk
# estimate when it compiles), run the atomics microbenchmark, the GPU tests, optionally the
# sanitizer, and the kernel benchmark. Logs under $OUT.
# Usage: benchmarks/device_run.sh "<bench args>" [tests] [sanitizer]
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
BENCH_ARGS=${1:-"--quick"}
STEPS=${2:-"micro tests bench"}
LOG=$OUT/run.log
exec > >(tee -a "$LOG") 2>&1
date -u
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
ARCH="-gencode=arch=compute_90a,code=sm_90a"
FL="-std=c++17 -O3 $ARCH -Xcompiler -fPIC -Icsrc -lineinfo"
B=/tmp/dsvb; mkdir -p $B
t0=$(date +%s)
nvcc $FL -c csrc/cuda/sparse_attention_fwd.cu -o $B/fwd.o &
nvcc $FL -c csrc/cuda/sparse_attention_bwd.cu -o $B/bwd.o &
( nvcc $FL -c csrc/cuda/topk_estimate.cu -o $B/topk.o 2> $B/topk.err || echo "topk build failed" ) &
case "$STEPS" in *micro*) nvcc -O3 $ARCH benchmarks/atomic_microbench.cu -o $B/amb & ;; esac
gcc -O2 -fPIC -Icsrc -c csrc/cpu/status.c -o $B/status.o
wait
echo "build: $(( $(date +%s) - t0 )) s"
LIBOBJ="$B/fwd.o $B/bwd.o $B/status.o"
if [ -f $B/topk.o ]; then
  nvcc -shared $B/fwd.o $B/bwd.o $B/topk.o $B/status.o -o $B/libdsvattn.so -lcudart && \
  python3 -c "import ctypes; ctypes.CDLL('$B/libdsvattn.so')" || \
  nvcc -shared $LIBOBJ -o $B/libdsvattn.so -lcudart
else
  nvcc -shared $LIBOBJ -o $B/libdsvattn.so -lcudart
fi
export DSV_ATTN_LIB=$B/libdsvattn.so
case "$STEPS" in *micro*) $B/amb ;; esac
case "$STEPS" in *tests*)
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_sparse_attention_cuda.py -rf \
     2>&1 | tail -40 > $OUT/tests.log; tail -25 $OUT/tests.log ;;
esac
case "$STEPS" in *sanitizer*) timeout 200 tests/run_sanitizer.sh $OUT/san ;; esac
case "$STEPS" in *bench*)
  timeout 300 python3 benchmarks/bench_kernels.py $BENCH_ARGS --out $OUT/results ;;
esac
case "$STEPS" in *nothing*)
  timeout 120 python3 benchmarks/profile_bwd.py 2>&1 | tail -40 ;;
esac
date -u
