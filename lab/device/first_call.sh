#!/usr/bin/env bash
# One device call after a change of the launch path: the whole GPU suite, the runtime's host cost and no-table
# device time, and the incremental re-sweep's cost (each under its own limit; results under $OUT).
#   bash lab/device/first_call.sh [TEST_S] [RUNTIME_S] [INCREMENTAL_S]
set -uo pipefail
source lab/device/device_env.sh
nvidia-smi --query-gpu=name,uuid,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
step "${1:-280}" python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider --tb=short -W ignore -rfE tests > "$OUT/gpu-tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.log" | cut -c1-250 | tail -20
step "${2:-150}" python3 bench/runtime_overhead.py --out "$OUT/runtime.json" > "$OUT/runtime.log" 2>&1
tail -40 "$OUT/runtime.log"
step "${3:-130}" python3 bench/incremental_sweep.py --out "$OUT/incremental.json" > "$OUT/incremental.log" 2>&1
tail -8 "$OUT/incremental.log"
