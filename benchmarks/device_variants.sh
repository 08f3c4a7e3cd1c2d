#!/usr/bin/env bash
# One short device call that tests and times the kernel variants selectable at run time
# (DSV_TOPK_TWO_PHASE, DSV_ATTN_FWD_TILE / DSV_ATTN_BWD_TILE = 32x2), so that defaults can be
# chosen from measurements: each variant's GPU tests run with it switched on, then its timing.
# Needs .devso from benchmarks/build_devso.sh (carry ".devso").
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [ "$(cat .devso/csrc.sha256 2>/dev/null)" != "$(bash benchmarks/csrc_hash.sh)" ]; then
  echo ".devso is missing or was built from another csrc/: run benchmarks/build_devso.sh"; exit 1
fi
cp .devso/_C.abi3.so dsv_ext/
python3 -c "import dsv_ext, sys; sys.exit(0 if dsv_ext.has_cuda_kernels() else 1)" || { echo "no CUDA kernels"; exit 1; }
P="python3 -m pytest -q -p no:cacheprovider -x"
timeout 40 $P tests/test_topk_estimate_cuda.py > "$OUT/topk_default_tests.log" 2>&1
echo "topk default tests rc=$?: $(tail -1 "$OUT/topk_default_tests.log")"
DSV_TOPK_TWO_PHASE=1 timeout 40 $P tests/test_topk_estimate_cuda.py > "$OUT/topk_two_phase_tests.log" 2>&1
echo "topk two-phase tests rc=$?: $(tail -1 "$OUT/topk_two_phase_tests.log")"
timeout 40 python3 benchmarks/topk_variants.py 2>&1 | tee "$OUT/topk_variants.log"
DSV_ATTN_FWD_TILE=32x2 DSV_ATTN_BWD_TILE=32x2 timeout 60 $P tests/test_sparse_attention_cuda.py > "$OUT/attn_32x2_tests.log" 2>&1
echo "attention 32x2 tests rc=$?: $(tail -1 "$OUT/attn_32x2_tests.log")"
timeout 70 python3 benchmarks/bench_kernels.py --reps 3 --no-variants --dense cudnn --S 65536 --D 128 --G 32 64 \
  --sparsity 0.9 --dist random --tile-sweep --out "$OUT/sweep" > "$OUT/sweep.log" 2>&1
echo "sweep rc=$?"; grep -E "sweep|TILE|^65536" "$OUT/sweep.log"
timeout 30 python3 benchmarks/profile_sparse_core.py > "$OUT/profile_core.log" 2>&1; echo "profile rc=$?"; head -20 "$OUT/profile_core.log"
