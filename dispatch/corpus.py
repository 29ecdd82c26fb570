"""The measured corpus on disk (DESIGN §5): one folder per GPU model, append-only shards, a manifest.

    corpus/<gpu-slug>/manifest.json     {"format", "shards": {name: {"sha256", "records"}}, "retired": [...]}
    corpus/<gpu-slug>/shards/<key>-<sha>.jsonl
        line 1:  {"format", "provenance": {...}, "provenance_key", "records": count}
        then:    one Record per line, sorted, canonical JSON (sorted keys, no spaces)

A shard's name is its provenance key and a prefix of its own SHA-256, so the same content always gets the
same name and a shard is never rewritten. The manifest is the commit point: a shard counts once the manifest
lists it. Every file is written atomically (temp file in the same folder, fsync, rename, fsync the folder).
Writers hold an exclusive flock on the GPU folder, readers a shared one, so parallel sweep processes (one per
device) can append to one folder. A crash can leave only (a) a stale temp file, (b) a complete shard the
manifest does not list yet, (c) files of `retired` shards that compaction had not deleted yet; `recover()`,
run by every writer first, removes (a) and (c) and adopts (b) after validating it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import tempfile
import types
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from gemv_dispatch.dispatch.timing import Stats, TimingConfig
from gemv_dispatch.kernels.errors import InputError
from gemv_dispatch.kernels.registry import Candidate

SHARD_FORMAT = "gemv-dispatch-shard/1"
MANIFEST_FORMAT = "gemv-dispatch-corpus/1"
MANIFEST = "manifest.json"
SHARDS = "shards"
MODES = ("graph", "eager")
# Read-outs that drift between runs on the same device; they are recorded but kept out of the key, so a
# resumed sweep on the same GPU, sources and timing parameters still matches its earlier cells.
VOLATILE = ("sm_clock_mhz", "mem_clock_mhz")


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _is_a(value: Any, hint: Any) -> bool:
    """isinstance for the field annotations used here (int, float, str, bool, X | None, dict[..])."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_is_a(value, arg) for arg in get_args(hint))
    if origin is not None:
        return isinstance(value, origin)
    if hint is type(None):
        return value is None
    if hint is int:  # JSON true must not pass as 1
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _from_dict(cls: Any, data: Any, where: str) -> Any:
    """Build dataclass `cls` from a JSON object, insisting on exactly its fields with their types."""
    if not isinstance(data, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(data).__name__}")
    names = [f.name for f in fields(cls)]
    missing, extra = sorted(set(names) - set(data)), sorted(set(data) - set(names))
    if missing or extra:
        raise InputError(f"{where}: missing fields {missing}, unexpected fields {extra}")
    hints = get_type_hints(cls)
    for name in names:
        if not _is_a(data[name], hints[name]):
            raise InputError(f"{where}: field {name!r} must be {hints[name]}, got {data[name]!r}")
    return cls(**data)


def timing_parameters(config: TimingConfig) -> dict[str, Any]:
    """TimingConfig as provenance: without `mode`, which is part of each cell's key instead."""
    params = dataclasses.asdict(config)
    del params["mode"]
    return params


@dataclass(frozen=True)
class Provenance:
    """Where and how a shard's records were measured; stored once per shard, referenced by `key`."""

    gpu_name: str
    gpu_uuid: str
    sm_count: int
    l2_bytes: int
    sm_clock_mhz: int | None
    mem_clock_mhz: int | None
    driver_version: str
    cuda_runtime: str
    cupy_version: str | None
    kernel_digest: str
    tool_version: str
    timing: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Provenance:
        return _from_dict(cls, data, where)

    @cached_property
    def key(self) -> str:
        """Short SHA-256 of the canonical JSON minus the volatile clocks."""
        stable = {k: v for k, v in self.to_dict().items() if k not in VOLATILE}
        return _sha256(_canonical(stable).encode())[:16]


@dataclass(frozen=True, order=True)
class Cell:
    codebook: str
    m: int
    n: int
    k: int
    mode: str

    def __str__(self) -> str:
        return f"{self.codebook} M={self.m} N={self.n} K={self.k} {self.mode}"


