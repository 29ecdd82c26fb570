"""How good is a policy (docs/policy.md §6): regret against the per-cell oracle on measured cells.

Regret of a pick in a cell = its median time / the fastest median of the cell - 1 (0 = the oracle's pick).
Aggregates: geometric mean of the time ratios (minus 1), p95 and max, overall and per codebook, M, mode and
weight size (the true bytes of the matrix in its codebook).

The headline, `lofo` (leave-one-family-out): for every model family of the shape inventories in turn, every
geometry of its inventories is left out (also one another family shares), the fallback alone (trees, no
overlays) is fit on the rest and scored on the left-out cells. A geometry shared by several families is scored
once per family. Beside it on the same cells, the invariant oracle (below), and the fallback's **excess over the
invariant oracle** (fallback time / invariant-oracle time - 1): the oracle's own regret is the price of
invariance, which only kernels lower; the excess is what the fallback's decisions lose. TARGETS are checked on
these figures.

The folds of `lofo` and of `fallback-cv` share one time model, fit on the whole corpus: it only fills the M
values the corpus lacks, anchored to each geometry's own measurements. A fold's trees are fit to the rows of
its own geometries as the whole corpus's training builds them (`train.FallbackRows.subset`); only the M trend
of that fill has seen the left-out geometries. Refitting it per fold costs a model fit and a scoring per
fold (most of the time); on the committed H200 corpus it lowers the fallback's figures by 0.8 points, so the
shared ones are, if anything, pessimistic (docs/policy.md). The sealed hold-out refits it.

Other methods:
- `policy`: the policy trained on the whole corpus, overlays included, on every measured cell (in-sample by
  construction: its target is to stay within the noise band of the best invariant choice);
- `fallback-cv`: the fallback alone on geometries it never saw: k-fold cross-validation grouped by (N, K) over
  the non-held-out geometries;
- `fallback-holdout`: the sealed hold-out. HOLDOUT_FAMILIES are whole model families (fixed list, chosen
  before any result was seen: two families with distinctive widths, Phi and Falcon3). Every geometry of
  their inventories is held out (also one another family shares), the policy is fit on the rest (time model
  included) and frozen, then evaluated once on the held-out geometries;
- `best-single`: per codebook, the one candidate (valid in all its cells) of least geomean regret;
- `mmvq`: a llama.cpp-MMVQ-style rule mapped onto the registry (MMVQ_RULE);
- `invariant-oracle`: per cell the best launch of the identity the profile picks for its (codebook, N, K) with
  the whole corpus seen (hindsight): its regret is the price of invariance (what byte equality across M costs).
"""

from __future__ import annotations

import math
import multiprocessing
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ...kernels.errors import InputError
from ..common.threads import ENV as THREADS_ENV
from ..measure.corpus import Corpus
from ..measure.shapes import GRID_NAME, Inventory, load_inventories
from .features import weight_bytes
from .policy import CANONICAL_WIDE, LaunchKey, Policy, validate_profile
from .train import (
    FallbackRows,
    Measurements,
    TimeModel,
    TrainOptions,
    best_launch,
    check_corpus,
    fit_fallback,
    fit_policy,
    score,
    serving,
    with_overlays,
)

HOLDOUT_FAMILIES: tuple[str, ...] = ("falcon3", "phi-3", "phi-4")
FOLDS = 5
# What the fallback should reach on families it never saw (leave-one-family-out), in percent:
# (figure, statistic, at most).
TARGETS: tuple[tuple[str, str, float], ...] = (("excess", "geomean", 1.0), ("excess", "p95", 8.0),
                                               ("fallback", "geomean", 5.0))
# Upper edges (MiB) of the weight-size buckets: a GEMV's time is mostly its weight bytes over the bandwidth,
# and small matrices cannot fill the GPU, so regret is read per size.
SIZE_EDGES_MIB: tuple[int, ...] = (1, 4, 16, 64, 256)
Progress = Callable[[str], None]
METHODS: tuple[str, ...] = ("policy", "invariant-oracle", "fallback-cv", "fallback-holdout", "best-single", "mmvq")
# llama.cpp MMVQ (ggml-cuda/mmvq.cu) by M: one output row per CTA with its K split over 4 warps at M = 1,
# two rows per CTA over 2 warps of K at M 2..8, the int8 tensor-core path (MMQ) above. Nearest registry
# candidates: a CTA folding K partitions in shared memory is our `direct` family at its narrowest width.
MMVQ_RULE: tuple[tuple[int, str], ...] = ((1, "direct.s4.t32.c1"), (8, "direct.s2.t64.c1"),
                                          (1 << 62, "wide.s1.t128.mma2"))


