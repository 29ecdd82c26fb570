"""The measured corpus on disk (docs/architecture.md §5): one folder per GPU model, append-only shards, a manifest.

    corpus/<gpu-slug>/manifest.json     {"format", "shards": {name: {"sha256", "records"}}, "retired": [...]}
    corpus/<gpu-slug>/shards/<key>-<sha>.jsonl.gz    gzip of the text:
        line 1:  {"format", "provenance": {...}, "provenance_key", "records": count}
        then:    one Record per line, sorted, canonical JSON (sorted keys, no spaces)

A shard's name is its provenance key and the first 16 hex digits of the SHA-256 of its text (the manifest holds
the whole digest), so the same records always get the same name whatever zlib compressed them, a shard is never
rewritten, and a shard outside the manifest can still be checked against what its name promises. Shards are
compressed (about 8x) because corpora are committed and shipped with the package.

Every record carries the code digest of what it timed (kernels.digests.launch_digest: the kernel
instantiation's PTX and the launch facts). A folder may hold records of several kernel sources: a record is
*current* while its digest is the kernels' today, and only current records count as measured (a sweep re-times
the others) or train a policy. The manifest is the commit point: `load` reads only what it lists and
refuses any other shard. Every file is written atomically (temp file in the same folder, fsync, rename,
fsync the folder).

A sweep *stages* one shard per finished cell (written, not yet listed: no manifest rewrite per cell) and
adopts them at its end; `recover` and `compact` adopt staged shards too. Adoption checks each shard's name
against its bytes and validates every record as user input, so a damaged file is never adopted.

Writers that change the manifest (`write_shard`, `recover`, `compact`) hold an exclusive flock on the GPU
folder; stagers and readers hold a shared one, so the sweep processes of several devices stage into one
folder side by side. A crash can leave only (a) a stale temp file, (b) complete staged shards, (c) files of
`retired` shards that compaction had not deleted yet, (d) merged shards whose manifest was not written yet;
recovery removes (a), (c) and (d) and adopts (b). Every command that changes files first reads and validates
everything it needs in memory, then writes: a command that fails leaves every file as it was.

Only the manifest's shards count: a shard outside it is adopted where it adds records, never where it would
replace a record the manifest lists (same cell, candidate and provenance: `_adoption`), so a file dropped into
shards/ cannot rewrite measured cells. A folder whose manifest.json is gone gets it rebuilt from its shards once every
one verifies; nothing is written before that (`resume`, `init`).
"""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import json
import math
import operator
import os
import re
import shutil
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from functools import cache, cached_property, lru_cache
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from ...kernels.codebooks import CODEBOOKS
from ...kernels.digests import DIGEST_HEX, launch_digest
from ...kernels.errors import BLOCK, EnvironmentProblem, InputError
from ...kernels.registry import BY_ID, Candidate, candidates_for
from ..common.contract import MODES
from ..common.digests import canonical_bytes, compact_json, sha256
from ..common.files import locked, write_atomic
from ..common.gpu import GPU_SLUG_PREFIX, gpu_slug
from .timing import Stats, TimingConfig

SHARD_FORMAT = "gemv-dispatch-shard/2"
MANIFEST_FORMAT = "gemv-dispatch-corpus/2"
LEGACY_FORMATS = ("gemv-dispatch-shard/1", "gemv-dispatch-corpus/1")  # before code digests: migrate
MANIFEST = "manifest.json"
SHARDS = "shards"
# Read-outs that drift between runs on the same device; they are recorded but kept out of the key, so a
# resumed sweep on the same GPU, sources and timing parameters still matches its earlier cells.
VOLATILE = ("sm_clock_mhz", "mem_clock_mhz")
SHARD_SUFFIX = ".jsonl.gz"
SHARD_NAME = re.compile(r"([0-9a-f]{16})-([0-9a-f]{16})\.jsonl\.gz")
MIGRATE = "python tools/migrate_corpus.py FOLDER"
_CODE = re.compile(f"[0-9a-f]{{{DIGEST_HEX}}}")
COMPACTION_SPACE = 2  # free space compaction asks for, in multiples of the shards' size (new + margin)