@dataclass(frozen=True)
class Record:
    """One candidate's timing in one cell."""

    codebook: str
    m: int
    n: int
    k: int
    mode: str
    candidate: str
    family: str
    identity: int  # kernels.emulate.identity: candidates with equal identities give identical bytes
    median_us: float
    p5_us: float
    p95_us: float
    mad_us: float
    samples: int
    replays: int
    dropped: bool
    copies: int  # weight copies rotated through (1 = hot L2)
    provenance: str  # Provenance.key of the shard header

    @classmethod
    def measured(cls, cell: Cell, candidate: Candidate, stats: Stats, copies: int, provenance: str) -> Record:
        return cls(cell.codebook, cell.m, cell.n, cell.k, cell.mode, candidate.id, candidate.family,
                   candidate.identity(cell.k), stats.median_us, stats.p5_us, stats.p95_us, stats.mad_us,
                   stats.n, stats.replays, stats.dropped, copies, provenance)

    @property
    def cell(self) -> Cell:
        return Cell(self.codebook, self.m, self.n, self.k, self.mode)

    @property
    def stats(self) -> Stats:
        return Stats(self.median_us, self.p5_us, self.p95_us, self.mad_us, self.samples, self.replays,
                     self.dropped)

    @property
    def ident(self) -> tuple[Cell, str, str]:
        """What makes two records duplicates: same cell, candidate and provenance."""
        return self.cell, self.candidate, self.provenance

    def to_json(self) -> str:
        return _canonical(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Record:
        record = _from_dict(cls, data, where)
        if record.mode not in MODES:
            raise InputError(f"{where}: mode must be one of {', '.join(MODES)}, got {record.mode!r}")
        return record


def _combine(records: Iterable[Record]) -> list[Record]:
    """Sorted, one record per (cell, candidate, provenance); of duplicates the smallest JSON wins, so
    the result does not depend on which shard came first."""
    chosen: dict[tuple[Cell, str, str], tuple[str, Record]] = {}
    for r in records:
        text, old = r.to_json(), chosen.get(r.ident)
        if old is None or text < old[0]:
            chosen[r.ident] = (text, r)
    return [chosen[i][1] for i in sorted(chosen)]


def gpu_slug(name: str) -> str:
    """Folder name of a GPU model: "NVIDIA H200" -> "nvidia-h200"."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    if not slug:
        raise InputError(f"GPU name {name!r} gives no folder name")
    return slug


# ---------------------------------------------------------------------------------------------------------
# Files


def _write_atomic(path: Path, data: bytes) -> None:
    """A reader sees the old file or the whole new one; an error leaves neither a temp nor a partial file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; the corpus is shared data
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)  # the rename itself survives a power cut only once the folder is synced


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _locked(folder: Path, shared: bool = False) -> Iterator[None]:
    """flock on the folder itself: no lock file to clutter the checked-in corpus; the kernel drops the
    lock when its holder dies, so a killed sweep never leaves the folder locked."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _require(folder: Path) -> None:
    if not folder.is_dir():
        raise InputError(f"{folder}: no such corpus folder")


@dataclass(frozen=True)
class ShardEntry:
    sha256: str
    records: int


@dataclass(frozen=True)
class Manifest:
    shards: dict[str, ShardEntry]
    retired: tuple[str, ...] = ()  # compacted away; their files may still exist until deleted

    def to_bytes(self) -> bytes:
        data = {
            "format": MANIFEST_FORMAT,
            "shards": {name: dataclasses.asdict(e) for name, e in sorted(self.shards.items())},
            "retired": sorted(self.retired),
        }
        return (json.dumps(data, sort_keys=True, indent=1) + "\n").encode()


def _read_manifest(folder: Path) -> Manifest:
    path = folder / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{folder}: not a corpus folder (no {MANIFEST})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{path}: unreadable manifest ({err})") from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise InputError(f"{path}: not a {MANIFEST_FORMAT} manifest")
    shards, retired = data.get("shards"), data.get("retired")
    if not isinstance(shards, dict) or not isinstance(retired, list):
        raise InputError(f"{path}: 'shards' must be an object and 'retired' a list")
    entries = {name: _from_dict(ShardEntry, e, f"{path}: shards[{name!r}]") for name, e in shards.items()}
    return Manifest(entries, tuple(retired))


def _write_manifest(folder: Path, manifest: Manifest) -> None:
    _write_atomic(folder / MANIFEST, manifest.to_bytes())


@dataclass(frozen=True)
class Shard:
    name: str
    provenance: Provenance
    records: tuple[Record, ...]


def _shard_bytes(provenance: Provenance, records: list[Record]) -> bytes:
    header = {"format": SHARD_FORMAT, "provenance": provenance.to_dict(), "provenance_key": provenance.key,
              "records": len(records)}
    return (_canonical(header) + "\n" + "".join(r.to_json() + "\n" for r in records)).encode()


def _shard_name(provenance: Provenance, sha256: str) -> str:
    return f"{provenance.key}-{sha256[:16]}.jsonl"


def _parse_shard(path: Path, data: bytes) -> Shard:
    """Header and records of a shard's bytes; anything malformed raises InputError naming the file."""
    try:
        lines = data.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        raise InputError(f"{path}: shard is not UTF-8 text") from None
    if len(lines) < 2 or lines[-1] != "":
        raise InputError(f"{path}: shard does not end with a newline (truncated?)")
    try:
        rows = [json.loads(line) for line in lines[:-1]]
    except json.JSONDecodeError as err:
        raise InputError(f"{path}: malformed shard line ({err})") from None
    header = rows[0]
    if not isinstance(header, dict) or header.get("format") != SHARD_FORMAT:
        raise InputError(f"{path}: first line is not a {SHARD_FORMAT} header")
    provenance = Provenance.from_dict(header.get("provenance"), f"{path}: provenance")
    if header.get("provenance_key") != provenance.key:
        raise InputError(f"{path}: header key {header.get('provenance_key')!r} does not match its "
                         f"provenance ({provenance.key})")
    records = tuple(Record.from_dict(row, f"{path}: line {i}") for i, row in enumerate(rows[1:], start=2))
    if header.get("records") != len(records):
        raise InputError(f"{path}: header announces {header.get('records')!r} records, found {len(records)}")
    stray = next((r for r in records if r.provenance != provenance.key), None)
    if stray is not None:
        raise InputError(f"{path}: record of {stray.cell} refers to provenance {stray.provenance}, "
                         f"not the header's {provenance.key}")
    return Shard(path.name, provenance, records)