def mmvq_pick(m: int, n: int, k: int) -> str:
    """The MMVQ-style candidate for (M, N, K); the canonical wide launch where the mapped one is invalid."""
    pick = next(c for top, c in MMVQ_RULE if m <= top)
    return pick if pick in serving(m, n, k) else CANONICAL_WIDE


def summary(ratios: Iterable[float]) -> dict[str, float | int]:
    """{geomean, p95, max} regrets in percent of time ratios (>= 1), and n."""
    r = np.asarray(list(ratios), dtype=np.float64)
    if not r.size:
        return {"n": 0}
    return {"n": int(r.size), "geomean": 100 * (math.exp(float(np.mean(np.log(r)))) - 1),
            "p95": 100 * (float(np.percentile(r, 95)) - 1), "max": 100 * (float(r.max()) - 1)}


def size_bucket(codebook: str, n: int, k: int) -> str:
    """The weight-size bucket of a geometry: "<1 MiB", "1-4 MiB", ..., ">=256 MiB" (SIZE_EDGES_MIB)."""
    mib = weight_bytes(codebook, n, k) / (1 << 20)
    low = 0
    for edge in SIZE_EDGES_MIB:
        if mib < edge:
            return f"<{edge} MiB" if low == 0 else f"{low}-{edge} MiB"
        low = edge
    return f">={low} MiB"


def breakdown(ratios: Mapping[Any, float], key_of: Callable[[Any], LaunchKey] = lambda key: key,
              family_of: Callable[[Any], str] | None = None) -> dict[str, Any]:
    """summary overall and by codebook, M, mode and weight size (and family where `family_of` names it);
    `key_of` maps a key of `ratios` to its cell."""
    def by(group: Callable[[Any], Any]) -> dict[str, Any]:
        groups: dict[Any, list[float]] = {}
        for key, r in ratios.items():
            groups.setdefault(group(key), []).append(r)
        return {str(g): summary(v) for g, v in sorted(groups.items(), key=lambda item: _order(item[0]))}

    out = {"all": summary(ratios.values()), "codebook": by(lambda q: key_of(q)[0]), "m": by(lambda q: key_of(q)[1]),
           "mode": by(lambda q: key_of(q)[4]), "size": by(lambda q: size_bucket(*_geometry(key_of(q))))}
    if family_of is not None:
        out["family"] = by(family_of)
    return out


def _geometry(key: LaunchKey) -> tuple[str, int, int]:
    return key[0], key[2], key[3]


def _order(group: Any) -> tuple[Any, ...]:
    """Sort groups naturally: M numerically (also as JSON's string keys), size buckets by their bytes, names
    alphabetically."""
    text = str(group)
    if text.isdigit():
        return (0, int(text), "")
    if text.endswith(" MiB"):
        return (1, 0 if text.startswith("<") else int(text.strip(">= MiB").split("-")[0]), "")
    return (2, 0, text)


def _ratios(meas: Measurements, pick: Callable[[LaunchKey], str]) -> dict[LaunchKey, float]:
    out = {}
    for key, cell in sorted(meas.times.items()):
        chosen = pick(key)
        if chosen in cell:  # every valid candidate of a cell is measured; a pick is valid by construction
            out[key] = cell[chosen] / min(cell.values())
    return out


def policy_ratios(policy: Policy, meas: Measurements, overlays: bool = True) -> dict[LaunchKey, float]:
    """Regret ratios of `policy` (its fallback alone when not `overlays`) on the cells of `meas`."""
    if not overlays:
        policy = replace(policy, identity_overlays={}, launch_overlays={})
    return _ratios(meas, lambda key: policy.select(*key).candidate)