def _checker(hint: Any) -> Callable[[Any], bool]:
    """A predicate for the field annotations used here (int, float, str, bool, X | None, dict[..]); exact
    types, so JSON true does not pass as 1 nor 1 as a float."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        options = tuple(_checker(arg) for arg in get_args(hint))
        return lambda value: any(ok(value) for ok in options)
    if origin is not None:
        return lambda value: isinstance(value, origin)
    if hint is type(None):
        return lambda value: value is None
    return lambda value: type(value) is hint


@dataclass(frozen=True)
class _Schema:
    """A dataclass's fields as JSON checks, resolved once per class (type hints are slow to resolve)."""

    names: frozenset[str]
    values: Callable[[dict[str, Any]], tuple[Any, ...]]  # the field values, in field order
    types: tuple[type, ...] | None  # exact value types when no field is a union or generic: one C-level check
    checks: tuple[tuple[str, Callable[[Any], bool], Any], ...]  # (name, predicate, hint) per field


@cache
def _schema(cls: type) -> _Schema:
    every = get_type_hints(cls)
    hints = {f.name: every[f.name] for f in fields(cls)}
    exact = all(isinstance(h, type) and get_origin(h) is None for h in hints.values())
    return _Schema(frozenset(hints), operator.itemgetter(*hints), tuple(hints.values()) if exact else None,
                   tuple((name, _checker(hint), hint) for name, hint in hints.items()))


def _from_dict(cls: Any, data: Any, where: str) -> Any:
    """Build dataclass `cls` from a JSON object, insisting on exactly its fields with their types."""
    if type(data) is not dict:
        raise InputError(f"{where}: expected a JSON object, got {type(data).__name__}")
    schema = _schema(cls)
    if data.keys() != schema.names:
        missing, extra = sorted(schema.names - data.keys()), sorted(data.keys() - schema.names)
        raise InputError(f"{where}: missing fields {missing}, unexpected fields {extra}")
    if schema.types is None or tuple(map(type, schema.values(data))) != schema.types:
        for name, ok, hint in schema.checks:
            if not ok(data[name]):
                raise InputError(f"{where}: field {name!r} must be {hint}, got {data[name]!r}")
    # Every field checked and none has a __post_init__: filling __dict__ is what the frozen __init__ would
    # do, at a fraction of the cost (it matters at tens of thousands of records per load).
    obj = object.__new__(cls)
    obj.__dict__.update(data)
    return obj


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
        return sha256(compact_json(stable).encode())[:16]


@dataclass(frozen=True, order=True)
class Cell:
    codebook: str
    m: int
    n: int
    k: int
    mode: str

    def __str__(self) -> str:
        return f"{self.codebook} M={self.m} N={self.n} K={self.k} {self.mode}"


@lru_cache(maxsize=8192)
def cell_candidates(m: int, n: int, k: int) -> Mapping[str, tuple[str, int]]:
    """Candidate id -> (family, identity) of every candidate a sweep times for (M, N, K): what a complete
    cell holds and what a record of the cell may name."""
    return types.MappingProxyType({c.id: (c.family, c.identity(k)) for c in candidates_for(m, n, k)})


