#!/usr/bin/env bash
# One GPU call for a csrc/dev/ attention variant: build it and the shipped kernels
# (csrc/cuda/sparse_attention_*.cu + tuning.cu) into two ctypes libraries (benchmarks/
# build_devvar.sh; a .devvar/ built beforehand from the same csrc/ is used), run the attention GPU
# tests with DSV_ATTN_LIB = the variant (the variant's own test file, the first of the test files,
# also on the query-major path only and with key ranges), then time both with bench_kernels.py in
# the same
# process order (shipped, variant) and print the forward / backward side by side. Logs and the
# two benchmark JSONs under $OUT.
# Usage: benchmarks/device_variant.sh [variant.cu] [bench args] [test files]
#   default: csrc/dev/attn_fwd_pairs.cu, S = 64k, H = 24, D = 128, G = 32 and 64, sparsity 0.9,
#   random and smooth lists; tests/test_attn_fwd_pairs_cuda.py + tests/test_sparse_attention*.py
#   ("" as the third argument skips the tests). About 8-9 min in all: give the call 600 s.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
VAR=${1:-csrc/dev/attn_fwd_pairs.cu}
BENCH=${2:-"--S 65536 --D 128 --G 32 64 --sparsity 0.9 --dist random smooth --dense cudnn"}
TESTS=${3-"tests/test_attn_fwd_pairs_cuda.py tests/test_sparse_attention.py tests/test_sparse_attention_cuda.py"}
OWN=${TESTS%% *} # the variant's own test file
case "$VAR" in # the variant's kernels in the ptxas summary
  *attn_fwd_pairs*) KPAT=pair ;;
  *) KPAT=${KPAT:-dev} ;;
esac
date -u
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
B=/tmp/dsvvar; mkdir -p $B
t0=$(date +%s)
# the libraries: prebuilt in .devvar/ when carried (benchmarks/build_devvar.sh; same csrc hash),
# else built here
bash benchmarks/build_devvar.sh "$VAR" > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
name=$(basename "$VAR" .cu)
cp .devvar/ship.so $B/ship.so && cp .devvar/$name.so $B/variant.so || exit 1
cp .devvar/${name}_ptxas.log $OUT/variant_ptxas.log 2>/dev/null
echo "build: $(( $(date +%s) - t0 )) s"
awk '/Compiling entry function/ {k = $7} /spill stores/ {sp = $5 " spill stores"}
     /Used [0-9]+ registers/ && k ~ pat {print k ": " $5 " registers, " sp}' pat="$KPAT" \
  $OUT/variant_ptxas.log
if [ -n "$TESTS" ]; then
  DSV_ATTN_LIB=$B/variant.so timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider \
    $TESTS -rf --maxfail=10 -k "not backward_path" > $OUT/tests.log 2>&1
  tail -15 $OUT/tests.log
  # the variant's own tests once more with every head on the query-major path, then with key
  # ranges (the kernel tuning is read once per process)
  for tun in "km_ratio=0" "km_ratio=0,bwd_ranges=3"; do
    DSV_KERNEL_TUNING=$tun DSV_ATTN_LIB=$B/variant.so timeout 90 python3 -m pytest -q \
      -p no:cacheprovider $OWN -k "bfloat16 or agree" -rf --maxfail=5 \
      > $OUT/tests_$tun.log 2>&1
    echo "[$tun] $(tail -1 $OUT/tests_$tun.log)"
  done
fi
for lib in ship variant; do
  DSV_ATTN_LIB=$B/$lib.so timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/bench_kernels.py $BENCH \
    --out $OUT/bench_$lib > $OUT/bench_$lib.log 2>&1 || echo "bench $lib: exit $?"
done
python3 - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
rows = {}
for lib in ("ship", "variant"):
    p = os.path.join(out, f"bench_{lib}", "kernels.json")
    if os.path.exists(p):
        for r in json.load(open(p)):
            rows.setdefault((r["S"], r["D"], r["G"], r["sparsity"], r["dist"]), {})[lib] = r
print("S D G sparsity dist | fwd ms shipped / variant | x cuDNN fwd shipped / variant | bwd ms")
for key, d in sorted(rows.items()):
    s, v = d.get("ship", {}), d.get("variant", {})
    def x(r):
        c = r.get("cudnn_fwd_ms")
        return f"{c / r['fwd_ms']:.2f}" if c and r.get("fwd_ms") else "-"
    print(" ".join(map(str, key)), "|", s.get("fwd_ms", "-"), "/", v.get("fwd_ms", "-"), "|",
          x(s), "/", x(v), "|", s.get("bwd_ms", "-"), "/", v.get("bwd_ms", "-"))
# the target: G = 32 at least 0.8x as fast per selected key as G = 64 (same keys per query)
for (S, D, G, sp, dist), d in sorted(rows.items()):
    g64 = rows.get((S, D, 64, sp, dist), {}).get("ship", {}).get("fwd_ms")
    if G == 32 and g64 and "variant" in d:
        print(f"S={S} D={D} {sp} {dist}: G = 32 variant per selected key {g64 / d['variant']['fwd_ms']:.2f}x"
              f" of G = 64 (shipped {g64 / d['ship']['fwd_ms']:.2f}x)" if "ship" in d else "")
# G = 128 (same keys per list as G = 64): the variant's forward / backward against G = 64 shipped
for (S, D, G, sp, dist), d in sorted(rows.items()):
    r64 = rows.get((S, D, 64, sp, dist), {}).get("ship", {})
    if G == 128 and r64.get("fwd_ms") and "variant" in d:
        v, s = d["variant"], d.get("ship", {})
        print(f"S={S} D={D} {sp} {dist}: G = 128 variant fwd {v['fwd_ms']} / bwd {v.get('bwd_ms')} ms,"
              f" shipped G = 128 {s.get('fwd_ms')} / {s.get('bwd_ms')}, shipped G = 64"
              f" {r64['fwd_ms']} / {r64.get('bwd_ms')}")
EOF
date -u
