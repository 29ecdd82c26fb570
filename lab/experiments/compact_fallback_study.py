"""A fallback `select` could render: integer features, boosted oblivious trees, integer leaves. Leave-one-family-out.

gbm-physical (fallback_study.py) is the best fallback measured on unseen families, but one identity decision
predicts ~687 launches through 400 sklearn trees: far over select's budgets (C <= 5 us, Python <= 5 ms per
uncached key). This study keeps its idea (a model of log time over what a launch physically does) in a form a
generated module and C header can evaluate exactly:

- every feature an int from (codebook traits, candidate facts, M, N, K, mode, SM count): logs as ilog2 (64ths of
  an octave by bit_length, shifts and six squarings of a 17-bit mantissa: the same bits in C's uint64), ratios as
  differences of those logs or scaled by 64, weight bytes true (features.weight_bytes);
- the launch model: boosted *oblivious* trees (every node of a level shares feature and threshold, so a depth-d
  tree is d compares forming a leaf index), 200 of depth 6, of log time less its cell's mean (a launch argmin
  compares the launches of one cell: the mean cancels, and the trees spend no split on the shape's scale), leaves
  rounded to ints (x 2^24): a prediction is an integer sum, an argmin the same in Python and C. Evaluated only over
  the launches of the chosen identity valid at the key's own (M, N, K), about 8 per key;
- the teacher, offline only: oblivious trees (400 of depth 8) of log time less its shape's mean, which keeps the
  M values comparable: an identity's profile time sums its best launch over every M of the profile;
- the identity model: oblivious trees (100 of depth 6) of log(E_i / E_1) per available identity i (E: the
  profile-weighted time of the identity's best launch at each M), fit on the training shapes' profile times as the
  harness computes them and on a seeded sample of an octave grid of shapes labelled by the teacher: ~5 predictions
  per shape.

Methods scored on each left-out family (as fallback_study.py scores its methods):
- `compact`: the identity model's identity, the launch model's launch (what select would render);
- `compact-teacher`: the identity of least profile time predicted by the teacher over every M (not renderable:
  ~700 predictions through 400 trees), the same launches: what the distillation loses;
- `oracle-identity+compact-launch`: the invariant oracle's identity (hindsight), the launch model's launch;
- `gbm-physical` (with --gbm): refit per fold, as fallback_study.py.

Trees that split only on what is equal across the options of one argmin (shape, M, mode; the identity's S and
partition width for a launch decision) add the same integer to every option: a renderer drops them, and the cost
counts only the others. The cost is measured too: the full-corpus models rendered as a pure-Python evaluator
and a C evaluator (cc -O2 in a temporary folder, not in the product), timed on 1,000 random uncached keys.

    python lab/experiments/compact_fallback_study.py corpus/nvidia-h200 -o lab/results/compact-fallback-study-h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fallback_study as fs
from gemv_dispatch.dispatch.common.paths import shapes_dir
from gemv_dispatch.dispatch.learn import evaluate as ev
from gemv_dispatch.dispatch.learn.compact import (  # the product's compact fallback: features, trees, distillation
    LEAF_SCALE,
    CompactParams,
    Launches,
    Oblivious,
    centered,
    fit_identity,
    fit_oblivious,
    grid_geometries,
    identity_table,
    launch_data,
)
from gemv_dispatch.dispatch.learn.policy import IDENTITIES, SERVED_MS, validate_profile
from gemv_dispatch.dispatch.learn.train import Measurements, TimeModel, TrainOptions, score
from gemv_dispatch.dispatch.measure.corpus import load
from gemv_dispatch.dispatch.measure.shapes import load_inventories

Geometry = tuple[str, int, int]


def argmins(launches: Launches, score: np.ndarray,
            identity: Mapping[Geometry, int]) -> dict[tuple[str, int, int, int, str], str]:
    """Per (geometry, M, mode): the launch of least score among those of the geometry's identity (ties: id)."""
    out: dict[tuple[str, int, int, int, str], tuple[float, str]] = {}
    for (g, cid, m, mode), i, s in zip(launches.keys, launches.ident, score, strict=True):
        cb, n, k = launches.geos[g]
        if i == identity[(cb, n, k)]:
            key = (cb, m, n, k, mode)
            if key not in out or (s, cid) < out[key]:
                out[key] = (s, cid)
    return {key: cid for key, (_, cid) in out.items()}


