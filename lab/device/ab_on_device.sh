#!/usr/bin/env bash
# One part of a device call: A/B runs of kernel sources against the working tree (tools/source_ab.py), one per
# FAMILY:CODEBOOKS:MS spec, each cut after SECONDS (source_ab rewrites its JSON after every cell, so a cut run keeps
# what it timed). Two files per spec under $OUT (ab-FAMILY.log, ab-FAMILY.json): a call returns at most 8 files,
# so keep 2 × specs plus whatever else the call writes within that. The cell lines of every log are printed last.
#   bash lab/device/ab_on_device.sh BASE.cu SECONDS FAMILY:CODEBOOKS:MS [FAMILY:CODEBOOKS:MS ...]
#   bash lab/device/ab_on_device.sh .ab/base.cu 90 wide:Q4_0,IQ4_NL:1,4,8 kpar:Q4_0,IQ4_NL:1,4,8
# lab/device/ab_sweep_on_device.sh runs it, lets tools/ab_decide.py choose the source and sweeps that one, in one call.
set -uo pipefail
source lab/device/device_env.sh
base=${1:?the baseline kernel source}
seconds=${2:?seconds per spec}
shift 2
for spec in "$@"; do
    IFS=: read -r family codebooks ms <<< "$spec"
    start=$(date +%s)
    timeout -s KILL "$seconds" python3 tools/source_ab.py "$base" --family "$family" --codebooks "$codebooks" --ms "$ms" \
        --out "$OUT/ab-$family.json" > "$OUT/ab-$family.log" 2>&1
    echo "== ab $spec rc=$? in $(( $(date +%s) - start )) s"
done
for spec in "$@"; do grep -E "^(cell|[A-Z0-9_]+ M=)" "$OUT/ab-${spec%%:*}.log"; done