def fold_ratios(meas: Measurements, rows: FallbackRows, held: set[tuple[int, int]],
                options: TrainOptions) -> dict[LaunchKey, float]:
    """Regret ratios, on the cells of the `held` geometries of `meas`, of the fallback fit on the rows of its
    other geometries (`rows` may hold more: they were built once with the shared time model, and the module
    docstring says why one serves every fold)."""
    train = meas.subset(lambda n, k: (n, k) not in held)
    keep = {(n, k) for _, n, k in train.geometries()}
    bare = fit_fallback(train, rows.subset(lambda n, k: (n, k) in keep), options)
    return policy_ratios(bare, meas.subset(lambda n, k: (n, k) in held))


def family_geometries(inventories: Iterable[Inventory],
                      measured: set[tuple[int, int]]) -> dict[str, set[tuple[int, int]]]:
    """Per model family, its inventories' measured (N, K): the families a leave-one-family-out can leave out
    (some, not all, of the measured geometries). The synthetic grid is no model family: its points that a
    model shares belong to that model's family."""
    out: dict[str, set[tuple[int, int]]] = {}
    for inv in inventories:
        if inv.name != GRID_NAME:
            out.setdefault(inv.family, set()).update(set(inv.geometries()) & measured)
    return {fam: geos for fam, geos in sorted(out.items()) if geos and geos != measured}


def lofo(families: Mapping[str, set[tuple[int, int]]], folds: Mapping[str, Mapping[LaunchKey, float]],
         invariant: Mapping[LaunchKey, float]) -> tuple[dict[str, Any], dict[tuple[str, LaunchKey], float]]:
    """Leave-one-family-out from each family's fold (`fold_ratios` with its geometries held out): the
    fallback's regret, the invariant oracle's and the excess of the one over the other, and the TARGETS'
    verdicts; and the fallback's ratio per (family, cell)."""
    fallback = {(family, key): r for family, ratios in folds.items() for key, r in ratios.items()}
    paired = {fk: r for fk, r in fallback.items() if fk[1] in invariant}
    figures = {"fallback": paired, "invariant-oracle": {fk: invariant[fk[1]] for fk in paired},
               "excess": {fk: r / invariant[fk[1]] for fk, r in paired.items()}}
    out: dict[str, Any] = {
        "families": {fam: len(geos) for fam, geos in families.items()}, "cells": len(paired),
        **{name: breakdown(r, key_of=lambda fk: fk[1], family_of=lambda fk: fk[0]) for name, r in figures.items()}}
    out["targets"] = [{"figure": fig, "statistic": stat, "at_most": limit, "value": out[fig]["all"][stat],
                       "passed": out[fig]["all"][stat] <= limit} for fig, stat, limit in TARGETS]
    return out, paired


def best_single_ratios(meas: Measurements) -> dict[LaunchKey, float]:
    out: dict[LaunchKey, float] = {}
    for cb in meas.codebooks:
        cells = {key: cell for key, cell in meas.times.items() if key[0] == cb}
        common = set.intersection(*(set(cell) for cell in cells.values()))
        best = min(sorted(common),
                   key=lambda c: math.fsum(math.log(cell[c] / min(cell.values())) for cell in cells.values()))
        out |= {key: cell[best] / min(cell.values()) for key, cell in cells.items()}
    return dict(sorted(out.items()))


def mmvq_ratios(meas: Measurements) -> dict[LaunchKey, float]:
    """Regret ratios of MMVQ_RULE on the cells of `meas`."""
    return _ratios(meas, lambda key: mmvq_pick(key[1], key[2], key[3]))


def invariant_ratios(meas: Measurements, chosen: Mapping[tuple[str, int, int], int]) -> dict[LaunchKey, float]:
    """Price of invariance per cell: the best launch of the chosen identity over the unconstrained best."""
    out = {}
    for key, cell in sorted(meas.times.items()):
        cb, m, n, k, _ = key
        pick = best_launch(cell, chosen[(cb, n, k)], m, n, k, 0.0)
        if pick is not None:
            out[key] = cell[pick] / min(cell.values())
    return out


def holdout_geometries(inventories: Iterable[Inventory],
                       families: Iterable[str] = HOLDOUT_FAMILIES) -> set[tuple[int, int]]:
    """Every (N, K) of the held-out families' inventories."""
    families = set(families)
    return {g for inv in inventories if inv.family in families for g in inv.geometries()}


@dataclass(frozen=True)
class Report:
    """Everything `evaluate` prints; `regrets` keeps the per-cell ratios for the CDF plot."""

    data: dict[str, Any]
    regrets: dict[str, list[float]]


