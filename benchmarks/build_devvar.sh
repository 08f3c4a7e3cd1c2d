#!/usr/bin/env bash
# Build the shipped attention kernels (csrc/cuda/sparse_attention_*.cu + tuning.cu) and csrc/dev
# attention variants into ctypes libraries under .devvar/ (git-excluded): ship.so and
# <variant>.so (+ <variant>_ptxas.log), with the hash of csrc/ they were built from. Libraries
# that exist for the same hash are kept. benchmarks/device_variant.sh calls it, so a .devvar/
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
jobs=()
if [ ! -f $D/ship.so ]; then
  for f in csrc/cuda/sparse_attention_*.cu csrc/cuda/tuning.cu; do
    jobs+=("nvcc $FL -c $f -o $D/obj/ship_$(basename $f .cu).o")
  done
fi
for v in "$@"; do
  n=$(basename "$v" .cu)
  [ -f $D/$n.so ] || jobs+=("nvcc $FL -Xptxas -v -c $v -o $D/obj/var_$n.o > $D/${n}_ptxas.log 2>&1")
done
printf '%s\n' "${jobs[@]+"${jobs[@]}"}" | xargs -P "${MAX_JOBS:-$(nproc)}" -I{} sh -c '{}'
[ -f $D/ship.so ] || nvcc -shared $D/obj/ship_*.o $D/obj/status.o -o $D/ship.so -lcudart
for v in "$@"; do
  n=$(basename "$v" .cu)
  [ -f $D/$n.so ] || nvcc -shared $D/obj/var_$n.o $D/obj/status.o -o $D/$n.so -lcudart
done
echo "$hash" > $D/csrc.sha256
rm -f $D/obj/*.o
ls -la $D/*.so
