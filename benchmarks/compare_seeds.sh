#!/usr/bin/env bash
# The multi-seed comparison (python -m dsv_ext.app.compare --seeds N) with the seeds trained side by
# side: one compare process per seed, each into $RUN/seed<S> (seed i on GPU i mod the number of
# GPUs), then the statistics over the seeds (compare_seeds.md / .json). Processes that share a
# GPU share its time, so their tokens/s are not a speed measurement (speed: a run alone, or
# benchmarks/bench_train.py). Resumable: when the time
# runs out each seed stops with its checkpoints; call again (same machine, $RUN kept) to continue.
#   usage: bash benchmarks/compare_seeds.sh
#   carry: .devso (a prebuilt extension, benchmarks/build_devso.sh) and, without network, a folder
#          of the PyAV and scikit-video wheels named by WHEELS (default .dsvwheels)
#   env:   SEEDS ("0 1 2"), CONFIG (configs/small-video.yaml), RUN (runs/compare-seeds),
#          CALL_S seconds this call may take in all (590), ARGS more compare arguments
#          (e.g. "--val-videos 48"), DEVICE (one device for all seeds; default: spread over the
#          GPUs), DSV_COMMIT the commit to record
# $OUT gets compare-seeds.tgz (the run folder without checkpoints) and one log per seed.
set -u
t0=$(date +%s)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CONFIG=${CONFIG:-configs/small-video.yaml}
RUN=${RUN:-runs/compare-seeds}
SEEDS=${SEEDS:-"0 1 2"}
WHEELS=${WHEELS:-.dsvwheels}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD DSV_EXT_CACHE=${DSV_EXT_CACHE:-$PWD/runs/cache}
date -u; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null
. benchmarks/device_ext.sh
python3 -c "import av, importlib.util as u, sys; sys.exit(u.find_spec('skvideo') is None)" 2>/dev/null ||
  wheels "$WHEELS"
ensure_ext || exit 1
python3 -c "import dsv_ext; print('CUDA kernels:', dsv_ext.has_cuda_kernels())"
# decode the clips once, before the seeds start side by side
python3 -c "from dsv_ext.app.common import load_config; from dsv_ext.app.data import make_dataset as m; c = load_config('$CONFIG')['data']; m(c, 'train'); m(c, 'val')" || true
left=$(( ${CALL_S:-590} - ($(date +%s) - t0) - 60 ))
echo "training budget of this call: $left s, seeds $SEEDS, run folder $RUN"
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU"); [ "${ngpu:-0}" -ge 1 ] || ngpu=1
n=0
for s in $SEEDS; do  # seeds must be consecutive from the config's train.seed (compare --seeds)
  dev=${DEVICE:-cuda:$((n % ngpu))}  # several GPUs: the seeds spread over them
  python3 -m dsv_ext.app.compare --config "$CONFIG" --device "$dev" --out "$RUN/seed$s" \
    --set train.seed=$s --samples 0 --resume --time-limit "$left" --no-progress ${ARGS:-} \
    > "$OUT/seed$s.log" 2>&1 &
  n=$((n + 1))
done
wait
for s in $SEEDS; do echo "seed $s:"; grep -v "^\s*$" "$OUT/seed$s.log" | tail -4; done
done=1; for s in $SEEDS; do [ -f "$RUN/seed$s/compare.json" ] || done=0; done
if [ $done = 1 ]; then  # every seed finished: only the statistics are computed, nothing is trained
  python3 -m dsv_ext.app.compare --config "$CONFIG" --device "${DEVICE:-cuda}" --out "$RUN" --seeds $n \
    --samples 0 --resume --no-progress ${ARGS:-} > "$OUT/seeds.log" 2>&1
  cat "$RUN/compare_seeds.md"; echo complete
else echo "not complete: run this script again"; fi
tar czf "$OUT/compare-seeds.tgz" --exclude='*.pt' --exclude='*.tmp' -C "$(dirname "$RUN")" "$(basename "$RUN")"
date -u