@lru_cache(maxsize=8192)
def _cell_rules(codebook: str, m: int, n: int, k: int, mode: str) -> str | Mapping[str, tuple[str, int]]:
    """Why a cell cannot exist, or its `cell_candidates`: checked once per cell, not per record."""
    if mode not in MODES:
        return f"mode must be one of {', '.join(MODES)}, got {mode!r}"
    if codebook not in CODEBOOKS:
        return f"unknown codebook {codebook!r}"
    if m < 1 or n < 1 or k < BLOCK or k % BLOCK:
        return f"M={m}, N={n}, K={k} is not a GEMV shape (M, N >= 1, K a multiple of {BLOCK})"
    return cell_candidates(m, n, k)


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
    code: str  # kernels.digests.launch_digest of the launch timed: current while the kernels' is the same

    @classmethod
    def measured(cls, cell: Cell, candidate: Candidate, stats: Stats, copies: int, provenance: str) -> Record:
        return cls(cell.codebook, cell.m, cell.n, cell.k, cell.mode, candidate.id, candidate.family,
                   candidate.identity(cell.k), stats.median_us, stats.p5_us, stats.p95_us, stats.mad_us,
                   stats.n, stats.replays, stats.dropped, copies, provenance,
                   launch_digest(candidate, cell.codebook, cell.m, cell.n, cell.k))

    @property
    def cell(self) -> Cell:
        return Cell(self.codebook, self.m, self.n, self.k, self.mode)

    @property
    def stats(self) -> Stats:
        return Stats(self.median_us, self.p5_us, self.p95_us, self.mad_us, self.samples, self.replays,
                     self.dropped)

    @property
    def ident(self) -> tuple[str, int, int, int, str, str, str, str]:
        """What makes two records duplicates: cell, candidate, provenance and code, flat so that it sorts fast
        (in the order of (Cell, candidate, provenance, code)): a re-timing after a code change adds a record."""
        return self.codebook, self.m, self.n, self.k, self.mode, self.candidate, self.provenance, self.code

    def to_json(self) -> str:
        # Plain field values, all JSON scalars: dataclasses.asdict's deep copy would cost more than the dump.
        return compact_json({name: self.__dict__[name] for name in _schema(Record).names})

    def problem(self) -> str | None:
        """What makes this record impossible (the checks applied to user input), or None."""
        rules = _cell_rules(self.codebook, self.m, self.n, self.k, self.mode)
        if type(rules) is str:
            return rules
        expected = rules.get(self.candidate)
        if expected is None:
            if self.candidate not in BY_ID:
                return f"unknown candidate {self.candidate!r}"
            return f"candidate {self.candidate} is not timed for {self.cell}: " + (
                BY_ID[self.candidate].invalid_reason(self.m, self.n, self.k) or "not a normalized spelling")
        if (self.family, self.identity) != expected:
            return (f"candidate {self.candidate} is family {expected[0]}, identity {expected[1]} at K={self.k}, "
                    f"not {self.family}, {self.identity}")
        # Chained comparisons: a NaN fails every one, an infinity the bound.
        if not 0 < self.p5_us <= self.median_us <= self.p95_us < math.inf:
            times = self.p5_us, self.median_us, self.p95_us
            return f"times must be finite, positive and p5 <= median <= p95, got {times}"
        if not 0 <= self.mad_us < math.inf:
            return f"mad_us must be finite and >= 0, got {self.mad_us}"
        if min(self.samples, self.replays, self.copies) < 1:
            return f"samples, replays and copies must be >= 1, got {self.samples}, {self.replays}, {self.copies}"
        if _CODE.fullmatch(self.code) is None:
            return f"code must be {DIGEST_HEX} lowercase hex digits (kernels.digests), got {self.code!r}"
        return None

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Record:
        record = _from_dict(cls, data, where)
        problem = record.problem()
        if problem is not None:
            raise InputError(f"{where}: {problem}")
        return record


def _combine(records: Iterable[Record]) -> list[Record]:
    """Sorted, one record per (cell, candidate, provenance); of duplicates the smallest JSON wins, so
    the result does not depend on which shard came first."""
    records = list(records)
    idents = [r.ident for r in records]
    if all(a < b for a, b in itertools.pairwise(idents)):  # one compacted shard: already sorted, no duplicates
        return records
    chosen: dict[tuple[str, int, int, int, str, str, str, str], Record] = {}
    for i, r in zip(idents, records, strict=True):
        old = chosen.setdefault(i, r)
        if old is not r and r != old and r.to_json() < old.to_json():  # JSON only for real duplicates
            chosen[i] = r
    return [chosen[i] for i in sorted(chosen)]


# ---------------------------------------------------------------------------------------------------------
# Files


def _require(folder: Path) -> None:
    if folder.exists() and not folder.is_dir():
        raise InputError(f"{folder}: a file, not a corpus folder")
    if not folder.is_dir():
        raise InputError(f"{folder}: no such corpus folder")


@dataclass(frozen=True)
class ShardEntry:
    sha256: str
    records: int


@dataclass(frozen=True)
class Manifest:
    shards: Mapping[str, ShardEntry]
    retired: tuple[str, ...] = ()  # compacted away; their files may still exist until deleted

    def to_bytes(self) -> bytes:
        data = {
            "format": MANIFEST_FORMAT,
            "shards": {name: dataclasses.asdict(e) for name, e in sorted(self.shards.items())},
            "retired": sorted(self.retired),
        }
        return canonical_bytes(data)


def _read_manifest(folder: Path) -> Manifest:
    path = folder / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{folder}: not a corpus folder (no {MANIFEST})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{path}: unreadable manifest ({err})") from None
    if isinstance(data, dict) and data.get("format") in LEGACY_FORMATS:
        raise InputError(f"{path}: a {data['format']} corpus, without code digests: migrate it ({MIGRATE})")
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise InputError(f"{path}: not a {MANIFEST_FORMAT} manifest")
    shards, retired = data.get("shards"), data.get("retired")
    if not isinstance(shards, dict) or not isinstance(retired, list):
        raise InputError(f"{path}: 'shards' must be an object and 'retired' a list")
    entries = {name: _from_dict(ShardEntry, e, f"{path}: shards[{name!r}]") for name, e in shards.items()}
    return Manifest(entries, tuple(retired))


