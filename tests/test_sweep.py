"""The sweep: plans, replay timing through the CLI, resume after SIGKILL, --devices, bad input."""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from corpus_fixture import (
    GEOMETRIES,
    SLUG,
    build_corpus,
    cells,
    fake_provenance,
    fake_records,
    invoke,
    sweep_args,
    tree,
    write_shapes,
)
from gemv_dispatch.dispatch.cli import main
from gemv_dispatch.dispatch.measure import corpus, gpulock
from gemv_dispatch.dispatch.measure.corpus import MANIFEST, SHARDS, Cell, compact, load, write_shard
from gemv_dispatch.dispatch.measure.shapes import Inventory, Shape, load_inventory, write_inventory
from gemv_dispatch.dispatch.measure.sweep import (
    GpuTimer,
    Progress,
    ReplayTimer,
    SweepPlan,
    cell_work,
    parse_devices,
    parse_plan,
    run_sweep,
)
from gemv_dispatch.dispatch.measure.timing import TimingConfig
from gemv_dispatch.kernels.codebooks import CODEBOOKS, LEGACY
from gemv_dispatch.kernels.errors import EnvironmentProblem, InputError
from gemv_dispatch.kernels.registry import BY_ID

REPO = Path(__file__).resolve().parents[1]


# --- plans --------------------------------------------------------------------------------------------

def test_default_plan_is_the_model_inventories_all_codebooks_three_ms_graph():
    plan = parse_plan()
    assert plan.codebooks == CODEBOOKS and plan.ms == (1, 4, 16) and plan.modes == ("graph",)
    assert plan.timing.cold_l2 and plan.timing.race
    assert len(plan.geometries) == 96
    whole = [(n, k) for n, k in plan.geometries if k % 256 == 0]  # the super-block formats' geometries
    assert len(whole) == 90
    assert len(plan.cells()) == (96 * 6 + 90 * 4) * 3 == 2808


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


def typed_inventory(path: Path) -> Path:
    """A GGUF-derived inventory: the first geometry stored as Q4_0, the second as Q8_0 and Q4_K, plus an
    untyped shape, a Q6_K-only one, and an untyped one whose K (288) holds no whole super-block."""
    (g0, g1), extra = GEOMETRIES, (512, 256)
    shapes = (Shape(*g0, "q", "m", "f", ("Q4_0",)), Shape(*g1, "v", "m", "f", ("Q4_K", "Q8_0")),
              Shape(*extra, "o", "m", "f"), Shape(1024, 512, "down", "m", "f", ("Q6_K",)),
              Shape(64, 288, "k", "m", "f"))
    return write_inventory(Inventory("m", "f", "gguf:m.gguf", shapes), path)


def test_a_typed_inventory_sweeps_each_shape_in_its_own_types(tmp_path):
    inv = typed_inventory(tmp_path / "typed.json")
    plan = parse_plan("all", "1", "graph", [inv])
    (g0, g1), extra, q6, odd = GEOMETRIES, (512, 256), (1024, 512), (64, 288)
    assert {(c.codebook, c.n, c.k) for c in plan.cells()} == {
        ("Q4_0", *g0), ("Q8_0", *g1), ("Q4_K", *g1), ("Q6_K", *q6), *((cb, *extra) for cb in CODEBOOKS),
        *((cb, *odd) for cb in LEGACY)}
    narrowed = parse_plan("Q8_0", "1", "graph", [inv])
    assert {(c.codebook, c.n, c.k) for c in narrowed.cells()} == {("Q8_0", *g1), ("Q8_0", *extra), ("Q8_0", *odd)}
    q4_0_only = write_inventory(Inventory("m", "f", "gguf:m.gguf", (Shape(256, 512, "q", "m", "f", ("Q4_0",)),)),
                                tmp_path / "q4_0.json")
    with pytest.raises(InputError, match=r"no shape in the codebooks asked for \(Q8_0\)"):
        parse_plan("Q8_0", "1", "graph", [q4_0_only])
    assert parse_plan("all", "1", "graph", [write_shapes(tmp_path / "untyped.json")]).typed is None


