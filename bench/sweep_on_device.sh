#!/usr/bin/env bash
# One device call for the sweep issue: GPU tests of timing and sweep, the default sweep (timed), and the
# harness-vs-ncu check.   bash bench/sweep_on_device.sh      (corpus tarball and logs under $OUT)
set -uo pipefail
export PYTHONUNBUFFERED=1
export PATH="$PATH:/usr/local/cuda/bin:$(dirname "$(ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)" 2>/dev/null)"
timeout 45 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_timing.py tests/test_sweep.py 2>&1 | tail -2
start=$(date +%s)
timeout 400 python3 -m dispatch.cli sweep --json > "$OUT/sweep.json" 2> "$OUT/sweep.log"
echo "sweep rc=$? wall=$(( $(date +%s) - start ))s"; cat "$OUT/sweep.json"; tail -c 300 "$OUT/sweep.log"; echo
tar czf "$OUT/corpus.tgz" corpus/nvidia-h200
timeout 60 python3 bench/timing_vs_ncu.py run --out "$OUT/timing-vs-ncu.json" 2>&1 | tail -5
