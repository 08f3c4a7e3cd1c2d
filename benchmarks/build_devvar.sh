#!/usr/bin/env bash
# Build the shipped attention kernels (csrc/cuda/sparse_attention_*.cu + tuning.cu) and csrc/dev
# attention variants into ctypes libraries under .devvar/ (git-excluded): ship.so and
# <variant>.so (+ <variant>_ptxas.log), with the hash of csrc/ they were built from. Variants
# named topk_*.cu replace the top-K estimation in a library of the other ops (for DSV_OPS_LIB:
# tuning, predictor_loss, profile_attention, rows), built beside ops_ship.so, the same library
# with the shipped estimation (ship.so is then built only if an attention variant is named).
# Libraries that exist for the same hash are kept. benchmarks/device_variant.sh calls it, so a .devvar/
# built beforehand on a machine without a GPU (~5-10 min on 2 cores) and copied into the GPU
# machine's tree is used there instead of compiling.
#   usage: bash benchmarks/build_devvar.sh [csrc/dev/variant.cu ...]    (MAX_JOBS: parallel nvcc)
set -eu
cd "$(dirname "$0")/.."
D=.devvar
mkdir -p $D/obj
hash=$(bash benchmarks/csrc_hash.sh)
if [ "$(cat $D/csrc.sha256 2>/dev/null)" != "$hash" ]; then rm -f $D/*.so $D/*.log $D/obj/*; fi
# the extension's flags (setup.py): sm_90a with DSV_WGMMA, so that the shipped library runs the
# wgmma kernels as the extension does (without it its tuning reports wgmma=0: mma.sync only)
FL="-std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -DDSV_WGMMA -Xcompiler -fPIC -Icsrc -lineinfo --split-compile=0"
gcc -O2 -fPIC -Icsrc -c csrc/cpu/status.c -o $D/obj/status.o
ops=0; att=$([ $# = 0 ] && echo 1 || echo 0)
for v in "$@"; do case $(basename "$v") in topk_*) ops=1;; *) att=1;; esac; done
jobs=()
if [ $att = 1 ] && [ ! -f $D/ship.so ]; then
  for f in csrc/cuda/sparse_attention_*.cu csrc/cuda/tuning.cu; do
    jobs+=("nvcc $FL -c $f -o $D/obj/ship_$(basename $f .cu).o")
  done
fi
if [ $ops = 1 ]; then
  for f in topk_estimate tuning predictor_loss profile_attention rows; do
    jobs+=("nvcc $FL -c csrc/cuda/$f.cu -o $D/obj/ops_$f.o")
  done
fi
for v in "$@"; do
  n=$(basename "$v" .cu)
  [ -f $D/$n.so ] || jobs+=("nvcc $FL -Xptxas -v -c $v -o $D/obj/var_$n.o > $D/${n}_ptxas.log 2>&1")
done
printf '%s\n' "${jobs[@]+"${jobs[@]}"}" | xargs -P "${MAX_JOBS:-$(nproc)}" -I{} sh -c '{}'
[ $att = 0 ] || [ -f $D/ship.so ] || nvcc -shared $D/obj/ship_*.o $D/obj/status.o -o $D/ship.so -lcudart
others="$D/obj/ops_tuning.o $D/obj/ops_predictor_loss.o $D/obj/ops_profile_attention.o $D/obj/ops_rows.o"
if [ $ops = 1 ] && [ ! -f $D/ops_ship.so ]; then
  nvcc -shared $D/obj/ops_topk_estimate.o $others $D/obj/status.o -o $D/ops_ship.so -lcudart
fi
for v in "$@"; do
  n=$(basename "$v" .cu)
  case $n in
    topk_*) [ -f $D/$n.so ] || nvcc -shared $D/obj/var_$n.o $others $D/obj/status.o -o $D/$n.so -lcudart ;;
    *) [ -f $D/$n.so ] || nvcc -shared $D/obj/var_$n.o $D/obj/status.o -o $D/$n.so -lcudart ;;
  esac
done
echo "$hash" > $D/csrc.sha256
rm -f $D/obj/*.o
ls -la $D/*.so