def _read_shard(path: Path, entry: ShardEntry) -> Shard:
    data = path.read_bytes()
    actual = _sha256(data)
    if actual != entry.sha256:
        raise InputError(f"{path}: SHA-256 {actual[:16]}… differs from the manifest's {entry.sha256[:16]}… "
                         "(truncated or altered shard)")
    shard = _parse_shard(path, data)
    if len(shard.records) != entry.records:
        raise InputError(f"{path}: {len(shard.records)} records, the manifest says {entry.records}")
    return shard


def _shard_files(folder: Path) -> set[str]:
    shards = folder / SHARDS
    return {p.name for p in shards.glob("*.jsonl")} if shards.is_dir() else set()


# ---------------------------------------------------------------------------------------------------------
# Writing


def init(folder: Path) -> None:
    """Create an empty corpus folder (idempotent)."""
    (folder / SHARDS).mkdir(parents=True, exist_ok=True)
    with _locked(folder):
        if not (folder / MANIFEST).exists():
            _write_manifest(folder, Manifest({}))


def _write_shard_file(folder: Path, provenance: Provenance, records: list[Record]) -> tuple[str, ShardEntry]:
    """Write one shard file (unless present: same name, same bytes), not yet listed; lock held."""
    data = _shard_bytes(provenance, records)
    sha = _sha256(data)
    name = _shard_name(provenance, sha)
    path = folder / SHARDS / name
    if not path.exists():
        _write_atomic(path, data)
    return name, ShardEntry(sha, len(records))


def write_shard(folder: Path, provenance: Provenance, records: Iterable[Record]) -> str:
    """Append one shard of `records` (all of `provenance`) to the corpus; returns its file name."""
    records = _combine(records)
    if not records:
        raise ValueError("a shard needs at least one record")
    if any(r.provenance != provenance.key for r in records):
        raise ValueError(f"every record of a shard must refer to provenance {provenance.key}")
    with _locked(folder):
        name, entry = _write_shard_file(folder, provenance, records)
        manifest = _read_manifest(folder)
        _write_manifest(folder, Manifest({**manifest.shards, name: entry}, manifest.retired))
    return name


def recover(folder: Path) -> list[str]:
    """Finish what an interrupted writer left; returns one line per action taken (see module docstring)."""
    _require(folder)
    with _locked(folder):
        return _recover(folder)


def _recover(folder: Path) -> list[str]:
    """recover() with the lock held."""
    actions: list[str] = []
    manifest = _read_manifest(folder)
    shards = folder / SHARDS
    for tmp in sorted(shards.glob(".*.tmp")):  # writers hold the lock, so no temp is in progress
        tmp.unlink()
        actions.append(f"removed unfinished temp file {tmp.name}")
    files = _shard_files(folder)
    for name in sorted(set(manifest.retired) & files):
        (shards / name).unlink()
        actions.append(f"removed compacted shard {name}")
    adopted = dict(manifest.shards)
    for name in sorted(files - set(manifest.shards) - set(manifest.retired)):
        data = (shards / name).read_bytes()
        shard = _parse_shard(shards / name, data)  # renamed only when complete, but check anyway
        adopted[name] = ShardEntry(_sha256(data), len(shard.records))
        actions.append(f"adopted shard {name} written before an interruption")
    if actions or manifest.retired:
        _write_manifest(folder, Manifest(adopted))
    return actions


