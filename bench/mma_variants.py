"""Experiments: variants of the tensor-core engine (bench/mma_variants.cu: `pipe`) against the
registry's kernels, bytes first, then speed, in one run on a GPU.

    python bench/mma_variants.py --out bench/results/mma-variants-h200.json [--seed S]

1. Bytes: for every codebook, three shapes (one with a ragged last chunk: KB = 129), M in 1..16 and 31, each
   variant's twin of every registry mma candidate valid there must equal that candidate as uint32 (outputs and
   workspaces poisoned first). Negative control: a twin's S = 1 result against the registry's S = 4 must
   differ, or the comparison could not fail.
2. Speed: every registry candidate and every twin, timed as the sweep times a cell (cold L2 by rotation,
   CUDA-graph replays, interleaved rounds, medians), on the large anchors at M in {2, 4, 8, 16}.
The kernel sources of the package are untouched: the twins compile from gemv.cu + mma_variants.cu here only.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import cupy as cp
import numpy as np
from anchors import ANCHORS
from gemv_dispatch.dispatch.sweep import sweep_timing, weight_copies
from gemv_dispatch.dispatch.timing import CupyBackend, cell_seed, time_candidates
from gemv_dispatch.kernels import launch, program
from gemv_dispatch.kernels.codebooks import CODEBOOKS
from gemv_dispatch.kernels.registry import BY_ID, CANDIDATES, Candidate, candidates_for

SOURCE = Path(__file__).with_name("mma_variants.cu")
VARIANTS = ("pipe",)  # gemv_mma_<variant>, same template parameters as gemv_mma; `staged` (version 7) is in git history
MMA = [c for c in CANDIDATES if c.mma_tiles]
BYTE_SHAPES = [(4096, 4096), (1032, 4128), (264, 1024)]
BYTE_MS = [*range(1, 17), 31]
SPEED_MS = (2, 4, 8, 16)
SPEED_CODEBOOKS = ("Q4_0", "Q8_0", "IQ4_NL")
POISON = np.uint32(0x7FC0DEAD)  # a NaN no kernel writes


def twin_name(variant: str, c: Candidate, codebook: str, m: int) -> str:
    return c.kernel_name(codebook, m).replace("gemv_mma<", f"gemv_mma_{variant}<")


@cache
def variants_module(codebook: str) -> Any:
    names = sorted({twin_name(v, c, codebook, m) for v in VARIANTS for c in MMA for m in range(1, 33)})
    return cp.RawModule(code=program.source() + "\n" + SOURCE.read_text(), options=program.CONTRACT_OPTIONS,
                        name_expressions=names)


def twin_plan(variant: str, c: Candidate, weights: launch.DeviceWeights, m: int) -> launch.Plan:
    """The registry candidate's launch (geometry, arguments, fold) with the variant's kernel swapped in."""
    name = twin_name(variant, c, weights.codebook, m)
    return replace(launch.plan(c, weights, m), kernel=variants_module(weights.codebook).get_function(name))


def poisoned(*shape: int) -> Any:
    return cp.full(shape, POISON, cp.uint32).view(cp.float32)


def run(p: launch.Plan, qact: Any, n: int, stream: Any) -> Any:
    out = poisoned(p.m, n)
    ws = poisoned(max(p.workspace_floats, 1))
    p.enqueue(launch.storage(qact), out, ws, stream)
    return out


def check_bytes(seed: int, stream: Any) -> dict[str, Any]:
    rng = cp.random.default_rng(seed)
    compared, failures = 0, []
    control_differs = []
    with stream:
        for cb in CODEBOOKS:
            for n, k in BYTE_SHAPES:
                w = launch.random_weights(cb, n, k, rng)
                for m in BYTE_MS:
                    x = rng.standard_normal((m, k), dtype=cp.float32)
                    qact = launch.quantize_activations(x, stream)
                    for c in MMA:
                        if not c.valid(m, n, k):
                            continue
                        ref = run(launch.plan(c, w, m), qact, n, stream)
                        for v in VARIANTS:
                            got = run(twin_plan(v, c, w, m), qact, n, stream)
                            compared += 1
                            if not bool((ref.view(cp.uint32) == got.view(cp.uint32)).all()):
                                failures.append(f"{v}: {cb} M={m} N={n} K={k} {c.id}")
                    s4 = BY_ID["kpar.s4.t128.mma2"]
                    if s4.valid(m, n, k):
                        b = run(launch.plan(s4, w, m), qact, n, stream)
                        for v in VARIANTS:
                            a = run(twin_plan(v, BY_ID["wide.s1.t128.mma2"], w, m), qact, n, stream)
                            control_differs.append(not bool((a.view(cp.uint32) == b.view(cp.uint32)).all()))
    stream.synchronize()
    return {"seed": seed, "compared": compared, "failures": failures,
            "negative_controls": len(control_differs), "negative_controls_differing": sum(control_differs)}


def time_cell(codebook: str, m: int, n: int, k: int, copies: list[Any], stream: Any) -> dict[str, float]:
    cands = candidates_for(m, n, k)
    with stream:
        qact = launch.quantize_activations(cp.random.default_rng(m).standard_normal((m, k), dtype=cp.float32), stream)
        out = cp.empty((m, n), cp.float32)
        need = max(c.workspace_bytes(m, n, k) for c in cands)
        ws = cp.empty(max(need // 4, 1), cp.float32)
    launches = {c.id: launch.bind(c, copies, qact, out, stream, ws if c.grid_split else None) for c in cands}
    store = launch.storage(qact)
    for c in cands:
        for v in VARIANTS if c.mma_tiles else ():
            plans = [twin_plan(v, c, w, m) for w in copies]
            launches[f"{v}:{c.id}"] = lambda i, plans=plans: plans[i].enqueue(store, out, ws, stream)
    config = replace(sweep_timing(), mode="graph")
    stats = time_candidates(launches, len(copies), config, CupyBackend(stream), seed=cell_seed(codebook, m, n, k))
    return {cid: s.median_us for cid, s in stats.items()}


def best(times: dict[str, float], keep: Any) -> tuple[str, float]:
    cid = min((c for c in times if keep(c)), key=times.__getitem__)
    return cid, times[cid]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    ap.add_argument("--skip-speed", action="store_true")
    args = ap.parse_args()
    print(f"seed {args.seed}", flush=True)
    stream = cp.cuda.Stream(non_blocking=True)
    start = time.monotonic()
    result: dict[str, Any] = {"bytes": check_bytes(args.seed, stream)}
    print(f"bytes: {result['bytes']} ({time.monotonic() - start:.0f} s)", flush=True)
    rows = []
    if not args.skip_speed:
        l2 = int(cp.cuda.runtime.getDeviceProperties(0)["l2CacheSize"])
        for cb in SPEED_CODEBOOKS:
            for n, k in ANCHORS[:7]:  # the large ones
                with stream:
                    copies = weight_copies(cb, n, k, cp.random.default_rng(cell_seed(cb, n, k)), l2)
                stream.synchronize()
                for m in SPEED_MS:
                    times = time_cell(cb, m, n, k, copies, stream)
                    reg = best(times, lambda c: ":" not in c)
                    mma = best(times, lambda c: ":" not in c and BY_ID[c].mma_tiles)
                    twins = {v: best(times, lambda c, v=v: c.startswith(f"{v}:")) for v in VARIANTS}
                    rows.append({"codebook": cb, "m": m, "n": n, "k": k, "best": reg, "best_mma": mma,
                                 "best_twins": twins, "times": times})
                    print(f"{cb:6s} M={m:2d} {n:6d}x{k:<5d} registry {reg[1]:7.2f} ({reg[0]}) mma {mma[1]:7.2f} "
                          + " ".join(f"{v} {t[1]:7.2f} ({t[0].split(':')[1]})" for v, t in twins.items()), flush=True)
                del copies
                cp.get_default_memory_pool().free_all_blocks()
    result["speed"] = rows
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"\nbytes: {result['bytes']['compared']} compared, {len(result['bytes']['failures'])} failures, "
          f"negative controls differing {result['bytes']['negative_controls_differing']}/"
          f"{result['bytes']['negative_controls']}; {time.monotonic() - start:.0f} s")
    if rows:
        print("codebook  M  N x K  registry-best  mma-best  " + "  ".join(f"{v}-best" for v in VARIANTS)
              + "  registry/" + "  registry/".join(VARIANTS))
        for r in rows:
            twins = [r["best_twins"][v][1] for v in VARIANTS]
            print(f"{r['codebook']:6s} {r['m']:2d} {r['n']}x{r['k']}  {r['best'][1]:7.2f}  {r['best_mma'][1]:7.2f}  "
                  + "  ".join(f"{t:7.2f}" for t in twins) + "  " + "  ".join(f"{r['best'][1] / t:.3f}" for t in twins))


if __name__ == "__main__":
    main()