def pick_identities(geos: Sequence[Geometry], pairs: Sequence[tuple[int, int]],
                    score: np.ndarray) -> dict[Geometry, int]:
    best: dict[int, tuple[float, int]] = {}
    for (g, i), s in zip(pairs, score, strict=True):
        if g not in best or (s, i) < best[g]:
            best[g] = (s, i)
    return {geos[g]: i for g, (_, i) in best.items()}


def summarize(results: Mapping[str, Mapping[tuple[str, tuple], float]], invariant: Mapping[tuple, float]) -> dict:
    out = {}
    for name, ratios in results.items():
        paired = {fk: r for fk, r in ratios.items() if fk[1] in invariant}
        excess = {fk: r / invariant[fk[1]] for fk, r in paired.items()}
        out[name] = {"total": ev.breakdown(paired, key_of=lambda fk: fk[1], family_of=lambda fk: fk[0]),
                     "excess": ev.breakdown(excess, key_of=lambda fk: fk[1], family_of=lambda fk: fk[0])}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", type=Path, nargs="?")
    parser.add_argument("-o", "--output", type=Path, required=True)
    parser.add_argument("--show", action="store_true", help="print the result in --output again (no run)")
    parser.add_argument("--reference", type=Path,
                        help="a fallback_study.py result whose gbm-physical and trees rows print beside it")
    parser.add_argument("--families", help="comma-separated families to leave out [default: every model family]")
    parser.add_argument("--gbm", action="store_true", help="also refit gbm-physical per fold (slow)")
    parser.add_argument("--launch-trees", type=int, default=CompactParams.launch_trees)
    parser.add_argument("--identity-trees", type=int, default=CompactParams.identity_trees)
    parser.add_argument("--depth", type=int, default=CompactParams.launch_depth)
    parser.add_argument("--rate", type=float, default=CompactParams.rate, help="shrinkage of both runtime models")
    parser.add_argument("--grid", type=int, default=600, help="grid shapes the teacher labels")
    parser.add_argument("--grid-weight", type=float, default=CompactParams.grid_weight)
    parser.add_argument("--center", choices=("none", "shape", "cell"), default="cell",
                        help="the launch model's target: log time less its shape's (codebook, N, K, mode) mean, "
                             "or its cell's (+ M), or raw; an argmin never sees the mean")
    parser.add_argument("--teacher-trees", type=int, default=400,
                        help="a separate offline teacher (shape-centered) of this many trees [0: the launch model]")
    parser.add_argument("--teacher-depth", type=int, default=8)
    parser.add_argument("--save-models", type=Path, help="keep the full-corpus models (.npz) for compact_render.py")
    parser.add_argument("--no-cost", action="store_true", help="skip the full-corpus fit and the timing")
    args = parser.parse_args(argv)
    if args.show:
        report(json.loads(args.output.read_text()), args.reference)
        return 0
    params = CompactParams(launch_trees=args.launch_trees, identity_trees=args.identity_trees,
                           launch_depth=args.depth, identity_depth=args.depth, grid_weight=args.grid_weight,
                           rate=args.rate, teacher_trees=args.teacher_trees or args.launch_trees,
                           teacher_depth=args.teacher_depth, grid=args.grid)
    t0 = time.perf_counter()

    def say(text: str) -> None:
        print(f"[{time.perf_counter() - t0:6.0f} s] {text}", file=sys.stderr, flush=True)

    options = TrainOptions()
    profile = validate_profile(options.profile)
    ms = sorted(set(profile) | set(SERVED_MS))
    meas = Measurements.from_corpus(load(args.corpus))
    sm, modes = meas.sm_count, meas.modes
    scores = score(meas, TimeModel().fit(meas), profile)  # the harness's profile times (shared fill, as evaluate)
    invariant = ev.invariant_ratios(meas, scores.chosen)
    families = ev.family_geometries(load_inventories(shapes_dir()), {(n, k) for _, n, k in meas.geometries()})
    if args.families:
        families = {f: families[f] for f in args.families.split(",")}
    say("scores")
    # Launch model rows: every measured (cell, candidate), features once for the corpus.
    # Launch model rows: every measured (cell, candidate), features once for the corpus.
    mkeys, mx, my = launch_data(meas.times, sm)
    mnk = np.asarray([(key[2], key[3]) for key in mkeys])
    y_launch = {"none": my, "shape": centered(my, mkeys, cell=False),
                "cell": centered(my, mkeys, cell=True)}[args.center]
    y_teacher = centered(my, mkeys, cell=False)
    separate = bool(args.teacher_trees) or args.center == "cell"
    teacher_trees = args.teacher_trees or params.launch_trees

    def fit_pair(mask: np.ndarray | slice) -> tuple[Oblivious, Oblivious]:
        """(launch model, teacher): one model unless a separate teacher is asked for or the launch target
        cannot compare M values (cell-centered)."""
        launch = fit_oblivious(mx[mask], y_launch[mask], params.launch_trees, params.launch_depth,
                               params.rate)
        if not separate:
            return launch, launch
        return launch, fit_oblivious(mx[mask], y_teacher[mask], teacher_trees, args.teacher_depth, params.rate)
    every = Launches.build(meas.geometries(), ms, modes, sm)  # the measured geometries at every profile M
    grid = Launches.build(grid_geometries(meas.codebooks, set(meas.geometries()), params.grid), ms, modes, sm)
    say(f"features: {len(mx)} measured launches, {len(every.keys)} served launches of {len(every.geos)} shapes, "
        f"grid {len(grid.geos)} shapes / {len(grid.keys)} launches")

    methods = ["compact", "compact-teacher", "oracle-identity+compact-launch"] + (["gbm-physical"] if args.gbm else [])
    results: dict[str, dict[tuple[str, tuple], float]] = {name: {} for name in methods}
    agree = {"teacher": [0, 0], "gbm": [0, 0], "identity_int_float": [0, 0], "launch_int_float": [0, 0],
             "teacher_int_float": [0, 0]}
    for fold, (family, held) in enumerate(families.items(), 1):
        say(f"fold {fold}/{len(families)}: {family}")
        train_mask = np.asarray([(n, k) not in held for n, k in mnk])
        launch, teacher = fit_pair(train_mask)
        test = meas.subset(lambda n, k, h=held: (n, k) in h)
        tgeos = test.geometries()
        rows = np.asarray([every.geos[g][1:] in held for g, *_ in every.keys])
        sub = Launches(every.geos, [key for key, r in zip(every.keys, rows, strict=True) if r], every.ident[rows],
                       every.x[rows])
        lt_float, lt_int = launch.predict(sub.x), launch.predict(sub.x, integer=True)
        teacher_t = sub.profile_times(teacher.predict(sub.x) if separate else lt_float, profile, modes)
        teacher_ti = sub.profile_times(teacher.predict(sub.x, integer=True) / LEAF_SCALE, profile, modes)
        teacher_ids = {every.geos[g]: IDENTITIES[int(np.argmin(teacher_t[g]))] for g in range(len(every.geos))
                       if every.geos[g] in set(tgeos)}
        for g, geo in enumerate(every.geos):
            if geo in teacher_ids:
                agree["teacher_int_float"][0] += int(np.argmin(teacher_t[g]) == np.argmin(teacher_ti[g]))
                agree["teacher_int_float"][1] += 1
        train_expected = {g: e for g, e in scores.expected.items() if (g[1], g[2]) not in held}
        student = fit_identity(train_expected, grid, teacher, profile, modes, sm, params)
        pairs, ix = identity_table(tgeos, sm)
        student_ids = pick_identities(tgeos, pairs, student.predict(ix, integer=True))
        student_float = pick_identities(tgeos, pairs, student.predict(ix))
        agree["identity_int_float"][0] += sum(student_ids[g] == student_float[g] for g in tgeos)
        agree["identity_int_float"][1] += len(tgeos)
        agree["teacher"][0] += sum(student_ids[g] == teacher_ids[g] for g in tgeos)
        agree["teacher"][1] += len(tgeos)
        tag = {key: (family, key) for key in test.times}
        chosen = {"compact": student_ids, "compact-teacher": teacher_ids,
                  "oracle-identity+compact-launch": {g: scores.chosen[g] for g in tgeos}}
        for name, ids in chosen.items():
            pick = argmins(sub, lt_int, ids)
            if name == "compact":
                pick_f = argmins(sub, lt_float, ids)
                agree["launch_int_float"][0] += sum(pick[key] == pick_f[key] for key in pick)
                agree["launch_int_float"][1] += len(pick)
            plan = fs.Plan(ids, {key: pick[key] for key in test.times})
            results[name] |= {tag[key]: r for key, r in fs.ratios_of(plan, test).items()}
        if args.gbm:
            train = meas.subset(lambda n, k, h=held: (n, k) not in h)
            physical = fs.PhysicalModel().fit(train)
            plan, _ = fs.predicted_plan(test, physical.log_times, profile, modes)
            results["gbm-physical"] |= {tag[key]: r for key, r in fs.ratios_of(plan, test).items()}
            agree["gbm"][0] += sum(student_ids[g] == plan.identity[g] for g in tgeos)
            agree["gbm"][1] += len(tgeos)
        e = summarize({"compact": {fk: r for fk, r in results["compact"].items() if fk[0] == family}}, invariant)
        say(f"  {family}: compact excess {e['compact']['excess']['all']['geomean']:.2f} % geomean, "
            f"teacher agreement {agree['teacher'][0]}/{agree['teacher'][1]} so far")

    out: dict[str, object] = {
        "corpus": str(args.corpus), "cells": len(meas.times), "families": {f: len(g) for f, g in families.items()},
        "params": params.__dict__ | {"center": args.center, "teacher_trees": teacher_trees,
                                      "teacher_depth": args.teacher_depth if separate else params.launch_depth},
        "methods": summarize(results, invariant),
        "agreement": {k: {"agree": a, "of": b, "rate": a / b if b else None} for k, (a, b) in agree.items()}}
    oracle = {fk: invariant[fk[1]] for fk in results["compact"] if fk[1] in invariant}
    out["invariant-oracle"] = ev.breakdown(oracle, key_of=lambda fk: fk[1], family_of=lambda fk: fk[0])
    if not args.no_cost:
        say("full-corpus fit for the cost")
        launch, teacher = fit_pair(slice(None))
        student = fit_identity(dict(scores.expected), grid, teacher, profile, modes, sm, params)
        import compact_render

        if args.save_models:
            compact_render.save(args.save_models, launch, student, sm)

        out["cost"] = compact_render.measure(launch, student, sm, say)
    out["seconds"] = round(time.perf_counter() - t0)
    args.output.write_text(json.dumps(out, indent=1, sort_keys=True, default=int) + "\n")
    report(out, args.reference)
    return 0


