#!/usr/bin/env bash
# One device call of the default sweep (timed) for the given codebooks; the corpus comes back as a tarball.
#   bash bench/sweep_on_device.sh Q4_0,Q8_0,Q4_1        (then Q5_0,Q5_1,IQ4_NL: two calls fit the call limit)
# The first call of a new kernel digest starts from an empty corpus folder: records of another kernel source
# cannot be mixed into one. Runs split by codebook never repeat a cell, whichever H200 each one gets.
set -uo pipefail
export PYTHONUNBUFFERED=1
codebooks=${1:?codebooks, e.g. Q4_0,Q8_0,Q4_1}
start=$(date +%s)
timeout -s KILL 560 python3 -m dispatch.cli sweep --codebooks "$codebooks" --json > "$OUT/sweep.json" 2> "$OUT/sweep.log"
echo "sweep rc=$? wall=$(( $(date +%s) - start ))s"; cat "$OUT/sweep.json"; tail -c 300 "$OUT/sweep.log"; echo
tar czf "$OUT/corpus.tgz" corpus/  # whichever GPU folder the sweep wrote
