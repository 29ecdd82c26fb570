#!/usr/bin/env bash
# One device call on a machine with several GPUs: `sweep --ray` over every GPU of a local Ray, against the
# same plan's --devices sweep (lab/device/sweep_on_device.sh). Ray travels as a pruned copy of its wheel in .ray/
# (ray-min.tar.xz: no Java jars, dashboard build, RLlib, Data, Serve, Train, Tune) and the wheels of the
# dependencies the device image lacks; carry .ray and .whl. To make .ray/ (here, with network; listed in
# .git/info/exclude): pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux2014_x86_64 -d /tmp/w ray jsonschema jsonschema-specifications referencing rpds-py; unzip the ray wheel,
# delete ray/{jars,rllib,data,serve,train,tune,llm} and ray/dashboard/client/build, `tar cJf .ray/ray-min.tar.xz .`
# inside it; move the four other wheels to .ray/. (.ray/extra/ holds ray/widgets and ray/workflow if they were
# deleted too: ray imports them at start.) The whole travels under the 64 MiB limit only without the corpus
# shards: move corpus/*/shards out of the checkout for that call.
#   bash lab/device/fleet_on_device.sh [CODEBOOKS] [MS] [MODES] [SECONDS]   -> $OUT/ray.tgz, $OUT/ray.json, $OUT/ray.log
set -uo pipefail
source lab/device/device_env.sh
mkdir -p /tmp/rs && tar xJf .ray/ray-min.tar.xz -C /tmp/rs \
    && { [ ! -d .ray/extra ] || cp -r .ray/extra/ray/. /tmp/rs/ray/; } && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/rs .ray/*.whl \
    && export PYTHONPATH=/tmp/rs:${PYTHONPATH:-}
python3 -c "import ray; print('ray', ray.__version__)" || exit 3
start=$(date +%s)
timeout -s KILL "${4:-240}" python3 -m gemv_dispatch.dispatch.cli sweep --ray --corpus-root /tmp/fleet \
    --codebooks "${1:-all}" --m "${2:-1}" --modes "${3:-graph}" --json > "$OUT/ray.json" 2> "$OUT/ray.log"
echo "sweep --ray rc=$? wall=$(( $(date +%s) - start ))s"; cat "$OUT/ray.json"; grep -E "^GPU|cells \(" "$OUT/ray.log" | tail -6
tar czf "$OUT/ray.tgz" -C /tmp fleet  # not /tmp/ray: Ray keeps its sessions there