def compact(folder: Path) -> tuple[int, int]:
    """Merge each provenance's shards into one deterministic shard; returns (shards before, after).

    Order: write the merged shards, then the manifest listing them with the old ones `retired`, then delete
    the old files and clear `retired`. A crash at any point leaves a corpus that loads the same records."""
    folder = Path(folder)
    _require(folder)
    with _locked(folder):  # one exclusive hold: a concurrent compaction cannot retire the same shards
        _recover(folder)
        manifest, shards = _read_shards(folder)
        corpus = _verified(folder, shards)
        records: dict[str, list[Record]] = {}
        for r in corpus.records:
            records.setdefault(r.provenance, []).append(r)
        merged = dict(_write_shard_file(folder, corpus.provenances[key], recs) for key, recs in sorted(records.items()))
        retired = tuple(s.name for s in shards if s.name not in merged)
        kept = {**{n: e for n, e in manifest.shards.items() if n not in retired}, **merged}
        _write_manifest(folder, Manifest(kept, retired))
        for name in retired:
            (folder / SHARDS / name).unlink()
        _write_manifest(folder, Manifest(kept))
    return len(shards), len(kept)


# ---------------------------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True)
class Corpus:
    folder: Path
    shards: tuple[Shard, ...]
    provenances: Mapping[str, Provenance]
    records: tuple[Record, ...]  # sorted by (cell, candidate, provenance), one per such key

    def cells(self) -> list[Cell]:
        return sorted(self._by_cell)

    def records_for(self, cell: Cell) -> list[Record]:
        return list(self._by_cell.get(cell, ()))

    def done_cells(self, provenance_key: str) -> set[Cell]:
        """Cells measured under this provenance (a cell's shard is all-or-nothing, so done = present)."""
        return {r.cell for r in self.records if r.provenance == provenance_key}

    @cached_property
    def _by_cell(self) -> dict[Cell, list[Record]]:
        out: dict[Cell, list[Record]] = {}
        for r in self.records:
            out.setdefault(r.cell, []).append(r)
        return out


def load(folder: str | os.PathLike[str], *, kernel_digest: str | None = None, gpu_uuid: str | None = None,
         gpu_name: str | None = None) -> Corpus:
    """Read and verify a corpus folder: every shard's hash against the manifest, no unlisted shard, no
    listed shard missing, one GPU model and one kernel digest throughout (each equal to the requested one,
    if given; gpu_uuid, if given, for every shard). Duplicates collapse deterministically."""
    folder = Path(folder)
    _require(folder)
    with _locked(folder, shared=True):
        _, shards = _read_shards(folder)
    return _verified(folder, shards, kernel_digest=kernel_digest, gpu_uuid=gpu_uuid, gpu_name=gpu_name)


def _read_shards(folder: Path) -> tuple[Manifest, tuple[Shard, ...]]:
    """The manifest and every listed shard, each checked against it; a lock held."""
    manifest = _read_manifest(folder)
    files = _shard_files(folder)
    unlisted = sorted(files - set(manifest.shards) - set(manifest.retired))
    if unlisted:
        raise InputError(f"{folder / SHARDS / unlisted[0]}: shard is not in the manifest (left by an "
                         "interrupted write? `gemv-dispatch corpus compact` adopts complete ones)")
    absent = sorted(set(manifest.shards) - files)
    if absent:
        raise InputError(f"{folder / SHARDS / absent[0]}: listed in the manifest but missing")
    return manifest, tuple(_read_shard(folder / SHARDS / n, manifest.shards[n]) for n in sorted(manifest.shards))


def _verified(folder: Path, shards: tuple[Shard, ...], *, kernel_digest: str | None = None,
              gpu_uuid: str | None = None, gpu_name: str | None = None) -> Corpus:
    """The corpus of these shards, refusing a mix of GPU models or kernel sources (see `load`)."""
    expect = {"gpu_name": gpu_name, "kernel_digest": kernel_digest, "gpu_uuid": gpu_uuid}
    for field in ("gpu_name", "kernel_digest"):  # a folder holds one GPU model and one kernel source
        if expect[field] is None and shards:
            expect[field] = getattr(shards[0].provenance, field)
    for shard in shards:
        for field, want in expect.items():
            got = getattr(shard.provenance, field)
            if want is not None and got != want:
                raise InputError(f"{folder / SHARDS / shard.name}: {field} {got!r} is not {want!r} "
                                 "(records of another GPU or kernel source cannot be mixed)")
    provenances = {s.provenance.key: s.provenance for s in shards}
    records = _combine(r for s in shards for r in s.records)
    return Corpus(folder, shards, provenances, tuple(records))
