#!/usr/bin/env bash
# One part of a device call: a timed sweep; the corpus root comes back as a tarball.
#   bash lab/device/sweep_on_device.sh CODEBOOKS [MS] [MODES] [SECONDS] [DEVICES] [ROOT]
#   bash lab/device/sweep_on_device.sh all 2,8,31 graph      (the M values the first corpus lacked)
#   bash lab/device/sweep_on_device.sh all 1,4,16 eager 480 0,1   (two GPUs of one host: one child process each)
# The sweep is cut after SECONDS (default 560; `timeout` kills its whole process group, --devices children
# included) so that the tarball is written inside the device call's limit: the cells finished by then come
# back and a rerun resumes. Run nothing else in the same call unless SECONDS leaves room for it (a call killed
# at its limit returns only what already lies under $OUT). ROOT (default corpus) -> $OUT/ROOT.tgz.
# A call returns at most 8 files from $OUT and this script writes 3: whatever else the call runs must write at most 5,
# or the tarball may be the one left behind (a machine still warm keeps ROOT: a prompt rerun resumes from it).
# The tarball is the whole ROOT: replace the GPU folder with it (`rm -rf corpus/nvidia-h200; tar xzf corpus.tgz`), as a
# resumed sweep compacts the earlier call's shards and an old shard left beside the new manifest refuses the corpus.
# To resume on a machine that kept nothing, or in a call whose carried folders replace ROOT's: carry the returned
# tarball as ROOT.tgz beside ROOT (e.g. `.sw/corpus.tgz`: the unpacked corpus with the tree passes the 64-MiB carry
# limit); where ROOT is missing, unpack_root (device_env.sh) unpacks it from there. A sweep resumes only on the GPU
# that began it (its UUID is in the provenance): elsewhere it starts over beside it.
set -uo pipefail
source lab/device/device_env.sh
codebooks=${1:?codebooks, e.g. Q4_0,Q8_0,Q4_1 or all}
ms=${2:-1,4,16}
modes=${3:-graph}
seconds=${4:-560}
devices=${5:-}
root=${6:-corpus}
name=$(basename "$root")-$modes-${ms//,/_}
start=$(date +%s)
unpack_root "$root" || exit 1
# A kernel source that spills cannot be certified: refuse it before the sweep spends the call on it.
python3 -m gemv_dispatch.kernels.ptxas || { echo "sweep refused: the kernel source spills"; exit 1; }
timeout -s KILL "$seconds" python3 -m gemv_dispatch.dispatch.cli sweep --corpus-root "$root" --codebooks "$codebooks" \
    --m "$ms" --modes "$modes" ${devices:+--devices "$devices"} --json > "$OUT/$name.json" 2> "$OUT/$name.log"
echo "sweep $codebooks M=$ms $modes devices=${devices:-0} rc=$? wall=$(( $(date +%s) - start ))s"
cat "$OUT/$name.json"; tail -c 400 "$OUT/$name.log"; echo
tar czf "$OUT/$(basename "$root").tgz" -C "$(dirname "$root")" "$(basename "$root")"