def test_a_typed_replay_sweep_through_the_cli_measures_only_what_the_model_stores(source, tmp_path):
    inv = typed_inventory(tmp_path / "typed.json")
    result = invoke("sweep", "--replay", str(source), "--shapes", str(inv), "--corpus-root", str(tmp_path / "out"),
                    "--codebooks", "Q4_0,Q8_0", "--m", "1,4", "--modes", "graph", "--json")
    assert result.exit_code == 2, result.output  # the replayed corpus lacks two geometries
    assert "8 of 12 cells of the plan cannot be timed" in result.stderr  # (512, 256) and (64, 288) in both
    with_known = write_inventory(Inventory("m", "f", "gguf:m.gguf", tuple(
        s for s in load_inventory(inv).shapes if s.codebooks and s.role != "down")), tmp_path / "known.json")
    result = invoke("sweep", "--replay", str(source), "--shapes", str(with_known), "--corpus-root",
                    str(tmp_path / "out"), "--codebooks", "Q4_0,Q8_0", "--m", "1,4", "--modes", "graph")
    assert result.exit_code == 0, result.output
    assert "warning" not in result.output
    swept = {(c.codebook, c.n, c.k) for c in load(tmp_path / "out" / SLUG).cells()}
    (g0, g1) = GEOMETRIES
    assert swept == {("Q4_0", *g0), ("Q8_0", *g1)}


def test_progress_line_has_an_eta_from_measured_cells_weighted_by_work():
    out = io.StringIO()
    progress = Progress([1.0, 1.0, 1.0, 1.0, 4.0], "device 1: ", out, every_s=0.0)
    for i in range(1, 6):
        progress.update(i, f"cell {i}")
    lines = out.getvalue().splitlines()
    assert len(lines) == 5 and lines[0].startswith("device 1: 1/5 cells (20.0%)") and "ETA ?" in lines[0]
    assert "ETA ?" in lines[1] and "ETA ?" not in lines[2]  # "?" until three cells are measured
    assert lines[-1].endswith("cell 5")
    # 3 units of work took 30 s: the 5 units left take 50 s, not 2 cells x 10 s.
    assert progress.eta(3, 30.0) == "0m50s" and progress.eta(4, 40.0) == "0m40s"


def test_cell_work_grows_with_candidates_and_large_weights():
    small, large = Cell("Q4_0", 1, 4096, 4096, "graph"), Cell("Q4_0", 1, 262144, 16384, "graph")
    assert cell_work(large) > cell_work(small) > 0


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


def test_a_replay_lacking_cells_is_refused_up_front(source, shapes, tmp_path):
    plan = SweepPlan(("Q4_0", "Q8_0"), (1, 4, 16), ("graph",), ((256, 512), (2048, 2048)))
    with pytest.raises(InputError, match=r"8 of 12 cells .* e\.g\. Q4_0 M=16 N=256 K=512 graph; Q4_0 M=1 N=2048"):
        run_sweep(plan, tmp_path, ReplayTimer(load(source)))
    assert list(tmp_path.iterdir()) == []  # no empty folder left behind
    result = invoke(*sweep_args(source, shapes, tmp_path / "out", "--m", "1,31"))
    assert result.exit_code == 2 and "8 of 16 cells of the plan cannot be timed" in result.stderr
    assert result.stderr.count("\n") == 1 and not (tmp_path / "out").exists()


def test_replay_of_a_corpus_of_several_gpus_reproduces_it(tmp_path):
    folder = build_corpus(tmp_path / "src", compact=False)
    twin = fake_provenance(gpu_uuid="GPU-twin")
    for cell in cells()[:5]:  # the twin measured a few of the same cells, and one partially
        write_shard(folder, twin, fake_records(cell, twin))
    write_shard(folder, twin, fake_records(cells()[5], twin)[1:])
    compact(folder)
    plan = parse_plan("Q4_0,Q8_0", "1,4", "graph,eager", [write_shapes(tmp_path / "s.json")])
    result = run_sweep(plan, tmp_path / "out", ReplayTimer(load(folder)))
    assert result.provenances == tuple(sorted((fake_provenance().key, twin.key)))
    assert (result.timed, result.skipped) == (len(cells()) + 5, 0)
    replayed = tree(tmp_path / "out" / SLUG)
    assert replayed != tree(folder)  # the twin's partial cell cannot be served ...
    write_shard(folder, twin, fake_records(cells()[5], twin))  # ... once complete, the copy is exact
    compact(folder)
    run_sweep(plan, tmp_path / "again", ReplayTimer(load(folder)))
    assert tree(tmp_path / "again" / SLUG) == tree(folder)