@dataclass(frozen=True)
class Shard:
    name: str
    provenance: Provenance
    records: tuple[Record, ...]
    sha256: str
    size: int  # bytes on disk

    @property
    def entry(self) -> ShardEntry:
        return ShardEntry(self.sha256, len(self.records))


def _shard_bytes(provenance: Provenance, records: list[Record]) -> bytes:
    header = {"format": SHARD_FORMAT, "provenance": provenance.to_dict(), "provenance_key": provenance.key,
              "records": len(records)}
    return (compact_json(header) + "\n" + "".join(r.to_json() + "\n" for r in records)).encode()


def _shard_name(provenance: Provenance, sha256: str) -> str:
    return f"{provenance.key}-{sha256[:16]}{SHARD_SUFFIX}"


def _json_rows(path: Path, body: str) -> list[Any]:
    """The JSON value of every line of `body` (newline-terminated lines), parsed in one call."""
    try:
        return json.loads("[" + body[:-1].replace("\n", ",") + "]") if body else []
    except json.JSONDecodeError:
        pass
    for i, line in enumerate(body[:-1].split("\n"), start=2):  # name the first bad line
        try:
            json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(f"{path}: malformed shard line {i} ({err})") from None
    raise InputError(f"{path}: malformed shard")


def _records(path: Path, rows: list[Any]) -> tuple[Record, ...]:
    """Record.from_dict of every row (line 2 onwards), its common path inlined: loads run it per record."""
    schema, new, out = _schema(Record), object.__new__, []
    for row in rows:
        if type(row) is not dict or row.keys() != schema.names:
            break
        if tuple(map(type, schema.values(row))) != schema.types:
            break
        record = new(Record)
        record.__dict__.update(row)
        if record.problem() is not None:
            break
        out.append(record)
    else:
        return tuple(out)
    line = len(out) + 2
    Record.from_dict(rows[line - 2], f"{path}: line {line}")  # raises, naming what is wrong
    raise AssertionError("unreachable: the row failed the inlined checks")


def _parse_shard(path: Path, packed: bytes) -> Shard:
    """A shard file's bytes checked against its name and validated record by record; anything wrong raises
    InputError naming the file."""
    named = SHARD_NAME.fullmatch(path.name)
    if named is None:
        raise InputError(f"{path}: not a shard name (<provenance key>-<sha256 prefix>{SHARD_SUFFIX})")
    try:
        data = gzip.decompress(packed)
    except (OSError, EOFError, ValueError) as err:  # zlib.error is an OSError subclass in gzip's hands
        raise InputError(f"{path}: not a gzip shard ({err}; truncated or altered)") from None
    sha = sha256(data)
    if named[2] != sha[:16]:
        raise InputError(f"{path}: SHA-256 {sha[:16]}… differs from the {named[2]}… its name promises "
                         "(truncated or altered shard)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{path}: shard is not UTF-8 text") from None
    if not text.endswith("\n"):
        raise InputError(f"{path}: shard does not end with a newline (truncated?)")
    first, _, body = text.partition("\n")
    try:
        header = json.loads(first)
    except json.JSONDecodeError as err:
        raise InputError(f"{path}: malformed shard header ({err})") from None
    if isinstance(header, dict) and header.get("format") in LEGACY_FORMATS:
        raise InputError(f"{path}: a {header['format']} shard, without code digests: migrate it ({MIGRATE})")
    if not isinstance(header, dict) or header.get("format") != SHARD_FORMAT:
        raise InputError(f"{path}: first line is not a {SHARD_FORMAT} header")
    provenance = Provenance.from_dict(header.get("provenance"), f"{path}: provenance")
    if header.get("provenance_key") != provenance.key or named[1] != provenance.key:
        raise InputError(f"{path}: header key {header.get('provenance_key')!r} and name do not both match its "
                         f"provenance ({provenance.key})")
    records = _records(path, _json_rows(path, body))
    if header.get("records") != len(records):
        raise InputError(f"{path}: header announces {header.get('records')!r} records, found {len(records)}")
    stray = next((r for r in records if r.provenance != provenance.key), None)
    if stray is not None:
        raise InputError(f"{path}: record of {stray.cell} refers to provenance {stray.provenance}, "
                         f"not the header's {provenance.key}")
    return Shard(path.name, provenance, records, sha, len(packed))


