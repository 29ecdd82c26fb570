#!/usr/bin/env bash
# One device call for the kernel issue: GPU tests, the harness-vs-ncu check, the kernel benchmark.
#   bash lab/device/on_device.sh        (results under $OUT; copy them to bench/results/ as NAME-<gpu slug>.*)
set -uo pipefail
source lab/device/device_env.sh
export PATH="$PATH:/usr/local/cuda/bin:$(dirname "$(ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)" 2>/dev/null)"
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short -W ignore tests 2>&1 > "$OUT/gpu-tests.log"
grep -E "Error|passed|failed" "$OUT/gpu-tests.log" | cut -c1-300 | tail -15
timeout 120 python3 bench/timing_vs_ncu.py run --out "$OUT/timing-vs-ncu.json" 2>&1 | tail -8
timeout 240 python3 bench/kernels.py --out "$OUT/kernels.json" 2>&1 > "$OUT/bench.log"
tail -82 "$OUT/bench.log"
