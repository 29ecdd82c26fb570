"""`sweep --ray` on a CPU: a local Ray cluster declaring two fake GPUs, timings replayed from the fixture corpus.

Without Ray the cluster tests skip with a reason, except under CI (CI=true), which installs it with the test extra.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator

import pytest
from corpus_fixture import FAKE_GPU, SLUG, build_corpus, cells, fake_provenance, invoke, sweep_args, tree
from gemv_dispatch.dispatch.common.gpu import gpu_slug
from gemv_dispatch.dispatch.measure.corpus import load
from gemv_dispatch.dispatch.measure.fleet import ReplaySpec, run_fleet
from gemv_dispatch.dispatch.measure.sweep import ReplayTimer, parse_plan, run_sweep
from test_sweep import cli, shard_files


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray of 2 CPUs and 2 fake GPUs for the whole module (starting one takes seconds); its address."""
    if os.environ.get("CI"):
        ray = importlib.import_module("ray")
    else:
        ray = pytest.importorskip("ray", reason="Ray is not installed (the `fleet` extra); CI requires it")
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, logging_level="WARNING", object_store_memory=100 << 20)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def test_a_fleet_replay_equals_the_one_process_sweep(cluster, source, shapes, clean_sweep, tmp_path):
    result = invoke(*sweep_args(source, shapes, tmp_path, "--ray", "--json"))  # --ray alone: this process's Ray
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["cells"] == summary["timed"] == len(cells()) and summary["skipped"] == 0
    assert summary["records"] == len(load(source).records) and summary["folders"] == [str(tmp_path / SLUG)]
    assert tree(tmp_path / SLUG) == clean_sweep
    assert f"GPU 0: {FAKE_GPU} on " in result.stderr and f"GPU 1: {FAKE_GPU} on " in result.stderr
    assert f"{len(cells())}/{len(cells())} cells (100.0%)" in result.stderr and "ETA" in result.stderr
    again = json.loads(invoke(*sweep_args(source, shapes, tmp_path, "--ray", "--json")).stdout)
    assert (again["timed"], again["skipped"], again["records"]) == (0, len(cells()), 0)
    assert tree(tmp_path / SLUG) == clean_sweep


def test_workers_killed_mid_run_lose_and_duplicate_nothing(cluster, source, shapes, clean_sweep, tmp_path):
    """A driver of its own (a subprocess attached to the cluster by address); both actors' processes are
    SIGKILLed while each measures a group (4 groups of 4 cells, 0.3 s a cell). Ray restarts them and retries."""
    child = cli(*sweep_args(source, shapes, tmp_path, "--ray", cluster, "--replay-delay", "0.3", "--json"))
    pids = []
    while len(pids) < 2 and (line := child.stderr.readline()):
        pids += [int(m[1]) for m in [re.search(r"^GPU \d+: .* pid (\d+)$", line)] if m]
    assert len(pids) == 2, child.communicate()
    deadline = time.monotonic() + 60
    while shard_files(tmp_path / SLUG) < 4 and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # the first groups are in, the next ones a quarter measured
    staged = shard_files(tmp_path / SLUG)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    assert child.poll() is None and 4 <= staged < len(cells()), "the sweep was not mid-run"
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    summary = json.loads(out)
    assert summary["timed"] == len(cells()) and summary["records"] == len(load(source).records)  # each cell once
    assert tree(tmp_path / SLUG) == clean_sweep


def test_each_gpu_model_gets_its_own_folder_and_resumes(cluster, source, shapes, tmp_path):
    other = build_corpus(tmp_path / "other", provenance=fake_provenance(gpu_name="Other GPU 7"))
    plan = parse_plan("Q4_0,Q8_0", "1,4", "graph,eager", [shapes])
    out = tmp_path / "out"
    run_sweep(parse_plan("Q4_0,Q8_0", "1,4", "graph,eager", [shapes], limit=5), out, ReplayTimer(load(source)))
    result = run_fleet(plan, out, ReplaySpec((str(source), str(other))))  # GPU 0 replays source, GPU 1 other
    assert result.folders == (str(out / SLUG), str(out / gpu_slug("Other GPU 7")))
    assert (result.cells, result.skipped, result.timed) == (2 * len(cells()), 5, 2 * len(cells()) - 5)
    assert tree(out / SLUG) == tree(source) and tree(out / gpu_slug("Other GPU 7")) == tree(other)


def test_an_actors_error_is_one_line(cluster, source, shapes, tmp_path):
    result = invoke(*sweep_args(source, shapes, tmp_path, "--ray", "--m", "1,31"))
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: 8 of 16 cells of the plan cannot be timed (a replay corpus lacks"), \
        result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert not (tmp_path / SLUG).exists()


# --- without a cluster ----------------------------------------------------------------------------------

def test_ray_and_devices_exclude_each_other(source, shapes, tmp_path):
    result = invoke(*sweep_args(source, shapes, tmp_path, "--ray", "--devices", "0,1"))
    assert result.exit_code == 2 and result.stderr == "error: --ray and --devices exclude each other: a Ray " \
        "cluster deals out its own GPUs\n"


def test_without_ray_installed_one_line_and_exit_3(source, shapes, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    result = invoke(*sweep_args(source, shapes, tmp_path, "--ray", "auto"))
    assert result.exit_code == 3
    assert result.stderr == "error: Ray is not installed: pip install 'gemv-dispatch[fleet]'\n"
    assert not (tmp_path / SLUG).exists()
