#!/usr/bin/env bash
# One device call with the committed table (lab/device/table_on_device.sh's, unpacked into the tree): install it, the
# whole GPU suite, the kernel benchmark, `check --installed`. Under $OUT: gpu-tests.log, kernels.json, roofline.png,
# bench.log, check.log (copy them to bench/results/ as NAME-<gpu slug>.*, e.g. kernels-nvidia-h200.json;
# bench/kernels_report.py renders kernels-<gpu slug>.md).
#   bash lab/device/verify_on_device.sh [CALL_SECONDS] [TEST_SECONDS]      (defaults 560 and 270)
# TEST_SECONDS 0 leaves the GPU suite out, and the benchmark runs only where the call leaves it time (`step` skips a
# limit of 0 or less). Where the suite needs most of a call, split it: `verify_on_device.sh 585 500` (suite and check),
# then `verify_on_device.sh 560 0`.
set -uo pipefail
source lab/device/device_env.sh
start=$(date +%s)
export GEMV_DISPATCH_TABLES=/tmp/tables
step 15 gemv-dispatch install generated/nvidia-h200
step "${2:-270}" python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider --tb=short -W ignore tests > "$OUT/gpu-tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.log" | cut -c1-300 | tail -15
# The benchmark gets what is left but the check's 70 s.
left=$(( ${1:-560} - ($(date +%s) - start) - 75 ))
step "$left" python3 bench/kernels.py --out "$OUT/kernels.json" --plot "$OUT/roofline.png" > "$OUT/bench.log" 2>&1; tail -30 "$OUT/bench.log"
step 70 gemv-dispatch check --installed > "$OUT/check.log" 2>&1; tail -12 "$OUT/check.log"
