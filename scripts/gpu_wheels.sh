#!/usr/bin/env bash
# Downloads the wheels the GPU machine lacks (scripts/gpu_wheels.txt: pinned, one version each)
# for CPython 3.12 on manylinux x86_64, into scripts/gpu_wheels/ (ignored by git). Run it here,
# where the package registry is reachable; the GPU machine has no network and installs them
# with scripts/gpu_check.sh. The folder travels with the working tree (`carry`), so it must
# stay under 64 MiB: this script fails above that.
#
#   bash scripts/gpu_wheels.sh [--python-version 3.12] [--dest DIR]
# --python-version: another CPython for the same pins (the rehearsal's own Python here).
# manylinux_2_28 wheels are accepted beside manylinux2014: the image runs torch 2.11's CUDA
# wheels, which need glibc 2.28 themselves.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
version=3.12
dest=scripts/gpu_wheels
while [ $# -gt 0 ]; do
    case "$1" in
        --python-version) version=$2; shift 2 ;;
        --dest) dest=$2; shift 2 ;;
        *) echo "gpu_wheels.sh: unknown argument $1 (want --python-version X.Y, --dest DIR)" >&2; exit 2 ;;
    esac
done
limit=$((64 << 20))

pins=$(sed 's/#.*//' scripts/gpu_wheels.txt | awk 'NF {print $1}')
tmp="$dest.partial"
rm -rf "$tmp"
mkdir -p "$tmp"
# shellcheck disable=SC2086  # one argument per pin
"$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version "$version" \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d "$tmp" $pins

# one wheel per pin, nothing else, under the limit
count=0
for pin in $pins; do
    name=${pin%%==*}
    ver=${pin#*==}
    stem=$(echo "$name" | tr '.-' '__')
    found=$(find "$tmp" -maxdepth 1 -iname "${stem}-${ver}-*.whl" | wc -l)
    if [ "$found" -ne 1 ]; then
        echo "gpu_wheels.sh: $pin: $found wheels downloaded, want 1 (see $tmp)" >&2
        exit 1
    fi
    count=$((count + 1))
done
total=$(find "$tmp" -maxdepth 1 -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
files=$(find "$tmp" -maxdepth 1 -type f | wc -l)
if [ "$files" -ne "$count" ]; then
    echo "gpu_wheels.sh: $files files for $count pins in $tmp" >&2
    exit 1
fi
if [ "$total" -ge "$limit" ]; then
    echo "gpu_wheels.sh: $total bytes, over the 64 MiB that travels with the working tree" >&2
    exit 1
fi
rm -rf "$dest"
mv "$tmp" "$dest"
ls -l "$dest" | awk 'NR > 1 {printf "  %8.1f KiB  %s\n", $5 / 1024, $9}'
echo "gpu_wheels.sh: $count wheels for CPython $version, $((total >> 10)) KiB in $dest"