def _read_shard(path: Path, entry: ShardEntry | None = None) -> Shard:
    """A shard file, verified against its name and, when listed, its manifest entry."""
    shard = _parse_shard(path, path.read_bytes())
    if entry is not None and shard.sha256 != entry.sha256:
        raise InputError(f"{path}: SHA-256 {shard.sha256[:16]}… differs from the manifest's "
                         f"{entry.sha256[:16]}… (truncated or altered shard)")
    if entry is not None and len(shard.records) != entry.records:
        raise InputError(f"{path}: {len(shard.records)} records, the manifest says {entry.records}")
    return shard


# ---------------------------------------------------------------------------------------------------------
# The state of a folder, read and verified in memory before anything is written


@dataclass(frozen=True)
class _Folder:
    manifest: Manifest
    listed: tuple[Shard, ...]
    staged: tuple[Shard, ...]  # complete shards outside the manifest, verified, adding records: to adopt
    temps: tuple[str, ...]  # stale temp files of interrupted writes, relative to the folder
    retired: tuple[str, ...]  # files of compacted-away shards still present
    redundant: tuple[str, ...] = ()  # shards outside the manifest holding only records it lists (a merge cut short)
    rebuilt: bool = False  # manifest.json was missing: the manifest is the staged shards, once verified

    @property
    def shards(self) -> tuple[Shard, ...]:
        return tuple(sorted(self.listed + self.staged, key=lambda s: s.name))

    @property
    def settled(self) -> bool:
        """Nothing for recovery to do."""
        return not (self.staged or self.temps or self.retired or self.manifest.retired or self.redundant)

    def adopted(self) -> Manifest:
        return Manifest({**self.manifest.shards, **{s.name: s.entry for s in self.staged}})

    def actions(self) -> list[str]:
        """One line per kind of action: a resumed sweep adopts a shard per cell, thousands of them."""
        adopted = ("rebuilt the missing manifest from the verified shards" if self.rebuilt else
                   "adopted shards written before the manifest listed them")
        kinds = (("removed unfinished temp files", list(self.temps)), ("removed compacted shards", list(self.retired)),
                 ("removed unlisted shards holding only listed records", list(self.redundant)),
                 (adopted, [s.name for s in self.staged]))
        return [f"{what}: {names[0]}" if len(names) == 1 else f"{what}: {len(names)} ({names[0]} … {names[-1]})"
                for what, names in kinds if names]


def _shard_files(folder: Path) -> set[str]:
    """Names of the shard files in folder/shards/ (temp files excluded)."""
    shards = folder / SHARDS
    names = {p.name for p in shards.iterdir()} if shards.is_dir() else set()
    return {n for n in names if n.endswith(SHARD_SUFFIX) and not n.startswith(".")}


def _adoption(folder: Path, listed: tuple[Shard, ...], unlisted: list[Shard]) -> tuple[list[Shard], list[str]]:
    """(shards to adopt, names of redundant shards) of the verified shards outside the manifest. The manifest is
    the commit point (docs/architecture.md §5): an unlisted shard is adopted where it adds records, never where
    it would replace listed ones. InputError, naming the shard, when one holds a record of a (cell, candidate,
    provenance) the manifest lists that is not the listed record, or when two unlisted shards disagree on one."""
    if not unlisted:
        return [], []
    listed_by_ident: dict[tuple[str, int, int, int, str, str, str, str], set[Record]] = {}
    for shard in listed:
        for r in shard.records:
            listed_by_ident.setdefault(r.ident, set()).add(r)
    seen: dict[tuple[str, int, int, int, str, str, str, str], tuple[Record, str]] = {}
    adopt, redundant = [], []
    for shard in unlisted:
        path, adds = folder / SHARDS / shard.name, False
        for r in shard.records:
            if r.ident in listed_by_ident:
                if r not in listed_by_ident[r.ident]:
                    raise InputError(f"{path}: shard outside the manifest would replace listed records of "
                                     f"{r.cell} (provenance {r.provenance}, e.g. {r.candidate}); an unlisted shard "
                                     f"is adopted only where it adds records: move it out of {folder / SHARDS}")
                continue
            first, where = seen.setdefault(r.ident, (r, shard.name))
            if first != r:
                raise InputError(f"{path}: shard outside the manifest disagrees with {where}, also unlisted, on "
                                 f"{r.candidate} in {r.cell}: move the one that was not written by a sweep out of "
                                 f"{folder / SHARDS}")
            adds = True
        (adopt if adds else redundant).append(shard)
    return adopt, [s.name for s in redundant]


