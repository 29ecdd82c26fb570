# Sourced by the device scripts: install this checkout (editable, no network, no dependencies: the device image
# has them) and any wheels carried in .whl/ (e.g. gguf), so `gemv_dispatch` imports the working tree.
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | grep -v -i warning | tail -3
# step LIMIT CMD...: run CMD under its own time limit (killed at it, so a slow step cannot take the results of the
# earlier ones with it) and print its exit status and seconds. A limit of 0 or less skips CMD (`timeout 0` is none).
step() { local limit=$1; shift; local t0=$(date +%s)
         if [ "$limit" -le 0 ]; then echo "== $* -> skipped: $limit s left"; return 124; fi
         timeout -s KILL "$limit" "$@"; local rc=$?
         echo "== $* -> rc=$rc in $(( $(date +%s) - t0 )) s"; return $rc; }
# unpack_root ROOT: a corpus root carried as its tarball (ROOT.tgz beside it, as sweep_on_device.sh returns it) is
# unpacked where ROOT is missing; the sweep resumes from it and the table is trained on it.
unpack_root() {
    local root=$1
    if [ -d "$root" ] || [ ! -f "$root.tgz" ]; then return 0; fi
    tar xzf "$root.tgz" -C "$(dirname "$root")" || { echo "cannot unpack $root.tgz"; return 1; }
    echo "unpacked $root.tgz"
}
