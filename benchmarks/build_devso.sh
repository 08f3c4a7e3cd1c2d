#!/usr/bin/env bash
# Build the CUDA extension here (no GPU needed: torch with CUDA + nvcc) and put it in .devso/
# (git-excluded) for device calls: carry ".devso" and benchmarks/device_session.sh uses it when
# it loads there and was built from the same csrc/ and setup.py (checked by a hash), else it
# builds on the device. About 1-1.5 min on 2 cores.
#   usage: bash benchmarks/build_devso.sh
set -eu
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
git ls-files -co --exclude-standard | grep -v '^\.devso/' | tar cf - -T - | tar xf - -C "$tmp"
(cd "$tmp" && MAX_JOBS=${MAX_JOBS:-2} DSV_BUILD_CUDA=1 python3 setup.py -q build_ext --inplace > build.log 2>&1) ||
  { tail -30 "$tmp/build.log"; exit 1; }
mkdir -p .devso
cp "$tmp/dsv_ext/_C.abi3.so" .devso/
bash benchmarks/csrc_hash.sh > .devso/csrc.sha256
rm -rf "$tmp"
echo "built .devso/_C.abi3.so for csrc $(cat .devso/csrc.sha256)"
