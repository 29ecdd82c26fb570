#!/usr/bin/env bash
# One device call of a sweep (timed); the corpus comes back as a tarball.
#   bash bench/sweep_on_device.sh CODEBOOKS [MS] [MODES]
#   bash bench/sweep_on_device.sh all 2,8,31 graph      (the M values the first corpus lacked)
#   bash bench/sweep_on_device.sh all 1,4,16 eager
# A call that runs out of time is cut at 560 s; the cells finished by then come back and a rerun resumes.
set -uo pipefail
source bench/device_env.sh
codebooks=${1:?codebooks, e.g. Q4_0,Q8_0,Q4_1 or all}
ms=${2:-1,4,16}
modes=${3:-graph}
start=$(date +%s)
timeout -s KILL 560 python3 -m gemv_dispatch.dispatch.cli sweep --corpus-root corpus --codebooks "$codebooks" --m "$ms" --modes "$modes" --json \
    > "$OUT/sweep.json" 2> "$OUT/sweep.log"
echo "sweep rc=$? wall=$(( $(date +%s) - start ))s"; cat "$OUT/sweep.json"; tail -c 300 "$OUT/sweep.log"; echo
tar czf "$OUT/corpus.tgz" corpus/  # whichever GPU folder the sweep wrote
