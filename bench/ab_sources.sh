#!/usr/bin/env bash
# Kernel sources for bench/source_ab.py from committed patches, the working tree untouched:
#   bash bench/ab_sources.sh DIR [NAME ...]
# writes DIR/head.cu (HEAD's kernels/cuda/gemv.cu) and, for each bench/results/NAME.patch (e.g.
# v66-ring-cells-by-warp), DIR/vNN.cu: HEAD's source with that patch's kernel source hunks applied (vNN: the name up
# to its first dash). Exit 2 on a usage error or a missing patch, 1 when a patch does not apply to HEAD's source.
set -euo pipefail
if [ $# -lt 1 ]; then echo "usage: bash bench/ab_sources.sh DIR [NAME ...]" >&2; exit 2; fi
dir=$1; shift
root=$(git rev-parse --show-toplevel)
mkdir -p "$dir"
git -C "$root" show HEAD:kernels/cuda/gemv.cu > "$dir/head.cu"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/kernels/cuda"
for name in "$@"; do
    patch="$root/bench/results/$name.patch"
    if [ ! -f "$patch" ]; then echo "no patch bench/results/$name.patch" >&2; exit 2; fi
    cp "$dir/head.cu" "$scratch/kernels/cuda/gemv.cu"
    if ! (cd "$scratch" && git apply --include=kernels/cuda/gemv.cu "$patch"); then
        echo "$name does not apply to HEAD's kernel source" >&2; exit 1
    fi
    cp "$scratch/kernels/cuda/gemv.cu" "$dir/${name%%-*}.cu"
    echo "$dir/${name%%-*}.cu: $name"
done