def _scan(folder: Path, *, adopt: bool) -> _Folder:
    """Read the manifest and every shard it lists (and, with `adopt`, every staged one); a lock held.
    Without `adopt`, a shard outside the manifest is refused; with it, a missing manifest is rebuilt from the
    verified shards when the folder has its shards/ folder (`_adoption` decides what is adopted)."""
    shards = folder / SHARDS
    rebuilt = adopt and not (folder / MANIFEST).exists() and shards.is_dir()
    manifest = Manifest({}) if rebuilt else _read_manifest(folder)
    names = {p.name for p in shards.iterdir()} if shards.is_dir() else set()
    files = _shard_files(folder)
    unlisted = sorted(files - set(manifest.shards) - set(manifest.retired))
    if unlisted and not adopt:
        raise InputError(f"{shards / unlisted[0]}: shard is not in the manifest (a sweep in progress, or one "
                         "interrupted: `gemv-dispatch corpus compact` adopts complete shards)")
    absent = sorted(set(manifest.shards) - files)
    if absent:
        raise InputError(f"{shards / absent[0]}: listed in the manifest but missing")
    listed = tuple(_read_shard(shards / n, manifest.shards[n]) for n in sorted(manifest.shards))
    staged, redundant = _adoption(folder, listed, [_read_shard(shards / n) for n in unlisted])
    return _Folder(
        manifest,
        listed,
        tuple(staged),
        tuple(sorted(f"{SHARDS}/{n}" for n in names if n.startswith(".") and n.endswith(".tmp")))
        + tuple(sorted(p.name for p in folder.glob(f".{MANIFEST}.*.tmp"))),  # a manifest write cut short
        tuple(sorted(set(manifest.retired) & files)),
        tuple(redundant),
        rebuilt,
    )


def _settle(folder: Path, state: _Folder, manifest: Manifest) -> None:
    """Write `manifest`, then delete what it no longer needs (temps, retired and redundant files); a lock held."""
    write_atomic(folder / MANIFEST, manifest.to_bytes())
    for name in state.temps:
        (folder / name).unlink(missing_ok=True)
    for name in state.retired + state.redundant:
        (folder / SHARDS / name).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------------
# Writing


def init(folder: Path) -> None:
    """Create an empty corpus folder (idempotent). Where shards/ holds shards but manifest.json is gone, no
    empty manifest is written over them: `recover` rebuilds it once every shard is verified."""
    (folder / SHARDS).mkdir(parents=True, exist_ok=True)
    with locked(folder):
        if not (folder / MANIFEST).exists() and not _shard_files(folder):
            write_atomic(folder / MANIFEST, Manifest({}).to_bytes())


def _shard_of(provenance: Provenance, records: Iterable[Record]) -> tuple[str, bytes]:
    """Name and bytes of the shard holding `records` (all of `provenance`, each valid)."""
    records = _combine(records)
    if not records:
        raise ValueError("a shard needs at least one record")
    bad = next((r for r in records if r.provenance != provenance.key or r.problem()), None)
    if bad is not None:
        raise ValueError(f"record {bad.to_json()} cannot be stored under provenance {provenance.key}: "
                         f"{bad.problem() or 'another provenance'}")
    data = _shard_bytes(provenance, records)
    return _shard_name(provenance, sha256(data)), data


def _put(folder: Path, name: str, data: bytes) -> bool:
    """Write a shard file of text `data` unless present (same name, same records); True when written. The gzip
    stream carries no time stamp or file name, so the same text gives the same file on one zlib."""
    path = folder / SHARDS / name
    if path.exists():
        return False
    write_atomic(path, gzip.compress(data, compresslevel=9, mtime=0))
    return True


def stage_shard(folder: Path, provenance: Provenance, records: Iterable[Record]) -> str:
    """Write one shard without listing it (no manifest rewrite): the next `recover` or `compact` adopts it,
    `load` refuses the folder until then. Returns its file name. A folder `resume` found empty is made here,
    by the first shard, so a sweep that fails before it has a cell leaves no folder behind."""
    name, data = _shard_of(provenance, records)
    if not (folder / MANIFEST).exists():
        init(folder)
    with locked(folder, shared=True):  # recovery (exclusive) must not remove our temp file mid-write
        _put(folder, name, data)
    return name


def write_shard(folder: Path, provenance: Provenance, records: Iterable[Record]) -> str:
    """Append one shard of `records` (all of `provenance`) to the corpus, listed; returns its file name."""
    name, data = _shard_of(provenance, records)
    with locked(folder):
        manifest = _read_manifest(folder)
        _put(folder, name, data)
        entry = ShardEntry(sha256(data), data.count(b"\n") - 1)
        write_atomic(folder / MANIFEST, Manifest({**manifest.shards, name: entry}, manifest.retired).to_bytes())
    return name


