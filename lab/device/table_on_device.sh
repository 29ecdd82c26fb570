#!/usr/bin/env bash
# One device call that turns a sweep into the committed table: resume the sweep of ROOT for SECONDS (0: none; on a
# machine still warm from lab/device/sweep_on_device.sh's call, ROOT keeps what that call timed), train on the GPU
# folder, certify on this GPU, generate. Under $OUT: the corpus tarball (sweep_on_device.sh's three files), policy.json,
# cert.json, train-certify.log, generated.tgz: seven of the eight files a call returns.
#   [SWEEP_DEVICES=0,1] bash lab/device/table_on_device.sh [SECONDS] [ROOT]   (SWEEP_DEVICES: the GPUs to sweep on)
#   bash lab/device/table_on_device.sh 340 .sw/corpus
#   (after `bash lab/device/sweep_on_device.sh all 1,4,16 graph 550 "" .sw/corpus`; on a machine that kept nothing, carry
#   the returned tarball as .sw/corpus.tgz: unpack_root unpacks it)
# Then here: `rm -rf corpus/nvidia-h200 && tar xzf corpus.tgz` (the tarball's top folder is ROOT's name: corpus),
# `tar xzf generated.tgz`, policy.json into generated/nvidia-h200/, and the golden files regenerated
# (`GEMV_DISPATCH_UPDATE_GOLDEN=1 pytest tests/test_generate.py -k golden`).
set -uo pipefail
source lab/device/device_env.sh
seconds=${1:-0}
root=${2:-corpus}
start=$(date +%s)
unpack_root "$root" || exit 1
if [ "$seconds" -gt 0 ]; then
    bash lab/device/sweep_on_device.sh all 1,4,16 graph "$seconds" "${SWEEP_DEVICES:-}" "$root" | tail -4
fi
gpu=${GPU_SLUG:-nvidia-h200}
folder="corpus/$gpu"  # trained and certified where the repository keeps it, as the CPU `tune` reads it
if [ "$root" != corpus ]; then rm -rf "$folder" && cp -r "$root/$gpu" corpus/ || exit 1; fi
step 110 gemv-dispatch train "$folder" -o "$OUT/policy.json" > "$OUT/train-certify.log" 2>&1 \
    || { tail -5 "$OUT/train-certify.log"; exit 1; }
step 150 gemv-dispatch certify "$OUT/policy.json" -o "$OUT/cert.json" --corpus "$folder" --device gpu \
    >> "$OUT/train-certify.log" 2>&1
tail -16 "$OUT/train-certify.log"
rm -rf "generated/$gpu"
step 30 gemv-dispatch generate "$OUT/policy.json" --cert "$OUT/cert.json" -o "generated/$gpu" \
    && tar czf "$OUT/generated.tgz" "generated/$gpu"
echo "call: $(( $(date +%s) - start )) s"
