"""What a user gets: the installed package, run from a folder outside the checkout, finds its shipped data (shape
inventories, the committed corpus and table) and installs under the one import name gemv_dispatch. Under CI the
package must come from site-packages, not from the checkout, or these tests would prove nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gemv_dispatch.dispatch.common.paths as paths
import pytest

REPO = Path(__file__).resolve().parents[1]


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMV_DISPATCH_")}
    env.update(HOME=str(cwd), XDG_DATA_HOME=str(cwd / "share"), PYTHONPATH="")
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)


def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "gemv_dispatch.dispatch.cli", *args], tmp_path)


@pytest.mark.skipif(not os.environ.get("CI"), reason="CI installs the package non-editable; a checkout may not")
def test_ci_tests_the_installed_package_not_the_checkout():
    assert paths.source_checkout() is None, f"gemv_dispatch runs from the checkout {paths.source_checkout()}"
    assert REPO not in Path(paths.__file__).resolve().parents


def test_shipped_inventories_are_found_from_another_folder(tmp_path):
    done = cli(tmp_path, "shapes", "list", "--json")
    assert done.returncode == 0, done.stderr
    names = {inv["name"] for inv in json.loads(done.stdout)}
    assert {"llama-3.1-8b", "qwen2.5-7b", "synthetic-grid"} <= names


def test_shipped_corpus_and_table_are_found(tmp_path):
    data = paths.data_dir()
    done = cli(tmp_path, "corpus", "check", str(data / "corpus" / "nvidia-h200"), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["records"] > 0
    for name in ("dispatch_table.py", "dispatch_table.h", "certificate.json", "policy.json"):
        assert (data / "generated" / "nvidia-h200" / name).is_file()


def test_bare_names_kernels_and_dispatch_are_not_ours(tmp_path):
    code = ("import importlib.util, gemv_dispatch.kernels, gemv_dispatch.dispatch\n"
            "for name in ('kernels', 'dispatch'):\n"
            "    spec = importlib.util.find_spec(name)\n"
            "    print(name, None if spec is None else spec.origin)\n")
    done = run([sys.executable, "-c", code], tmp_path)
    assert done.returncode == 0, done.stderr
    for line in done.stdout.splitlines():
        name, origin = line.split(" ", 1)
        assert origin == "None" or "gemv_dispatch" not in origin, f"{name} resolves to {origin}"


def test_a_missing_data_folder_is_one_line(tmp_path):
    """Negative control: pointed at an empty data folder, the tool says so instead of finding shapes."""
    env_run = run([sys.executable, "-c", "import os, subprocess, sys; os.environ['GEMV_DISPATCH_DATA'] = sys.argv[1];"
                   "sys.exit(subprocess.run([sys.executable, '-m', 'gemv_dispatch.dispatch.cli', 'shapes', 'list']"
                   ").returncode)", str(tmp_path)], tmp_path)
    assert env_run.returncode == 2, env_run.stderr
    assert len(env_run.stderr.strip().splitlines()) == 1


def test_readme_commands_work_from_any_folder(tmp_path):
    """Issue 50 (2): the README's paths (corpus/nvidia-h200, generated/nvidia-h200/) failed outside a checkout.
    Run from an empty folder, they name the shipped corpus and table; `paths` says where those are."""
    done = cli(tmp_path, "paths", "--json")
    assert done.returncode == 0, done.stderr
    where = json.loads(done.stdout)
    assert "nvidia-h200" in where["gpu_models_with_a_corpus"] and where["gpu_models_with_a_table"] == ["nvidia-h200"]
    for args in (["corpus", "check", "corpus/nvidia-h200", "--json"], ["corpus", "check", "nvidia-h200", "--json"]):
        done = cli(tmp_path, *args)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["folder"] == str(Path(where["shipped_corpora"]) / "nvidia-h200")
    done = cli(tmp_path, "install", "generated/nvidia-h200/", "--tables", str(tmp_path / "tables"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{tmp_path / 'tables' / 'nvidia-h200'}: current is")