def test_a_code_change_re_times_only_the_candidates_it_touches(source, shapes, tmp_path, monkeypatch):
    """After a change of the code some candidates run (here: every kernel instantiation only one family
    launches), a sweep times just those candidates, in every cell that has them, and keeps the rest; their old
    records stay as stale; a policy trained before the change is refused."""
    from gemv_dispatch.dispatch.learn.train import train
    from gemv_dispatch.dispatch.table.certify import check_policy
    from gemv_dispatch.kernels import digests
    from gemv_dispatch.kernels.registry import CANDIDATES

    plan = parse_plan("Q4_0,Q8_0", "1,4", "graph,eager", [shapes])
    first = run_sweep(plan, tmp_path, ReplayTimer(load(source)))
    folder = tmp_path / SLUG
    before, _ = train(load(folder))
    names = {c.family: set() for c in CANDIDATES}
    for c in CANDIDATES:
        names[c.family] |= {c.kernel_name(cb, m) for cb in ("Q4_0", "Q8_0") for m in (1, 4)}
    family = next(f for f in sorted(names) if names[f] - set().union(*(v for g, v in names.items() if g != f)))
    touched = names[family] - set().union(*(v for g, v in names.items() if g != family))
    expected = sum(BY_ID[r.candidate].kernel_name(r.codebook, r.m) in touched for r in load(folder).records)
    assert touched and 0 < expected < first.records
    changed = {name: "f" * 64 if name in touched else code for name, code in digests.table().items()}
    monkeypatch.setattr(digests, "table", lambda: changed)
    monkeypatch.setattr(digests, "code_digest", lambda: "e" * 64)
    timer, timed = ReplayTimer(load(source)), []
    measure = timer.measure
    monkeypatch.setattr(timer, "measure", lambda cell, p, cands: timed.extend(cands) or measure(cell, p, cands))
    second = run_sweep(plan, tmp_path, timer)
    assert {c.family for c in timed} == {family} and len(timed) == second.records == expected
    after = load(folder)
    assert after.stale == expected and len(after.current) == first.records
    assert all(r.candidate in {c.id for c in timed} for r in after.records if r not in set(after.current))
    assert run_sweep(plan, tmp_path, timer).records == 0  # nothing left to time
    with pytest.raises(InputError, match="trained for kernel code"):
        check_policy(before)


# --- interruption and devices (subprocesses) -------------------------------------------------------------