@dataclass(frozen=True)
class _Fold:
    """One fit of `evaluate` that needs only the shared state: a fold of the fallback (`held` out of `meas`, or
    of the training part without the sealed hold-out when `within_training`), or the sealed hold-out."""

    label: str  # what progress says of it
    held: frozenset[tuple[int, int]] = frozenset()
    within_training: bool = False
    holdout: bool = False


_SHARED: dict[str, Any] = {}  # what every _Fold reads: set once per worker process, or in this one


def _share(state: Mapping[str, Any], worker: bool = False) -> None:
    # Worker processes only share the cores by turns; an OpenMP pool in each would also spin at its barriers
    # while another worker holds the core (common.threads), so each fits with one thread.
    if worker:
        os.environ[THREADS_ENV] = "1"
    _SHARED.clear()
    _SHARED.update(state)


def _run_fold(fold: _Fold) -> dict[LaunchKey, float]:
    train_meas, options = _SHARED["train_meas"], _SHARED["options"]
    if fold.holdout:
        return policy_ratios(fit_policy(train_meas, options), _SHARED["test_meas"], overlays=False)
    return fold_ratios(train_meas if fold.within_training else _SHARED["meas"], _SHARED["rows"], set(fold.held),
                       options)


def _start_folds(folds: Sequence[_Fold], state: Mapping[str, Any], processes: int, say: Callable[[str], None],
                 stack: ExitStack) -> Callable[[], list[dict[LaunchKey, float]]]:
    """Start the folds and return what collects their ratios, in the order given. With no `processes` they run
    in this process when collected; else at once in that many spawned processes, each handed `state` once
    (the pool is shut down when `stack` closes). The results do not depend on which. Progress names each fold
    as it starts (here) or ends (workers)."""
    if processes < 1:
        def run_here() -> list[dict[LaunchKey, float]]:
            _share(state)
            try:
                return [say(fold.label) or _run_fold(fold) for fold in folds]
            finally:
                _SHARED.clear()
        return run_here
    context = multiprocessing.get_context("spawn")  # fork would copy OpenMP's state, which deadlocks libgomp
    pool = stack.enter_context(ProcessPoolExecutor(processes, mp_context=context, initializer=_share,
                                                   initargs=(state, True)))
    futures = {pool.submit(_run_fold, fold): fold for fold in folds}

    def collect() -> list[dict[LaunchKey, float]]:
        for future in as_completed(futures):
            say(f"{futures[future].label}: done")
        return [future.result() for future in futures]
    return collect


