#!/usr/bin/env bash
# Repack the wheels of a carry folder for device calls: each DIR/NAME.whl becomes
# DIR/NAME.whl.tar.xz, its files unpacked and xz-compressed (PyAV's wheel, mostly FFmpeg's shared
# libraries: 35 -> 24 MB), so that the video wheels fit the carry beside the prebuilt extension
# (.devso) and the tree. benchmarks/device_ext.sh's `wheels DIR` unpacks them into /tmp/site, as
# pip installs the plain ones. Pure-Python wheels (a few MB) gain little; any wheel works.
#   usage: bash benchmarks/pack_wheels.sh [DIR] [WHEEL...]   (DIR: .dsvwheels; default: every wheel)
set -eu
dir=${1:-.dsvwheels}; shift || true
[ $# -gt 0 ] || set -- "$dir"/*.whl
for w in "$@"; do
  [ -f "$w" ] || { echo "no wheel $w" >&2; exit 1; }
  tmp=$(mktemp -d)
  python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$w" "$tmp"
  tar cf - -C "$tmp" . | xz -9 -T0 > "$w.tar.xz.part"
  mv "$w.tar.xz.part" "$w.tar.xz" && rm -f "$w" && rm -rf "$tmp"
  echo "$w -> $w.tar.xz ($(du -h "$w.tar.xz" | cut -f1))"
done
