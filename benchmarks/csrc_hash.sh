#!/usr/bin/env bash
# Hash of what the extension is built from (csrc/ and setup.py): names a prebuilt .devso build.
cd "$(dirname "$0")/.."
find csrc setup.py -type f | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16