def evaluate(corpus: Corpus, options: TrainOptions | None = None, inventories: list[Inventory] | None = None,
             folds: int = FOLDS, progress: Progress | None = None, workers: int = 1) -> Report:
    """Fit and score every method of the module docstring on `corpus`; `progress` hears of each fit.

    inventories default to the shipped model inventories (they name the families and the hold-out's geometries).
    With `workers` > 1 the folds run in that many spawned processes and the sealed hold-out in one more, beside
    the whole corpus's fit (a script that calls this needs the `if __name__ == "__main__":` guard that spawned
    processes need); the report is the same for any count."""
    from sklearn.model_selection import GroupKFold

    def say(text: str) -> None:
        if progress:
            progress(text)

    options = options or TrainOptions()
    check_corpus(corpus)
    meas = Measurements.from_corpus(corpus)
    inventories = inventories if inventories is not None else load_inventories(_shapes())
    measured = {(n, k) for _, n, k in meas.geometries()}
    held = holdout_geometries(inventories) & measured
    if not held or held == measured:
        raise InputError("the hold-out families' geometries must be some, not all, of the corpus geometries")
    families = family_geometries(inventories, measured)
    train_meas = meas.subset(lambda n, k: (n, k) not in held)
    test_meas = meas.subset(lambda n, k: (n, k) in held)

    with ExitStack() as stack:
        # The sealed hold-out needs nothing of the whole corpus's fit: with a core to spare it runs beside it.
        holdout = _start_folds([_Fold(f"sealed hold-out ({', '.join(HOLDOUT_FAMILIES)}): time model and policy "
                                      "without them", holdout=True)],
                               {"train_meas": train_meas, "test_meas": test_meas, "options": options},
                               1 if workers > 1 else 0, say, stack)
        say(f"time model and policy on the whole corpus ({len(meas.times)} cells)")
        model = TimeModel(random_state=options.random_state).fit(meas)
        profile = validate_profile(options.profile)
        scores = score(meas, model, profile)
        rows = FallbackRows.build(meas, scores, options.predicted_weight)
        full = with_overlays(meas, scores, fit_fallback(meas, rows, options))
        invariant = invariant_ratios(meas, scores.chosen)

        geos = sorted({(n, k) for _, n, k in train_meas.geometries()})
        splits = list(GroupKFold(n_splits=min(folds, len(geos))).split(geos, groups=list(range(len(geos)))))
        fold_jobs = [
            *(_Fold(f"leave-one-family-out {i}/{len(families)}: {family} ({len(geos_out)} geometries)",
                    frozenset(geos_out)) for i, (family, geos_out) in enumerate(families.items(), 1)),
            *(_Fold(f"grouped cross-validation {i}/{len(splits)}", frozenset(geos[j] for j in test_idx), True)
              for i, (_, test_idx) in enumerate(splits, 1))]
        fold_results = _start_folds(fold_jobs, {"meas": meas, "train_meas": train_meas, "rows": rows,
                                                "options": options},
                                    min(workers, len(fold_jobs)) if workers > 1 else 0, say, stack)()
        (holdout_ratios,) = holdout()
    family_folds, cv_folds = fold_results[:len(families)], fold_results[len(families):]
    headline, lofo_ratios = lofo(families, dict(zip(families, family_folds, strict=True)), invariant)
    cv: dict[LaunchKey, float] = {}
    for ratios in cv_folds:
        cv |= ratios

    methods = {
        "policy": policy_ratios(full, meas),
        "invariant-oracle": invariant,
        "fallback-cv": dict(sorted(cv.items())),
        "fallback-holdout": holdout_ratios,
        "best-single": best_single_ratios(meas),
        "mmvq": mmvq_ratios(meas),
    }
    noise = meas.noise_rel
    paired = [(methods["policy"][key], invariant[key]) for key in methods["policy"] if key in invariant]
    data = {
        "corpus": dict(full.source), "cells": len(meas.times), "noise_rel": noise,
        **({"fallback": options.fallback} if options.fallback != "trees" else {}),  # the default's report unchanged
        "lofo": headline,
        "holdout": {"families": list(HOLDOUT_FAMILIES), "geometries": len(held), "cells": len(test_meas.times)},
        "cv_folds": folds, "profile": {str(m): w for m, w in full.profile.items()},
        "overlays": {"identity": len(full.identity_overlays), "launch": len(full.launch_overlays)},
        "methods": {name: breakdown(r) for name, r in methods.items()},
        "policy_vs_invariant": summary(p / i for p, i in paired),
        "policy_within_noise": sum(p <= i * (1 + noise) for p, i in paired) / max(1, len(paired)),
        "price_of_invariance": _price(scores, full.profile),
    }
    regrets = {name: sorted(r.values()) for name, r in [("fallback-lofo", lofo_ratios), *methods.items()]}
    return Report(data, regrets)


def _price(scores: Any, profile: Mapping[int, int]) -> dict[str, Any]:
    """Price of invariance over every scored cell (measured and model-filled): at M = 1, and over the profile
    (each cell weighted by its M's profile weight)."""
    ratios, weights, at_one = [], [], []
    for (cb, m, n, k, _), cell in sorted(scores.cells.items()):
        if m not in profile:
            continue
        best = min(cell.values())
        ident = scores.chosen[(cb, n, k)]
        mine = min(t for c, t in cell.items() if serving(m, n, k).get(c) == ident)
        ratios.append(mine / best)
        weights.append(profile[m])
        if m == 1:
            at_one.append(mine / best)
    r, w = np.asarray(ratios), np.asarray(weights, dtype=np.float64)
    return {"m1": summary(at_one), "profile": {
        "geomean": 100 * (math.exp(float(np.sum(w * np.log(r)) / w.sum())) - 1),
        "max": 100 * (float(r.max()) - 1), "n": int(r.size)}}


def _shapes() -> Path:
    from ..common.paths import shapes_dir

    return shapes_dir()


