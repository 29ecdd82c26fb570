"""How good is a policy (docs/policy.md §6): regret against the per-cell oracle on measured cells.

Regret of a pick in a cell = its median time / the fastest median of the cell - 1 (0 = the oracle's pick).
Aggregates: geometric mean of the time ratios (minus 1), p95 and max, overall and per codebook, M and mode.

Methods compared:
- `policy`: the policy trained on the whole corpus, overlays included, on every measured cell (in-sample by
  construction: its target is to stay within the noise band of the best invariant choice);
- `fallback-cv`: the fallback alone (trees, no overlays) on geometries it never saw: 5-fold
  cross-validation grouped by (N, K) over the non-held-out geometries, each fold refitting everything
  (time model included);
- `fallback-holdout`: the sealed hold-out. HOLDOUT_FAMILIES are whole model families (fixed list, chosen
  before any result was seen: two families with distinctive widths, Phi and Falcon3). Every geometry of
  their inventories is held out (also one another family shares), the policy is fit on the rest and frozen,
  then evaluated once on the held-out geometries;
- `best-single`: per codebook, the one candidate (valid in all its cells) of least geomean regret;
- `mmvq`: a llama.cpp-MMVQ-style rule mapped onto the registry (MMVQ_RULE);
- `invariant-oracle`: per cell the best launch of the identity the profile picks for its (codebook, N, K):
  its regret is the price of invariance (what byte equality across M costs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...kernels.errors import InputError
from ..measure.corpus import Corpus
from ..measure.shapes import Inventory, load_inventories
from .policy import CANONICAL_WIDE, LaunchKey, Policy
from .train import (
    Measurements,
    TimeModel,
    TrainOptions,
    best_launch,
    check_corpus,
    fit_policy,
    score,
    serving,
)

HOLDOUT_FAMILIES: tuple[str, ...] = ("falcon3", "phi-3", "phi-4")
FOLDS = 5
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


def breakdown(ratios: Mapping[LaunchKey, float]) -> dict[str, Any]:
    """summary overall and by codebook, M and mode."""
    def by(index: int) -> dict[str, Any]:
        groups: dict[Any, list[float]] = {}
        for key, r in ratios.items():
            groups.setdefault(key[index], []).append(r)
        return {str(g): summary(v) for g, v in sorted(groups.items())}

    return {"all": summary(ratios.values()), "codebook": by(0), "m": by(1), "mode": by(4)}


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
        policy = Policy(policy.source, policy.options, policy.codebooks, policy.identity_tree, policy.launch_tree,
                        {}, {}, policy.shapes)
    return _ratios(meas, lambda key: policy.select(*key).candidate)


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


def evaluate(corpus: Corpus, options: TrainOptions | None = None, inventories: list[Inventory] | None = None,
             folds: int = FOLDS) -> Report:
    """Fit and score every method of the module docstring on `corpus`.

    inventories default to the shipped model inventories (they name the hold-out families' geometries)."""
    from sklearn.model_selection import GroupKFold

    options = options or TrainOptions()
    check_corpus(corpus)
    meas = Measurements.from_corpus(corpus)
    held = holdout_geometries(inventories if inventories is not None else load_inventories(_shapes()))
    measured = {(n, k) for _, n, k in meas.geometries()}
    held &= measured
    if not held or held == measured:
        raise InputError("the hold-out families' geometries must be some, not all, of the corpus geometries")
    train_meas = meas.subset(lambda n, k: (n, k) not in held)
    test_meas = meas.subset(lambda n, k: (n, k) in held)

    model = TimeModel(random_state=options.random_state).fit(meas)
    full = fit_policy(meas, options, model)
    scores = score(meas, model, full.profile)
    frozen = fit_policy(train_meas, options)

    geos = sorted({(n, k) for _, n, k in train_meas.geometries()})
    splits = GroupKFold(n_splits=min(folds, len(geos))).split(geos, groups=list(range(len(geos))))
    cv: dict[LaunchKey, float] = {}
    for _, test_idx in splits:
        test = {geos[i] for i in test_idx}
        fold = fit_policy(train_meas.subset(lambda n, k, t=test: (n, k) not in t), options)
        cv |= policy_ratios(fold, train_meas.subset(lambda n, k, t=test: (n, k) in t), overlays=False)

    invariant = invariant_ratios(meas, scores.chosen)
    methods = {
        "policy": policy_ratios(full, meas),
        "fallback-cv": dict(sorted(cv.items())),
        "fallback-holdout": policy_ratios(frozen, test_meas, overlays=False),
        "best-single": best_single_ratios(meas),
        "mmvq": mmvq_ratios(meas),
        "invariant-oracle": invariant,
    }
    noise = meas.noise_rel
    paired = [(methods["policy"][key], invariant[key]) for key in methods["policy"] if key in invariant]
    data = {
        "corpus": dict(full.source), "cells": len(meas.times), "noise_rel": noise,
        "holdout": {"families": list(HOLDOUT_FAMILIES), "geometries": len(held), "cells": len(test_meas.times)},
        "cv_folds": folds, "profile": {str(m): w for m, w in full.profile.items()},
        "overlays": {"identity": len(full.identity_overlays), "launch": len(full.launch_overlays)},
        "methods": {name: breakdown(r) for name, r in methods.items()},
        "policy_vs_invariant": summary(p / i for p, i in paired),
        "policy_within_noise": sum(p <= i * (1 + noise) for p, i in paired) / max(1, len(paired)),
        "price_of_invariance": _price(scores, full.profile),
    }
    return Report(data, {name: sorted(r.values()) for name, r in methods.items()})


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


def render(data: Mapping[str, Any]) -> str:
    """The report as a text table (regrets in %)."""
    codebooks = list(data["methods"]["policy"]["codebook"])
    head = f"{'method':<18} {'cells':>5} {'geomean':>8} {'p95':>8} {'max':>8}  " + " ".join(
        f"{cb:>7}" for cb in codebooks)
    lines = [f"corpus {data['corpus']['corpus']} ({data['cells']} cells, noise band {100 * data['noise_rel']:.0f} %);"
             f" hold-out families {', '.join(data['holdout']['families'])} ({data['holdout']['geometries']} "
             f"geometries); {data['cv_folds']}-fold CV grouped by (N, K)",
             "regret vs the per-cell oracle [%]: all cells, then geomean per codebook", head]
    for name, b in data["methods"].items():
        a = b["all"]
        lines.append(f"{name:<18} {a['n']:>5} {a['geomean']:>8.2f} {a['p95']:>8.2f} {a['max']:>8.2f}  "
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
