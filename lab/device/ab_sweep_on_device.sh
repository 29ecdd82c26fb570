#!/usr/bin/env bash
# One device call that registers a kernel change only if it wins: A/B the working tree's kernel source (base + the
# applied PATCHES) against BASE (lab/device/ab_on_device.sh), let tools/ab_decide.py --geomean GEOMEAN choose, revert the
# patches (last first) if it keeps the baseline, then sweep with the call's remaining time into ROOT (resumable:
# lab/device/table_on_device.sh finishes it in the next call, on a machine still warm).
#   bash lab/device/ab_sweep_on_device.sh BASE.cu SECONDS GEOMEAN "PATCH ..." FAMILY:CODEBOOKS:MS ...
#   bash lab/device/ab_sweep_on_device.sh .ab/base.cu 75 0.99 "lab/patches/vNN-a.patch lab/patches/vNN-b.patch" \
#       direct:Q4_K:1 kpar:Q4_K,IQ4_XS:1,4,16 wide:IQ4_XS:16,1
# (versions 38–44 were measured and registered this way: lab/journal.md, row 44)
# Under $OUT: ab.tgz (every A/B log and JSON), decide.txt (the verdict per cell) and the sweep's three files (none
# when the source kept is the one the committed corpus was swept with).
# SWEEP_DEVICES=0,1 (a machine of two GPUs) sweeps on both, one child process each (sweep_on_device.sh's DEVICES).
# CALL_SECONDS (default 575): what this script may take in all; less where the call runs something before it.
# Mirror the verdict in the tree the next call sends (revert the same patches there if decide.txt ends "baseline's").
# A spec cut by SECONDS before its last requested cell gives no verdict (and no sweep) unless a measured cell already
# keeps the baseline: size SECONDS for the longest spec (H200, compile included: direct about 30 s a codebook at
# M = 1, kpar about 10 s and wide about 9 s a (codebook, M); the logs of versions 38–45's A/B runs, lab/journal.md row 44).
set -uo pipefail
source lab/device/device_env.sh
start=$(date +%s)
base=${1:?the baseline kernel source}
seconds=${2:?seconds per A/B spec}
geomean=${3:?the geomean the tree must beat}
read -r -a patches <<< "${4:?the applied patches, as one word}"
shift 4
bash lab/device/ab_on_device.sh "$base" "$seconds" "$@" > "$OUT/ab-cells.txt" 2>&1
grep "^==" "$OUT/ab-cells.txt"
python3 tools/ab_decide.py "$OUT"/ab-*.json --geomean "$geomean" > "$OUT/decide.txt"
verdict=$?
if [ "$verdict" -eq 0 ]; then
    echo "A/B: the tree's source is kept"
elif [ "$verdict" -ne 1 ]; then
    echo "A/B: no verdict (ab_decide.py exit $verdict): no sweep"; grep -v "^[A-Z0-9_]* M=" "$OUT/decide.txt"; exit 1
else
    echo "A/B: the baseline's source is kept; reverting ${patches[*]}"
    for ((i = ${#patches[@]} - 1; i >= 0; i--)); do
        patch -R -p1 -s < "${patches[i]}" || { echo "reverting ${patches[i]} failed: no sweep"; exit 1; }
    done
fi
tail -1 "$OUT/decide.txt"
(cd "$OUT" && tar czf ab.tgz ab-*.json ab-*.log ab-cells.txt && rm -f ab-*.json ab-*.log ab-cells.txt)
# A baseline already swept into the committed corpus (the registered source) is not swept again: the call's time is
# better spent on the next step. corpus.load refuses a folder (or a missing one) of another kernel digest.
if digest=$(python3 -c "import sys; from gemv_dispatch.dispatch.measure.corpus import load; from gemv_dispatch.kernels import program
print(program.digest()[:12]); load(sys.argv[1], kernel_digest=program.digest())" "corpus/${GPU_SLUG:-nvidia-h200}" \
        2> /dev/null); then
    echo "kernel digest $digest is the committed corpus's: no sweep"; exit 0
fi
echo "sweeping kernel digest $digest"
bash lab/device/sweep_on_device.sh all 1,4,16 graph $(( ${CALL_SECONDS:-575} - ($(date +%s) - start) )) "${SWEEP_DEVICES:-}" /tmp/sw/corpus
echo "call: $(( $(date +%s) - start )) s"
