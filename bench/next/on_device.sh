#!/usr/bin/env bash
# One device call before the staged source is promoted: the GPU tests of the package as it is (kernels.launch
# now derives its arguments from the source's declaration and makes every format's random planes), then the
# staged source's bytes and speed (check_on_device.py). Each step has its own limit; results under $OUT.
#   bash bench/next/on_device.sh
set -uo pipefail
source bench/device_env.sh
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
step() { local limit=$1; shift; local start=$(date +%s); timeout -s KILL "$limit" "$@"; local rc=$?
         echo "== $* -> rc=$rc in $(( $(date +%s) - start )) s"; return $rc; }
step 200 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short -W ignore tests > "$OUT/gpu-tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.log" | cut -c1-300 | tail -15
step 330 python3 bench/next/check_on_device.py --out "$OUT/next.json" > "$OUT/next.log" 2>&1
grep -E "^bytes" "$OUT/next.log" | tail -3; tail -60 "$OUT/next.log"
