"""A/B of kernel sources: the same candidates on the same cells, timed interleaved in one run.

    git show REV:kernels/cuda/gemv.cu > .ab/base.cu
    python tools/source_ab.py .ab/base.cu [.ab/variant.cu ...] --family kpar --out ab.json
    python tools/source_ab.py .ab/base.cu --family direct,kpar,wide ...   # a cell's best over three families

Each source is a file (not a revision: the device copy has no git history), the first the baseline; the working
tree's source ("tree") is always timed too. All are built with the same options and name expressions, so they
must keep the parameter list and the workspace layout; a source whose gemv_mma takes fewer template arguments than
the tree's gets each name cut to its own (an argument added since, e.g. version 32's WEIGHTS_A, is timed against the
older source's one path). Every version of a candidate enters one
time_candidates call (graph replay, cold L2 by rotation, interleaved rounds, medians, no racing): each ratio
comes from one run. First every version's instantiations of the families are compiled with nvcc (sm_90, the
contract's options): a version that spills is refused (the certificate's spill_free check would refuse its table
after a whole sweep), and the registers of each go into the report. Before timing, every version's output is
compared byte for byte with the tree's, and a kpar launch must leave its tickets zero: sources that disagree are
refused, with the cell and candidate named. A source without the staged walks' shared-memory ring (no `CopyTo`,
versions before 55) launches with the shared memory it asks for without one (Candidate.shared_bytes without a
codebook): the ring's bytes would cost it occupancy it never uses. `--ring-min-blocks TAG=BLOCKS` gives version TAG's
staged walks the ring from BLOCKS blocks a thread instead of registry.RING_MIN_BLOCKS (a source may be the tree's
own, to time the threshold alone); `--ring-shared-limit BYTES` gives every version's ring up to BYTES of shared memory
a CTA (Hopper opts in to 227 KB). `--unchecked TAG` times version TAG without the byte comparison: a study variant
that leaves work out (e.g. kpar's fold) to price it, never a version to register; its rows name it. Each version's
ring has the slots its source declares (`PIPE_SLOTS`), and its launches the shared memory of that many. Each cell's
line is printed, and --out rewritten, as soon as it is timed, so a run cut by a time limit keeps what it finished.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import cupy as cp
import numpy as np
from gemv_dispatch.dispatch.measure.sweep import sweep_timing, weight_copies
from gemv_dispatch.dispatch.measure.timing import CupyBackend, cell_seed, time_candidates
from gemv_dispatch.kernels import launch, program, ptxas, registry
from gemv_dispatch.kernels.registry import CANDIDATES, PIPE_SLOTS, RING_MIN_BLOCKS, candidates_for, ticket_words

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the benchmarks' anchor shapes
from anchors import ANCHORS

CONFIG = replace(sweep_timing(), window_us=300.0, race=False)
TREE = "tree"
RING_MARK = "CopyTo"  # the staged walks' shared-memory ring (version 55 on)
RING_SLOTS = re.compile(r"constexpr int PIPE_SLOTS = (\d+);")  # the ring's slots a thread, as a source declares them
_MMA_TEMPLATE = re.compile(r"template <([^<>]*)>\s*__global__ void [^\n]*\bgemv_mma\(")


def mma_arity(text: str) -> int:
    """Template arguments of gemv_mma in a kernel source."""
    found = _MMA_TEMPLATE.search(text)
    if found is None:
        raise SystemExit("a kernel source without gemv_mma")
    return found.group(1).count(",") + 1


def spelled(name: str, arity: int) -> str:
    """A registry kernel name as a source whose gemv_mma takes `arity` template arguments instantiates it."""
    if not name.startswith("gemv_mma<"):
        return name
    return "gemv_mma<" + ", ".join(name[len("gemv_mma<"):-1].split(", ")[:arity]) + ">"


def ring_of(text: str, threshold: int) -> tuple[int, int] | None:
    """A source's ring as Candidate.shared_bytes sizes it, (from how many blocks a thread, slots a thread), or None
    for a source without one."""
    if RING_MARK not in text:
        return None
    slots = RING_SLOTS.search(text)
    return threshold, int(slots.group(1)) if slots else PIPE_SLOTS


def ring_bytes(c: registry.Candidate, m: int, k: int, codebook: str, threshold: int, slots: int) -> int:
    """c's shared memory with a version's ring, from `threshold` blocks a thread and `slots` slots a thread: the
    registry's RING_MIN_BLOCKS and PIPE_SLOTS, which Candidate.shared_bytes reads at each call, set for this one."""
    saved = registry.RING_MIN_BLOCKS, registry.PIPE_SLOTS
    registry.RING_MIN_BLOCKS, registry.PIPE_SLOTS = threshold, slots
    try:
        return c.shared_bytes(m, k, codebook)
    finally:
        registry.RING_MIN_BLOCKS, registry.PIPE_SLOTS = saved


