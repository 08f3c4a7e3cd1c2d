#!/usr/bin/env bash
# The kernel benchmark grid of issue 3 in one device call (after benchmarks/device_session.sh has
# put the extension in place, or with a prebuilt .devso/_C.abi3.so): several bench_kernels.py
# runs, each into its own folder under $OUT/grid_*; merge them here with
#   python benchmarks/bench_kernels.py --merge DIR/grid_*/kernels.json --out benchmarks/results
set -u
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
B="python3 benchmarks/bench_kernels.py --reps 3"
run() { local name=$1; shift; timeout ${GRID_LIMIT:-150} $B "$@" --out "$OUT/grid_$name" > "$OUT/grid_$name.log" 2>&1
        echo "grid $name rc=$?"; grep -v '^{' "$OUT/grid_$name.log" | tail -n +3 | grep -v '^S=' | tail -20; }
run flex   --S 65536 --D 128 --G 64 --sparsity 0.9 0.95 --dist random --flex
run random --S 16384 32768 65536 131072 --D 128 --G 64 --sparsity 0.8 0.9 0.95 0.98 --dist random
run d64g32 --S 65536 --D 64 --G 32 64 --sparsity 0.9 --dist random
run g32    --S 65536 --D 128 --G 32 --sparsity 0.9 --dist random
[ -n "${GRID_SMOOTH:-}" ] && run smooth --S 65536 --D 128 --G 64 --sparsity 0.8 0.9 0.95 0.98 --dist smooth