def recover(folder: str | os.PathLike[str], *, kernel_digest: str | None = None, gpu_uuid: str | None = None,
            gpu_name: str | None = None) -> tuple[Corpus, list[str]]:
    """Finish what interrupted writers left (module docstring) and return the corpus (verified as by `load`)
    with one line per action taken. Every shard is verified before the manifest changes."""
    folder = Path(folder)
    _require(folder)
    with locked(folder):
        state = _scan(folder, adopt=True)
        loaded = _verified(folder, state.shards, kernel_digest=kernel_digest, gpu_uuid=gpu_uuid,
                           gpu_name=gpu_name)
        if not state.settled:
            _settle(folder, state, state.adopted())
    return loaded, state.actions()


def resume(folder: str | os.PathLike[str], *, kernel_digest: str | None = None,
           gpu_name: str | None = None) -> tuple[Corpus, list[str]]:
    """What a sweep starts from: `recover` of the folder, or, where it holds no corpus yet (no manifest and no
    shard), an empty corpus with nothing written (`stage_shard` makes the folder with the first cell)."""
    folder = Path(folder)
    if not (folder / MANIFEST).exists() and not (folder.is_dir() and _shard_files(folder)):
        if folder.exists() and not folder.is_dir():
            raise InputError(f"{folder}: not a folder, so it cannot hold a corpus")
        return Corpus(folder, (), {}, ()), []
    return recover(folder, kernel_digest=kernel_digest, gpu_name=gpu_name)


def _merged(corpus: Corpus) -> dict[str, bytes]:
    """Name -> bytes of one shard per provenance holding all of its records."""
    by_key: dict[str, list[Record]] = {}
    for r in corpus.records:
        by_key.setdefault(r.provenance, []).append(r)
    return dict(_shard_of(corpus.provenances[key], recs) for key, recs in sorted(by_key.items()))


def compact(folder: str | os.PathLike[str]) -> tuple[int, int]:
    """Adopt staged shards and merge each provenance's shards into one deterministic shard; returns the
    number of shards (before, after). Nothing is written when the folder is already compact.

    Everything is read and verified first, free space checked (COMPACTION_SPACE x the shards' size), then:
    write the merged shards, then the manifest listing them with the old ones `retired`, then delete the old
    files and clear `retired`. A failure before the manifest is written removes the new files again; a crash
    after it leaves a corpus that loads the same records."""
    folder = Path(folder)
    _require(folder)
    with locked(folder):  # one exclusive hold: a concurrent compaction cannot retire the same shards
        state = _scan(folder, adopt=True)
        shards = state.shards
        merged = _merged(_verified(folder, shards))
        # A merged shard an interrupted compaction wrote is redundant now and listed again below: kept, not removed.
        state = dataclasses.replace(state, redundant=tuple(n for n in state.redundant if n not in merged))
        if state.settled and set(merged) == {s.name for s in shards}:
            return len(shards), len(shards)
        need = COMPACTION_SPACE * sum(s.size for s in shards)
        free = shutil.disk_usage(folder).free
        if free < need:
            raise EnvironmentProblem(f"{folder}: compaction needs about {need / 1e6:.1f} MB free, "
                                     f"{free / 1e6:.1f} MB available")
        written: list[str] = []
        try:
            for name, data in merged.items():
                if _put(folder, name, data):
                    written.append(name)
            retired = tuple(s.name for s in shards if s.name not in merged)
            kept = {name: ShardEntry(sha256(data), data.count(b"\n") - 1) for name, data in merged.items()}
            write_atomic(folder / MANIFEST, Manifest(kept, retired + state.manifest.retired).to_bytes())
        except BaseException:
            for name in written:
                (folder / SHARDS / name).unlink(missing_ok=True)
            raise
        for name in retired:
            (folder / SHARDS / name).unlink(missing_ok=True)
        _settle(folder, state, Manifest(kept))
    return len(shards), len(kept)


