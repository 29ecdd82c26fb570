"""Migrate a corpus folder made before code digests (formats gemv-dispatch-corpus/1 and -shard/1: plain JSON Lines
shards) to the current format: gzip shards whose records carry the code digest of the launch they timed.

A record can be given the digest only if it was timed with this repository's kernel source (its provenance's
kernel digest is the source's today): then the code it ran is the code the kernels run now. Records of other
sources are left out, and counted.

    python tools/migrate_corpus.py OLD_FOLDER NEW_FOLDER      (NEW_FOLDER must not exist)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gemv_dispatch.dispatch.measure import corpus
from gemv_dispatch.dispatch.measure.corpus import Provenance, Record
from gemv_dispatch.kernels import program
from gemv_dispatch.kernels.digests import launch_digest
from gemv_dispatch.kernels.registry import by_id


def legacy_shards(folder: Path) -> list[tuple[Provenance, list[dict]]]:
    manifest = json.loads((folder / corpus.MANIFEST).read_text())
    if manifest.get("format") != "gemv-dispatch-corpus/1":
        raise SystemExit(f"{folder}: not a gemv-dispatch-corpus/1 folder ({manifest.get('format')!r})")
    out = []
    for name in sorted(manifest["shards"]):
        lines = (folder / corpus.SHARDS / name).read_text().splitlines()
        header = json.loads(lines[0])
        out.append((Provenance.from_dict(header["provenance"], name), [json.loads(line) for line in lines[1:]]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    args = ap.parse_args()
    if args.new.exists():
        print(f"error: {args.new} exists", file=sys.stderr)
        return 2
    kept, dropped = 0, 0
    corpus.init(args.new)
    for provenance, rows in legacy_shards(args.old):
        if provenance.kernel_digest != program.digest():
            dropped += len(rows)
            continue
        records = [Record.from_dict({**row, "code": launch_digest(by_id(row["candidate"]), row["codebook"], row["m"],
                                                                  row["n"], row["k"])}, f"{args.old}: record")
                   for row in rows]
        corpus.write_shard(args.new, provenance, records)
        kept += len(records)
    corpus.compact(args.new)
    loaded = corpus.load(args.new)
    print(f"{args.new}: {kept} records migrated ({len(loaded.cells())} cells), {dropped} of other kernel sources "
          "left out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
