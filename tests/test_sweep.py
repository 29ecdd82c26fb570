"""The sweep: plans, replay timing through the CLI, resume after SIGKILL, --devices, bad input."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from corpus_fixture import (
    FAKE_GPU,
    GEOMETRIES,
    build_corpus,
    cells,
    fake_provenance,
    fake_records,
    tree,
    write_shapes,
)
from gemv_dispatch.dispatch.cli import main
from gemv_dispatch.dispatch.corpus import MANIFEST, Cell, gpu_slug, load, write_shard
from gemv_dispatch.dispatch.sweep import (
    GpuTimer,
    Progress,
    ReplayTimer,
    SweepPlan,
    parse_devices,
    parse_plan,
    run_sweep,
)
from gemv_dispatch.dispatch.timing import TimingConfig
from gemv_dispatch.kernels.codebooks import CODEBOOKS
from gemv_dispatch.kernels.errors import InputError

REPO = Path(__file__).resolve().parents[1]
SLUG = gpu_slug(FAKE_GPU)
PLAN_ARGS = ["--codebooks", "Q4_0,Q8_0", "--m", "1,4", "--modes", "graph,eager"]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The fixture corpus a replay sweep reads."""
    return build_corpus(tmp_path_factory.mktemp("source"))


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    return write_shapes(tmp_path_factory.mktemp("shapes") / "fixture.json")


def sweep_args(source: Path, shapes: Path, root: Path, *extra: str) -> list[str]:
    return ["sweep", "--replay", str(source), "--shapes", str(shapes), "--corpus-root", str(root),
            *PLAN_ARGS, *extra]


def invoke(*args: str) -> object:
    return CliRunner().invoke(main, list(args))


@pytest.fixture(scope="module")
def clean_sweep(source, shapes, tmp_path_factory) -> dict[str, bytes]:
    """The corpus files of one uninterrupted one-process replay sweep: what every other run must equal."""
    root = tmp_path_factory.mktemp("clean")
    result = invoke(*sweep_args(source, shapes, root))
    assert result.exit_code == 0, result.output
    return tree(root / SLUG)


# --- plans --------------------------------------------------------------------------------------------

def test_default_plan_is_the_model_inventories_all_codebooks_three_ms_graph():
    plan = parse_plan()
    assert plan.codebooks == CODEBOOKS and plan.ms == (1, 4, 16) and plan.modes == ("graph",)
    assert plan.timing.cold_l2 and plan.timing.race
    assert len(plan.geometries) == 96
    assert len(plan.cells()) == 96 * 6 * 3 == 1728


def test_plan_options_widen_and_limit(shapes):
    plan = parse_plan("all", "1,2", "eager,graph", [shapes], limit=5, hot=True)
    assert plan.codebooks == CODEBOOKS and plan.modes == ("eager", "graph") and not plan.timing.cold_l2
    assert plan.geometries == GEOMETRIES
    assert len(plan.cells()) == 5
    assert parse_plan("q4_0", "1", "graph", [shapes]).codebooks == ("Q4_0",)


def test_cells_are_grouped_by_geometry_and_parts_deal_whole_geometries(shapes):
    plan = parse_plan("Q4_0,Q8_0", "1,4,16", "graph,eager", [shapes])
    full = plan.cells()
    assert full == sorted(full, key=lambda c: (c.codebook, c.n, c.k, c.m, c.mode != "graph"))
    parts = [plan.part(i, 3) for i in range(3)]
    assert sorted(c for p in parts for c in p) == sorted(full)
    geometry = [{(c.codebook, c.n, c.k) for c in p} for p in parts]
    assert all(not (a & b) for i, a in enumerate(geometry) for b in geometry[i + 1:])
    assert plan.part(0, 1) == full


def test_progress_line_has_an_eta():
    out = io.StringIO()
    progress = Progress(4, "device 1: ", out, every_s=0.0)
    for i in range(1, 5):
        progress.update(i, f"cell {i}")
    lines = out.getvalue().splitlines()
    assert len(lines) == 4 and lines[0].startswith("device 1: 1/4 cells (25.0%)") and "ETA" in lines[0]
    assert lines[-1].endswith("cell 4")


# --- replay -------------------------------------------------------------------------------------------