# ---------------------------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True)
class Corpus:
    folder: Path
    shards: tuple[Shard, ...]
    provenances: Mapping[str, Provenance]
    records: tuple[Record, ...]  # sorted by Record.ident, one per such key

    def cells(self) -> list[Cell]:
        return sorted(self._by_cell)

    def records_for(self, cell: Cell) -> list[Record]:
        return list(self._by_cell.get(cell, ()))

    @cached_property
    def current(self) -> tuple[Record, ...]:
        """The records whose code digest is the kernels' today (kernels.digests.launch_digest of the same
        candidate and cell): what counts as measured and what trains."""
        codes: dict[tuple[str, str, int, int, int], str] = {}
        out = []
        for r in self.records:
            key = (r.candidate, r.codebook, r.m, r.n, r.k)
            code = codes.get(key)
            if code is None:
                code = codes[key] = launch_digest(BY_ID[r.candidate], r.codebook, r.m, r.n, r.k)
            if r.code == code:
                out.append(r)
        return tuple(out)

    @property
    def stale(self) -> int:
        """Records timed with code the kernels no longer run (kept, never used)."""
        return len(self.records) - len(self.current)

    def done_cells(self, provenance_key: str) -> set[Cell]:
        """Cells with a current record of every candidate under this provenance (a fleet deals whole cells)."""
        done = set()
        for cell, records in self._current_by_cell.items():
            have = {r.candidate for r in records if r.provenance == provenance_key}
            if have and have.issuperset(cell_candidates(cell.m, cell.n, cell.k)):
                done.add(cell)
        return done

    def missing(self, cell: Cell, provenance: Provenance, *, model: bool) -> list[str]:
        """Candidate ids of the cell (`cell_candidates`) with no current record under `provenance` or, with
        `model`, under any provenance of its GPU model and timing parameters: what a sweep still has to time
        there. A resumed sweep, or one after a kernel change, times only these."""
        if model:
            accepted = {key for key, p in self.provenances.items()
                        if p.gpu_name == provenance.gpu_name and p.timing == provenance.timing}
        else:
            accepted = {provenance.key}
        have = {r.candidate for r in self._current_by_cell.get(cell, ()) if r.provenance in accepted}
        return [c for c in cell_candidates(cell.m, cell.n, cell.k) if c not in have]

    @cached_property
    def _current_by_cell(self) -> dict[Cell, list[Record]]:
        return _group_by_cell(self.current)

    @cached_property
    def _by_cell(self) -> dict[Cell, list[Record]]:
        return _group_by_cell(self.records)


def _group_by_cell(records: Iterable[Record]) -> dict[Cell, list[Record]]:
    out: dict[Cell, list[Record]] = {}
    for r in records:
        out.setdefault(r.cell, []).append(r)
    return out


def load(folder: str | os.PathLike[str], *, kernel_digest: str | None = None, gpu_uuid: str | None = None,
         gpu_name: str | None = None) -> Corpus:
    """Read and verify a corpus folder: every shard's hash against the manifest and its name, every record
    valid, no unlisted shard, no listed shard missing, one GPU model throughout (the requested one, if given;
    kernel_digest and gpu_uuid, if given, for every shard). Records of several kernel sources may sit side by
    side: `Corpus.current` tells which the kernels still run. Duplicates collapse deterministically."""
    folder = Path(folder)
    _require(folder)
    with locked(folder, shared=True):
        state = _scan(folder, adopt=False)
    return _verified(folder, state.listed, kernel_digest=kernel_digest, gpu_uuid=gpu_uuid, gpu_name=gpu_name)


def _verified(folder: Path, shards: tuple[Shard, ...], *, kernel_digest: str | None = None,
              gpu_uuid: str | None = None, gpu_name: str | None = None) -> Corpus:
    """The corpus of these shards, refusing a mix of GPU models (see `load`)."""
    expect = {"gpu_name": gpu_name, "kernel_digest": kernel_digest, "gpu_uuid": gpu_uuid}
    if expect["gpu_name"] is None and shards:  # a folder holds one GPU model
        expect["gpu_name"] = shards[0].provenance.gpu_name
    slug = gpu_slug(str(expect["gpu_name"])) if shards else folder.name
    if folder.name.startswith(GPU_SLUG_PREFIX) and folder.name != slug:  # named for a GPU model: for its own
        raise InputError(f"{folder}: the folder is named for GPU model {folder.name}, its records were timed on "
                         f"{expect['gpu_name']} ({slug})")
    for shard in shards:
        for field, want in expect.items():
            got = getattr(shard.provenance, field)
            if want is not None and got != want:
                why = "a corpus folder holds one GPU model" if field == "gpu_name" else "the one asked for"
                raise InputError(f"{folder / SHARDS / shard.name}: {field} {got!r} is not {want!r} ({why})")
    provenances = {s.provenance.key: s.provenance for s in shards}
    records = _combine(r for s in shards for r in s.records)
    return Corpus(folder, shards, provenances, tuple(records))
