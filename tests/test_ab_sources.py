"""tools/ab_sources.sh, in a scratch repository: each patch's kernel source beside HEAD's (a pending one from
lab/patches/, one since removed from git history), the working tree untouched, and one clear exit status for a patch
that is missing (2) or does not apply (1)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from test_bench_report import REPO

SCRIPT = REPO / "tools" / "ab_sources.sh"
pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
SOURCE = "kernels/cuda/gemv.cu"


def patch(old: str, new: str) -> str:
    """A patch of the kernel source's second line (old -> new) and of another file, which the script leaves out."""
    return (f"--- a/{SOURCE}\n+++ b/{SOURCE}\n@@ -1,3 +1,3 @@\n a\n-{old}\n+{new}\n c\n"
            "--- a/README\n+++ b/README\n@@ -1 +1 @@\n-x\n+y\n")


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "kernels" / "cuda").mkdir(parents=True)
    (root / "lab" / "patches").mkdir(parents=True)
    (root / "tools").mkdir()
    (root / SOURCE).write_text("a\nb\nc\n")
    (root / "README").write_text("x\n")
    shutil.copy(SCRIPT, root / "tools" / "ab_sources.sh")
    (root / "lab" / "patches" / "v7-good.patch").write_text(patch("b", "B"))
    (root / "lab" / "patches" / "v8-stale.patch").write_text(patch("q", "Q"))
    (root / "lab" / "patches" / "v6-gone.patch").write_text(patch("b", "b6"))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "base"],
                    ["rm", "-q", "lab/patches/v6-gone.patch"], ["commit", "-q", "-m", "v6 registered"]):
        subprocess.run([*git, *command], cwd=root, check=True)
    (root / SOURCE).write_text("a\nb\nworking tree\n")  # an uncommitted edit: HEAD's source is the base
    return root


def run(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "tools/ab_sources.sh", *args], cwd=root, capture_output=True, text=True,
                          timeout=60)


def test_each_patch_gives_its_version_of_heads_source(repo):
    done = run(repo, "out", "v7-good")
    assert done.returncode == 0, done.stderr
    assert (repo / "out" / "head.cu").read_text() == "a\nb\nc\n"
    assert (repo / "out" / "v7.cu").read_text() == "a\nB\nc\n"
    assert (repo / SOURCE).read_text() == "a\nb\nworking tree\n" and (repo / "README").read_text() == "x\n"


def test_a_missing_or_stale_patch_is_named_with_its_exit_status(repo):
    missing = run(repo, "out", "v9-missing")
    assert missing.returncode == 2 and "lab/patches/v9-missing.patch" in missing.stderr
    stale = run(repo, "out", "v7-good", "v8-stale")
    assert stale.returncode == 1 and "v8-stale does not apply" in stale.stderr
    assert run(repo).returncode == 2


def test_a_patch_removed_from_the_tree_comes_from_git_history(repo):
    """v6's patch was committed, then removed (its version registered): its last committed version still applies."""
    assert not (repo / "lab" / "patches" / "v6-gone.patch").exists()
    done = run(repo, "out", "v6-gone")
    assert done.returncode == 0, done.stderr
    assert "v6-gone: from git history" in done.stdout
    assert (repo / "out" / "v6.cu").read_text() == "a\nb6\nc\n"
