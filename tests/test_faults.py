"""Fault injection (issue 50, 7), on a CPU: damaged, truncated, forged and unlisted shards; a deleted manifest; a
full disk; a kill at every OS call of install and of compaction; tampered installed files; sweeps and installs
running at once. Each case asserts its exact outcome (the message, and the files unchanged or consistent), and
each harness has a control showing it did something: a kill harness that never killed, or a disk that never
filled, would otherwise pass."""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from corpus_fixture import (
    SLUG,
    build_corpus,
    cells,
    fake_provenance,
    fake_records,
    put_text,
    shard_paths,
    shard_text,
    sweep_args,
    tree,
    write_shapes,
)
from gemv_dispatch.dispatch.cli import main
from gemv_dispatch.dispatch.measure import corpus
from gemv_dispatch.dispatch.measure.corpus import MANIFEST, SHARDS, compact, load
from gemv_dispatch.dispatch.serve import install
from gemv_dispatch.dispatch.table import bundle
from gemv_dispatch.kernels.errors import InputError
from policy_fixture import FAKE_GPU
from table_fixture import certified_folder, forge, small_policy

REPO = Path(__file__).resolve().parents[1]
PROV = fake_provenance()


def cli(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line(result, code: int) -> str:
    assert result.exit_code == code, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    return result.stderr.strip()


@pytest.fixture()
def folder(tmp_path) -> Path:
    """A compacted corpus of the fixture's 16 cells, one shard."""
    return build_corpus(tmp_path / "root")


# --- shards -----------------------------------------------------------------------------------------------

def corrupt(path: Path) -> None:
    data = bytearray(shard_text(path))
    data[len(data) // 2] ^= 0x01  # one bit in the middle of a record, in a well-formed gzip file
    put_text(path, bytes(data))


def truncate(path: Path) -> None:
    put_text(path, shard_text(path)[:-37])


SHARD_FAULTS = {"corrupt": corrupt, "truncated": truncate}


@pytest.mark.parametrize("fault", sorted(SHARD_FAULTS))
@pytest.mark.parametrize("command", ["corpus check", "corpus compact", "sweep", "train"])
def test_a_damaged_listed_shard_is_named_and_nothing_changes(fault, command, folder, tmp_path):
    (path,) = shard_paths(folder)
    SHARD_FAULTS[fault](path)
    before = tree(folder)
    args = {"corpus check": ["corpus", "check", folder], "corpus compact": ["corpus", "compact", folder],
            "sweep": sweep_args(build_corpus(tmp_path / "src"), write_shapes(tmp_path / "s.json"), folder.parent),
            "train": ["train", folder, "-o", tmp_path / "p.json"]}[command]
    message = one_line(cli(*args), 2)
    assert message == (f"error: {path}: SHA-256 {corpus.sha256(shard_text(path))[:16]}… differs from the "
                       f"{path.name.split('-')[1][:16]}… its name promises (truncated or altered shard)")
    assert tree(folder) == before and not (tmp_path / "p.json").exists()


def forged_shard(folder: Path, factor: float) -> Path:
    """A well-formed shard, named after its own bytes, of the first cell's records with times x `factor`,
    dropped into shards/ without the manifest listing it."""
    records = [dataclasses.replace(r, median_us=r.median_us * factor, p5_us=r.p5_us * factor,
                                   p95_us=r.p95_us * factor, mad_us=r.mad_us * factor)
               for r in fake_records(cells()[0], PROV)]
    name, data = corpus._shard_of(PROV, records)
    put_text(folder / SHARDS / name, data)
    return folder / SHARDS / name


def test_a_forged_unlisted_shard_cannot_replace_listed_records(folder, tmp_path):
    """The issue's case: same cell and provenance, times / 10, dropped into shards/. load refuses the folder (an
    unlisted shard); every writer refuses to adopt it; the listed records stay what they were."""
    records = load(folder).records
    forged = forged_shard(folder, 0.1)
    before = tree(folder)
    assert one_line(cli("corpus", "check", folder), 2) == (
        f"error: {forged}: shard is not in the manifest (a sweep in progress, or one interrupted: "
        "`gemv-dispatch corpus compact` adopts complete shards)")
    src, shapes = build_corpus(tmp_path / "src"), write_shapes(tmp_path / "s.json")
    first = min(r.candidate for r in fake_records(cells()[0], PROV))
    for args in (["corpus", "compact", folder], sweep_args(src, shapes, folder.parent)):
        assert one_line(cli(*args), 2) == (
            f"error: {forged}: shard outside the manifest would replace listed records of {cells()[0]} (provenance "
            f"{PROV.key}, e.g. {first}); an unlisted shard is adopted only where it adds records: move it out of "
            f"{folder / SHARDS}")
        assert tree(folder) == before
    forged.unlink()
    assert load(folder).records == records


def test_an_unlisted_shard_that_adds_cells_is_adopted_after_verification(folder):
    """The control of the case above: the same kind of file for a cell the manifest lacks is adopted."""
    records = load(folder).records
    extra = corpus.Cell("Q4_0", 16, 256, 512, "graph")
    name, data = corpus._shard_of(PROV, fake_records(extra, PROV))
    put_text(folder / SHARDS / name, data)
    result = cli("corpus", "compact", folder)
    assert result.exit_code == 0, result.output
    loaded = load(folder)
    assert set(records) < set(loaded.records) and extra in loaded.cells()


def test_a_shard_whose_name_lies_about_its_provenance_is_refused(folder):
    twin = fake_provenance(gpu_uuid="GPU-twin")
    name, data = corpus._shard_of(PROV, fake_records(corpus.Cell("Q4_0", 16, 256, 512, "graph"), PROV))
    forged = folder / SHARDS / name.replace(PROV.key, twin.key)
    put_text(forged, data)
    before = tree(folder)
    assert one_line(cli("corpus", "compact", folder), 2) == (
        f"error: {forged}: header key '{PROV.key}' and name do not both match its provenance ({PROV.key})")
    assert tree(folder) == before


# --- the manifest -----------------------------------------------------------------------------------------

def test_a_deleted_manifest_is_rebuilt_from_verified_shards_or_nothing_is_written(tmp_path):
    folder = build_corpus(tmp_path / "root", compact=False)
    records = load(folder).records
    (folder / MANIFEST).unlink()
    assert one_line(cli("corpus", "check", folder), 2) == f"error: {folder}: not a corpus folder (no manifest.json)"
    bad = shard_paths(folder)[3]
    good = bad.read_bytes()
    truncate(bad)
    before = tree(folder)
    src, shapes = build_corpus(tmp_path / "src"), write_shapes(tmp_path / "s.json")
    for args in (["corpus", "compact", folder], sweep_args(src, shapes, folder.parent)):
        assert f"{bad.name}: SHA-256" in one_line(cli(*args), 2)
        assert tree(folder) == before and not (folder / MANIFEST).exists()
    bad.write_bytes(good)
    result = cli(*sweep_args(src, shapes, folder.parent))
    assert result.exit_code == 0, result.output
    assert "rebuilt the missing manifest from the verified shards: 16" in result.stderr
    assert load(folder).records == records and len(shard_paths(folder)) == 1


# --- a full disk --------------------------------------------------------------------------------------------

def _file_size_limit(limit: int) -> Callable[[], None]:
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    return apply


def limited(limit: int | None, *args: object) -> subprocess.CompletedProcess:
    """The command line in a child process whose files cannot grow past `limit` bytes (RLIMIT_FSIZE, as
    `ulimit -f` sets it): the disk is full for any larger write."""
    return subprocess.run([sys.executable, "-m", "gemv_dispatch.dispatch.cli", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, check=False, timeout=300,
                          preexec_fn=_file_size_limit(limit) if limit else None)


@pytest.fixture(scope="module")
def file_size_limits() -> None:
    """Skip, with the reason, where the platform does not enforce RLIMIT_FSIZE (the control of the tests below)."""
    code = "import tempfile\nwith tempfile.TemporaryFile() as f: f.write(b'x' * 8192); f.flush()"
    probe = subprocess.run([sys.executable, "-c", code], preexec_fn=_file_size_limit(4096), capture_output=True,
                           text=True, check=False)
    if "File too large" not in probe.stderr:
        pytest.skip(f"RLIMIT_FSIZE is not enforced here (an 8 KiB write under a 4 KiB limit: {probe.returncode})")


def test_disk_full_during_compaction_changes_nothing(file_size_limits, tmp_path):
    folder = build_corpus(tmp_path / "root", compact=False)
    before = tree(folder)
    done = limited(4096, "corpus", "compact", folder)  # the merged shard is ~40 KiB, each staged one less
    assert done.returncode == 3, done.stderr
    assert done.stderr == f"error: {folder / SHARDS}/{done.stderr.split('/')[-1].split(':')[0]}: File too large\n"
    assert tree(folder) == before
    assert limited(None, "corpus", "compact", folder).returncode == 0  # control: the same command, no limit


def test_disk_full_during_install_keeps_the_installed_table(file_size_limits, tmp_path):
    a = certified_folder(tmp_path / "a" / "fake-gpu-9000")
    b = certified_folder(tmp_path / "b" / "fake-gpu-9000", small_policy(22, overlays=5))
    tables = tmp_path / "tables"
    install.install(a, tables, gpu=lambda: None)
    before = tree(tables)
    done = limited(1024, "install", b, "--tables", tables)  # the module is several KiB
    assert done.returncode == 3 and done.stderr.count("\n") == 1 and "File too large" in done.stderr, done.stderr
    assert tree(tables) == before
    assert limited(None, "install", b, "--tables", tables).returncode == 0


def test_disk_full_during_a_sweep_keeps_what_was_there(file_size_limits, tmp_path):
    src, shapes = build_corpus(tmp_path / "src"), write_shapes(tmp_path / "s.json")
    root = tmp_path / "root"
    assert limited(None, *sweep_args(src, shapes, root, "--limit", "2")).returncode == 0
    before = tree(root / SLUG)
    done = limited(2048, *sweep_args(src, shapes, root))  # a cell's shard is several KiB
    errors = [line for line in done.stderr.splitlines() if " cells (" not in line]
    assert done.returncode == 3 and errors == [errors[0]] and errors[0].endswith(": File too large"), done.stderr
    assert tree(root / SLUG) == before  # no temp file, no manifest change
    assert limited(None, *sweep_args(src, shapes, root)).returncode == 0
    assert tree(root / SLUG) == tree(src)


# --- a kill at every OS call -------------------------------------------------------------------------------

MUTATING = ("open", "fsync", "replace", "rename", "unlink", "symlink", "mkdir", "rmdir", "chmod", "ftruncate")


def killed_at(limit: int, action: Callable[[], object]) -> tuple[int, int]:
    """Run `action` in a forked child that SIGKILLs itself at its `limit`-th OS call that can change a file
    (limit 0: never); returns (exit status, negative for a signal, and the calls the child made when it ended
    without being killed). The fork keeps the parent's imports: one kill point costs milliseconds."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read)
            real = {name: getattr(os, name) for name in MUTATING}
            calls = [0]

            def counted(fn: Callable[..., object]) -> Callable[..., object]:
                def wrapper(*args: object, **kwargs: object) -> object:
                    calls[0] += 1
                    if calls[0] == limit:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return fn(*args, **kwargs)
                return wrapper

            for name, fn in real.items():
                setattr(os, name, counted(fn))
            action()
            for name, fn in real.items():
                setattr(os, name, fn)
            os.write(write, str(calls[0]).encode())
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    out = os.read(read, 64)
    os.close(read)
    return os.waitstatus_to_exitcode(status), int(out or 0)


def every_kill(action: Callable[[Path], object], setup: Callable[[Path], None], check: Callable[[Path], str],
               tmp_path: Path) -> set[str]:
    """Kill `action` at each of its OS calls in a fresh copy made by `setup`, `check` the state it leaves; returns
    the outcomes `check` named. The control: the uninterrupted run must make calls, and every point must kill."""
    probe = tmp_path / "probe"
    setup(probe)
    status, total = killed_at(0, lambda: action(probe))
    assert status == 0 and total > 5, (status, total)
    outcomes = set()
    for k in range(1, total + 1):
        where = tmp_path / f"k{k}"
        setup(where)
        status, _ = killed_at(k, lambda where=where: action(where))
        assert status == -signal.SIGKILL, f"kill point {k} of {total}: the child was not killed ({status})"
        outcomes.add(check(where))
    return outcomes


def test_compaction_killed_at_every_os_call_loses_nothing(tmp_path):
    """A compaction killed at any OS call leaves a corpus that `load` reads with the same records (the manifest
    old or new) or refuses naming an unlisted shard, that recovery turns back into the same records, and that a
    second compaction turns into the bytes of an uninterrupted one."""
    source = build_corpus(tmp_path / "source", compact=False)
    records = load(source).records
    clean = tmp_path / "clean"
    build_corpus(clean, compact=False)
    compact(clean / SLUG)
    compacted = tree(clean / SLUG)
    manifest = (source / MANIFEST).read_bytes()

    def setup(where: Path) -> None:
        build_corpus(where, compact=False)

    def check(where: Path) -> str:
        folder = where / SLUG
        try:
            state = "old manifest" if (folder / MANIFEST).read_bytes() == manifest else "new manifest"
            assert load(folder).records == records
        except InputError as err:
            assert "shard is not in the manifest" in str(err), err
            state = "merged shard unlisted"
        assert corpus.recover(folder)[0].records == records
        compact(folder)
        assert tree(folder) == compacted
        return state

    outcomes = every_kill(lambda where: compact(where / SLUG), setup, check, tmp_path)
    assert outcomes == {"old manifest", "merged shard unlisted", "new manifest"}, outcomes


@pytest.fixture(scope="module")
def tables_made(tmp_path_factory):
    root = tmp_path_factory.mktemp("generated")
    return (certified_folder(root / "a" / "fake-gpu-9000"),
            certified_folder(root / "b" / "fake-gpu-9000", small_policy(22, overlays=5)))


def installed_module(tables: Path) -> bytes | None:
    """The module the runtime would serve, or None where the installed table does not verify."""
    install._verified.cache_clear()
    try:
        loaded = install.installed_table(FAKE_GPU, tables)
    except InputError:
        return None
    assert loaded is not None
    return loaded.table.files[bundle.MODULE]


@pytest.mark.parametrize("tampered", ["previous", "current"])
def test_a_repairing_install_killed_at_every_os_call(tampered, tables_made, tmp_path):
    """Reinstalling a version whose installed copy was tampered with repairs it; killed at any OS call of that,
    the current table is the old one or the repaired new one (a damaged current one stays refused, never served
    as it is), and the next install completes the repair."""
    a, b = tables_made
    old, new = (b / bundle.MODULE).read_bytes(), (a / bundle.MODULE).read_bytes()

    def setup(tables: Path) -> None:
        first = install.install(a, tables, gpu=lambda: None)
        if tampered == "previous":
            install.install(b, tables, gpu=lambda: None)
        copy = tables / "fake-gpu-9000" / install.VERSIONS / first.version
        forge(copy, lambda c: c.update(passed=False))

    def check(tables: Path) -> str:
        served = installed_module(tables)
        if tampered == "previous":
            assert served in (old, new)
        else:
            assert served in (None, new)  # still the damaged copy (refused), or repaired
        install.install(a, tables, gpu=lambda: None)
        assert installed_module(tables) == new
        leftovers = [p.name for p in (tables / "fake-gpu-9000").rglob("*") if ".tmp" in p.name]
        assert not leftovers, leftovers
        return {old: "old", new: "new", None: "refused"}[served]

    outcomes = every_kill(lambda tables: install.install(a, tables, gpu=lambda: None), setup, check, tmp_path)
    assert outcomes == ({"old", "new"} if tampered == "previous" else {"refused", "new"}), outcomes


# --- tampered installed files ------------------------------------------------------------------------------

TAMPER = {
    "module byte": (lambda v: (v / bundle.MODULE).write_bytes((v / bundle.MODULE).read_bytes()[:-2] + b"#\n"),
                    "dispatch_table.py: its bytes differ from what the certificate binds"),
    "header removed": (lambda v: (v / bundle.HEADER).unlink(), ": no dispatch_table.h file"),
    "certificate re-signed": (lambda v: forge(v, lambda c: c.update(passed=False)),
                              "certificate.json: the certificate records failed or missing checks"),
    "certificate edited": (lambda v: (v / bundle.CERTIFICATE).write_bytes(
        (v / bundle.CERTIFICATE).read_bytes().replace(b'"passed": true', b'"passed": false')),
        "certificate.json: digest mismatch"),
}


@pytest.mark.parametrize("how", sorted(TAMPER))
def test_a_tampered_installed_table_is_refused_by_the_runtime_and_check_and_repaired_by_install(how, tables_made,
                                                                                                 tmp_path):
    a, _ = tables_made
    tables = tmp_path / "tables"
    done = install.install(a, tables, gpu=lambda: None)
    version = tables / "fake-gpu-9000" / install.VERSIONS / done.version
    spoil, message = TAMPER[how]
    spoil(version)
    install._verified.cache_clear()
    with pytest.raises(InputError, match=message):
        install.installed_table(FAKE_GPU, tables)
    check = one_line(cli("check", "--installed", "fake-gpu-9000", "--tables", tables, "--device", "emulator"), 2)
    assert message in check, check
    result = cli("install", a, "--tables", tables)
    assert result.exit_code == 0 and "repaired the installed copy" in result.output, result.output
    assert installed_module(tables) == (a / bundle.MODULE).read_bytes()


# --- at the same time --------------------------------------------------------------------------------------

def test_concurrent_replay_sweeps_into_one_folder_give_the_clean_corpus(tmp_path):
    """Three replay sweeps (no GPU lock) into one corpus folder at once, each slowed per cell so they overlap:
    every one ends 0 and the folder holds the bytes of one uninterrupted sweep."""
    src, shapes = build_corpus(tmp_path / "src"), write_shapes(tmp_path / "s.json")
    root = tmp_path / "root"
    children = [subprocess.Popen([sys.executable, "-m", "gemv_dispatch.dispatch.cli",
                                  *sweep_args(src, shapes, root, "--replay-delay", "0.05", "--json")], cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [(child.communicate(timeout=300), child.returncode) for child in children]
    for (_, err), code in results:
        assert code == 0, err
    timed = [json.loads(out)["timed"] for (out, _), _ in results]
    assert sum(timed) >= len(cells())  # together they timed every cell, some cells twice
    assert tree(root / SLUG) == tree(src)


CONCURRENT_INSTALL = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from gemv_dispatch.dispatch.serve import install
    real, delay = install._write_version, float(sys.argv[3])
    def slow(slot, table):
        time.sleep(delay)  # inside the lock: the other install comes while this one holds it
        return real(slot, table)
    install._write_version = slow
    sys.argv[1:] = ["install", sys.argv[1], "--tables", sys.argv[2]]
    from gemv_dispatch.dispatch.cli import main
    main()
""")


def test_concurrent_installs_one_wins_the_other_refuses_in_one_line(tables_made, tmp_path):
    a, b = tables_made
    tables = tmp_path / "tables"
    install.install(a, tables, gpu=lambda: None)  # the slot exists: both contend for its lock
    script = tmp_path / "install.py"
    script.write_text(CONCURRENT_INSTALL)
    first = subprocess.Popen([sys.executable, str(script), str(b), str(tables), "3"], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)  # the first holds the lock by now: it imports (< 1 s here), then sleeps 3 s inside it
    second = subprocess.run([sys.executable, str(script), str(a), str(tables), "0"], cwd=REPO, capture_output=True,
                            text=True, check=False, timeout=120)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert second.returncode == 2 and second.stderr == (
        f"error: {tables / 'fake-gpu-9000'}: another install or rollback is in progress; try again when it ends\n")
    assert installed_module(tables) == (b / bundle.MODULE).read_bytes()
    again = subprocess.run([sys.executable, str(script), str(a), str(tables), "0"], cwd=REPO, capture_output=True,
                           text=True, check=False, timeout=120)
    assert again.returncode == 0, again.stderr  # control: with the lock free, the same command installs
    assert installed_module(tables) == (a / bundle.MODULE).read_bytes()