def _stats(summary_: Mapping[str, Any]) -> str:
    return f"{summary_['geomean']:>8.2f} {summary_['p95']:>8.2f} {summary_['max']:>8.2f}"


def render_lofo(lofo_data: Mapping[str, Any]) -> list[str]:
    """The leave-one-family-out headline: three figures, their breakdowns (geomean), the targets."""
    names = (("fallback", "fallback (no overlays)"), ("invariant-oracle", "invariant oracle"),
             ("excess", "excess over the oracle"))
    fams = lofo_data["families"]
    lines = [f"leave-one-family-out ({len(fams)} families, {lofo_data['cells']} cells; each family's geometries "
             "left out in turn, the fallback fit on the rest)",
             f"{'[%]':<24} {'geomean':>8} {'p95':>8} {'max':>8}"]
    lines += [f"{label:<24} {_stats(lofo_data[name]['all'])}" for name, label in names]
    for part, title in (("m", "M"), ("codebook", "codebook"), ("size", "weight size"), ("family", "family")):
        lines.append(f"  by {title} (geomean fallback / oracle / excess): " + "; ".join(
            f"{g} " + "/".join(f"{lofo_data[name][part][g]['geomean']:.1f}" for name, _ in names)
            for g in sorted(lofo_data["excess"][part], key=_order)))
    labels = {"excess": "excess over the invariant oracle", "fallback": "fallback regret"}
    lines += [f"target: {labels[t['figure']]} {t['statistic']} <= {t['at_most']:g} %: "
              f"{'PASS' if t['passed'] else 'FAIL'} ({t['value']:.2f} %)" for t in lofo_data["targets"]]
    return lines


def render(data: Mapping[str, Any]) -> str:
    """The report as text (regrets in %): the leave-one-family-out headline, then every method."""
    codebooks = list(data["methods"]["policy"]["codebook"])
    head = f"{'method':<18} {'cells':>5} {'geomean':>8} {'p95':>8} {'max':>8}  " + " ".join(
        f"{cb:>7}" for cb in codebooks)
    lines = [f"corpus {data['corpus']['corpus']} ({data['cells']} cells, noise band {100 * data['noise_rel']:.0f} %)",
             *render_lofo(data["lofo"]), "",
             f"hold-out families {', '.join(data['holdout']['families'])} ({data['holdout']['geometries']} "
             f"geometries); {data['cv_folds']}-fold CV grouped by (N, K)",
             "regret vs the per-cell oracle [%]: all cells, then geomean per codebook", head]
    for name in METHODS:
        b = data["methods"][name]
        a = b["all"]
        lines.append(f"{name:<18} {a['n']:>5} {_stats(a)}  "
                     + " ".join(f"{b['codebook'].get(cb, {}).get('geomean', float('nan')):>7.2f}"
                                for cb in codebooks))
    p = data["price_of_invariance"]
    lines += [f"price of invariance: M=1 geomean {p['m1']['geomean']:.2f} % (p95 {p['m1']['p95']:.2f}, max "
              f"{p['m1']['max']:.2f}); over the profile geomean {p['profile']['geomean']:.2f} % (max "
              f"{p['profile']['max']:.2f}, {p['profile']['n']} cells, unmeasured M from the time model)",
              f"policy vs the invariant oracle: {100 * data['policy_within_noise']:.1f} % of cells within the noise "
              f"band; overlays: {data['overlays']['identity']} identity, {data['overlays']['launch']} launch"]
    return "\n".join(lines)


def require_matplotlib() -> Any:
    """matplotlib.pyplot on the Agg backend; InputError naming the extra when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("--plot needs matplotlib: pip install 'gemv-dispatch[plot]'") from None
    return plt


def plot_cdf(report: Report, path: Path) -> None:
    """Regret CDF per method into `path` (PNG/SVG/PDF by suffix); InputError when matplotlib is missing."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, ratios in report.regrets.items():
        r = 100 * (np.asarray(ratios) - 1)
        ax.plot(np.maximum(r, 1e-3), np.arange(1, r.size + 1) / r.size, label=f"{name} (n={r.size})")
    ax.set_xscale("log")
    ax.set_xlabel("regret vs per-cell oracle [%] (log; 0 drawn at 0.001)")
    ax.set_ylabel("fraction of cells")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
