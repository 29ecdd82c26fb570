#!/usr/bin/env bash
# One device call: GPU certification of a policy trained on the CPU (so the CPU `tune` can reproduce its
# module byte for byte), the generated table, install + check, the GPU tests, the runtime benchmark.
#   bash lab/device/certify_on_device.sh generated/nvidia-h200/policy.json
# Everything under $OUT: cert.json, generated.tgz (the table folder), logs, runtime.json. Each step has its
# own time limit, so a slow one cannot take the results of the earlier ones with it.
set -uo pipefail
source lab/device/device_env.sh
policy=${1:?policy.json trained on the committed corpus}
out_dir=$(dirname "$policy")
nvidia-smi --query-gpu=name,uuid,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
# certify's time grows with the table's launches (version 12's 996 shapes: ~210 s, past the 170 s this step had).
step "${CERTIFY_LIMIT:-300}" gemv-dispatch certify "$policy" -o "$OUT/cert.json" --corpus corpus/nvidia-h200 --device gpu \
    > "$OUT/certify.log" 2>&1; tail -14 "$OUT/certify.log"
step 30 gemv-dispatch generate "$policy" --cert "$OUT/cert.json" -o "$out_dir" && tar czf "$OUT/generated.tgz" "$out_dir"
export GEMV_DISPATCH_TABLES=/tmp/tables
step 15 gemv-dispatch install "$out_dir"
# The GPU tests that read the installed table (GGUF end to end) or the runtime, or GPU_TESTS (default: those),
# within GPU_TESTS_LIMIT seconds (default 170; the whole suite, GPU_TESTS=tests, needs about 260). With the whole
# suite the call needs ~560 s: give the device call its 600 s.
step "${GPU_TESTS_LIMIT:-170}" python3 -m pytest -m gpu -n 6 -q -p no:cacheprovider --tb=short -W ignore \
    ${GPU_TESTS:-tests/test_end_to_end.py tests/test_runtime_gpu.py} > "$OUT/gpu-tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.log" | cut -c1-300 | tail -25
step 45 python3 bench/runtime_overhead.py --quick --out "$OUT/runtime.json" > "$OUT/runtime.log" 2>&1; tail -25 "$OUT/runtime.log"
step 170 gemv-dispatch check --installed > "$OUT/check.log" 2>&1; tail -12 "$OUT/check.log"  # last: as long as time is left
