#!/usr/bin/env bash
# One device call of a sweep (timed); the corpus comes back as a tarball.
#   bash bench/sweep_on_device.sh CODEBOOKS [MS] [MODES] [SECONDS]
#   bash bench/sweep_on_device.sh all 2,8,31 graph      (the M values the first corpus lacked)
#   bash bench/sweep_on_device.sh all 1,4,16 eager
# The sweep is cut after SECONDS (default 560) so that the tarball is written inside the device call's limit:
# the cells finished by then come back and a rerun resumes. Run nothing else in the same call unless SECONDS
# leaves room for it (a call killed at its limit returns only what already lies under $OUT).
set -uo pipefail
source bench/device_env.sh
codebooks=${1:?codebooks, e.g. Q4_0,Q8_0,Q4_1 or all}
ms=${2:-1,4,16}
modes=${3:-graph}
seconds=${4:-560}
start=$(date +%s)
timeout -s KILL "$seconds" python3 -m gemv_dispatch.dispatch.cli sweep --corpus-root corpus --codebooks "$codebooks" --m "$ms" --modes "$modes" --json \
    > "$OUT/sweep.json" 2> "$OUT/sweep.log"
echo "sweep rc=$? wall=$(( $(date +%s) - start ))s"; cat "$OUT/sweep.json"; tail -c 300 "$OUT/sweep.log"; echo
tar czf "$OUT/corpus.tgz" corpus/  # whichever GPU folder the sweep wrote
