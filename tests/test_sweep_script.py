"""lab/device/sweep_on_device.sh resumes from a carried tarball, off the device: with python3 stubbed (the spill check
passes, the sweep records its arguments), a missing ROOT is unpacked from ROOT.tgz before the sweep, an existing ROOT
is kept as it is, and a tarball that cannot be unpacked stops the call before anything is swept."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
from test_bench_report import REPO

SCRIPT = REPO / "lab" / "device" / "sweep_on_device.sh"
pytestmark = pytest.mark.skipif(not SCRIPT.is_file() or shutil.which("tar") is None,
                                reason="needs the checkout's lab/device/ and tar")


def call(tree: Path, out: Path) -> subprocess.CompletedProcess:
    (tree / "lab" / "device").mkdir(parents=True, exist_ok=True)
    for script in (SCRIPT, SCRIPT.parent / "device_env.sh"):
        shutil.copy(script, tree / "lab" / "device" / script.name)
    # python3 on PATH (the sweep runs under `timeout`, so a shell function would not stand in): device_env.sh's
    # install does nothing, the spill check (-m gemv_dispatch.kernels.ptxas) passes, the sweep writes its arguments
    # to $OUT/args.
    stub = tree / "stub" / "python3"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text('#!/bin/sh\n[ "$2" = gemv_dispatch.dispatch.cli ] && echo "$@" > "$OUT/args"\nexit 0\n')
    stub.chmod(0o755)
    out.mkdir(exist_ok=True)
    env = {**os.environ, "OUT": str(out), "PATH": f"{stub.parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["bash", "lab/device/sweep_on_device.sh", "all", "1", "graph", "30", "", "sw/corpus"],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=60)


def carried_tarball(tree: Path, manifest: str) -> None:
    """sw/corpus.tgz as the script returns a root: its top folder is the root's name."""
    source = tree / "returned" / "corpus" / "nvidia-h200"
    source.mkdir(parents=True)
    (source / "manifest.json").write_text(manifest)
    (tree / "sw").mkdir()
    with tarfile.open(tree / "sw" / "corpus.tgz", "w:gz") as tar:
        tar.add(source.parent, arcname="corpus")


def test_a_missing_root_is_unpacked_from_its_tarball(tmp_path):
    tree, out = tmp_path / "tree", tmp_path / "out"
    carried_tarball(tree, '{"carried": true}')
    result = call(tree, out)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "unpacked sw/corpus.tgz" in result.stdout
    assert (tree / "sw" / "corpus" / "nvidia-h200" / "manifest.json").read_text() == '{"carried": true}'
    assert "--corpus-root sw/corpus" in (out / "args").read_text()
    with tarfile.open(out / "corpus.tgz") as tar:  # and the root goes back, the carried cells in it
        assert "corpus/nvidia-h200/manifest.json" in tar.getnames()


def test_an_existing_root_is_not_replaced(tmp_path):
    tree, out = tmp_path / "tree", tmp_path / "out"
    carried_tarball(tree, '{"carried": true}')
    kept = tree / "sw" / "corpus" / "nvidia-h200"
    kept.mkdir(parents=True)
    (kept / "manifest.json").write_text('{"kept": true}')
    result = call(tree, out)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "unpacked" not in result.stdout and (kept / "manifest.json").read_text() == '{"kept": true}'


def test_a_broken_tarball_stops_the_call_before_the_sweep(tmp_path):
    tree, out = tmp_path / "tree", tmp_path / "out"
    (tree / "sw").mkdir(parents=True)
    (tree / "sw" / "corpus.tgz").write_bytes(b"not a tarball")
    result = call(tree, out)
    assert result.returncode == 1 and "cannot unpack sw/corpus.tgz" in result.stdout
    assert not (out / "args").exists() and not (out / "corpus.tgz").exists()