def report(out: Mapping, reference: Path | None = None) -> None:
    """The table: total and excess regret (%), excess geomean at M = 1, 4, 16; a reference study's rows after."""
    print(f"{'method':<32} {'total gm':>9} {'excess gm':>9} {'p95':>8} {'max':>8} {'M=1':>6} {'M=4':>6} {'M=16':>6}")
    rows = dict(out["methods"])
    if reference is not None:
        ref = json.loads(reference.read_text())["methods"]
        rows |= {f"{name} (fallback_study)": ref[name] for name in ("gbm-physical", "trees")}
    for name, res in rows.items():
        t, e = res["total"]["all"], res["excess"]["all"]
        by_m = [res["excess"]["m"].get(str(m), {}).get("geomean", math.nan) for m in (1, 4, 16)]
        print(f"{name:<32} {t['geomean']:>9.2f} {e['geomean']:>9.2f} {e['p95']:>8.2f} {e['max']:>8.2f} "
              + " ".join(f"{v:>6.2f}" for v in by_m))
    print(f"invariant oracle {out['invariant-oracle']['all']['geomean']:.2f} % geomean")
    for k, v in out["agreement"].items():
        print(f"agreement {k}: {v['agree']}/{v['of']}")
    if "cost" in out:
        print(json.dumps(out["cost"], indent=1))


if __name__ == "__main__":
    sys.exit(main())
