"""Install (docs/policy.md §9, §10): only certified, unedited tables for these kernels and this GPU model; atomic
replacement with the previous table kept; a kill at any instant leaves a working table; bad input is one line,
exit 2 (exit 3 for a full or read-only disk), and the installed table unchanged."""

from __future__ import annotations

import errno
import fcntl
import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner
from gemv_dispatch.dispatch.cli import main
from gemv_dispatch.dispatch.serve import install
from gemv_dispatch.dispatch.table import bundle
from gemv_dispatch.kernels.errors import InputError
from policy_fixture import FAKE_GPU
from table_fixture import as_gpu_level, certified_folder, forge, small_policy

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def tables_made(tmp_path_factory):
    """Two certified versions of the fake GPU's table (different policies)."""
    root = tmp_path_factory.mktemp("generated")
    return certified_folder(root / "a" / "fake-gpu-9000"), certified_folder(root / "b" / "fake-gpu-9000",
                                                                            small_policy(22, overlays=5))


def copy(folder: Path, to: Path) -> Path:
    to.mkdir(parents=True)
    for name in bundle.FILES:
        (to / name).write_bytes((folder / name).read_bytes())
    return to


def cli(*args: str):
    return CliRunner().invoke(main, list(args))


def current_bytes(tables: Path) -> dict[str, bytes]:
    current = tables / "fake-gpu-9000" / install.CURRENT
    return {name: (current / name).read_bytes() for name in bundle.FILES}


def test_install_serves_the_table_and_rollback_swaps(tables_made, tmp_path):
    a, b = tables_made
    tables = tmp_path / "tables"
    assert install.installed_table(FAKE_GPU, tables) is None
    done = install.install(a, tables, gpu=lambda: None)
    assert done.level == "emulator" and "emulator-level" in done.note
    loaded = install.installed_table(FAKE_GPU, tables)
    assert loaded.gpu_level is False  # emulator-level: serves no GPU
    assert tuple(loaded.select("q4_0", 5, 256, 512, "graph")) == tuple(small_policy().select("q4_0", 5, 256, 512))
    second = install.install(b, tables, gpu=lambda: None)
    assert second.previous == done.version
    assert current_bytes(tables)[bundle.MODULE] == (b / bundle.MODULE).read_bytes()
    back = install.rollback(FAKE_GPU, tables)
    assert back.version == done.version
    assert current_bytes(tables)[bundle.MODULE] == (a / bundle.MODULE).read_bytes()
    # Only the current and previous versions are kept.
    assert len(list((tables / "fake-gpu-9000" / install.VERSIONS).iterdir())) == 2


def test_gpu_model_and_level_rules(tables_made, tmp_path):
    a, _ = tables_made
    tables = tmp_path / "tables"
    with pytest.raises(InputError, match="this machine has a Other GPU"):
        install.install(a, tables, gpu=lambda: {"name": "Other GPU", "uuid": "u"})
    with pytest.raises(InputError, match="emulator-level certificate"):
        install.install(a, tables, gpu=lambda: {"name": FAKE_GPU, "uuid": "u"})
    gpu_level = copy(a, tmp_path / "gpu" / "fake-gpu-9000")
    forge(gpu_level, as_gpu_level)
    install.install(gpu_level, tables, gpu=lambda: {"name": FAKE_GPU, "uuid": "u"})
    assert install.installed_table(FAKE_GPU, tables).gpu_level is True


def tamper_module(folder: Path) -> None:
    data = bytearray((folder / bundle.MODULE).read_bytes())
    data[-2] ^= 1  # one byte
    (folder / bundle.MODULE).write_bytes(bytes(data))


def tamper_certificate(folder: Path) -> None:
    """One value edited, the JSON still valid and canonical: only the digest can tell."""
    data = (folder / bundle.CERTIFICATE).read_bytes()
    edited = data.replace(b'"passed": true', b'"passed": false', 1)
    assert edited != data
    (folder / bundle.CERTIFICATE).write_bytes(edited)


