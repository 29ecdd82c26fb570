#!/usr/bin/env bash
# One device call: install carried wheels, run the GPU tests, then the kernel benchmark.
#   bash bench/on_device.sh [quick]      (results under $OUT)
set -uo pipefail
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -m gpu -q -x -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu-tests.log" | tail -15
python3 bench/kernels.py --out "$OUT/kernels.json" ${1:+--quick} 2>&1 | tee "$OUT/bench.log" | tail -60
