"""lab/device/ab_sweep_on_device.sh's decisions, off the device: with the A/B and the sweep stubbed (the recorded
version 35 runs, which ab_decide keeps, and version 36's, which it drops), the applied patches stay or are reverted
last first, the sweep runs on whatever source is kept, and a call without a verdict sweeps nothing."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from corpus_fixture import build_corpus, fake_provenance
from test_ab_decide import requesting, runs
from test_bench_report import DATA, REPO

SCRIPT = REPO / "lab" / "device" / "ab_sweep_on_device.sh"
pytestmark = pytest.mark.skipif(not SCRIPT.is_file() or shutil.which("patch") is None,
                                reason="needs the checkout's lab/device/ and the patch tool")


def call(tmp_path: Path, runs: list[str | Path], patches: int,
         **env: str) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """The script in a scratch tree whose file `source` holds `patches` lines, line i added by patch i; the stubbed
    A/B leaves the recorded runs `ab-RUN.json` of tests/data (or the run files given as paths)."""
    tree, out = tmp_path / "tree", tmp_path / "out"
    device = tree / "lab" / "device"
    device.mkdir(parents=True)
    (tree / "tools").mkdir()
    out.mkdir()
    shutil.copy(SCRIPT, device / SCRIPT.name)
    shutil.copy(REPO / "tools" / "ab_decide.py", tree / "tools" / "ab_decide.py")
    (device / "device_env.sh").write_text(f'python3() {{ "{sys.executable}" "$@"; }}\n')
    files = [run if isinstance(run, Path) else DATA / f"ab-{run}.json" for run in runs]
    copies = " ".join(f'cp {file} "$OUT"; touch "$OUT/{file.stem}.log";' for file in files)
    (device / "ab_on_device.sh").write_text(copies + "\n")
    (device / "sweep_on_device.sh").write_text('echo "$@" > "$OUT/swept"\n')
    names = [f"p{i}.patch" for i in range(patches)]
    for i, name in enumerate(names):  # patch i appends line i
        (tree / name).write_text(f"--- a/source\n+++ b/source\n@@ -{i},0 +{i + 1} @@\n+line {i}\n")
    (tree / "source").write_text("".join(f"line {i}\n" for i in range(patches)))
    command = ["bash", "lab/device/ab_sweep_on_device.sh", "base.cu", "1", "0.99", " ".join(names), "x:Q4_0:1"]
    result = subprocess.run(command, cwd=tree, env={**os.environ, "OUT": str(out), **env}, capture_output=True,
                            text=True, timeout=120)
    return result, tree, out


def test_a_winning_tree_is_swept_as_it_is(tmp_path):
    result, tree, out = call(tmp_path, [f"v35-{f}-h200" for f in ("direct", "kpar", "wide")], 2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tree / "source").read_text() == "line 0\nline 1\n"
    assert "keep the tree's source" in (out / "decide.txt").read_text()
    assert (out / "swept").read_text().startswith("all 1,4,16 graph ") and (out / "ab.tgz").is_file()


def test_a_losing_tree_is_reverted_before_the_sweep(tmp_path):
    result, tree, out = call(tmp_path, [f"v36-{f}-h200" for f in ("kpar", "wide")], 2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tree / "source").read_text() == ""
    assert "reverting p0.patch p1.patch" in result.stdout and (out / "swept").is_file()


def test_no_verdict_no_sweep(tmp_path):
    result, tree, out = call(tmp_path, [], 1)
    assert result.returncode == 1 and "no sweep" in result.stdout
    assert (tree / "source").read_text() == "line 0\n" and not (out / "swept").exists()


def test_a_cut_run_gives_no_verdict_and_names_what_it_missed(tmp_path):
    """Versions 38-44's direct run, faster everywhere, as if its command had asked for a codebook it never reached."""
    cut = requesting(runs("v38-44-direct")[0], "direct", "IQ4_XS,Q6_K,IQ4_NL", "1")
    (tmp_path / "ab-direct.json").write_text(json.dumps(cut))
    result, tree, out = call(tmp_path, [tmp_path / "ab-direct.json"], 1)
    assert result.returncode == 1 and "no verdict (ab_decide.py exit 2): no sweep" in result.stdout
    assert "not measured (the run was cut): direct IQ4_NL M=1" in result.stdout
    assert (tree / "source").read_text() == "line 0\n" and not (out / "swept").exists()


def test_the_sweep_takes_the_gpus_it_is_given(tmp_path):
    result, _, out = call(tmp_path, [f"v35-{f}-h200" for f in ("direct", "kpar", "wide")], 1, SWEEP_DEVICES="0,1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (out / "swept").read_text().split()[4:] == ["0,1", "/tmp/sw/corpus"]


@pytest.mark.parametrize("digest", [None, "0" * 64])
def test_a_kept_source_the_committed_corpus_holds_is_not_swept_again(tmp_path, digest):
    """The baseline wins; the committed corpus (GPU_SLUG's folder) was swept with its digest (the installed package's
    source, as on the device), or, the negative control, with another one."""
    folder = build_corpus(tmp_path / "tree" / "corpus", fake_provenance(kernel_digest=digest), codebooks=["Q4_0"])
    result, tree, out = call(tmp_path, [f"v36-{f}-h200" for f in ("kpar", "wide")], 1, GPU_SLUG=folder.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ("is the committed corpus's: no sweep" in result.stdout) == (digest is None)
    assert re.search(r"kernel digest [0-9a-f]{12}\b", result.stdout)  # named in either case
    assert (out / "swept").exists() == (digest is not None)
    assert (tree / "source").read_text() == ""  # reverted all the same
