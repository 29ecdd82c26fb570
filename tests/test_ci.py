"""CI's own checks (issue 50, 6): `.ci/run` fails when nothing was tested and requires its tools itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CI = Path(__file__).resolve().parents[1] / ".ci"


def report(tmp_path: Path, *cases: str) -> Path:
    """A junit XML report of pytest's form holding `cases` ("pass", or "skip:REASON")."""
    rows = []
    for i, case in enumerate(cases):
        body = "" if case == "pass" else f'<skipped type="pytest.skip" message="{case[5:]}">x</skipped>'
        rows.append(f'<testcase classname="tests.test_x" name="test_{i}" time="0.0">{body}</testcase>')
    path = tmp_path / "report.xml"
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{"".join(rows)}</testsuite>'
                    "</testsuites>")
    return path


def verdict(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CI / "verdict.py"), str(path), "--allow-skip", "gpu test:"],
                          capture_output=True, text=True, check=False)


@pytest.mark.parametrize(("cases", "message"), [
    ((), "ci: no test ran (none collected)"),
    (("skip:gpu test: no CuPy", "skip:gpu test: no CuPy"), "ci: every one of the 2 tests was skipped"),
    (("pass", "skip:nvcc is not on PATH"), "ci: 1 tests skipped for a reason CI must not have, e.g. "
                                           "tests.test_x::test_1: nvcc is not on PATH"),
])
def test_the_verdict_fails_a_run_that_tested_nothing_or_skipped_a_tool(cases, message, tmp_path):
    done = verdict(report(tmp_path, *cases))
    assert done.returncode == 1 and done.stderr.startswith(message), done.stderr


def test_the_verdict_passes_a_run_with_only_gpu_skips(tmp_path):
    """The control: the same script passes what CI should pass."""
    done = verdict(report(tmp_path, "pass", "pass", "skip:gpu test: no CuPy"))
    assert done.returncode == 0 and done.stdout.startswith("ci: 2 tests ran, 1 skipped"), done.stderr
    assert verdict(tmp_path / "absent.xml").returncode == 1


def fake_tools(folder: Path, *names: str) -> str:
    folder.mkdir()
    for name in names:
        (folder / name).write_text("#!/bin/sh\nexit 0\n")
        (folder / name).chmod(0o755)
    return str(folder)


@pytest.mark.parametrize(("tools", "message"), [((), "ci: nvcc is required"), (("nvcc",), "ci: g++ is required")])
def test_ci_run_requires_nvcc_and_gpp_itself(tools, message, tmp_path):
    """Without nvcc or g++ on PATH, .ci/run stops at once, whatever CI says; with both (fakes) it goes past the
    check (and then fails here for want of python3 on that PATH: the control that the check can pass)."""
    bash = "/bin/bash" if os.path.exists("/bin/bash") else "bash"
    env = {"PATH": fake_tools(tmp_path / "bin", *tools), "CI": "true"}
    done = subprocess.run([bash, str(CI / "run")], capture_output=True, text=True, env=env, check=False, timeout=60)
    assert done.returncode == 1 and done.stderr.startswith(message), done.stderr
    env["PATH"] = fake_tools(tmp_path / "both", "nvcc", "g++")
    done = subprocess.run([bash, str(CI / "run")], capture_output=True, text=True, env=env, check=False, timeout=60)
    assert done.returncode != 0 and "is required" not in done.stderr, done.stderr
