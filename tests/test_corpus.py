"""The corpus on disk: records and provenance, atomic hashed shards, manifest, verification, compaction."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from corpus_fixture import (
    FAKE_GPU,
    build_corpus,
    cells,
    fake_provenance,
    fake_records,
    put_text,
    shard_paths,
    shard_text,
    tree,
)
from gemv_dispatch.dispatch.cli import main
from gemv_dispatch.dispatch.common.gpu import gpu_slug
from gemv_dispatch.dispatch.measure import corpus
from gemv_dispatch.dispatch.measure.corpus import (
    MANIFEST,
    SHARDS,
    Cell,
    Provenance,
    Record,
    compact,
    load,
    write_shard,
)
from gemv_dispatch.dispatch.measure.timing import TimingConfig
from gemv_dispatch.kernels.errors import InputError

PROV = fake_provenance()


def new_folder(tmp_path: Path, name: str = "c") -> Path:
    folder = tmp_path / name
    corpus.init(folder)
    return folder


# --- records and provenance ----------------------------------------------------------------------------

def test_record_and_provenance_round_trip_through_json():
    record = fake_records(cells()[0], PROV)[0]
    assert Record.from_dict(json.loads(record.to_json()), "here") == record
    again = Provenance.from_dict(json.loads(json.dumps(PROV.to_dict())), "here")
    assert again == PROV and again.key == PROV.key and len(PROV.key) == 16


def test_provenance_key_ignores_clocks_but_not_sources_gpu_or_timing():
    assert dataclasses.replace(PROV, sm_clock_mhz=345, mem_clock_mhz=None).key == PROV.key
    assert fake_provenance(kernel_digest="0" * 64).key != PROV.key
    assert fake_provenance(gpu_uuid="GPU-other").key != PROV.key
    assert fake_provenance(timing=TimingConfig(cold_l2=False)).key != PROV.key
    assert "mode" not in PROV.timing  # the mode is part of each cell, not of the provenance


def test_record_fields_are_type_checked():
    data = json.loads(fake_records(cells()[0], PROV)[0].to_json())
    for field, value in (("m", True), ("median_us", "fast"), ("mode", "lazy")):
        with pytest.raises(InputError, match=f"line 7.*{field}"):
            Record.from_dict({**data, field: value}, "line 7")
    with pytest.raises(InputError, match="unexpected fields"):
        Record.from_dict({**data, "extra": 1}, "line 7")


def test_gpu_slug():
    assert gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert gpu_slug(FAKE_GPU) == "fake-gpu-9000"
    with pytest.raises(InputError):
        gpu_slug("  ")


# --- writing ------------------------------------------------------------------------------------------

def test_shards_are_atomic_hashed_and_listed_in_the_manifest(tmp_path):
    folder = new_folder(tmp_path)
    names = [write_shard(folder, PROV, fake_records(cell, PROV)) for cell in cells()[:3]]
    manifest = json.loads((folder / MANIFEST).read_text())
    assert sorted(manifest["shards"]) == sorted(names) == [p.name for p in shard_paths(folder)]
    for path in shard_paths(folder):
        entry = manifest["shards"][path.name]
        assert entry["sha256"] == hashlib.sha256(shard_text(path)).hexdigest()  # of the text, not the gzip file
        assert entry["records"] == len(shard_text(path).splitlines()) - 1
        assert path.name.startswith(PROV.key)
    assert sorted(os.listdir(folder / SHARDS)) == sorted(names)  # no temp file left behind
    assert sorted(os.listdir(folder)) == [MANIFEST, SHARDS]


def test_same_records_give_the_same_shard_and_nothing_is_rewritten(tmp_path):
    folder = new_folder(tmp_path)
    records = fake_records(cells()[0], PROV)
    name = write_shard(folder, PROV, records)
    mtime = (folder / SHARDS / name).stat().st_mtime_ns
    assert write_shard(folder, PROV, reversed(records)) == name
    assert (folder / SHARDS / name).stat().st_mtime_ns == mtime


def disk_full(*args: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("write", [write_shard, corpus.stage_shard])
def test_a_failure_mid_write_names_the_shard_and_leaves_no_partial_file(tmp_path, monkeypatch, write):
    folder = new_folder(tmp_path)
    write_shard(folder, PROV, fake_records(cells()[0], PROV))
    before = tree(folder)
    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left on device") as caught:
        write(folder, PROV, fake_records(cells()[1], PROV))
    monkeypatch.undo()
    # The destination, not the temp file: what the command line prints as "path: cause".
    assert Path(caught.value.filename).parent == folder / SHARDS
    assert not Path(caught.value.filename).name.startswith(".")
    assert tree(folder) == before
    assert len(load(folder).cells()) == 1


# --- verification -------------------------------------------------------------------------------------

def test_load_returns_sorted_records_and_the_cell_index(tmp_path):
    folder = build_corpus(tmp_path)
    loaded = load(folder)
    assert list(loaded.records) == sorted(loaded.records, key=lambda r: r.ident)
    assert loaded.cells() == cells()
    cell = cells()[0]
    assert {r.candidate for r in loaded.records_for(cell)} == {r.candidate for r in fake_records(cell, PROV)}
    assert loaded.records_for(Cell("Q4_0", 1, 32, 32, "graph")) == []
    assert loaded.done_cells(PROV.key) == set(cells())
    assert loaded.done_cells("someone-else") == set()
    assert loaded.provenances == {PROV.key: PROV}


def test_truncated_shard_is_named(tmp_path):
    folder = build_corpus(tmp_path)
    (path,) = shard_paths(folder)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(InputError, match=f"{path.name}.*truncated or altered"):
        load(folder)


def test_altered_shard_is_named(tmp_path):
    folder = build_corpus(tmp_path)
    (path,) = shard_paths(folder)
    put_text(path, shard_text(path).replace(b'"median_us":', b'"median_us":1', 1))
    with pytest.raises(InputError, match=f"{path.name}.*SHA-256"):
        load(folder)


def test_shard_missing_from_the_manifest_and_manifest_entry_without_file(tmp_path):
    folder = build_corpus(tmp_path)
    (path,) = shard_paths(folder)
    stray = folder / SHARDS / "stray.jsonl.gz"
    stray.write_bytes(path.read_bytes())
    with pytest.raises(InputError, match=r"stray\.jsonl\.gz: shard is not in the manifest"):
        load(folder)
    with pytest.raises(InputError, match=r"stray\.jsonl\.gz: not a shard name"):  # and never adopted
        corpus.recover(folder)
    stray.unlink()
    path.unlink()
    with pytest.raises(InputError, match=f"{path.name}: listed in the manifest but missing"):
        load(folder)


def test_not_a_corpus(tmp_path):
    with pytest.raises(InputError, match="no such corpus folder"):
        load(tmp_path / "nope")
    with pytest.raises(InputError, match=r"no manifest\.json"):
        load(tmp_path)
    (tmp_path / MANIFEST).write_text("{")
    with pytest.raises(InputError, match="unreadable manifest"):
        load(tmp_path)


def test_another_gpu_model_or_an_unasked_kernel_digest_is_refused_by_shard_name(tmp_path):
    folder = build_corpus(tmp_path)
    other_gpu = fake_provenance(gpu_name="Other GPU")
    name = write_shard(folder, other_gpu, fake_records(cells()[0], other_gpu))
    # Unasked, the first shard in name order sets the model, so either shard may be the one named.
    with pytest.raises(InputError, match=f"gpu_name '({FAKE_GPU}|Other GPU)' is not '(Other GPU|{FAKE_GPU})'"):
        load(folder)
    with pytest.raises(InputError, match=f"{name}: gpu_name 'Other GPU' is not '{FAKE_GPU}'"):
        load(folder, gpu_name=FAKE_GPU)

    # Several kernel sources may share a folder (Corpus.current tells what the kernels still run); asked for
    # one, the others are refused by name.
    folder = build_corpus(tmp_path / "b")
    old = fake_provenance(kernel_digest="0" * 64)
    name = write_shard(folder, old, fake_records(cells()[0], old))
    assert set(load(folder).provenances) == {PROV.key, old.key}
    with pytest.raises(InputError, match=f"{name}: kernel_digest '0000"):
        load(folder, kernel_digest=PROV.kernel_digest)

    folder = build_corpus(tmp_path / "c")
    (shard,) = shard_paths(folder)
    with pytest.raises(InputError, match=f"{shard.name}: kernel_digest .* is not '1111"):
        load(folder, kernel_digest="1" * 64)
    with pytest.raises(InputError, match=f"{shard.name}: gpu_uuid .* is not 'GPU-x'"):
        load(folder, gpu_uuid="GPU-x")
    assert load(folder, gpu_uuid=PROV.gpu_uuid, kernel_digest=PROV.kernel_digest, gpu_name=FAKE_GPU).records


def test_a_folder_named_for_another_gpu_model_is_refused(tmp_path):
    h100 = fake_provenance(gpu_name="NVIDIA H100 80GB HBM3")
    folder = build_corpus(tmp_path, h100, geometries=[(256, 256)])
    assert folder.name == "nvidia-h100-80gb-hbm3" and load(folder).records
    moved = folder.rename(tmp_path / "nvidia-h200")
    with pytest.raises(InputError, match="named for GPU model nvidia-h200, its records were timed on NVIDIA H100 "
                                         r"80GB HBM3 \(nvidia-h100-80gb-hbm3\)"):
        load(moved)
    assert load(moved.rename(tmp_path / "my-corpus")).records  # a folder named by its user is its user's


def test_two_uuids_of_one_gpu_model_may_share_a_folder(tmp_path):
    folder = build_corpus(tmp_path)
    twin = fake_provenance(gpu_uuid="GPU-twin")
    write_shard(folder, twin, fake_records(cells()[0], twin))
    loaded = load(folder)
    assert set(loaded.provenances) == {PROV.key, twin.key}
    assert len(loaded.records_for(cells()[0])) == 2 * len(fake_records(cells()[0], PROV))


# --- combining ----------------------------------------------------------------------------------------

def test_duplicates_collapse_and_compaction_is_deterministic_byte_for_byte(tmp_path):
    all_cells = cells()
    retimed = [dataclasses.replace(r, median_us=r.median_us * 2, p95_us=r.p95_us * 2)
               for r in fake_records(all_cells[0], PROV)]
    batches = [fake_records(c, PROV) for c in all_cells] + [retimed]
    a, b = new_folder(tmp_path, "a"), new_folder(tmp_path, "b")
    for batch in batches:
        write_shard(a, PROV, batch)
    for batch in reversed(batches):
        write_shard(b, PROV, batch)
    assert load(a).records == load(b).records
    assert len(load(a).records) == sum(len(batch) for batch in batches[:-1])  # the re-timed cell once
    assert compact(a) == (len(batches), 1)
    compact(b)
    assert tree(a) == tree(b)
    assert len(shard_paths(a)) == 1
    before = tree(a)
    assert compact(a) == (1, 1) and tree(a) == before  # idempotent


def test_compaction_keeps_one_shard_per_provenance(tmp_path):
    folder = build_corpus(tmp_path)
    twin = fake_provenance(gpu_uuid="GPU-twin")
    for cell in cells()[:2]:
        write_shard(folder, twin, fake_records(cell, twin))
    records = load(folder).records
    assert compact(folder) == (3, 2)
    assert load(folder).records == records


# --- recovery after a crash ---------------------------------------------------------------------------

def test_recover_adopts_a_complete_orphan_and_removes_temps(tmp_path):
    folder = build_corpus(tmp_path)
    records = load(folder).records
    manifest = (folder / MANIFEST).read_bytes()
    # A crash between renaming a shard into place and listing it: an orphan, plus an unfinished temp.
    orphan = build_corpus(tmp_path / "other", geometries=((512, 1024),))
    (orphan_path,) = shard_paths(orphan)
    (folder / SHARDS / orphan_path.name).write_bytes(orphan_path.read_bytes())
    (folder / SHARDS / ".x.jsonl.123.tmp").write_bytes(b"{partial")
    with pytest.raises(InputError, match="not in the manifest"):
        load(folder)
    _, actions = corpus.recover(folder)
    assert len(actions) == 2
    loaded = load(folder)
    assert set(records) < set(loaded.records)
    assert not list((folder / SHARDS).glob(".*"))
    assert (folder / MANIFEST).read_bytes() != manifest


def test_recover_refuses_a_broken_orphan_by_name(tmp_path):
    """A truncated orphan under a well-formed shard name reaches the hash check (a name like broken.jsonl would
    stop at the name check, proving nothing about the bytes)."""
    folder = build_corpus(tmp_path)
    orphan = build_corpus(tmp_path / "other", geometries=((512, 1024),))
    (source,) = shard_paths(orphan)
    broken = folder / SHARDS / source.name
    broken.write_bytes(source.read_bytes()[:-10])
    before = tree(folder)
    with pytest.raises(InputError, match=rf"{broken.name}: .*truncated or altered"):
        corpus.recover(folder)
    assert tree(folder) == before
    broken.write_bytes(source.read_bytes())  # control: the whole orphan is adopted
    assert len(corpus.recover(folder)[1]) == 1


def test_a_crash_inside_compaction_loses_nothing(tmp_path, monkeypatch):
    folder = build_corpus(tmp_path, PROV, compact=False)
    records = load(folder).records

    def crash(self: Path, missing_ok: bool = False) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "unlink", crash)  # dies after the merged shard and manifest are written
    with pytest.raises(KeyboardInterrupt):
        compact(folder)
    monkeypatch.undo()
    assert load(folder).records == records  # old files are `retired`: present but ignored
    assert json.loads((folder / MANIFEST).read_text())["retired"]
    compact(folder)
    assert load(folder).records == records and len(shard_paths(folder)) == 1
    assert json.loads((folder / MANIFEST).read_text())["retired"] == []


# --- CLI ----------------------------------------------------------------------------------------------

def test_corpus_check_and_compact_cli(tmp_path):
    folder = build_corpus(tmp_path, PROV, compact=False)
    runner = CliRunner()
    result = runner.invoke(main, ["corpus", "check", str(folder), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["shards"] == len(cells()) and report["cells"] == len(cells())
    assert report["provenances"][PROV.key]["records"] == report["records"] == len(load(folder).records)
    result = runner.invoke(main, ["corpus", "compact", str(folder)])
    assert result.exit_code == 0 and f"{len(cells())} shards -> 1" in result.stdout
    result = runner.invoke(main, ["corpus", "check", str(folder)])
    assert result.exit_code == 0 and "ok, 1 shards" in result.stdout


@pytest.mark.parametrize("command", ["check", "compact"])
def test_corpus_cli_errors_are_one_line(tmp_path, command):
    result = CliRunner().invoke(main, ["corpus", command, str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0 and "no such corpus folder" in result.stderr
    folder = build_corpus(tmp_path)
    (path,) = shard_paths(folder)
    path.write_bytes(path.read_bytes()[:-1])
    result = CliRunner().invoke(main, ["corpus", command, str(folder)])
    assert result.exit_code == 2 and path.name in result.stderr and result.stderr.count("\n") == 1


# --- integrity: nothing corrupt is adopted or loaded (issue 8) ------------------------------------------

def shard_with(folder: Path, rows: list[dict], provenance: Provenance = PROV, listed: bool = True) -> Path:
    """A shard holding `rows` as given, named after its own bytes (as a writer names it), listed or not."""
    header = {"format": corpus.SHARD_FORMAT, "provenance": provenance.to_dict(), "provenance_key": provenance.key,
              "records": len(rows)}
    data = "".join(json.dumps(x, sort_keys=True, separators=(",", ":")) + "\n" for x in [header, *rows]).encode()
    sha = hashlib.sha256(data).hexdigest()
    path = folder / SHARDS / f"{provenance.key}-{sha[:16]}.jsonl.gz"
    put_text(path, data)
    if listed:
        manifest = json.loads((folder / MANIFEST).read_text())
        manifest["shards"][path.name] = {"sha256": sha, "records": len(rows)}
        (folder / MANIFEST).write_text(json.dumps(manifest))
    return path


def good_row(**change: object) -> dict:
    cell = Cell("Q4_1", 16, 256000, 2304, "graph")
    return {**json.loads(fake_records(cell, PROV)[0].to_json()), **change}


def test_recovery_refuses_a_shard_whose_bytes_differ_from_its_name(tmp_path):
    """Issue 8, case 1: one flipped byte (K 2304 -> 2307) and the manifest deleted; it was adopted."""
    folder = build_corpus(tmp_path)
    (path,) = shard_paths(folder)
    put_text(path, shard_text(path).replace(b'"k":4096', b'"k":4099', 1))
    (folder / MANIFEST).unlink()
    corpus.init(folder)
    before = tree(folder)
    with pytest.raises(InputError, match=f"{path.name}: SHA-256 .* its name promises"):
        corpus.recover(folder)
    with pytest.raises(InputError, match=path.name):
        compact(folder)
    assert tree(folder) == before  # nothing adopted


def test_recovery_refuses_a_renamed_shard_of_valid_records_under_another_key(tmp_path):
    folder = new_folder(tmp_path)
    twin = fake_provenance(gpu_uuid="GPU-twin")
    path = shard_with(folder, [good_row()], listed=False)
    path.rename(folder / SHARDS / path.name.replace(PROV.key, twin.key))
    with pytest.raises(InputError, match="name do not both match its provenance"):
        corpus.recover(folder)


@pytest.mark.parametrize(("change", "message"), [
    ({"k": 2307}, "not a GEMV shape"),
    ({"m": 0}, "not a GEMV shape"),
    ({"n": 0}, "not a GEMV shape"),
    ({"codebook": "Q9_9"}, "unknown codebook"),
    ({"mode": "lazy"}, "mode must be one of"),
    ({"candidate": "wide.s9.t1.c1"}, "unknown candidate"),
    ({"candidate": "kpar.s64.t128.c1"}, "is not timed for"),
    ({"identity": 3}, "identity"),
    ({"family": "kpar"}, "family"),
    ({"median_us": float("nan")}, "times must be finite"),
    ({"p95_us": float("inf")}, "times must be finite"),
    ({"p5_us": -1.0}, "times must be finite, positive"),
    ({"p5_us": 1e9}, "p5 <= median <= p95"),
    ({"mad_us": -0.5}, "mad_us"),
    ({"samples": 0}, "samples"),
])
def test_every_record_is_validated_on_load_and_recovery(tmp_path, change, message):
    folder = new_folder(tmp_path)
    path = shard_with(folder, [good_row(), good_row(**change)])
    with pytest.raises(InputError, match=f"{path.name}: line 3: .*{message}"):
        load(folder)
    folder = new_folder(tmp_path, "unlisted")
    shard_with(folder, [good_row(**change)], listed=False)
    before = tree(folder)
    with pytest.raises(InputError, match=message):
        corpus.recover(folder)
    assert tree(folder) == before
    assert load(new_folder(tmp_path, "control")).records == ()  # negative control: a clean folder loads


def test_good_rows_written_by_the_test_helper_load(tmp_path):
    """The control for the two tests above: the same helper with valid rows gives a loadable corpus."""
    folder = new_folder(tmp_path)
    shard_with(folder, [good_row()])
    assert len(load(folder).records) == 1
    shard_with(folder, [good_row(candidate="wide.s1.t256.c1")], listed=False)
    loaded, actions = corpus.recover(folder)
    assert len(loaded.records) == 2 and len(actions) == 1


def test_recover_reports_each_kind_of_action_in_one_line(tmp_path):
    """A resumed sweep adopts one staged shard per cell: the report names their count, not every file."""
    folder = new_folder(tmp_path)
    shard_with(folder, [good_row()])
    for candidate in ("wide.s1.t256.c1", "wide.s1.t128.c2", "wide.s1.t128.mma2"):
        shard_with(folder, [good_row(candidate=candidate)], listed=False)
    loaded, actions = corpus.recover(folder)
    assert len(loaded.records) == 4
    assert len(actions) == 1 and actions[0].startswith("adopted shards written before the manifest listed them: 3 (")


def test_a_cell_is_done_only_when_every_candidate_has_a_record(tmp_path):
    folder = new_folder(tmp_path)
    full, partial, raced = cells()[:3]
    write_shard(folder, PROV, fake_records(full, PROV))
    write_shard(folder, PROV, fake_records(partial, PROV)[1:])
    write_shard(folder, PROV, [dataclasses.replace(r, dropped=True, samples=1) for r in fake_records(raced, PROV)])
    assert load(folder).done_cells(PROV.key) == {full, raced}  # racing-dropped records count


def test_type_hints_are_resolved_once_per_class_not_per_record(tmp_path, monkeypatch):
    folder = build_corpus(tmp_path)
    calls = []
    real = corpus.get_type_hints
    monkeypatch.setattr(corpus, "get_type_hints", lambda cls: calls.append(cls) or real(cls))
    corpus._schema.cache_clear()
    loaded = load(folder)
    assert len(loaded.records) > 100
    assert sorted(map(str, calls)) == sorted(map(str, {Record, Provenance, corpus.ShardEntry}))


# --- failures leave every file as it was (issue 8, cases 2 and 3) --------------------------------------

def test_a_failed_compact_changes_nothing(tmp_path):
    folder = build_corpus(tmp_path, compact=False)
    other = fake_provenance(gpu_name="Other GPU")
    corpus.stage_shard(folder, other, fake_records(cells()[0], other))
    (folder / SHARDS / ".left.jsonl.x.tmp").write_bytes(b"{")
    before = tree(folder)
    result = CliRunner().invoke(main, ["corpus", "compact", str(folder)])
    assert result.exit_code == 2 and "Other GPU" in result.stderr and result.stderr.count("\n") == 1
    assert tree(folder) == before


def test_compaction_checks_free_space_first(tmp_path, monkeypatch):
    folder = build_corpus(tmp_path, compact=False)
    before = tree(folder)
    size = sum(p.stat().st_size for p in shard_paths(folder))
    monkeypatch.setattr(corpus.shutil, "disk_usage", lambda p: SimpleNamespace(free=size))
    result = CliRunner().invoke(main, ["corpus", "compact", str(folder)])
    assert result.exit_code == 3 and result.stderr.count("\n") == 1
    assert f"{folder}: compaction needs about" in result.stderr
    assert tree(folder) == before
    monkeypatch.setattr(corpus.shutil, "disk_usage", lambda p: SimpleNamespace(free=2 * size))
    assert compact(folder) == (len(before) - 1, 1)  # control: enough room, it compacts


def test_disk_full_during_compaction_is_one_line_and_changes_nothing(tmp_path, monkeypatch):
    folder = build_corpus(tmp_path, compact=False)
    before = tree(folder)
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: disk_full() if str(b).endswith(MANIFEST) else real_replace(a, b))
    result = CliRunner().invoke(main, ["corpus", "compact", str(folder)])
    assert result.exit_code == 3 and result.stderr.count("\n") == 1
    assert result.stderr == f"error: {folder / MANIFEST}: No space left on device\n"
    assert tree(folder) == before  # the merged shard written before the manifest failed is gone again


def test_a_read_only_corpus_folder_is_one_line(tmp_path, monkeypatch):
    folder = build_corpus(tmp_path, compact=False)
    before = tree(folder)

    def read_only(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), kwargs.get("dir"))

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    result = CliRunner().invoke(main, ["corpus", "compact", str(folder)])
    assert result.exit_code == 3 and result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"error: {folder / SHARDS}/") and "Read-only file system" in result.stderr
    assert tree(folder) == before


# --- the manifest is the commit point (issue 50, 1b) -----------------------------------------------------

def unlisted_copy(folder: Path, records: list[Record], provenance: Provenance = PROV) -> Path:
    """A well-formed shard of `records` dropped into shards/ without the manifest listing it."""
    name, data = corpus._shard_of(provenance, records)
    path = folder / SHARDS / name
    put_text(path, data)
    return path


def test_an_unlisted_shard_never_replaces_listed_records(tmp_path):
    """Issue 50: a well-formed shard of a listed cell and provenance, times / 10, silently replaced the cell's
    listed records on the next sweep. Refused, naming the shard, and nothing changes."""
    folder = build_corpus(tmp_path)
    listed = load(folder).records
    cell = cells()[0]
    faster = [dataclasses.replace(r, median_us=r.median_us / 10, p5_us=r.p5_us / 10, p95_us=r.p95_us / 10,
                                  mad_us=r.mad_us / 10) for r in fake_records(cell, PROV)]
    forged = unlisted_copy(folder, faster)
    before = tree(folder)
    for write in (corpus.recover, compact):
        with pytest.raises(InputError, match=f"{forged.name}: shard outside the manifest would replace listed "
                                             f"records of {cell}"):
            write(folder)
        assert tree(folder) == before
    forged.unlink()
    assert load(folder).records == listed
    # Control: the same records for a cell the manifest lacks are adopted (they add records).
    new_cell = Cell("Q4_0", 16, 256, 512, "graph")
    adopted = unlisted_copy(folder, fake_records(new_cell, PROV))
    loaded, actions = corpus.recover(folder)
    assert adopted.name in json.loads((folder / MANIFEST).read_text())["shards"]
    assert set(listed) < set(loaded.records) and actions[0].startswith("adopted shards")


def test_two_unlisted_shards_that_disagree_are_refused(tmp_path):
    folder = build_corpus(tmp_path)
    cell = Cell("Q4_0", 16, 256, 512, "graph")
    records = fake_records(cell, PROV)
    first = unlisted_copy(folder, records)
    second = unlisted_copy(folder, [dataclasses.replace(records[0], median_us=records[0].median_us * 1.5,
                                                        p95_us=records[0].p95_us * 1.5)])
    before = tree(folder)
    names = sorted((first.name, second.name))
    with pytest.raises(InputError, match=f"{names[1]}: shard outside the manifest disagrees with {names[0]}"):
        corpus.recover(folder)
    assert tree(folder) == before


def test_a_merged_shard_left_by_an_interrupted_compaction_is_kept_or_removed_never_refused(tmp_path):
    """Killed after writing the merged shard, before the manifest listed it: its records are the listed ones.
    Recovery removes it as redundant; compaction keeps it as the shard it writes anyway (not deleted under the
    manifest that lists it)."""
    for write in (corpus.recover, compact):
        folder = build_corpus(tmp_path / write.__name__, compact=False)
        records = load(folder).records
        (merged_name, data), = corpus._merged(load(folder)).items()
        put_text(folder / SHARDS / merged_name, data)
        write(folder)
        assert load(folder).records == records
        names = {p.name for p in shard_paths(folder)}
        assert (merged_name in names) == (write is compact), names


# --- a failing command changes nothing (issue 50, 1c) ----------------------------------------------------

def test_a_deleted_manifest_is_rebuilt_only_from_shards_that_all_verify(tmp_path):
    folder = build_corpus(tmp_path, compact=False)
    records = load(folder).records
    (folder / MANIFEST).unlink()
    bad = shard_paths(folder)[2]
    good = bad.read_bytes()
    put_text(bad, shard_text(bad).replace(b'"median_us":', b'"median_us":1', 1))
    before = tree(folder)
    corpus.init(folder)  # no empty manifest over shards
    for write in (corpus.recover, compact):
        with pytest.raises(InputError, match=f"{bad.name}: SHA-256"):
            write(folder)
        assert tree(folder) == before and not (folder / MANIFEST).exists()
    bad.write_bytes(good)  # control: with every shard sound, the manifest is rebuilt from them
    loaded, actions = corpus.recover(folder)
    assert loaded.records == records == load(folder).records
    assert actions == [f"rebuilt the missing manifest from the verified shards: {len(cells())} "
                       f"({shard_paths(folder)[0].name} … {shard_paths(folder)[-1].name})"]


# --- code digests: what is current (issue 53, item 3) ----------------------------------------------------

def test_records_are_current_while_their_code_is_the_kernels(tmp_path, monkeypatch):
    """A record carries the code digest of its launch; once the code of one kernel instantiation changes, its
    records are stale (kept, counted by `corpus check`), missing from their cells, and the rest stay current."""
    from gemv_dispatch.kernels import digests

    folder = build_corpus(tmp_path)
    fresh = load(folder)
    assert fresh.current == fresh.records and fresh.stale == 0
    cell = cells()[0]
    assert fresh.missing(cell, PROV, model=False) == []
    victim = fresh.records_for(cell)[0]
    name = corpus.BY_ID[victim.candidate].kernel_name(victim.codebook, victim.m)
    changed = dict(digests.table(), **{name: "0" * 64})
    monkeypatch.setattr(digests, "table", lambda: changed)
    later = load(folder)
    stale = [r for r in later.records if corpus.BY_ID[r.candidate].kernel_name(r.codebook, r.m) == name]
    assert later.stale == len(stale) > 0 and set(later.current).isdisjoint(stale)
    assert victim.candidate in later.missing(cell, PROV, model=False)
    # Model level: a current record under another GPU of the model (same timing) counts; another model's not.
    twin = fake_provenance(gpu_uuid="GPU-twin")
    write_shard(folder, twin, fake_records(cell, twin))
    assert load(folder).missing(cell, PROV, model=True) == []
    assert victim.candidate in load(folder).missing(cell, PROV, model=False)
    result = CliRunner().invoke(main, ["corpus", "check", str(folder), "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["stale"] == len(stale)


def test_a_record_without_a_code_digest_is_refused():
    data = json.loads(fake_records(cells()[0], PROV)[0].to_json())
    with pytest.raises(InputError, match="code must be 16 lowercase hex"):
        Record.from_dict({**data, "code": "xyz"}, "line 3")
    with pytest.raises(InputError, match=r"missing fields \['code'\]"):
        Record.from_dict({k: v for k, v in data.items() if k != "code"}, "line 3")


def test_a_corpus_of_the_old_format_names_the_migration(tmp_path):
    folder = tmp_path / "old"
    (folder / SHARDS).mkdir(parents=True)
    (folder / MANIFEST).write_text(json.dumps({"format": "gemv-dispatch-corpus/1", "shards": {}, "retired": []}))
    with pytest.raises(InputError, match=r"without code digests: migrate it .*tools/migrate_corpus\.py"):
        load(folder)
