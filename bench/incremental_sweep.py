"""Incremental re-sweep, on a GPU: what a kernel change that touches one family costs against a full sweep.

    python bench/incremental_sweep.py [--codebooks Q4_0] [--m 1,4,16] [--out FILE] [--replay CORPUS_FOLDER]

(--replay: a committed corpus stands in for the GPU, as `sweep --replay` does: a CPU check of the mechanics, whose
seconds are the bookkeeping's alone.)

1. A full sweep of the plan (graph mode, the default shapes) into a fresh temporary corpus root; its wall time.
2. For each family that launches kernel instantiations no other family launches: those instantiations' code
   digests are changed (as a change of that family's code would change them; the kernels that run are the
   same, so only the digests differ), and the same sweep runs again on the same root: it re-times only the
   records whose digest changed (`Corpus.missing`). Its wall time against the full sweep's (target: <= 30 %),
   the records it timed against the expected count, and a third run that must time nothing.
The digests of each family's change are restored before the next family's. A short table is printed last.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from gemv_dispatch.dispatch.common.gpu import gpu_slug
from gemv_dispatch.dispatch.measure import sweep
from gemv_dispatch.dispatch.measure.corpus import load
from gemv_dispatch.kernels import digests
from gemv_dispatch.kernels.registry import BY_ID, CANDIDATES

TARGET = 0.30


def family_only_kernels(codebooks: list[str], ms: list[int]) -> dict[str, set[str]]:
    """Per family, the kernel instantiations (over the plan's codebooks and M) that only it launches."""
    names: dict[str, set[str]] = {c.family: set() for c in CANDIDATES}
    for c in CANDIDATES:
        names[c.family] |= {c.kernel_name(cb, m) for cb in codebooks for m in ms}
    return {f: own - set().union(*(v for g, v in names.items() if g != f)) for f, own in names.items()}


def timed_sweep(plan: sweep.SweepPlan, root: Path, timer: sweep.Timer) -> tuple[float, int]:
    start = time.perf_counter()
    result = sweep.run_sweep(plan, root, timer)
    return time.perf_counter() - start, result.records


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codebooks", default="Q4_0")
    ap.add_argument("--m", default="1,4,16")
    ap.add_argument("--out", type=Path, help="JSON results (default bench/results/incremental-<gpu-slug>.json)")
    ap.add_argument("--replay", type=Path, help="a corpus GPU folder to replay instead of timing on the GPU")
    args = ap.parse_args()
    plan = sweep.parse_plan(args.codebooks, args.m, "graph")
    timer = sweep.ReplayTimer(load(args.replay)) if args.replay else sweep.GpuTimer(plan.timing)
    out = args.out or Path(__file__).parent / "results" / f"incremental-{gpu_slug(timer.gpu_name)}.json"
    codebooks, ms = args.codebooks.split(","), [int(m) for m in args.m.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        full_s, full_records = timed_sweep(plan, root, timer)
        print(f"full sweep: {full_records} records in {full_s:.1f} s", file=sys.stderr)
        folder = root / gpu_slug(timer.gpu_name)
        for family, touched in sorted(family_only_kernels(codebooks, ms).items()):
            if not touched:
                continue
            expected = sum(BY_ID[r.candidate].kernel_name(r.codebook, r.m) in touched for r in load(folder).current)
            changed = {name: "f" * 64 if name in touched else code for name, code in digests.table().items()}
            with mock.patch.object(digests, "table", lambda changed=changed: changed):
                seconds, records = timed_sweep(plan, root, timer)
                _, again = timed_sweep(plan, root, timer)
            rows.append({"family": family, "instantiations": len(touched), "expected": expected,
                         "records": records, "seconds": seconds, "ratio": seconds / full_s, "again": again,
                         "ok": records == expected and again == 0 and seconds / full_s <= TARGET})
            print(f"{family}: {records} records in {seconds:.1f} s", file=sys.stderr)
    result = {"gpu": timer.gpu_name, "replay": bool(args.replay), "codebooks": codebooks, "ms": ms,
              "full_seconds": full_s, "full_records": full_records, "target_ratio": TARGET, "families": rows}
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{timer.gpu_name}: full sweep of {args.codebooks} M={args.m} graph: {full_records} records, "
          f"{full_s:.1f} s")
    print(f"{'family':8} {'kernels':>7} {'records':>8} {'expected':>8} {'s':>7} {'of full':>8}  ok")
    for r in rows:
        print(f"{r['family']:8} {r['instantiations']:7d} {r['records']:8d} {r['expected']:8d} {r['seconds']:7.1f} "
              f"{r['ratio']:8.1%}  {'PASS' if r['ok'] else 'FAIL'}")
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
