#!/usr/bin/env bash
# compute-sanitizer over a small-shape run of every CUDA op (tests/sanitizer_driver.py):
#   memcheck   every section but the fuzz matrix
#   racecheck  the same sections (shared-memory races)
#   fuzz       memcheck over the bad-input / edge-case fuzz matrix of tests/fuzz_worker.py on
#              CUDA tensors (every public and raw op, both seeds of tests/test_fuzz.py), plus the
#              deterministic backward; the driver also fails when a case fails its own check
#   paths      memcheck over the sparse attention section once per DSV_KERNEL_TUNING setting that
#              forces a backward path (query-major with 1 / 3 key ranges (also under racecheck:
#              the line reductions' slabs), the automatic ranges, its 64-row pass on mma.sync,
#              key-major; mma.sync instead of wgmma; the key-major dK / dV pass on mma.sync, or
#              on wgmma for 16-key block lists too;
#              merged groups everywhere their lists allow,
#              with 1 / 3 key ranges, with several builder windows, and under racecheck; the
#              forward at D 256 on mma.sync, wg256=0, under both tools), the
#              tuning being read once per process; the
#              settings of wgmma / km_wgmma also rerun the block-list section; tk_gpw=16 (the
#              top-K estimation with 16 groups per warp: the small shapes take 8 by default)
#              runs the ops section under memcheck and racecheck, tk_sample=0 (radix passes
#              only) under memcheck, tk_split=2 (clusters of two CTAs, distributed shared
#              memory) under memcheck and racecheck, tk_split=4 / 8 (clusters of four under
#              memcheck, of eight under racecheck), tk_band=2 (the band pass without its
#              histogram, built from the stored keys) under both, and in clusters,
#              tk_compact=1 with tk_band=2 (the compaction from the band pass's key masks, its
#              staged list stores: the driver's 32k case takes that path) under both
# Needs a GPU (Firecracker machines: sanitizer works; gVisor: not).
# Usage: tests/run_sanitizer.sh [logdir] [steps...]   (default steps: memcheck racecheck fuzz;
#        `tests/run_sanitizer.sh /tmp/san fuzz` runs only the fuzz matrix under memcheck)
#        env SAN_PATHS="tk_split=2 racecheck:tk_split=2" limits the `paths` step to those settings
# Exit status 0 only when every step reports 0 errors and the driver exits 0.
set -u
cd "$(dirname "$0")/.."
LOG=${1:-/tmp/dsv_sanitizer}
shift || true
STEPS=${*:-memcheck racecheck fuzz paths}
mkdir -p "$LOG"
PY=${PYTHON:-python3}
# precise bounds: every tensor its own cudaMalloc
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
status=0
for step in $STEPS; do
  case $step in
    memcheck) tool=memcheck; extra="--leak-check no"; only=""; skip="fuzz";;
    racecheck) tool=racecheck; extra="--racecheck-report all"; only=""; skip="fuzz";;
    fuzz) tool=memcheck; extra="--leak-check no"; only="fuzz"; skip="";;
    paths)
      for t in ${SAN_PATHS:-km_ratio=0,bwd_ranges=1 km_ratio=0,bwd_ranges=3 km_ratio=0,bwd_rmax=4 \
               km_ratio=0,qm_wgmma=0 racecheck:km_ratio=0,bwd_ranges=3 \
               km_ratio=1e9,bwd_ranges=1 km_ratio=0,wgmma=0 km_ratio=1e9,wgmma=0 \
               km_ratio=1e9,bwd_ranges=1,km_wgmma=1 km_ratio=1e9,bwd_ranges=1,km_wgmma=2 \
               km_ratio=0,merge=1,bwd_ranges=1 km_ratio=0,merge=1,bwd_ranges=3 \
               km_ratio=0,merge=1,merge_window=64 racecheck:km_ratio=0,merge=1 \
               wg256=0 racecheck:wg256=0 \
               tk_gpw=16 racecheck:tk_gpw=16 tk_sample=0 tk_split=2 racecheck:tk_split=2 tk_split=4 racecheck:tk_split=8 \
               tk_band=2 racecheck:tk_band=2 tk_band=2,tk_split=2 tk_compact=1,tk_band=2,tk_split=1 \
               racecheck:tk_compact=1,tk_band=2,tk_split=1}; do
        sec=sparse_attention tool=memcheck extra="--leak-check no"
        case $t in *wgmma=*) sec=sparse_attention,kv_blocks;; esac
        case $t in *tk_gpw=*|tk_sample=*|*tk_split=*|*tk_band=*|*tk_compact=*) sec=ops_kernels;; esac
        case $t in racecheck:*) tool=racecheck extra="--racecheck-report all";; esac
        DSV_KERNEL_TUNING=${t#racecheck:} DSV_SANITIZER_SECTIONS=$sec \
          compute-sanitizer --tool $tool $extra --error-exitcode 99 \
          "$PY" tests/sanitizer_driver.py >"$LOG/paths_$t.log" 2>&1
        rc=$?
        summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$LOG/paths_$t.log" | tail -1)
        echo "sanitizer paths ($t): rc=$rc ${summary:-no summary line}"
        [ $rc -ne 0 ] && status=1
      done
      continue;;
    *) echo "unknown step $step (memcheck, racecheck, fuzz, paths)"; exit 2;;
  esac
  DSV_SANITIZER_SECTIONS=$only DSV_SANITIZER_SKIP=$skip \
    compute-sanitizer --tool "$tool" $extra --error-exitcode 99 \
    "$PY" tests/sanitizer_driver.py >"$LOG/$step.log" 2>&1
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$LOG/$step.log" | tail -1)
  echo "sanitizer $step: rc=$rc ${summary:-no summary line}"
  [ $rc -ne 0 ] && status=1
done
exit $status