def test_replay_sweep_through_the_cli_reproduces_its_source(source, shapes, tmp_path):
    result = invoke(*sweep_args(source, shapes, tmp_path, "--json"))
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    n_cells = len(cells())
    assert summary["cells"] == summary["timed"] == n_cells and summary["skipped"] == 0
    assert summary["folders"] == [str(tmp_path / SLUG)]
    assert summary["provenances"] == [fake_provenance().key]
    assert summary["records"] == len(load(source).records)
    assert tree(tmp_path / SLUG) == tree(source)  # same provenance, same stats: the same bytes
    again = invoke(*sweep_args(source, shapes, tmp_path))
    assert again.exit_code == 0 and f"0 timed, {n_cells} already in the corpus" in again.stdout
    assert tree(tmp_path / SLUG) == tree(source)


def test_run_sweep_skips_done_cells_and_limit_cuts_the_plan(source, shapes, tmp_path):
    timer = ReplayTimer(load(source))
    fixture_plan = {"codebooks": "Q4_0,Q8_0", "shapes": [shapes], "ms": "1,4", "modes": "graph,eager"}
    first = run_sweep(parse_plan(**fixture_plan, limit=3), tmp_path, timer)
    assert (first.cells, first.timed, first.skipped) == (3, 3, 0)
    second = run_sweep(parse_plan(**fixture_plan), tmp_path, timer)
    assert (second.cells, second.timed, second.skipped) == (len(cells()), len(cells()) - 3, 3)
    assert tree(tmp_path / SLUG) == tree(source)


def test_replay_of_a_missing_cell_is_named(source, tmp_path):
    plan = SweepPlan(("Q4_0",), (1,), ("graph",), ((2048, 2048),))
    with pytest.raises(InputError, match="no record of cell Q4_0 M=1 N=2048 K=2048 graph"):
        run_sweep(plan, tmp_path, ReplayTimer(load(source)))


def test_replay_needs_a_corpus_of_one_provenance(tmp_path):
    folder = build_corpus(tmp_path)
    twin = fake_provenance(gpu_uuid="GPU-twin")
    write_shard(folder, twin, fake_records(cells()[0], twin))
    with pytest.raises(InputError, match="one provenance, found 2"):
        ReplayTimer(load(folder))


def test_sweep_refuses_a_folder_measured_with_other_kernel_sources(source, shapes, tmp_path):
    old = fake_provenance(kernel_digest="0" * 64)
    folder = build_corpus(tmp_path, provenance=old)
    result = invoke(*sweep_args(source, shapes, tmp_path))
    assert result.exit_code == 2
    (shard,) = (folder / "shards").glob("*.jsonl")
    assert shard.name in result.stderr and "kernel_digest" in result.stderr


# --- interruption and devices (subprocesses) -------------------------------------------------------------

