#!/usr/bin/env bash
# One device call that registers a kernel change only if it wins: A/B the working tree's kernel source (base + the
# applied PATCHES) against BASE (bench/ab_on_device.sh), let bench/ab_decide.py --geomean GEOMEAN choose, revert the
# patches (last first) if it keeps the baseline, then sweep with the call's remaining time into ROOT (resumable:
# bench/table_on_device.sh finishes it in the next call, on a machine still warm).
#   bash bench/ab_sweep_on_device.sh BASE.cu SECONDS GEOMEAN "PATCH ..." FAMILY:CODEBOOKS:MS ...
#   bash bench/ab_sweep_on_device.sh .ab/base35ab.cu 75 0.99 "bench/results/v38-k6-unpacked.patch \
#       bench/results/v39-superblock-ring.patch bench/results/v40-iq4-addends.patch \
#       bench/results/v41-iq4xs-superblock-walk.patch bench/results/v42-k-superblock-walk.patch \
#       bench/results/v43-q6k-raw-codes.patch bench/results/v44-iq4-ring-addends.patch \
#       bench/results/v45-iq4-one-row-addends.patch" \
#       direct:IQ4_XS,Q4_K,IQ4_NL,Q5_K,Q6_K:1 \
#       kpar:IQ4_XS,Q4_K,Q5_K,IQ4_NL,Q5_1:1,4,16,31 wide:IQ4_XS,Q4_K,Q5_K,IQ4_NL:16,1   (bench/NOTES.md, row 41)
# Under $OUT: ab.tgz (every A/B log and JSON), decide.txt (the verdict per cell) and the sweep's three files (none
# when the source kept is the one the committed corpus was swept with).
# SWEEP_DEVICES=0,1 (a machine of two GPUs) sweeps on both, one child process each (sweep_on_device.sh's DEVICES).
# Mirror the verdict in the tree the next call sends (revert the same patches there if decide.txt ends "baseline's").
set -uo pipefail
source bench/device_env.sh
start=$(date +%s)
base=${1:?the baseline kernel source}
seconds=${2:?seconds per A/B spec}
geomean=${3:?the geomean the tree must beat}
read -r -a patches <<< "${4:?the applied patches, as one word}"
shift 4
bash bench/ab_on_device.sh "$base" "$seconds" "$@" > "$OUT/ab-cells.txt" 2>&1
grep "^==" "$OUT/ab-cells.txt"
python3 bench/ab_decide.py "$OUT"/ab-*.json --geomean "$geomean" > "$OUT/decide.txt"
verdict=$?
if [ "$verdict" -eq 0 ]; then
    echo "A/B: the tree's source is kept"
elif [ "$verdict" -ne 1 ]; then
    echo "A/B: no verdict (ab_decide.py exit $verdict): no sweep"; exit 1
else
    echo "A/B: the baseline's source is kept; reverting ${patches[*]}"
    for ((i = ${#patches[@]} - 1; i >= 0; i--)); do
        patch -R -p1 -s < "${patches[i]}" || { echo "reverting ${patches[i]} failed: no sweep"; exit 1; }
    done
fi
tail -1 "$OUT/decide.txt"
(cd "$OUT" && tar czf ab.tgz ab-*.json ab-*.log ab-cells.txt && rm -f ab-*.json ab-*.log ab-cells.txt)
digest=$(python3 -c "from gemv_dispatch.kernels import program; print(program.digest())")
# A baseline already swept into the committed corpus (the registered source) is not swept again: the call's time is
# better spent on the next step.
if grep -qs "\"kernel_digest\":\"$digest\"" corpus/*/shards/*.jsonl; then
    echo "kernel digest ${digest:0:12} is the committed corpus's: no sweep"; exit 0
fi
echo "sweeping kernel digest ${digest:0:12}"
bash bench/sweep_on_device.sh all 1,4,16 graph $(( 575 - ($(date +%s) - start) )) "${SWEEP_DEVICES:-}" /tmp/sw/corpus
echo "call: $(( $(date +%s) - start )) s"
