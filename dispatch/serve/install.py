"""Install certified tables (docs/policy.md §9) and load them for the runtime.

Layout of the install location (`paths.tables_dir()`, env GEMV_DISPATCH_TABLES, or --tables):

    <tables>/<gpu-slug>/versions/<version>/{dispatch_table.py, dispatch_table.h, certificate.json}
    <tables>/<gpu-slug>/current  -> versions/<version>     the table the runtime serves
    <tables>/<gpu-slug>/previous -> versions/<version>     kept for `install --rollback`
    <tables>/<gpu-slug>/.lock                              flock held by an install or rollback

A version folder is written under a temp name, fsynced and renamed whole, and never changed afterwards; the
`current` and `previous` symlinks are replaced with rename (atomic), `previous` first. So a reader that
resolves `current` always sees one complete, verified table, and an install killed at any instant leaves
`current` at the old or the new table; the next install removes what the killed one left. Installing a version
that is there already compares its copy with the verified bytes first and rewrites each file that differs
(atomically): a copy damaged or edited since is repaired before it becomes current, never made current as is.

`verify` is the one place a table folder is judged (install, check, and the runtime through
`installed_table` and `shipped_table`): certificate present, canonical and self-consistent, passed; module and
header bytes equal to what it binds; the module's own DIGESTS and GPU_NAME equal to the certificate's; made for
these kernels.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from ...kernels.errors import InputError
from ..common.files import fsync_dir, locked, write_atomic
from ..common.gpu import current_gpu, gpu_slug
from ..common.paths import data_dir, tables_dir
from ..table.bundle import CERTIFICATE, FILES, Table, verify

CURRENT = "current"
PREVIOUS = "previous"
VERSIONS = "versions"
LOCK = ".lock"
TEMP_PREFIX = ".tmp-"


# ---------------------------------------------------------------------------------------------------------
# The runtime's view


@dataclass(frozen=True)
class LoadedTable:
    """The installed table of one GPU model, as the runtime uses it (docs/policy.md)."""

    table: Table
    gpu_level: bool  # certified on a GPU of this model (docs/policy.md §9: only then may it serve that GPU)

    @property
    def certificate(self) -> dict[str, Any]:
        return self.table.certificate

    @property
    def sm_count(self) -> int | None:
        """The SMs of the GPU the table was tuned on (its module's SM_COUNT), None where the module lacks it."""
        sms = getattr(self.table.module, "SM_COUNT", None)
        return sms if isinstance(sms, int) else None

    def select(self, codebook: str, m: int, n: int, k: int, mode: str = "graph") -> Any:
        """Choice(candidate, identity, source) of the installed module; ValueError for invalid arguments."""
        return self.table.module.select(codebook, m, n, k, mode)


@cache
def _verified(folder: str) -> Table:
    # An installed version folder never changes once renamed into place, nor does the shipped data: each is
    # verified once per process.
    return verify(Path(folder))


def installed_table(gpu_name: str, tables: Path | None = None) -> LoadedTable | None:
    """The table installed for `gpu_name`'s model, or None when none is. InputError when one is installed but
    fails verification (damaged, or made for other kernel sources)."""
    link = (tables or tables_dir()) / gpu_slug(gpu_name) / CURRENT
    if not link.is_symlink():
        return None
    table = _verified(str(link.resolve()))
    return LoadedTable(table, table.level == "gpu" and table.gpu_name == gpu_name)


def shipped_table(gpu_name: str, sm_count: int, shipped: Path | None = None) -> tuple[LoadedTable | None, list[str]]:
    """The committed table (`generated/<gpu-slug>/` of the shipped data, or `shipped`) that serves a GPU model
    with no installed table, and why each other one was refused.

    Only tables that `verify` accepts (as install does: certificate, digests, these kernels) with a GPU-level
    certificate count. This model's own committed table comes first; else the one tuned on the GPU model whose
    SM count (its module's SM_COUNT) is nearest to `sm_count`, ties to the folder name (deterministic). (None,
    reasons) when none loads."""
    folder = shipped or data_dir() / "generated"
    refused, usable = [], []
    for cert in sorted(folder.glob(f"*/{CERTIFICATE}")):
        try:
            table = LoadedTable(_verified(str(cert.parent)), False)
        except InputError as err:
            refused.append(str(err))
            continue
        if table.table.level != "gpu":
            refused.append(f"{cert.parent}: certified on the emulator only")
            continue
        usable.append(table)

    def rank(t: LoadedTable) -> tuple[bool, float, str]:
        own = gpu_slug(t.table.gpu_name) == gpu_slug(gpu_name)
        return not own, float("inf") if t.sm_count is None else abs(t.sm_count - sm_count), t.table.folder.name

    best = min(usable, key=rank, default=None)
    if best is None:
        return None, refused
    return LoadedTable(best.table, gpu_slug(best.table.gpu_name) == gpu_slug(gpu_name)), refused


# ---------------------------------------------------------------------------------------------------------
# Install and rollback


@dataclass(frozen=True)
class Installed:
    folder: Path  # <tables>/<gpu-slug>
    version: str
    level: str
    previous: str | None
    note: str  # one line for the user


@contextlib.contextmanager
def _locked(slot: Path) -> Iterator[None]:
    """An exclusive, non-blocking lock: a second install fails at once instead of queueing behind the first."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(locked(slot / LOCK, wait=False))
        except BlockingIOError:
            raise InputError(f"{slot}: another install or rollback is in progress; try again when it ends") from None
        yield


def _target(slot: Path, name: str) -> str | None:
    """Where a symlink of the slot points (relative, versions/<version>), or None."""
    link = slot / name
    return os.readlink(link) if link.is_symlink() else None


def _point(slot: Path, name: str, target: str) -> None:
    """Make slot/name a symlink to `target`, atomically (a new link renamed over the old one)."""
    tmp = slot / f".{name}.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, slot / name)
    fsync_dir(slot)


def _tidy(slot: Path) -> None:
    """Remove what an interrupted install left (temp folders and links) and versions nothing points at."""
    keep = {Path(t).name for t in (_target(slot, CURRENT), _target(slot, PREVIOUS)) if t}
    for stray in slot.glob(".*.tmp"):
        stray.unlink()
    versions = slot / VERSIONS
    for entry in versions.iterdir() if versions.is_dir() else ():
        if entry.name not in keep:
            shutil.rmtree(entry)
        elif entry.is_dir() and not entry.is_symlink():
            for stray in entry.glob(".*.tmp"):  # a repair (`_repair`) cut short
                stray.unlink()


def _repair(final: Path, table: Table) -> list[str]:
    """Make an existing versions/<version>/ hold exactly the table's bytes, each differing or missing file
    rewritten atomically (the bytes a version folder's name stands for, so nothing a reader may hold changes
    meaning); returns the names rewritten. A reader never saw this copy as valid: `verify` refuses it."""
    repaired = []
    for name in FILES:
        path = final / name
        try:
            same = not path.is_symlink() and path.read_bytes() == table.files[name]
        except (FileNotFoundError, IsADirectoryError):
            same = False
        if not same:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            write_atomic(path, table.files[name])
            repaired.append(name)
    return repaired


def _write_version(slot: Path, table: Table) -> tuple[str, list[str]]:
    """versions/<version>/ with the table's files, complete before it gets its name, or, where that version is
    installed already, its copy verified byte for byte and repaired; returns the link target and the names of
    the files repaired."""
    versions = slot / VERSIONS
    versions.mkdir(exist_ok=True)
    final = versions / table.version
    target = f"{VERSIONS}/{table.version}"
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        final.unlink()  # nothing install writes: the version is written whole below
    if final.is_dir():
        return target, _repair(final, table)
    tmp = versions / f"{TEMP_PREFIX}{table.version}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for name in FILES:
            fd = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "wb") as out:
                out.write(table.files[name])
                out.flush()
                os.fsync(out.fileno())
        fsync_dir(tmp)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(versions)
    return target, []


def install(source: Path, tables: Path | None = None,
            gpu: Callable[[], dict[str, str] | None] = current_gpu) -> Installed:
    """Verify the table in `source` and make it the current table of its GPU model under `tables`.

    Refused (InputError) when `verify` refuses it, when this machine has a GPU of another model, or when it
    has a GPU of this model but the certificate is emulator-level. On a machine without a GPU an
    emulator-level table installs, marked as such (the runtime serves no GPU from it). `gpu` reports this
    machine's GPU (tests substitute it)."""
    table = verify(source)
    here = gpu()
    if here is not None and here["name"] != table.gpu_name:
        raise InputError(f"{source}: a table for {table.gpu_name}, this machine has a {here['name']}")
    if here is not None and table.level != "gpu":
        raise InputError(f"{source}: emulator-level certificate; certify the policy on this {here['name']} "
                         "(gemv-dispatch certify --device gpu) before installing it here")
    root = tables or tables_dir()
    slot = root / table.certificate["gpu_slug"]
    slot.mkdir(parents=True, exist_ok=True)
    with _locked(slot):
        _tidy(slot)
        target, repaired = _write_version(slot, table)
        old = _target(slot, CURRENT)
        if old != target:
            if old is not None:
                _point(slot, PREVIOUS, old)
            _point(slot, CURRENT, target)
        _tidy(slot)
    note = ("GPU-level certificate" if table.level == "gpu" else
            "emulator-level certificate (no GPU here): it serves no GPU until certified on one")
    if repaired:
        note += (f"; repaired the installed copy of this version ({', '.join(repaired)} differed from the "
                 "certified bytes)")
    return Installed(slot, table.version, table.level, Path(old).name if old and old != target else None, note)


def rollback(gpu_name_or_slug: str, tables: Path | None = None) -> Installed:
    """Swap the current and previous tables of a GPU model; InputError when there is no previous table."""
    slot = (tables or tables_dir()) / gpu_slug(gpu_name_or_slug)
    if not (slot / CURRENT).is_symlink():
        raise InputError(f"{slot}: no installed table")
    with _locked(slot):
        old, prev = _target(slot, CURRENT), _target(slot, PREVIOUS)
        if prev is None or old is None:
            raise InputError(f"{slot}: no previous table to roll back to")
        table = verify(slot / prev)  # never make a damaged table current
        _point(slot, CURRENT, prev)
        _point(slot, PREVIOUS, old)
    return Installed(slot, Path(prev).name, table.level, Path(old).name, "rolled back")

