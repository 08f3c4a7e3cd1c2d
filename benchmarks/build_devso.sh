#!/usr/bin/env bash
# Build the CUDA extension here (no GPU needed: torch with CUDA + nvcc) and put it in .devso/
# (git-excluded) for device calls, xz-compressed (_C.abi3.so.xz, about 14 MB of 26: it fits the
# carry beside the video wheels): carry ".devso" and the device scripts (benchmarks/device_ext.sh)
# use it when it loads there and was built from the same csrc/ and setup.py (checked by a hash),
# else they build on the device. About 1.5-3 min on 2 cores.
#   usage: bash benchmarks/build_devso.sh          (the working tree -> .devso/)
#          bash benchmarks/build_devso.sh REV      (commit REV -> .devso-before/: the "before" of
#          a kernel change, timed against the tree by device_session.sh's "ab" step)
set -eu
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
if [ $# -ge 1 ]; then
  git archive "$1" | tar xf - -C "$tmp"
  dest=.devso-before
else
  git ls-files -co --exclude-standard | grep -v '^\.devso' | tar cf - -T - | tar xf - -C "$tmp"
  dest=.devso
  hash=$(cd "$tmp" && find csrc setup.py -type f | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)
fi
(cd "$tmp" && MAX_JOBS=${MAX_JOBS:-2} DSV_BUILD_CUDA=1 python3 setup.py -q build_ext --inplace > build.log 2>&1) ||
  { tail -30 "$tmp/build.log"; exit 1; }
mkdir -p $dest
rm -f $dest/_C.abi3.so
python3 -c "import lzma, shutil, sys; shutil.copyfileobj(open(sys.argv[1], 'rb'), lzma.open(sys.argv[2], 'wb', preset=6))" \
  "$tmp/dsv_ext/_C.abi3.so" $dest/_C.abi3.so.xz
if [ $# -ge 1 ]; then
  git rev-parse --short "$1" > $dest/commit
  echo "built $dest/_C.abi3.so.xz from commit $(cat $dest/commit)"
else
  echo "$hash" > $dest/csrc.sha256  # of the copy built (the tree may have changed since)
  echo "built $dest/_C.abi3.so.xz for csrc $(cat $dest/csrc.sha256)"
fi
rm -rf "$tmp"