def time_cell(modules: dict[str, tuple[Any, int]], rings: dict[str, tuple[int, int] | None], codebook: str, m: int,
              n: int, k: int, families: list[str], stream: Any, l2: int,
              unchecked: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """Every version of every candidate of `families` in the cell: medians (µs) by version, bytes checked first
    (but those of the `unchecked` versions); rings[tag]: from how many blocks a thread that version's staged walks
    take the ring, and its slots (None: no ring)."""
    rng = cp.random.default_rng(cell_seed(codebook, n, k, CONFIG.seed))
    with stream:
        copies = weight_copies(codebook, n, k, rng, l2, CONFIG.cold_l2)
        x = cp.random.default_rng(cell_seed(codebook, m, n, k)).standard_normal((m, k), dtype=cp.float32)
        qact = launch.quantize_activations(x, stream)
    qa, da, sa = launch.storage(qact)
    candidates = [c for c in candidates_for(m, n, k) if c.family in families]
    need = max(c.workspace_bytes(m, n, k) for c in candidates)
    launches, results = {}, {}
    for c in candidates:
        for tag, (module, arity) in modules.items():
            with stream:
                out = cp.full((m, n), np.nan, cp.float32)
                ws = launch.new_workspace(need, n) if need else None
            plans = [launch.plan(c, w, m) for w in copies]
            ring = rings[tag]
            shared = c.shared_bytes(m, k) if ring is None else ring_bytes(c, m, k, codebook, *ring)
            plans = [replace(p, shared=shared) for p in plans]
            if module is not None:
                name = spelled(c.kernel_name(codebook, m), arity)
                plans = [replace(p, kernel=launch.opt_in(name, module.get_function(name))) for p in plans]
            fixed = {"qa": qa, "da": da, "sa": sa, "out": launch.address(out), "ws": launch.address(ws)}
            prepared = [p.prepare(fixed, keep=(qact, out, ws)) for p in plans]
            launches[f"{tag}:{c.id}"] = lambda i, prepared=prepared: prepared[i].launch(stream.ptr)
            launches[f"{tag}:{c.id}"](0)
            results[(tag, c.id)] = (out, ws)
    stream.synchronize()
    for (tag, cid), (out, ws) in results.items():
        if tag in unchecked:
            continue
        where = f"{codebook} M={m} {n}x{k} {cid} ({tag})"
        if not np.array_equal(cp.asnumpy(out).view(np.uint32), cp.asnumpy(results[(TREE, cid)][0]).view(np.uint32)):
            raise SystemExit(f"{where}: the output differs from the working tree's source")
        if ws is not None and cp.asnumpy(ws[: ticket_words(n)]).any():
            raise SystemExit(f"{where}: the launch left its tickets nonzero")
    stats = time_candidates(launches, len(copies), CONFIG, CupyBackend(stream), seed=cell_seed(codebook, m, n, k))
    return [{"codebook": codebook, "m": m, "n": n, "k": k, "candidate": c.id,
             "us": {tag: stats[f"{tag}:{c.id}"].median_us for tag in modules}}
            | ({"unchecked": sorted(unchecked)} if unchecked else {}) for c in candidates]


def family_kernels(families: list[str], codebooks: list[str], ms: list[int]) -> list[str]:
    """The instantiations the candidates of `families` launch for these codebooks and M (only these: an older source
    may lack another family's names)."""
    return sorted({c.kernel_name(cb, m) for c in CANDIDATES if c.family in families for cb in codebooks for m in ms})


def registers(texts: dict[str, str], arities: dict[str, int], families: list[str], codebooks: list[str],
              ms: list[int]) -> dict[str, dict[str, int]]:
    """Registers by version and kernel name of the families' instantiations; a version that spills is refused."""
    names = family_kernels(families, codebooks, ms)
    found = {}
    for tag, text in texts.items():
        try:
            built = ptxas.compile_parallel(sorted({spelled(n, arities[tag]) for n in names}), text=text)
        except RuntimeError as failed:  # e.g. 44 has no Q6_K ring, whose candidates the tree launches since 49
            raise SystemExit(f"{tag} cannot build the tree's instantiations of {','.join(codebooks)} "
                             f"(leave out the codebooks it lacks): {ptxas.error_line(str(failed))}") from None
        if spills := [r.describe() for r in built if not r.spill_free]:
            raise SystemExit(f"{tag} spills: {'; '.join(spills)}")
        found[tag] = {r.name: r.registers for r in built if r.name not in program.HELPER_KERNELS}
    width = max(map(len, names))
    print(f"{'registers':{width}s} " + " ".join(f"{t:>8s}" for t in found))
    for name in names:
        cells = (found[t].get(spelled(name, arities[t]), 0) for t in found)
        print(f"{name:{width}s} " + " ".join(f"{r:8d}" for r in cells))
    return found


def header(tags: list[str]) -> str:
    """The column titles of cell_line's lines."""
    return f"{'cell':24s} " + " ".join(f"{'best ' + t:>26s}" for t in tags) + "   best / best " + tags[0]


def cell_line(rows: list[dict[str, Any]], tags: list[str]) -> str:
    """One cell's rows: the best candidate of each version, and its time over the baseline's best."""
    r0, base = rows[0], tags[0]
    bests = {t: min(rows, key=lambda r, t=t: r["us"][t]) for t in tags}
    return (f"{r0['codebook']} M={r0['m']:<2d} {r0['n']}x{r0['k']:<11d} "
            + " ".join(f"{bests[t]['candidate']:>18s} {bests[t]['us'][t]:7.1f}" for t in tags) + "   "
            + " ".join(f"{bests[t]['us'][t] / bests[base]['us'][base]:.3f}" for t in tags[1:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sources", type=Path, nargs="+", help="kernel source files, the baseline first")
    ap.add_argument("--family", default="kpar", help="candidate families to compare, comma-separated (default kpar)")
    ap.add_argument("--codebooks", default="Q4_0,Q8_0")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--shapes", help="NxK,... (default: the anchors)")
    ap.add_argument("--ring-min-blocks", action="append", default=[], metavar="TAG=BLOCKS",
                    help="the ring from BLOCKS blocks a thread for version TAG (a source's stem, or tree)")
    ap.add_argument("--ring-shared-limit", type=int, metavar="BYTES",
                    help="each version's ring where its CTA's shared memory fits BYTES (registry.RING_SHARED_LIMIT)")
    ap.add_argument("--unchecked", action="append", default=[], metavar="TAG",
                    help="time version TAG without comparing its bytes (a study variant; never to register)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.ring_shared_limit:  # read at each launch's shared_bytes and opt_in
        registry.RING_SHARED_LIMIT = args.ring_shared_limit
    started = time.time()
    stream = cp.cuda.Stream(non_blocking=True)
    l2 = int(cp.cuda.runtime.getDeviceProperties(0)["l2CacheSize"])
    texts = {p.stem: p.read_text() for p in args.sources}
    tags = [*texts, TREE]
    codebooks, ms = args.codebooks.split(","), [int(m) for m in args.ms.split(",")]
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else ANCHORS
    every = texts | {TREE: program.source()}
    arities = {tag: mma_arity(text) for tag, text in every.items()}
    thresholds = dict(spec.split("=") for spec in args.ring_min_blocks)
    if unknown := thresholds.keys() - every.keys():
        raise SystemExit(f"--ring-min-blocks names no version: {', '.join(sorted(unknown))}")
    if unknown := set(args.unchecked) - texts.keys():
        raise SystemExit(f"--unchecked names no source: {', '.join(sorted(unknown))}")
    rings = {tag: ring_of(text, int(thresholds.get(tag, RING_MIN_BLOCKS))) for tag, text in every.items()}
    families = args.family.split(",")
    regs = registers(every, arities, families, codebooks, ms)
    rows: list[dict[str, Any]] = []
    # What the run was asked for, so that a run cut by its time limit shows what it did not reach (ab_decide.py).
    requested = {"family": args.family, "cells": [[cb, m, n, k] for cb in codebooks for m in ms for n, k in shapes]}

    def save() -> None:
        """The run so far (first with no rows, then after every cell): a run cut by its limit keeps what it did."""
        if args.out:
            result = {"sources": [p.name for p in args.sources], "config": asdict(CONFIG), "registers": regs,
                      "requested": requested, "rows": rows, "seconds": time.time() - started}
            partial = args.out.with_suffix(".partial")
            partial.write_text(json.dumps(result, indent=1) + "\n")
            partial.replace(args.out)

    save()
    print(header(tags), flush=True)
    for codebook in codebooks:
        names = family_kernels(families, [codebook], ms)
        modules = {tag: (cp.RawModule(code=text, options=program.CONTRACT_OPTIONS,
                                      name_expressions=sorted({spelled(n, arities[tag]) for n in names})),
                         arities[tag])
                   for tag, text in texts.items()} | {TREE: (None, arities[TREE])}
        for m in ms:
            for n, k in shapes:
                cell = time_cell(modules, rings, codebook, m, n, k, families, stream, l2, frozenset(args.unchecked))
                rows += cell
                print(cell_line(cell, tags), flush=True)
                save()


if __name__ == "__main__":
    main()