def cli(*args: str, **kwargs: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gemv_dispatch.dispatch.cli", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def listed_shards(folder: Path) -> int:
    try:
        return len(json.loads((folder / MANIFEST).read_text())["shards"])
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def test_sigkill_mid_sweep_then_rerun_loses_and_duplicates_nothing(source, shapes, clean_sweep, tmp_path):
    killed = tmp_path / "killed"
    child = cli(*sweep_args(source, shapes, killed, "--replay-delay", "0.2"))
    deadline = time.monotonic() + 60
    while listed_shards(killed / SLUG) < 3 and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.communicate()
    assert child.returncode == -signal.SIGKILL, "the sweep ended before it could be killed"
    done = listed_shards(killed / SLUG)
    assert 3 <= done < len(cells())

    result = invoke(*sweep_args(source, shapes, killed, "--json"))
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["skipped"] >= done and summary["timed"] + summary["skipped"] == len(cells())
    assert tree(killed / SLUG) == clean_sweep


def test_devices_with_replay_give_the_same_corpus_as_one_device(source, shapes, clean_sweep, tmp_path):
    multi = tmp_path / "multi"
    result = invoke(*sweep_args(source, shapes, multi, "--devices", "0,1", "--json"))
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["timed"] == len(cells()) and summary["folders"] == [str(multi.resolve() / SLUG)]
    assert tree(multi / SLUG) == clean_sweep


def test_a_failing_device_child_is_reported(tmp_path, shapes):
    result = invoke(*sweep_args(tmp_path / "missing", shapes, tmp_path, "--devices", "3"))
    assert result.exit_code == 1 and "sweep failed on device 3" in result.stderr


# --- bad input ----------------------------------------------------------------------------------------

def bad_shapes(tmp_path: Path, entry: dict) -> Path:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"name": "bad", "family": "bad", "source": "test", "shapes": [entry]}))
    return path


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a, t: [*a, "--codebooks", "Q9_9"], "unknown codebook 'Q9_9'"),
        (lambda a, t: [*a, "--m", "0"], "--m: '0' is not an integer >= 1"),
        (lambda a, t: [*a, "--modes", "lazy"], "--modes: unknown mode 'lazy'"),
        (lambda a, t: [*a, "--limit", "0"], "--limit must be >= 1"),
        (lambda a, t: [*a, "--devices", "0,x"], "--devices: 'x' is not a device id"),
        (lambda a, t: [*a, "--devices", "1,1"], "names a device twice"),
        (lambda a, t: [*a, "--shapes", str(bad_shapes(t, {"role": "q", "n": 64, "k": 100}))],
         "k=100 is not a multiple of 32"),
        (lambda a, t: [*a, "--shapes", str(bad_shapes(t, {"role": "q", "n": 64}))], "missing key(s) k"),
        (lambda a, t: [*a, "--shapes", str(t / "none.json")], "no such inventory file"),
        (lambda a, t: [*a[:2], str(t / "nope"), *a[3:]], "no such corpus folder"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(source, shapes, tmp_path, change, message):
    args = change(sweep_args(source, shapes, tmp_path / "out"), tmp_path)
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert not (tmp_path / "out").exists()  # nothing written


def test_no_timing_under_a_profiler(monkeypatch):
    monkeypatch.setenv("CUDA_INJECTION64_PATH", "/opt/nsight/libinjection.so")
    with pytest.raises(InputError, match="profiler is attached"):
        GpuTimer(TimingConfig())


def test_parse_devices():
    assert parse_devices("0, 2,1") == ["0", "2", "1"]


def test_plan_validates_hand_built_plans():
    with pytest.raises(InputError, match="spelled"):
        SweepPlan(("q4_0",), (1,), ("graph",), ((64, 64),))
    with pytest.raises(InputError, match="invalid"):
        SweepPlan(("Q4_0",), (1,), ("graph",), ((64, 48),))
    assert SweepPlan(("Q4_0",), (1,), ("graph",), ((64, 64),)).cells() == [Cell("Q4_0", 1, 64, 64, "graph")]


# --- on a GPU -----------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_sweep_smoke(tmp_path, shapes):
    """Four cells of one codebook, hot L2 so windows stay short (cold L2 needs thousands of copies here)."""
    args = ["sweep", "--shapes", str(shapes), "--corpus-root", str(tmp_path), "--codebooks", "Q4_0",
            "--m", "1,3", "--modes", "graph,eager", "--limit", "4", "--hot", "--json"]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["timed"] == 4
    (folder,) = summary["folders"]
    loaded = load(folder)
    assert len(loaded.cells()) == 4 and len(loaded.shards) == 1
    (prov,) = loaded.provenances.values()
    assert prov.gpu_uuid.startswith("GPU-") and prov.l2_bytes > 0 and prov.sm_count > 0
    assert not prov.timing["cold_l2"]
    for record in loaded.records:
        assert 0 < record.p5_us <= record.median_us <= record.p95_us and record.copies == 1
    again = json.loads(invoke(*args).stdout)
    assert (again["timed"], again["skipped"]) == (0, 4)


def test_sweep_without_a_usable_device_is_one_line(monkeypatch, tmp_path):
    """CuPy present but no driver or device: one clear line and exit 2, not a CUDA traceback."""
    from types import SimpleNamespace

    from gemv_dispatch.kernels import launch

    class CUDARuntimeError(RuntimeError):
        pass

    def no_driver() -> int:
        raise CUDARuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")

    runtime = SimpleNamespace(CUDARuntimeError=CUDARuntimeError, getDeviceCount=no_driver)
    monkeypatch.setattr(launch, "cupy", SimpleNamespace(cuda=SimpleNamespace(runtime=runtime)))
    result = CliRunner().invoke(main, ["sweep", "--limit", "1", "--corpus-root", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.strip() == "error: no usable CUDA device: cudaErrorInsufficientDriver: CUDA driver version " \
        "is insufficient"
