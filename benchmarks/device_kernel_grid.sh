#!/usr/bin/env bash
# The kernel benchmark grid (docs/PERFORMANCE.md, Kernels) on one GPU, after
# benchmarks/device_session.sh has put the extension in place (or with a prebuilt
# .devso, benchmarks/device_ext.sh): bench_kernels.py runs, each into its own folder under $OUT/grid_*, every
# one with cuDNN and FlexAttention block-sparse at the same density in the same run. The axes as
# crosses through the target shape (S = 64k, D = 128, sparsity 0.9, random lists):
#   a  G 64 / 128, sparsity 0.8 / 0.9 / 0.95 / 0.98, random and smooth lists     (16 shapes)
#   b  S 16k / 32k / 128k, G 64 / 128, sparsity 0.9 / 0.95, random               (12 shapes)
#   c  D 64 / 96 / 256, G 64 / 128, sparsity 0.9, random and smooth              (12 shapes)
#   d  G 32, sparsity 0.9 / 0.95, random and smooth                              (4 shapes)
# About a minute per part once the machine is up (all four parts took 3.5 minutes on an H100;
# FlexAttention compiles once per shape), so one device call holds the grid (default all four
# parts; GRID_PARTS="a b" runs some of them); then merge here:
#   python benchmarks/bench_kernels.py --merge DIR/grid_*/kernels.json --out benchmarks/results
set -u
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
B="python3 benchmarks/bench_kernels.py --reps 3 --flex"
run() { local name=$1; shift; timeout ${GRID_LIMIT:-280} $B "$@" --out "$OUT/grid_$name" > "$OUT/grid_$name.log" 2>&1
        echo "grid $name rc=$?"; grep -v '^{' "$OUT/grid_$name.log" | tail -n +3 | grep -v '^S=' | tail -20; }
for part in ${GRID_PARTS:-a b c d}; do
  case $part in
    a) run a --S 65536 --D 128 --G 64 128 --sparsity 0.8 0.9 0.95 0.98 --dist random smooth ;;
    b) run b --S 16384 32768 131072 --D 128 --G 64 128 --sparsity 0.9 0.95 --dist random ;;
    c) run c --S 65536 --D 64 96 256 --G 64 128 --sparsity 0.9 --dist random smooth ;;
    d) run d --S 65536 --D 128 --G 32 --sparsity 0.9 0.95 --dist random smooth ;;
    *) echo "GRID_PARTS: unknown part $part (a b c d)"; exit 2 ;;
  esac
done