def cli(*args: str, **kwargs: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gemv_dispatch.dispatch.cli", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def shard_files(folder: Path) -> int:
    """Complete shards, listed or staged (a sweep lists its staged shards at its end)."""
    return len(list((folder / SHARDS).glob("*.jsonl.gz")))


def test_sigkill_mid_sweep_then_rerun_loses_and_duplicates_nothing(source, shapes, clean_sweep, tmp_path):
    killed = tmp_path / "killed"
    child = cli(*sweep_args(source, shapes, killed, "--replay-delay", "0.2"))
    deadline = time.monotonic() + 60
    while shard_files(killed / SLUG) < 3 and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.communicate()
    assert child.returncode == -signal.SIGKILL, "the sweep ended before it could be killed"
    done = shard_files(killed / SLUG)
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
    # A missing replay folder is refused by the parent now (common.paths.resolve), before any child starts:
    # the child fails instead on a replay corpus that exists but does not load.
    assert invoke(*sweep_args(tmp_path / "missing", shapes, tmp_path, "--devices", "3")).exit_code == 2
    broken = build_corpus(tmp_path / "src")
    (shard,) = (broken / SHARDS).glob("*.jsonl.gz")
    shard.write_bytes(shard.read_bytes()[:-5])
    result = invoke(*sweep_args(broken, shapes, tmp_path / "out", "--devices", "3"))
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
    """CuPy present but no usable device: one clear line and exit 3 (the environment's), not a traceback."""
    from types import SimpleNamespace

    from gemv_dispatch.kernels import launch

    class CUDARuntimeError(RuntimeError):
        pass

    def no_driver() -> int:
        raise CUDARuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")

    runtime = SimpleNamespace(CUDARuntimeError=CUDARuntimeError, getDeviceCount=no_driver)
    monkeypatch.setattr(launch, "cupy", SimpleNamespace(cuda=SimpleNamespace(runtime=runtime)))
    monkeypatch.setattr(launch, "nvidia_driver_present", lambda: True)
    result = CliRunner().invoke(main, ["sweep", "--limit", "1", "--corpus-root", str(tmp_path)])
    assert result.exit_code == 3
    assert result.output.strip() == "error: no usable CUDA device: cudaErrorInsufficientDriver: CUDA driver version " \
        "is insufficient"
    # Without libcuda at all, CuPy reports the same "insufficient driver"; say what is really missing.
    monkeypatch.setattr(launch, "nvidia_driver_present", lambda: False)
    result = CliRunner().invoke(main, ["sweep", "--limit", "1", "--corpus-root", str(tmp_path)])
    assert result.exit_code == 3 and result.output == "error: no NVIDIA driver found (libcuda.so.1 cannot be loaded)\n"
    info = CliRunner().invoke(main, ["info", "--json"])
    assert info.exit_code == 0 and "no NVIDIA driver found" in json.loads(info.stdout)["cuda_device"]
    assert list(tmp_path.iterdir()) == []


# --- issue 8: options, lock, per-cell cost, OS errors -----------------------------------------------------

@pytest.mark.parametrize(("extra", "message"), [
    (["--hot"], "--hot cannot apply under --replay"),
    (["--wait"], "--wait cannot apply under --replay"),
])
def test_options_that_cannot_apply_to_a_replay_are_refused(source, shapes, tmp_path, extra, message):
    result = invoke(*sweep_args(source, shapes, tmp_path / "out", *extra))
    assert result.exit_code == 2 and result.stderr == f"error: {message}\n"
    assert not (tmp_path / "out").exists()
    assert invoke(*sweep_args(source, shapes, tmp_path / "out")).exit_code == 0  # control: without it, it runs


class LockingReplay(ReplayTimer):
    """A replay that claims a GPU, as GpuTimer does: the sweep must hold that GPU's lock while it times."""

    lock_key = "GPU-00000000-0000-0000-0000-00000000beef"


@pytest.fixture
def locks(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(gpulock.LOCKS_ENV, str(tmp_path / "locks"))
    return tmp_path / "locks"


def test_gpu_lock_refuses_a_second_holder_and_names_its_pid(locks):
    with gpulock.hold("GPU-a") as path:
        assert path == locks / "GPU-a.lock"
        busy = f"GPU GPU-a is being timed by another sweep \\(pid {os.getpid()}"
        with pytest.raises(EnvironmentProblem, match=busy), gpulock.hold("GPU-a"):
            pass
        with gpulock.hold("GPU-b"):  # another GPU is free
            pass
    with gpulock.hold("GPU-a"):  # released on exit
        pass


def test_a_second_sweep_on_one_gpu_is_refused_or_waits(source, shapes, locks, tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from gemv_dispatch.dispatch.measure import gpulock\n"
                               f"with gpulock.hold({LockingReplay.lock_key!r}):\n print('held', flush=True)\n"
                               " time.sleep(float(sys.argv[1]))\n print('releasing', time.time(), flush=True)", "1.5"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        plan = parse_plan("Q4_0,Q8_0", "1,4", "graph,eager", [shapes])
        with pytest.raises(EnvironmentProblem, match=f"pid {holder.pid}"):
            run_sweep(plan, tmp_path, LockingReplay(load(source)))
        assert not (tmp_path / SLUG).exists()  # refused before anything was written
        start = time.monotonic()
        result = run_sweep(plan, tmp_path, LockingReplay(load(source)), wait=True)
        finished = time.time()
        # The waiting sweep ended after the holder's last moment with the lock (not after its exit, which a loaded
        # machine can delay past the sweep's end).
        releasing = float(holder.stdout.readline().split()[1])
        assert result.timed == len(cells()) and releasing <= finished and time.monotonic() - start > 0.3
    finally:
        holder.kill()
        holder.wait()


def test_a_sweep_rewrites_the_manifest_once_not_per_cell(source, shapes, tmp_path, monkeypatch):
    writes: list[str] = []
    real = corpus.write_atomic
    monkeypatch.setattr(corpus, "write_atomic", lambda path, data: writes.append(path.name) or real(path, data))
    plan = parse_plan("Q4_0,Q8_0", "1,4", "graph,eager", [shapes])
    run_sweep(plan, tmp_path, ReplayTimer(load(source)))
    assert writes.count(MANIFEST) <= 3 and len(writes) >= len(cells())  # init, compaction (2); one shard per cell
    assert tree(tmp_path / SLUG) == tree(source)


def test_a_no_op_rerun_does_not_compact(source, shapes, tmp_path, monkeypatch):
    plan = parse_plan("Q4_0,Q8_0", "1,4", "graph,eager", [shapes])
    run_sweep(plan, tmp_path, ReplayTimer(load(source)))
    before = tree(tmp_path / SLUG)
    monkeypatch.setattr(corpus, "compact", lambda folder: pytest.fail("compacted a corpus that did not change"))
    assert run_sweep(plan, tmp_path, ReplayTimer(load(source))).timed == 0
    assert tree(tmp_path / SLUG) == before


def test_disk_full_during_a_sweep_is_one_line_and_keeps_the_finished_cells(source, shapes, tmp_path, monkeypatch):
    real, calls = os.fsync, []

    def full_after_three_shards(fd: int) -> None:
        calls.append(fd)
        if len(calls) > 8:  # the manifest at init (2 fsyncs), then 2 per staged shard
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    monkeypatch.setattr(os, "fsync", full_after_three_shards)
    result = invoke(*sweep_args(source, shapes, tmp_path))
    monkeypatch.undo()
    errors = [line for line in result.stderr.splitlines() if " cells (" not in line]  # not a progress line
    assert result.exit_code == 3 and len(errors) == 1, result.output  # beside the progress lines, one line
    assert errors[0].startswith(f"error: {tmp_path / SLUG / SHARDS}/") and "No space left" in errors[0]
    assert not list((tmp_path / SLUG / SHARDS).glob(".*"))  # no temp file left
    assert shard_files(tmp_path / SLUG) == 3
    again = json.loads(invoke(*sweep_args(source, shapes, tmp_path, "--json")).stdout)
    assert again["skipped"] == 3 and tree(tmp_path / SLUG) == tree(source)


def test_an_inventory_into_a_read_only_folder_names_the_path(tmp_path, monkeypatch):
    def read_only(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(OSError, match="Read-only file system") as caught:
        write_shapes(tmp_path / "shapes.json")
    assert caught.value.filename == str(tmp_path / "shapes.json") and list(tmp_path.iterdir()) == []


def test_the_gpu_uuid_survives_a_zero_byte(monkeypatch):
    """CUDA's 16 UUID bytes spell nvidia-smi's UUID; bytes cut at a zero byte (CuPy reads a C string) are
    asked of nvidia-smi by PCI bus id, and an answer from neither is an environment problem."""
    from gemv_dispatch.dispatch.common import gpu

    assert gpu.gpu_uuid(bytes(range(16)), "x") == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    asked = []
    monkeypatch.setattr(gpu, "nvidia_smi", lambda gpu, query: asked.append((gpu, query)) or ["GPU-00ab-cd"])
    assert gpu.gpu_uuid(b"", "00000000:19:00.0") == "GPU-00ab-cd"
    assert asked == [("00000000:19:00.0", "uuid")]
    monkeypatch.setattr(gpu, "nvidia_smi", lambda gpu, query: None)
    with pytest.raises(EnvironmentProblem, match=r"cannot read the UUID of GPU 00000000:19:00\.0"):
        gpu.gpu_uuid(b"\x12\x34", "00000000:19:00.0")


def test_a_failing_sweep_leaves_every_file_as_it_was(source, shapes, tmp_path):
    """Issue 50 (1c): a sweep into a folder whose manifest was deleted and a shard corrupted exited 2 but left a
    new, empty manifest.json behind; and a sweep whose first cell fails left an empty corpus folder."""
    folder = build_corpus(tmp_path / "root", compact=False)
    (folder / MANIFEST).unlink()
    bad = sorted((folder / SHARDS).glob("*.jsonl.gz"))[1]
    bad.write_bytes(bad.read_bytes()[:-20])
    before = tree(folder)
    result = invoke(*sweep_args(source, shapes, tmp_path / "root"))
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert bad.name in result.stderr and "truncated or altered" in result.stderr
    assert tree(folder) == before and not (folder / MANIFEST).exists()

    class Broken(ReplayTimer):
        def measure(self, *args):
            raise InputError("the first cell failed")

    with pytest.raises(InputError, match="the first cell failed"):
        run_sweep(parse_plan("Q4_0", "1", "graph", [shapes]), tmp_path / "fresh", Broken(load(source)))
    assert not (tmp_path / "fresh").exists()


def test_a_cell_listed_incomplete_gets_only_its_missing_candidates_timed(source, shapes, tmp_path):
    """A cell the manifest holds incomplete gets only its missing candidate timed: a staged shard that adds a
    record (recovery adopts it), never one that replaces the listed records."""
    folder = tmp_path / SLUG
    corpus.init(folder)
    partial = cells()[0]
    write_shard(folder, fake_provenance(), fake_records(partial, fake_provenance())[1:])
    result = run_sweep(parse_plan("Q4_0,Q8_0", "1,4", "graph,eager", [shapes]), tmp_path, ReplayTimer(load(source)))
    assert result.timed == len(cells())
    assert result.records == sum(len(fake_records(c, fake_provenance())) for c in cells()) - (
        len(fake_records(partial, fake_provenance())) - 1)
    assert load(folder).done_cells(fake_provenance().key) == set(cells())
