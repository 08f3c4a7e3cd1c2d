#!/usr/bin/env bash
# The extension and the optional wheels on a device machine, shared by the device scripts
# (sourced: `. benchmarks/device_ext.sh`, then `wheels DIR` and `ensure_ext || exit 1`).
#  - ensure_ext: the prebuilt .devso (benchmarks/build_devso.sh: _C.abi3.so.xz, about 14 MB, so it
#    fits the carry beside the video wheels) when it was built from this csrc/ and setup.py
#    (benchmarks/csrc_hash.sh) and loads here; else a build here (incremental on a machine that
#    built before; minutes on a fresh one). The build log goes to $OUT/build.log. A later call on
#    the same (warm) machine keeps the extension and needs no .devso while csrc/ is unchanged.
#  - devso_unpack DIR: DIR/_C.abi3.so from DIR/_C.abi3.so.xz (.devso-before for the "ab" step).
#  - wheels DIR: pip-installs the wheels carried in DIR into /tmp/site (and unpacks there the
#    wheels that benchmarks/pack_wheels.sh stored as DIR/*.whl.tar.xz) and puts it on PYTHONPATH
#    (also when an earlier call on the same machine installed them and DIR is not carried).
#   env: BUILD_LIMIT seconds for a build (300), OUT
devso_unpack() {
  [ -f "$1/_C.abi3.so.xz" ] || return 0
  python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
    "$1/_C.abi3.so.xz" "$1/_C.abi3.so"
}

have_ext() { python3 -c "import dsv_ext, sys; sys.exit(0 if dsv_ext.has_cuda_kernels() else 1)" 2>/dev/null; }

ensure_ext() {
  devso_unpack .devso
  local h
  h=$(bash benchmarks/csrc_hash.sh)
  if [ -f .devso/_C.abi3.so ] && [ "$(cat .devso/csrc.sha256 2>/dev/null)" = "$h" ] &&
     cp .devso/_C.abi3.so dsv_ext/ && have_ext; then
    echo "using the prebuilt extension (.devso, csrc $h)"
    echo "$h" > /tmp/dsv_ext_csrc  # a later call on this machine needs no .devso (the carry stays small)
    return 0
  fi
  if [ ! -f .devso/_C.abi3.so ] && [ "$(cat /tmp/dsv_ext_csrc 2>/dev/null)" = "$h" ] && have_ext; then
    echo "using the extension an earlier call on this machine installed (csrc $h)"
    return 0
  fi
  local t0 rc
  t0=$(date +%s)
  mkdir -p "${OUT:-/tmp/out}"
  MAX_JOBS=16 DSV_BUILD_CUDA=1 timeout "${BUILD_LIMIT:-300}" python3 setup.py -q build_ext --inplace \
    > "${OUT:-/tmp/out}/build.log" 2>&1
  rc=$?
  echo "build rc=$rc in $(( $(date +%s) - t0 )) s"
  if [ $rc -ne 0 ] || ! have_ext; then
    tail -40 "${OUT:-/tmp/out}/build.log"
    return 1
  fi
}

wheels() {
  local a got=0
  if ls "$1"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/site "$1"/*.whl 2>&1 |
      grep -v "already exists" || true
    got=1
  fi
  for a in "$1"/*.whl.tar.xz; do  # wheels unpacked and xz-compressed (benchmarks/pack_wheels.sh)
    [ -f "$a" ] || continue
    mkdir -p /tmp/site && tar xJf "$a" -C /tmp/site && got=1
  done
  # an earlier call on this machine may have installed them (then DIR need not be carried)
  { [ $got = 1 ] || [ -d /tmp/site ]; } && export PYTHONPATH=$PWD:/tmp/site
  return 0
}
