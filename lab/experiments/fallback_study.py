"""Which fallback generalizes to model families it never saw? Leave-one-family-out on a committed corpus, CPU only.

Every method below is fit without the left-out family's geometries and scored on that family's measured cells,
against the per-cell oracle (total regret) and against the invariant oracle (excess: what the decisions lose
beyond the price of invariance), as `gemv-dispatch evaluate` scores the product's fallback:

- `trees`: the product's fallback (train.fit_fallback: integer decision trees with preference leaves);
- `time-model`: the product's own time model (train.TimeModel over TIME_FEATURES, weight_kib 8x too large for
  super-block codebooks) refit per fold, the identity picked by predicted profile-weighted time;
- `gbm-physical`: a gradient-boosted model of log time over physical features (true weight bytes, CTAs per SM
  and the last wave's fill, bytes per CTA, partition width, row passes, outputs and threads per CTA, ...), the
  identity picked by predicted profile-weighted time, the launch by predicted time within it;
- `knn-regret`: per (codebook, mode) the k nearest training geometries in (log N, log K): the identity of
  least mean profile log-regret over them, the launch of least mean log-regret at the same M among those
  neighbours that measured it (else the one of least predicted time, as gbm-physical);
- `ensemble`: gbm-physical's and knn-regret's identity scores averaged (both as log-regret over the best
  option), launch as gbm-physical;
- `gbm-identity+tree-launch`: gbm-physical's identity, the launch from the trees' launch tree (as select would
  take it after an identity overlay), and `oracle-identity+tree-launch`: the invariant oracle's identity (with
  hindsight) and the launch tree: what the launch half of the trees loses on its own;
- `distilled`: what `select` could render within its budgets. An integer identity tree (the product's
  `_fit_tree`, preference leaves) over the product's identity features with weight_kib made true (super-block
  codebooks 8x smaller), fit to the profile regrets of the training geometries (as the product's) and to
  gbm-physical's predicted ones over a grid of shapes (every codebook, N and K in octaves) beside them; the
  launch from the trees' launch tree.

The time model that fills unmeasured M (to score the identities of the training geometries) is the product's,
fit on the whole corpus, as in `evaluate`'s folds; `--refit` refits it per fold too (slower), to price that
sharing on the trees' figures.

    python lab/experiments/fallback_study.py corpus/nvidia-h200 -o lab/results/fallback-study-h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gemv_dispatch.dispatch.common.paths import shapes_dir
from gemv_dispatch.dispatch.common.threads import bounded_threads
from gemv_dispatch.dispatch.learn import evaluate as ev
from gemv_dispatch.dispatch.learn.features import IDENTITY_FEATURES, codebook_features, identity_features, weight_bytes
from gemv_dispatch.dispatch.learn.policy import IDENTITIES, SERVED_MS, canonical, validate_profile
from gemv_dispatch.dispatch.learn.train import (
    FAMILIES,
    FallbackRows,
    Measurements,
    TimeModel,
    TrainOptions,
    TreeParams,
    _fit_tree,
    _regret_rows,
    fit_fallback,
    score,
    serving,
)
from gemv_dispatch.dispatch.measure.corpus import load
from gemv_dispatch.dispatch.measure.shapes import load_inventories
from gemv_dispatch.kernels.codebooks import formats_of, get
from gemv_dispatch.kernels.errors import BLOCK
from gemv_dispatch.kernels.registry import BY_ID, mma_row_tiles, row_tile

Geometry = tuple[str, int, int]
KNN = 5
# The distilled tree's extra shapes: N and K in octaves over the inventories' range (K whole super-blocks).
DISTIL_N = tuple(1 << e for e in range(6, 19))
DISTIL_K = tuple(1 << e for e in range(8, 17))
DISTIL_TREE = TreeParams(min_samples_leaf=3, max_leaf_nodes=96)
UNSEEN = 10.0  # log-regret of an identity no neighbour can run: ranked after every one some neighbour ran


def physical_features(codebook: str, cand_id: str, m: int, n: int, k: int, mode: str, sm_count: int) -> list[float]:
    """What a launch's time is made of: bytes, how the grid fills the GPU, how much each CTA walks."""
    c = BY_ID[cand_id]
    book = get(formats_of(codebook)[0])
    props = codebook_features(codebook)
    wbytes = weight_bytes(codebook, n, k)
    (gx, gy, _), (bx, by, _) = c.launch_geometry(m, n, k)
    ctas = gx * gy
    waves = ctas / sm_count
    last_fill = ((ctas - 1) % sm_count + 1) / sm_count
    tile = mma_row_tiles(m) * 16 if c.mma_tiles else row_tile(m, c.cpt)
    passes = -(-m // tile)
    split = c.split(k)
    width = -(-(k // BLOCK) // split)
    return [math.log2(wbytes), math.log2(n), math.log2(k), math.log2(m), book.block_bytes * 8 / book.weights,
            props["asymmetric"], props["high_bits"], props["table"], int(book.weights > BLOCK),
            FAMILIES.index(c.family), split, math.log2(width), c.threads, bx * by, c.cpt, c.mma_tiles, int(c.staged),
            tile, passes, math.log2(ctas), waves, math.ceil(waves), last_fill, math.log2(wbytes / ctas),
            math.log2(c.outputs_per_cta), math.log2(wbytes * passes), ("graph", "eager").index(mode)]


class PhysicalModel:
    """HistGradientBoosting of log time over physical_features (deterministic)."""

    def fit(self, meas: Measurements) -> PhysicalModel:
        from sklearn.ensemble import HistGradientBoostingRegressor

        x, y = [], []
        for (cb, m, n, k, mode), cell in sorted(meas.times.items()):
            for cand, t in sorted(cell.items()):
                x.append(physical_features(cb, cand, m, n, k, mode, meas.sm_count))
                y.append(math.log(t))
        self.sm_count = meas.sm_count
        self.model = HistGradientBoostingRegressor(max_iter=400, learning_rate=0.1, max_leaf_nodes=63,
                                                   early_stopping=False, random_state=0)
        with bounded_threads():
            self.model.fit(np.asarray(x), np.asarray(y))
        return self

    def log_times(self, keys: Sequence[tuple[str, str, int, int, int, str]]) -> np.ndarray:
        x = [physical_features(cb, c, m, n, k, mode, self.sm_count) for cb, c, m, n, k, mode in keys]
        with bounded_threads():
            return self.model.predict(np.asarray(x))


@dataclass(frozen=True)
class Plan:
    """A method's decisions for a set of geometries: the identity per geometry, the launch per measured cell."""

    identity: dict[Geometry, int]
    launch: dict[tuple[str, int, int, int, str], str]


def available(n: int, k: int) -> list[int]:
    return [i for i in IDENTITIES if canonical(i, n, k) is not None]


def predicted_plan(meas_test: Measurements, predict: Callable[[list], np.ndarray], profile: Mapping[int, int],
                   modes: Sequence[str]) -> tuple[Plan, dict[Geometry, dict[int, float]]]:
    """Identity of least predicted profile-weighted time (each M: the best predicted launch of it), launch of least
    predicted time within it; also every identity's predicted log-regret (for the ensemble)."""
    ms = sorted(set(profile) | set(SERVED_MS))
    keys = [(cb, c, m, n, k, mode) for cb, n, k in meas_test.geometries() for mode in modes for m in ms
            for c in serving(m, n, k)]
    logt = dict(zip(keys, predict(keys), strict=True))
    identity, regrets = {}, {}
    for cb, n, k in meas_test.geometries():
        expected = {}
        for ident in available(n, k):
            total = 0.0
            for m, w in profile.items():
                for mode in modes:
                    total += w * min(math.exp(logt[(cb, c, m, n, k, mode)]) for c, i in serving(m, n, k).items()
                                     if i == ident)
            expected[ident] = total
        best = min(expected.values())
        regrets[(cb, n, k)] = {i: math.log(e / best) for i, e in expected.items()}
        identity[(cb, n, k)] = min(expected, key=lambda i: (expected[i], i))
    return launches(meas_test, identity, predict), regrets


def knn_identity_regrets(train_scores: Mapping[Geometry, Mapping[int, float]],
                         test: Sequence[Geometry]) -> dict[Geometry, dict[int, float]]:
    """Per test geometry, every available identity's mean profile log-regret over its KNN nearest training
    geometries of the same codebook (log N, log K distance) that can run it."""
    out = {}
    for cb, n, k in test:
        near = sorted((math.dist((math.log2(n), math.log2(k)), (math.log2(tn), math.log2(tk))), (tcb, tn, tk))
                      for tcb, tn, tk in train_scores if tcb == cb)[:KNN]
        regrets = {}
        for ident in available(n, k):
            vals = []
            for _, geo in near:
                e = train_scores[geo]
                if ident in e:
                    vals.append(math.log(e[ident] / min(e.values())))
            regrets[ident] = float(np.mean(vals)) if vals else UNSEEN
        out[(cb, n, k)] = regrets
    return out


def launches(meas_test: Measurements, identity: dict[Geometry, int],
             predict: Callable[[list], np.ndarray]) -> Plan:
    """Given identities, the launch of least predicted time within each cell's identity."""
    keys = [(cb, c, m, n, k, mode) for cb, m, n, k, mode in meas_test.times
            for c, ident in serving(m, n, k).items() if ident == identity[(cb, n, k)]]
    logt = dict(zip(keys, predict(keys), strict=True))
    launch = {}
    for cb, m, n, k, mode in meas_test.times:
        options = [c for c, ident in serving(m, n, k).items() if ident == identity[(cb, n, k)]]
        launch[(cb, m, n, k, mode)] = min(options, key=lambda c: (logt[(cb, c, m, n, k, mode)], c))
    return Plan(identity, launch)


def student_features(codebook: str, n: int, k: int, sm_count: int) -> dict[str, int]:
    """The product's identity features with weight_kib counted in true bytes."""
    return identity_features(codebook, n, k, sm_count) | {"weight_kib": weight_bytes(codebook, n, k) // 1024}


def distilled_identities(train_expected: Mapping[Geometry, Mapping[int, float]], test: Sequence[Geometry],
                         teacher: PhysicalModel, profile: Mapping[int, int], modes: Sequence[str],
                         sm_count: int) -> dict[Geometry, int]:
    """Fit the student identity tree (training geometries' profile times, the teacher's over the grid) and walk
    it for the test geometries: the first available identity of the leaf, as select does."""
    codebooks = sorted({cb for cb, _, _ in train_expected})
    grid = [(cb, n, k) for cb in codebooks for n in DISTIL_N for k in DISTIL_K
            if (cb, n, k) not in train_expected and k % get(formats_of(cb)[0]).weights == 0]
    teacher_grid = Measurements({(cb, 1, n, k, modes[0]): {} for cb, n, k in grid}, 0.0, sm_count, {})
    _, teacher_regrets = predicted_plan(teacher_grid, teacher.log_times, profile, modes)
    rows = [(list(student_features(cb, n, k, sm_count).values()), dict(e), 1, 1.0)
            for (cb, n, k), e in sorted(train_expected.items())]
    rows += [(list(student_features(cb, n, k, sm_count).values()), {i: math.exp(r) for i, r in regrets.items()}, 1,
              1.0) for (cb, n, k), regrets in sorted(teacher_regrets.items())]
    tree = _fit_tree(_regret_rows(IDENTITIES, rows), IDENTITY_FEATURES, IDENTITIES, DISTIL_TREE, 0)
    return {(cb, n, k): next((i for i in tree.leaf(student_features(cb, n, k, sm_count))
                              if canonical(int(i), n, k) is not None), 1) for cb, n, k in test}


def ratios_of(plan: Plan, meas_test: Measurements) -> dict[tuple[str, int, int, int, str], float]:
    return {key: cell[plan.launch[key]] / min(cell.values()) for key, cell in meas_test.times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", type=Path)
    parser.add_argument("-o", "--output", type=Path, required=True)
    parser.add_argument("--refit", action="store_true", help="also refit the fill's time model per fold (trees)")
    parser.add_argument("--families", help="comma-separated families to leave out [default: every model family]")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    options = TrainOptions()
    profile = validate_profile(options.profile)
    meas = Measurements.from_corpus(load(args.corpus))
    model = TimeModel().fit(meas)
    scores = score(meas, model, profile)
    rows = FallbackRows.build(meas, scores, options.predicted_weight)
    invariant = ev.invariant_ratios(meas, scores.chosen)
    measured = {(n, k) for _, n, k in meas.geometries()}
    families = ev.family_geometries(load_inventories(shapes_dir()), measured)
    if args.families:
        families = {f: families[f] for f in args.families.split(",")}
    methods = ["trees", "time-model", "gbm-physical", "gbm-identity+tree-launch", "oracle-identity+tree-launch",
               "distilled", "knn-regret", "ensemble"]
    methods += ["trees-refit"] if args.refit else []
    results: dict[str, dict[tuple[str, tuple], float]] = {name: {} for name in methods}
    for i, (family, held) in enumerate(families.items(), 1):
        print(f"[{time.perf_counter() - t0:6.0f} s] fold {i}/{len(families)}: {family}", file=sys.stderr, flush=True)
        train = meas.subset(lambda n, k, h=held: (n, k) not in h)
        test = meas.subset(lambda n, k, h=held: (n, k) in h)
        tag = {key: (family, key) for key in test.times}
        keep = {(n, k) for _, n, k in train.geometries()}
        trees = fit_fallback(train, rows.subset(lambda n, k, kept=keep: (n, k) in kept), options)
        results["trees"] |= {tag[key]: r for key, r in ev.policy_ratios(trees, test).items()}
        if args.refit:
            refit = fit_fallback(train, FallbackRows.build(train, score(train, TimeModel().fit(train), profile),
                                                           options.predicted_weight), options)
            results["trees-refit"] |= {tag[key]: r for key, r in ev.policy_ratios(refit, test).items()}
        plan, _ = predicted_plan(test, TimeModel().fit(train).raw, profile, meas.modes)  # raw: log time
        results["time-model"] |= {tag[key]: r for key, r in ratios_of(plan, test).items()}
        physical = PhysicalModel().fit(train)
        plan, gbm_regrets = predicted_plan(test, physical.log_times, profile, meas.modes)
        results["gbm-physical"] |= {tag[key]: r for key, r in ratios_of(plan, test).items()}
        train_expected = {g: e for g, e in scores.expected.items() if (g[1], g[2]) not in held}
        knn = knn_identity_regrets(train_expected, test.geometries())
        ensemble = {g: {i: (r + gbm_regrets[g][i]) / 2 for i, r in knn[g].items()} for g in knn}
        oracle_ids = {g: scores.chosen[g] for g in test.geometries()}
        for name, chosen in (("gbm-identity+tree-launch", plan.identity), ("oracle-identity+tree-launch", oracle_ids),
                             ("distilled", distilled_identities(train_expected, test.geometries(), physical, profile,
                                                                meas.modes, meas.sm_count))):
            with_ids = replace(trees, identity_overlays=chosen)  # the launch tree under these identities
            results[name] |= {tag[key]: r for key, r in ev.policy_ratios(with_ids, test).items()}
        for name, regrets in (("knn-regret", knn), ("ensemble", ensemble)):
            plan = launches(test, {g: min(r, key=lambda i, r=r: (r[i], i)) for g, r in regrets.items()},
                            physical.log_times)
            results[name] |= {tag[key]: r for key, r in ratios_of(plan, test).items()}
    out: dict[str, object] = {"corpus": str(args.corpus), "cells": len(meas.times), "families": {
        f: len(g) for f, g in families.items()}, "seconds": round(time.perf_counter() - t0), "methods": {}}
    for name, ratios in results.items():
        paired = {fk: r for fk, r in ratios.items() if fk[1] in invariant}
        excess = {fk: r / invariant[fk[1]] for fk, r in paired.items()}
        out["methods"][name] = {  # type: ignore[index]
            "total": ev.breakdown(paired, key_of=lambda fk: fk[1], family_of=lambda fk: fk[0]),
            "excess": ev.breakdown(excess, key_of=lambda fk: fk[1], family_of=lambda fk: fk[0])}
    oracle = {fk: invariant[fk[1]] for fk in results["trees"] if fk[1] in invariant}
    out["invariant-oracle"] = ev.breakdown(oracle, key_of=lambda fk: fk[1], family_of=lambda fk: fk[0])
    args.output.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"{'method':<28} {'total gm':>9} {'excess gm':>9} {'p95':>8} {'max':>8}")
    for name, res in out["methods"].items():  # type: ignore[union-attr]
        t, e = res["total"]["all"], res["excess"]["all"]
        print(f"{name:<28} {t['geomean']:>9.2f} {e['geomean']:>9.2f} {e['p95']:>8.2f} {e['max']:>8.2f}")
    print(f"invariant oracle {out['invariant-oracle']['all']['geomean']:.2f} % geomean")  # type: ignore[index]
    return 0


if __name__ == "__main__":
    sys.exit(main())