BAD = {
    "tampered module": (tamper_module, "bytes differ from what the certificate binds"),
    "tampered certificate": (tamper_certificate, "certificate.json: digest mismatch: the certificate was edited"),
    "missing certificate": (lambda f: (f / bundle.CERTIFICATE).unlink(), "no certificate.json"),
    "other kernel code": (lambda f: forge(f, lambda c: c["digests"].update(code="0" * 64)), "kernel code 000000"),
    "failed certificate": (lambda f: forge(f, lambda c: c.update(passed=False)), "failed or missing checks"),
    "module digests differ": (lambda f: forge(f, lambda c: c["digests"].update(policy="0" * 64)),
                              "DIGESTS or GPU_NAME differ"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_tables_are_refused_in_one_line_and_change_nothing(case, tables_made, tmp_path, monkeypatch):
    a, b = tables_made
    tables = tmp_path / "tables"
    monkeypatch.setattr(install, "current_gpu", lambda: None)
    install.install(a, tables, gpu=lambda: None)
    before = current_bytes(tables)
    bad = copy(b, tmp_path / "bad" / "fake-gpu-9000")
    spoil, message = BAD[case]
    spoil(bad)
    result = CliRunner().invoke(main, ["install", str(bad), "--tables", str(tables)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert re.search(message, lines[0]), lines[0]
    assert current_bytes(tables) == before


def test_other_gpu_via_cli_and_concurrent_install(tables_made, tmp_path, monkeypatch):
    a, b = tables_made
    tables = tmp_path / "tables"
    install.install(a, tables, gpu=lambda: None)
    before = current_bytes(tables)
    monkeypatch.setattr(install.install, "__defaults__", (None, lambda: {"name": "NVIDIA H200", "uuid": "u"}))
    result = cli("install", str(b), "--tables", str(tables))
    assert result.exit_code == 2 and "this machine has a NVIDIA H200" in result.output
    monkeypatch.setattr(install.install, "__defaults__", (None, lambda: None))
    fd = os.open(tables / "fake-gpu-9000" / install.LOCK, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another install holds the slot
        result = cli("install", str(b), "--tables", str(tables))
        assert result.exit_code == 2 and "another install or rollback is in progress" in result.output
    finally:
        os.close(fd)
    assert current_bytes(tables) == before
    result = cli("install", str(b), "--tables", str(tables))  # the lock is gone with its holder
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS])
def test_full_or_read_only_disk_changes_nothing(err, tables_made, tmp_path, monkeypatch):
    """Tests run as root, so a read-only folder is simulated: every fsync (the first write that must reach the
    disk) fails as a full or read-only file system would."""
    a, b = tables_made
    tables = tmp_path / "tables"
    install.install(a, tables, gpu=lambda: None)
    before = current_bytes(tables)
    monkeypatch.setattr(install.install, "__defaults__", (None, lambda: None))

    def failing(fd):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(install.os, "fsync", failing)
    result = cli("install", str(b), "--tables", str(tables))
    assert result.exit_code == 3, result.output
    assert len(result.output.strip().splitlines()) == 1 and os.strerror(err) in result.output
    monkeypatch.undo()
    assert current_bytes(tables) == before
    assert not list((tables / "fake-gpu-9000" / install.VERSIONS).glob(".tmp-*"))


KILLER = textwrap.dedent("""
    import os, shutil, signal, sys
    sys.path.insert(0, {tests!r})
    from gemv_dispatch.dispatch.serve import install
    calls = [0]
    limit = int(sys.argv[1])
    def counted(fn):
        def wrapper(*args, **kwargs):
            calls[0] += 1
            if calls[0] == limit:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)
        return wrapper
    for name in ("open", "fsync", "rename", "replace", "symlink", "mkdir", "unlink", "rmdir", "write"):
        setattr(install.os, name, counted(getattr(os, name)))
    install.install(install.Path(sys.argv[2]), install.Path(sys.argv[3]), gpu=lambda: None)
    print("calls", calls[0])
""")


def test_install_killed_at_any_point_leaves_a_working_table(tables_made, tmp_path):
    """SIGKILL at every OS call an install makes (counted in a subprocess), then at random ones: afterwards the
    installed table is the old or the new one, complete and verified, and the next install succeeds."""
    a, b = tables_made
    script = tmp_path / "killer.py"
    script.write_text(KILLER.format(tests=str(TESTS)))

    def run(limit: int, tables: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script), str(limit), str(b), str(tables)], capture_output=True,
                              text=True, check=False)

    probe = tmp_path / "probe"
    install.install(a, probe, gpu=lambda: None)
    done = run(0, probe)
    assert done.returncode == 0, done.stderr
    total = int(done.stdout.split()[-1])
    seed = random.randrange(1 << 30)
    print(f"{total} OS calls per install; random seed {seed}")
    points = list(range(1, total + 1)) + random.Random(seed).sample(range(1, total + 1), min(5, total))
    old, new = (a / bundle.MODULE).read_bytes(), (b / bundle.MODULE).read_bytes()
    for limit in points:
        tables = tmp_path / f"t{limit}-{len(list(tmp_path.iterdir()))}"
        install.install(a, tables, gpu=lambda: None)
        killed = run(limit, tables)
        assert killed.returncode == -9, f"kill point {limit}: {killed.stderr}"
        install._verified.cache_clear()
        loaded = install.installed_table(FAKE_GPU, tables)
        assert loaded is not None, f"kill point {limit}: no table"
        assert loaded.table.files[bundle.MODULE] in (old, new), f"kill point {limit}"
        install.install(b, tables, gpu=lambda: None)  # recovers what the killed install left
        assert current_bytes(tables)[bundle.MODULE] == new
        leftovers = [p.name for p in (tables / "fake-gpu-9000").rglob("*") if ".tmp" in p.name]
        assert not leftovers, f"kill point {limit}: {leftovers}"


def test_rollback_without_previous_is_refused(tables_made, tmp_path):
    a, _ = tables_made
    tables = tmp_path / "tables"
    result = cli("install", "--rollback", "fake-gpu-9000", "--tables", str(tables))
    assert result.exit_code == 2 and "no installed table" in result.output
    install.install(a, tables, gpu=lambda: None)
    result = cli("install", "--rollback", "fake-gpu-9000", "--tables", str(tables))
    assert result.exit_code == 2 and "no previous table" in result.output


@pytest.mark.parametrize("damage", ["module byte", "certificate edited", "header missing", "file replaced by a folder"])
def test_reinstalling_a_tampered_version_repairs_it_before_it_becomes_current(damage, tables_made, tmp_path):
    """Issue 50 (1a): `install` of a version already under versions/ compared nothing and made a tampered copy
    current (exit 0, then the loader refused it). Now the copy is checked byte for byte and rewritten."""
    a, b = tables_made
    tables = tmp_path / "tables"
    first = install.install(a, tables, gpu=lambda: None)
    install.install(b, tables, gpu=lambda: None)
    copy_of_a = tables / "fake-gpu-9000" / install.VERSIONS / first.version
    if damage == "module byte":
        tamper_module(copy_of_a)
    elif damage == "certificate edited":
        forge(copy_of_a, lambda c: c.update(passed=False))  # valid JSON with its own digest: only the bytes differ
    elif damage == "header missing":
        (copy_of_a / bundle.HEADER).unlink()
    else:
        (copy_of_a / bundle.MODULE).unlink()
        (copy_of_a / bundle.MODULE).mkdir()
    with pytest.raises(InputError):  # the damage is real: the copy as it stands does not verify
        bundle.verify(copy_of_a)
    install._verified.cache_clear()
    result = cli("install", str(a), "--tables", str(tables))
    assert result.exit_code == 0, result.output
    assert "repaired the installed copy of this version" in result.output
    assert current_bytes(tables) == {name: (a / name).read_bytes() for name in bundle.FILES}
    assert install.installed_table(FAKE_GPU, tables).table.version == first.version
    again = cli("install", str(a), "--tables", str(tables))  # control: an intact copy is left as it is
    assert again.exit_code == 0 and "repaired" not in again.output
