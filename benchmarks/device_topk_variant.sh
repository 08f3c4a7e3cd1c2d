#!/usr/bin/env bash
# One device call for the sampled-threshold top-K variant (csrc/dev/topk_sampled.cu): build a
# ctypes library of it with csrc/cuda/{tuning,predictor_loss,profile_attention,rows}.cu (it exports the
# variant as dsv_topk_estimate_cuda, the folded one as dsv_dev_topk_estimate_fold_cuda and the
# shipped kernel as dsv_dev_topk_estimate_shipped_cuda), then
#   tests     the topk GPU tests through it (DSV_OPS_LIB: the variant in the shipped kernel's
#             place) and tests/test_topk_sampled_cuda.py (variants == shipped, entry for entry);
#   bench     benchmarks/topk_variant.py (the three kernels in one process, lists compared) and
#             benchmarks/bench_topk.py through the variant;
#   sanitizer compute-sanitizer memcheck / racecheck on the variant's GPU tests.
# Logs under $OUT.  Usage: benchmarks/device_topk_variant.sh "<steps>"  (default "tests bench")
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${1:-"tests bench"}
exec > >(tee -a "$OUT/topk_variant_run.log") 2>&1
date -u
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
ARCH="-gencode=arch=compute_90a,code=sm_90a"
t0=$(date +%s)
B=/tmp/tks; mkdir -p $B
# wait on the build jobs by id: a bare `wait` also waits for the tee above and never returns
nvcc -std=c++17 -O3 --expt-relaxed-constexpr $ARCH -DDSV_WGMMA -Xcompiler -fPIC -Icsrc -lineinfo \
  -c csrc/dev/topk_sampled.cu -o $B/topk_sampled.o & pids=$!
for f in tuning predictor_loss profile_attention rows; do
  nvcc -std=c++17 -O3 $ARCH -Xcompiler -fPIC -Icsrc -lineinfo -c csrc/cuda/$f.cu -o $B/$f.o & pids="$pids $!"
done
wait $pids
nvcc -shared $B/*.o -o $B/libtopk_sampled.so -lcudart || { echo "build failed"; exit 1; }
echo "lib: $B/libtopk_sampled.so ($(( $(date +%s) - t0 )) s)"
export DSV_TOPK_VARIANT_LIB=$B/libtopk_sampled.so
case "$STEPS" in *tests*)
  DSV_OPS_LIB=$DSV_TOPK_VARIANT_LIB timeout 150 python3 -m pytest -q -p no:cacheprovider -rfs \
    tests/test_topk_estimate.py tests/test_topk_estimate_cuda.py > "$OUT/t_topk_as_ops.log" 2>&1
  echo "topk tests through the variant rc=$? $(tail -1 $OUT/t_topk_as_ops.log)"
  grep -E "^(FAILED|ERROR)|^E  " "$OUT/t_topk_as_ops.log" | head -12
  timeout 200 python3 -m pytest -q -p no:cacheprovider -rfs tests/test_topk_sampled_cuda.py \
    tests/test_topk_sampled_rule.py > "$OUT/t_topk_sampled.log" 2>&1
  echo "test_topk_sampled_cuda rc=$? $(tail -1 $OUT/t_topk_sampled.log)"
  grep -E "^(FAILED|ERROR)|^E  " "$OUT/t_topk_sampled.log" | head -12 ;;
esac
case "$STEPS" in *bench*)
  timeout 200 python3 benchmarks/topk_variant.py --shapes 65536:0.1,65536:0.05,131072:0.2,32768:0.1 \
    --heads 24 --group 64 --json "$OUT/topk_variant.json"
  echo "topk_variant rc=$?"
  timeout 120 python3 benchmarks/topk_variant.py --shapes 65536:0.1 --heads 24 --group 64 \
    --patterns sample_up,sample_down,few,periodic --reps 5 --json "$OUT/topk_variant_adv.json"
  echo "topk_variant (adversarial inputs) rc=$?"
  DSV_OPS_LIB=$DSV_TOPK_VARIANT_LIB timeout 120 python3 benchmarks/bench_topk.py \
    --shapes 65536:0.1,65536:0.05,131072:0.2 --heads 24 --group 64 --json "$OUT/bench_topk_sampled.json" ;;
esac
case "$STEPS" in *sanitizer*)
  for tool in memcheck racecheck; do
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 200 compute-sanitizer --tool $tool --kernel-name kns=dsv_tks \
      --error-exitcode 99 python3 -m pytest -q -p no:cacheprovider -x tests/test_topk_sampled_cuda.py \
      -k "edge or B1_S4100 or S250 or tied" > "$OUT/san_tks_$tool.log" 2>&1
    echo "sanitizer $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $OUT/san_tks_$tool.log | tail -1)"
  done ;;
esac
echo "total $(( $(date +%s) - t0 )) s"
date -u
