#!/usr/bin/env bash
# Kernel sources for tools/source_ab.py from patches, the working tree untouched:
#   bash tools/ab_sources.sh DIR [NAME ...]
# writes DIR/head.cu (HEAD's kernels/cuda/gemv.cu) and, for each patch NAME (e.g. v75-iq4xs-scales-unpacked),
# DIR/vNN.cu: HEAD's source with that patch's kernel source hunks applied (vNN: the name up to its first dash). A
# pending patch lies in lab/patches/NAME.patch; one since removed from the tree (a version registered, dropped or
# held by a later patch) is taken from git history, as last committed under lab/patches/ or bench/results/.
# Exit 2 on a usage error or a patch found in neither, 1 when a patch does not apply to HEAD's source.
set -euo pipefail
if [ $# -lt 1 ]; then echo "usage: bash tools/ab_sources.sh DIR [NAME ...]" >&2; exit 2; fi
dir=$1; shift
root=$(git rev-parse --show-toplevel)
mkdir -p "$dir"
git -C "$root" show HEAD:kernels/cuda/gemv.cu > "$dir/head.cu"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/kernels/cuda"
# from_history NAME OUT: the patch's last committed version before the commit that removed it, into OUT.
from_history() {
    local path rev
    for path in "lab/patches/$1.patch" "bench/results/$1.patch"; do
        rev=$(git -C "$root" log -1 --format=%H --diff-filter=D -- "$path")
        if [ -n "$rev" ]; then git -C "$root" show "$rev^:$path" > "$2"; return 0; fi
    done
    return 1
}
for name in "$@"; do
    patch="$root/lab/patches/$name.patch"
    if [ ! -f "$patch" ]; then
        patch="$scratch/$name.patch"
        if ! from_history "$name" "$patch"; then
            echo "no patch lab/patches/$name.patch, nor one in git history" >&2; exit 2
        fi
        echo "$name: from git history"
    fi
    cp "$dir/head.cu" "$scratch/kernels/cuda/gemv.cu"
    if ! (cd "$scratch" && git apply --include=kernels/cuda/gemv.cu "$patch"); then
        echo "$name does not apply to HEAD's kernel source" >&2; exit 1
    fi
    cp "$scratch/kernels/cuda/gemv.cu" "$dir/${name%%-*}.cu"
    echo "$dir/${name%%-*}.cu: $name"
done
