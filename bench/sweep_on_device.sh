#!/usr/bin/env bash
# One device call for the sweep issue: the default sweep (timed), its GPU test, the harness-vs-ncu check.
#   bash bench/sweep_on_device.sh      (corpus tarball and logs under $OUT)
set -uo pipefail
export PYTHONUNBUFFERED=1
export PATH="$PATH:/usr/local/cuda/bin:$(dirname "$(ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)" 2>/dev/null)"
start=$(date +%s)
timeout 470 python3 -m dispatch.cli sweep --json > "$OUT/sweep.json" 2> "$OUT/sweep.log"
echo "sweep rc=$? wall=$(( $(date +%s) - start ))s"; cat "$OUT/sweep.json"; tail -c 600 "$OUT/sweep.log"; echo
tar czf "$OUT/corpus.tgz" corpus/nvidia-h200 2>/dev/null; ls -la corpus/nvidia-h200 2>/dev/null | head
timeout 70 python3 bench/timing_vs_ncu.py run --out "$OUT/timing-vs-ncu.json" 2>&1 | tail -6
timeout 40 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_sweep.py 2>&1 | tail -3
