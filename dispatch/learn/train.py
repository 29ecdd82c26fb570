"""Learn a dispatch policy from a corpus (docs/policy.md §6): identities over the M profile, launches within them,
an integer decision-tree fallback that is total, exact overlays where the fallback is measurably wrong.

Pipeline (every step deterministic; sklearn estimators seeded):
1. `Measurements`: the corpus as median times per (execution codebook, M, N, K, mode) and candidate. Aliases
   of one execution key are judged by their worst (slowest) alias; repeated measurements are averaged.
2. `TimeModel`: a gradient-boosted regressor of log time over integer shape and candidate features. It
   scores the M values of the profile the corpus lacks, anchored to the measurements: the prediction for M
   is shifted by the model's residual at the measured M values around it (interpolated in log2 M), so a
   measured cell is reproduced exactly and only the M-trend comes from the model.
3. Identity per measured (codebook, N, K): the S minimizing the profile-weighted expected time (each M's
   time = the best launch of that S; every mode of the corpus weighs equally); expected times within the
   corpus noise band of the best are a tie, broken toward the smaller S (fewer partitions, less workspace).
4. Fallback: two multi-output regression trees over integer features, fit to vectors of log regrets (one
   slot per identity, resp. per candidate; a slot that cannot serve the row carries the row's worst regret).
   Splits thus separate shapes whose choices cost differently. Each leaf becomes an ordered preference list
   built greedily from the training rows that fall in it, minimizing their summed log regret under the
   exact `select` semantics (first available entry, else the canonical candidate): a geomean-regret order.
   Opt-in instead (`TrainOptions.fallback = "compact"`): the compact fallback (compact.fit_compact), models of
   log time whose integer scores select argmins.
5. Overlays: an identity overlay where the tree's identity is slower over the profile than the chosen one
   beyond the noise band; a launch overlay for a measured cell where the tree's launch (under the final
   identity) is slower than the best launch of that identity beyond the noise band.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache, cached_property
from pathlib import Path
from typing import Any

import numpy as np

from ...kernels import digests, program
from ...kernels.codebooks import get
from ...kernels.errors import InputError
from ...kernels.registry import BY_ID, CANDIDATES, Candidate, mma_row_tiles, row_tile
from .. import __version__
from ..common.digests import sha256
from ..common.threads import bounded_threads
from ..measure.corpus import MANIFEST, Corpus
from .compact import FAMILIES, CompactParams, fit_compact
from .features import (
    IDENTITY_FEATURES,
    LAUNCH_FEATURES,
    MODES,
    identity_features,
    launch_features,
)
from .policy import (
    DEFAULT_PROFILE,
    IDENTITIES,
    SERVED_MS,
    IdentityKey,
    LaunchKey,
    Policy,
    Tree,
    canonical,
    serving,
    tie_key,
    validate_profile,
)

RANDOM_STATE = 0
FALLBACKS = ("trees", "compact")
CANDIDATE_IDS: tuple[str, ...] = tuple(c.id for c in CANDIDATES)
TIME_FEATURES: tuple[str, ...] = (*LAUNCH_FEATURES, "family", "ksplit", "threads", "cpt", "mma_tiles",
                                  "staged", "row_tile", "ctas")

Geometry = tuple[str, int, int]  # (codebook, n, k)


# ---------------------------------------------------------------------------------------------------------
# 1. Measurements


@dataclass(frozen=True)
class Measurements:
    """Median times (µs) per measured cell (codebook, m, n, k, mode) -> {candidate id: µs}, plus the corpus
    facts a policy records. Codebooks are execution keys."""

    times: Mapping[LaunchKey, Mapping[str, float]]
    noise_rel: float  # relative tie band of the corpus timing provenance (the widest, if several)
    sm_count: int
    source: Mapping[str, Any]

    @classmethod
    def from_corpus(cls, corpus: Corpus) -> Measurements:
        """Only the records of code the kernels still run (`Corpus.current`). InputError for a corpus without
        one, or provenances of different SM counts."""
        if not corpus.current:
            raise InputError(f"{corpus.folder}: the corpus holds no record of the kernels' current code "
                             f"({corpus.stale} stale): sweep again (only what changed is re-timed)")
        provenances = list(corpus.provenances.values())
        sms = {p.sm_count for p in provenances}
        if len(sms) != 1:
            raise InputError(f"{corpus.folder}: provenances disagree on the SM count ({sorted(sms)})")
        sums: dict[tuple[LaunchKey, str, str], list[float]] = {}
        for r in corpus.current:  # per (cell, candidate, source format): the mean over provenances
            key = (get(r.codebook).execution, r.m, r.n, r.k, r.mode)
            sums.setdefault((key, r.candidate, r.codebook), []).append(r.median_us)
        times: dict[LaunchKey, dict[str, float]] = {}
        for (key, cand, _), values in sorted(sums.items()):
            cell = times.setdefault(key, {})
            cell[cand] = max(cell.get(cand, 0.0), math.fsum(values) / len(values))  # worst alias
        manifest = Path(corpus.folder) / MANIFEST
        first = provenances[0]
        source = {"corpus": Path(corpus.folder).name, "corpus_manifest_sha256": sha256(manifest.read_bytes()),
                  "gpu_name": first.gpu_name, "sm_count": first.sm_count, "kernel_digest": program.digest(),
                  "code_digest": digests.code_digest(), "tool_version": __version__}
        noise = max(float(p.timing.get("noise_rel", 0.02)) for p in provenances)
        return cls(times, noise, first.sm_count, source)

    @cached_property
    def codebooks(self) -> tuple[str, ...]:
        return tuple(sorted({key[0] for key in self.times}))

    @cached_property
    def modes(self) -> tuple[str, ...]:
        return tuple(m for m in MODES if any(key[4] == m for key in self.times))

    def geometries(self) -> list[Geometry]:
        return sorted({(cb, n, k) for cb, _, n, k, _ in self.times})

    def subset(self, keep: Callable[[int, int], bool]) -> Measurements:
        """The measurements of the (N, K) geometries `keep(n, k)` accepts (cross-validation, hold-out)."""
        return Measurements({key: t for key, t in self.times.items() if keep(key[2], key[3])}, self.noise_rel,
                            self.sm_count, self.source)


def best_launch(times: Mapping[str, float], identity: int, m: int, n: int, k: int,
                noise_rel: float) -> str | None:
    """The launch of `identity` for a cell: the fastest median, ties within the noise band broken by
    policy.tie_key (no workspace, smaller id). None when no measured candidate fits."""
    serve = serving(m, n, k)
    live = {c: t for c, t in times.items() if serve.get(c) == identity}
    if not live:
        return None
    limit = min(live.values()) * (1.0 + noise_rel)
    return min((c for c, t in live.items() if t <= limit), key=lambda c: tie_key(BY_ID[c], m, n, k))


# ---------------------------------------------------------------------------------------------------------
# 2. Time model


def time_features(codebook: str, candidate: Candidate, m: int, n: int, k: int, mode: str,
                  sm_count: int) -> list[int]:
    """TIME_FEATURES of one candidate launch: the launch features plus the candidate's own shape."""
    feats = _launch_tuple(codebook, candidate.identity(k), m, n, k, mode, sm_count)
    (gx, gy, _), _ = candidate.launch_geometry(m, n, k)
    tile = mma_row_tiles(m) if candidate.mma_tiles else row_tile(m, candidate.cpt)
    return [*feats, FAMILIES.index(candidate.family), candidate.ksplit, candidate.threads, candidate.cpt,
            candidate.mma_tiles, int(candidate.staged), tile, gx * gy]


@cache
def _launch_tuple(codebook: str, identity: int, m: int, n: int, k: int, mode: str, sm_count: int) -> tuple[int, ...]:
    return tuple(launch_features(codebook, identity, m, n, k, mode, sm_count).values())


class TimeModel:
    """Regressor of log median time for (codebook, candidate, M, N, K, mode), anchored to measurements.

    scikit-learn style: `fit(measurements)` then `predict(keys)`; deterministic (fixed random_state, no early
    stopping, whose validation split would be random)."""

    def __init__(self, max_iter: int = 300, learning_rate: float = 0.1, max_leaf_nodes: int = 31,
                 random_state: int = RANDOM_STATE) -> None:
        self.max_iter, self.learning_rate = max_iter, learning_rate
        self.max_leaf_nodes, self.random_state = max_leaf_nodes, random_state

    def fit(self, meas: Measurements) -> TimeModel:
        from sklearn.ensemble import HistGradientBoostingRegressor

        rows, y = [], []
        for (cb, m, n, k, mode), cell in sorted(meas.times.items()):
            for cand, t in sorted(cell.items()):
                rows.append(time_features(cb, BY_ID[cand], m, n, k, mode, meas.sm_count))
                y.append(math.log(t))
        model = HistGradientBoostingRegressor(
            max_iter=self.max_iter, learning_rate=self.learning_rate, max_leaf_nodes=self.max_leaf_nodes,
            early_stopping=False, random_state=self.random_state,
        )
        with bounded_threads():  # OpenMP: a pool wider than the free cores collapses on a shared machine
            self.model_ = model.fit(np.asarray(rows, dtype=np.float64), np.asarray(y))
        self.meas_ = meas
        self.sm_count_ = meas.sm_count
        return self

    def raw(self, keys: Sequence[tuple[str, str, int, int, int, str]]) -> np.ndarray:
        """Unanchored log-time predictions for (codebook, candidate id, m, n, k, mode) keys: float64 [len]."""
        if not keys:
            return np.zeros(0)
        x = [time_features(cb, BY_ID[c], m, n, k, mode, self.sm_count_) for cb, c, m, n, k, mode in keys]
        with bounded_threads():
            return self.model_.predict(np.asarray(x, dtype=np.float64))

    def predict(self, keys: Sequence[tuple[str, str, int, int, int, str]]) -> np.ndarray:
        """Time in µs per key: the measurement where there is one; else the model, shifted by its residual at
        the measured M values of the same (codebook, candidate, N, K, mode), interpolated in log2 M
        (the nearest one outside their range; no shift where nothing of it was measured)."""
        times = self.meas_.times
        anchors: dict[tuple[str, str, int, int, str], list[int]] = {}
        for (cb, m, n, k, mode), cell in times.items():
            for c in cell:
                anchors.setdefault((cb, c, n, k, mode), []).append(m)
        need = sorted({(cb, c, am, n, k, mode) for cb, c, m, n, k, mode in keys
                       for am in anchors.get((cb, c, n, k, mode), ())})
        raw_at = dict(zip(need, self.raw(need), strict=True))
        base = self.raw(keys)
        out = np.empty(len(keys))
        resids: dict[tuple[str, str, int, int, str], dict[int, float]] = {}  # one per launch, shared by its Ms
        for i, (cb, c, m, n, k, mode) in enumerate(keys):
            measured = times.get((cb, m, n, k, mode), {}).get(c)
            if measured is not None:
                out[i] = measured
                continue
            launch = (cb, c, n, k, mode)
            if (resid := resids.get(launch)) is None:
                resid = resids[launch] = {am: math.log(times[(cb, am, n, k, mode)][c]) - raw_at[(cb, c, am, n, k, mode)]
                                          for am in sorted(anchors.get(launch, ()))}
            out[i] = math.exp(base[i] + _interpolate(resid, m))
        return out


def _interpolate(resid: Mapping[int, float], m: int) -> float:
    """Residual at M, linear in log2 M between the measured M values around it; nearest outside; 0 if none."""
    if not resid:
        return 0.0
    ms = sorted(resid)
    lo = max((a for a in ms if a <= m), default=ms[0])
    hi = min((a for a in ms if a >= m), default=ms[-1])
    if lo == hi:
        return resid[lo]
    f = (math.log2(m) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return (1 - f) * resid[lo] + f * resid[hi]


# ---------------------------------------------------------------------------------------------------------
# 3. Cell tables over the profile


@dataclass(frozen=True)
class Scores:
    """Everything the trees and overlays are fit to, for one set of measurements.

    cells: (codebook, m, n, k, mode) -> {candidate id: µs} for every served-or-profile M of every measured
    geometry in every corpus mode (measured cells as measured, the others predicted); `measured` marks the
    measured ones. expected: geometry -> {identity: profile-weighted expected µs}."""

    cells: Mapping[LaunchKey, Mapping[str, float]]
    measured: frozenset[LaunchKey]
    expected: Mapping[Geometry, Mapping[int, float]]
    chosen: Mapping[Geometry, int]


def score(meas: Measurements, model: TimeModel, profile: Mapping[int, int]) -> Scores:
    """Fill every (geometry, M in the profile or SERVED_MS, corpus mode) cell and choose identities."""
    ms = sorted(set(profile) | set(SERVED_MS))
    keys = [(cb, c.id, m, n, k, mode) for cb, n, k in meas.geometries() for mode in meas.modes for m in ms
            for c in CANDIDATES if c.id in serving(m, n, k) and (cb, m, n, k, mode) not in meas.times]
    cells: dict[LaunchKey, dict[str, float]] = {key: dict(t) for key, t in meas.times.items()}
    for (cb, c, m, n, k, mode), t in zip(keys, model.predict(keys), strict=True):
        cells.setdefault((cb, m, n, k, mode), {})[c] = float(t)
    total = sum(profile.values()) * len(meas.modes)
    expected: dict[Geometry, dict[int, float]] = {}
    chosen: dict[Geometry, int] = {}
    for cb, n, k in meas.geometries():
        per: dict[int, float] = {}
        for ident in IDENTITIES:
            if canonical(ident, n, k) is None:
                continue
            best = [(w, _best_time(cells[(cb, m, n, k, mode)], ident, m, n, k))
                    for m, w in profile.items() for mode in meas.modes]
            if all(t is not None for _, t in best):
                per[ident] = math.fsum(w * t for w, t in best) / total
        expected[(cb, n, k)] = per
        limit = min(per.values()) * (1.0 + meas.noise_rel)
        chosen[(cb, n, k)] = min(i for i, e in per.items() if e <= limit)
    return Scores(cells, frozenset(meas.times), expected, chosen)


def _best_time(cell: Mapping[str, float], identity: int, m: int, n: int, k: int) -> float | None:
    serve = serving(m, n, k)
    ts = [t for c, t in cell.items() if serve.get(c) == identity]
    return min(ts) if ts else None


# ---------------------------------------------------------------------------------------------------------
# 4. Trees


@dataclass(frozen=True)
class TreeParams:
    min_samples_leaf: int
    max_leaf_nodes: int


@dataclass(frozen=True)
class TrainOptions:
    """What `train` may be told. Profile: M -> integer weight (policy.validate_profile form)."""

    profile: Mapping[int, int] = field(default_factory=lambda: dict(DEFAULT_PROFILE))
    identity_tree: TreeParams = TreeParams(min_samples_leaf=3, max_leaf_nodes=48)
    launch_tree: TreeParams = TreeParams(min_samples_leaf=4, max_leaf_nodes=160)
    predicted_weight: float = 0.5  # weight of predicted (unmeasured M) rows in the launch tree
    random_state: int = RANDOM_STATE
    # "trees" (the default) or "compact" (docs/policy.md §6, compact.py): opt-in, the default's bytes unchanged
    fallback: str = "trees"
    compact: CompactParams = field(default_factory=CompactParams)

    def __post_init__(self) -> None:
        if self.fallback not in FALLBACKS:
            raise InputError(f"fallback {self.fallback!r} must be one of {', '.join(FALLBACKS)}")

    def to_dict(self) -> dict[str, Any]:
        """The options a policy records; the compact ones only when the compact fallback is used, so a default
        policy's bytes stay what they were."""
        out = {"profile": {str(m): w for m, w in self.profile.items()},
               "identity_tree": vars(self.identity_tree) | {}, "launch_tree": vars(self.launch_tree) | {},
               "predicted_weight": self.predicted_weight, "random_state": self.random_state}
        if self.fallback != "trees":
            out |= {"fallback": self.fallback, "compact": vars(self.compact) | {}}
            del out["identity_tree"], out["launch_tree"]
        return out


@dataclass(frozen=True)
class _Rows:
    """Training rows of one tree: integer features X, log-regret targets Y (one column per option), weights,
    and per row a function giving the cost of a preference list under select's fall-through."""

    x: np.ndarray  # int64 [rows, features]
    y: np.ndarray  # float64 [rows, options]
    weight: np.ndarray  # float64 [rows]
    usable: np.ndarray  # bool [rows, options]: the option can serve the row
    fallback: np.ndarray  # float64 [rows]: log regret of the canonical pick when no list entry is usable


def _regret_rows(options: Sequence[Any], rows: Iterable[tuple[list[int], Mapping[Any, float], Any, float]]) -> _Rows:
    """rows: (features, {option: time}, canonical option, weight) -> _Rows (regrets vs the row's best)."""
    xs, ys, ws, us, fb = [], [], [], [], []
    for feats, times, canon, w in rows:
        best = min(times.values())
        reg = np.array([math.log(times[o] / best) if o in times else np.nan for o in options])
        usable = ~np.isnan(reg)
        worst = float(np.nanmax(reg))
        xs.append(feats)
        ys.append(np.where(usable, reg, worst))
        ws.append(w)
        us.append(usable)
        fb.append(math.log(times[canon] / best) if canon in times else worst)
    return _Rows(np.asarray(xs, dtype=np.int64), np.asarray(ys), np.asarray(ws), np.asarray(us), np.asarray(fb))


class _NodeRows:
    """A tree node's rows, with what every leaf below it asks of them computed once: which options some row can
    run, and each option's weighted mean log regret over the rows that can run it."""

    def __init__(self, rows: _Rows, idx: np.ndarray) -> None:
        self.rows, self.idx = rows, idx
        self._runs: np.ndarray | None = None
        self._means: dict[int, float] = {}

    def runs(self, j: int) -> bool:
        if self._runs is None:
            self._runs = self.rows.usable[self.idx].any(axis=0)
        return bool(self._runs[j])

    def mean(self, j: int) -> float:
        if j not in self._means:
            can = self.idx[self.rows.usable[self.idx, j]]
            self._means[j] = float(np.average(self.rows.y[can, j], weights=self.rows.weight[can]))
        return self._means[j]


def _preference(rows: _Rows, idx: np.ndarray, options: Sequence[Any],
                ancestors: Sequence[_NodeRows] = ()) -> tuple[Any, ...]:
    """Ordered list for the rows `idx` of a leaf. Greedy first: repeatedly append the option that most lowers
    the weighted summed log regret of select's pick (first usable entry, else the canonical) until none
    helps; ties go to the earlier option (smaller identity, registry order). Then every other option by its
    weighted mean log regret in the leaf, so a shape where the leading entries cannot run (an unseen K
    where a split is not effective) falls through to the next good one, not to the canonical candidate.
    An option no row of the leaf can run (an identity the leaf never saw) is ranked after those by its mean
    over the rows that can run it in the nearest of `ancestors` (the leaf's ancestors' rows, nearest first)
    that has some: else all such options would tie and fall back to registry order, whatever their speed."""
    y, usable, w = rows.y[idx], rows.usable[idx], rows.weight[idx]
    current = rows.fallback[idx].copy()
    open_ = np.ones(len(idx), dtype=bool)  # rows whose pick the list has not decided yet
    chosen: list[Any] = []
    while open_.any():
        gains = [float(np.sum(w * np.where(open_ & usable[:, j], current - y[:, j], 0.0)))
                 for j in range(len(options))]
        j = int(np.argmax(gains))
        if gains[j] <= 0.0 or options[j] in chosen:
            break
        chosen.append(options[j])
        current = np.where(open_ & usable[:, j], y[:, j], current)
        open_ &= ~usable[:, j]
    mean = np.average(y, axis=0, weights=w)
    in_leaf = usable.any(axis=0)

    def rank(j: int) -> tuple[int, float]:
        if in_leaf[j]:
            return 0, float(mean[j])
        for level, up in enumerate(ancestors, 1):
            if up.runs(j):
                return level, up.mean(j)
        return len(ancestors) + 1, 0.0

    rest = sorted((*rank(j), j) for j in range(len(options)) if options[j] not in chosen)
    return (*chosen, *(options[j] for *_, j in rest))


def _fit_tree(rows: _Rows, names: tuple[str, ...], options: Sequence[Any], params: TreeParams,
              random_state: int) -> Tree:
    """A multi-output regression tree on log regrets, rendered as an integer Tree with preference leaves."""
    from sklearn.tree import DecisionTreeRegressor

    reg = DecisionTreeRegressor(min_samples_leaf=params.min_samples_leaf, max_leaf_nodes=params.max_leaf_nodes,
                                random_state=random_state)
    x = rows.x.astype(np.float64)
    reg.fit(x, rows.y, sample_weight=rows.weight)
    t = reg.tree_
    paths = reg.decision_path(x).tocsc()  # rows x nodes: the nodes each row passes
    # Column i's row indices straight from the CSC arrays (slicing a column builds a matrix per node).
    node_rows = [np.sort(paths.indices[paths.indptr[i]:paths.indptr[i + 1]]) for i in range(t.node_count)]
    parent = np.full(t.node_count, -1)
    for i in range(t.node_count):
        if t.children_left[i] != -1:
            parent[t.children_left[i]] = parent[t.children_right[i]] = i

    groups = [_NodeRows(rows, idx) for idx in node_rows]  # shared by the leaves below each node

    def ancestors(node: int) -> list[_NodeRows]:
        """The rows of each node above `node`, nearest first."""
        up = []
        while (node := parent[node]) != -1:
            up.append(groups[node])
        return up

    nodes, leaves = [], []
    for i in range(t.node_count):
        if t.children_left[i] == -1:
            nodes.append((-1, 0, 0, 0, len(leaves)))
            leaves.append(_preference(rows, node_rows[i], options, ancestors(i)))
        else:  # x <= t (float midpoint) is x <= floor(t) for an integer x
            nodes.append((int(t.feature[i]), math.floor(t.threshold[i]), int(t.children_left[i]),
                          int(t.children_right[i]), 0))
    return Tree(names, tuple(nodes), tuple(leaves))


def _identity_rows(meas: Measurements, scores: Scores) -> tuple[_Rows, list[tuple[int, int]]]:
    """The identity tree's rows, one per geometry, and each row's (N, K)."""
    geos = meas.geometries()
    return _regret_rows(IDENTITIES, (
        (list(identity_features(cb, n, k, meas.sm_count).values()), scores.expected[(cb, n, k)], 1, 1.0)
        for cb, n, k in geos)), [(n, k) for _, n, k in geos]


def _launch_rows(meas: Measurements, scores: Scores, weight: float) -> tuple[_Rows, list[tuple[int, int]]]:
    """One row per (cell, identity that some candidate of the cell serves): the tree must pick launches for
    whatever identity the identity step hands it, not only the chosen ones. And each row's (N, K)."""
    rows, nk = [], []
    for key in sorted(scores.cells):
        cb, m, n, k, mode = key
        cell = scores.cells[key]
        w = 1.0 if key in scores.measured else weight
        for ident in IDENTITIES:
            times = {c: t for c, t in cell.items() if serving(m, n, k).get(c) == ident}
            canon = canonical(ident, n, k)
            if times and canon is not None:
                rows.append((list(_launch_tuple(cb, ident, m, n, k, mode, meas.sm_count)), times,
                             canon.id, w))
                nk.append((n, k))
    return _regret_rows(CANDIDATE_IDS, rows), nk


@dataclass(frozen=True)
class FallbackRows:
    """The training rows of both trees with the (N, K) of each row. A row depends only on its own geometry's
    scores, so the rows of a subset of geometries are a subset of the rows (in the same order): evaluation
    folds take them from one set instead of rebuilding them."""

    identity: _Rows
    identity_nk: np.ndarray  # int64 [rows, 2]
    launch: _Rows
    launch_nk: np.ndarray
    # Scores.expected of the geometries: the profile times the compact fallback's identity model learns from
    expected: Mapping[Geometry, Mapping[int, float]] = field(default_factory=dict)

    @classmethod
    def build(cls, meas: Measurements, scores: Scores, predicted_weight: float) -> FallbackRows:
        (ident, ident_nk), (launch, launch_nk) = _identity_rows(meas, scores), _launch_rows(meas, scores,
                                                                                              predicted_weight)
        return cls(ident, np.asarray(ident_nk, dtype=np.int64).reshape(-1, 2), launch,
                   np.asarray(launch_nk, dtype=np.int64).reshape(-1, 2), dict(scores.expected))

    def subset(self, keep: Callable[[int, int], bool]) -> FallbackRows:
        """The rows of the (N, K) geometries `keep(n, k)` accepts."""
        def take(rows: _Rows, nk: np.ndarray) -> tuple[_Rows, np.ndarray]:
            mask = np.fromiter((keep(int(n), int(k)) for n, k in nk), dtype=bool, count=len(nk))
            kept = _Rows(rows.x[mask], rows.y[mask], rows.weight[mask], rows.usable[mask], rows.fallback[mask])
            return kept, nk[mask]

        return FallbackRows(*take(self.identity, self.identity_nk), *take(self.launch, self.launch_nk),
                            {g: e for g, e in self.expected.items() if keep(g[1], g[2])})


# ---------------------------------------------------------------------------------------------------------
# 5. The policy


def fit_fallback(meas: Measurements, rows: FallbackRows, options: TrainOptions | None = None) -> Policy:
    """The policy of `meas` without overlays: its two trees fit to `rows` (FallbackRows.build of `meas`, or the
    subset of a larger set's for the geometries of `meas`)."""
    options = options or TrainOptions()
    profile = validate_profile(options.profile)
    source = dict(meas.source) | {"sklearn_version": _sklearn_version()}
    opts = options.to_dict() | {"profile": {str(m): w for m, w in profile.items()}, "noise_rel": meas.noise_rel,
                                "modes": list(meas.modes)}
    if options.fallback == "compact":
        expected = {g: rows.expected[g] for g in meas.geometries()}
        compact = fit_compact(meas.times, expected, meas.codebooks, meas.modes, profile, meas.sm_count,
                              options.compact)
        return Policy(source, opts, meas.codebooks, None, None, {}, {}, tuple(meas.geometries()), compact)
    identity_tree = _fit_tree(rows.identity, IDENTITY_FEATURES, IDENTITIES, options.identity_tree,
                              options.random_state)
    launch_tree = _fit_tree(rows.launch, LAUNCH_FEATURES, CANDIDATE_IDS, options.launch_tree, options.random_state)
    return Policy(source, opts, meas.codebooks, identity_tree, launch_tree, {}, {}, tuple(meas.geometries()))


def fit_policy(meas: Measurements, options: TrainOptions | None = None, model: TimeModel | None = None) -> Policy:
    """Learn a policy from `meas` (a whole corpus, or a training subset for evaluation)."""
    options = options or TrainOptions()
    model = model or TimeModel(random_state=options.random_state).fit(meas)
    scores = score(meas, model, validate_profile(options.profile))
    return with_overlays(meas, scores, fit_fallback(meas, FallbackRows.build(meas, scores, options.predicted_weight),
                                                    options))


def with_overlays(meas: Measurements, scores: Scores, bare: Policy) -> Policy:
    """`bare` (fit_fallback's) with the overlays that make it exact on the measured cells of `meas`."""
    identity_overlays: dict[IdentityKey, int] = {}
    by_geometry: dict[Geometry, list[LaunchKey]] = {}
    for key in meas.times:
        by_geometry.setdefault((key[0], key[2], key[3]), []).append(key)
    for geo, want in sorted(scores.chosen.items()):
        got, _ = bare.identity(*geo)
        if got != want and _slower(got, want, [(key[1:], meas.times[key]) for key in by_geometry[geo]],
                                   scores.expected[geo], meas.noise_rel):
            identity_overlays[geo] = want
    with_ids = replace(bare, identity_overlays=identity_overlays)
    launch_overlays: dict[LaunchKey, str] = {}
    for key, cell in sorted(meas.times.items()):
        cb, m, n, k, mode = key
        ident, _ = with_ids.identity(cb, n, k)
        want = best_launch(cell, ident, m, n, k, meas.noise_rel)
        got = with_ids.select(cb, m, n, k, mode).candidate
        if want is not None and (got not in cell or cell[got] > cell[want] * (1.0 + meas.noise_rel)):
            launch_overlays[key] = want
    return replace(with_ids, launch_overlays=launch_overlays)


def _slower(got: int, want: int, cells: list[tuple[tuple[int, int, int, str], Mapping[str, float]]],
            expected: Mapping[int, float], noise_rel: float) -> bool:
    """Identity `got` is measurably worse than `want`: over the profile, or in some measured cell (best launch
    of each), beyond the noise band."""
    if got not in expected or expected[got] > expected[want] * (1.0 + noise_rel):
        return True
    for (m, n, k, _), cell in cells:
        mine, best = _best_time(cell, got, m, n, k), _best_time(cell, want, m, n, k)
        if mine is None or (best is not None and mine > best * (1.0 + noise_rel)):
            return True
    return False


def _sklearn_version() -> str:
    import sklearn

    return sklearn.__version__


def check_corpus(corpus: Corpus) -> list[str]:
    """Refuse (InputError) a corpus with no record of the kernels' current code, and one where a codebook has
    no current cell in some mode or M that other codebooks have (a partial corpus would train a table blind
    for that codebook); return warnings (stale records left out)."""
    if not corpus.records:
        raise InputError(f"{corpus.folder}: the corpus holds no records (nothing to train on)")
    current = corpus.current
    if not current:
        raise InputError(f"{corpus.folder}: the corpus holds no record of the kernels' current code "
                         f"({corpus.stale} stale records): sweep again (only what changed is re-timed)")
    notes = []
    if corpus.stale:
        notes.append(f"{corpus.stale} of {len(corpus.records)} records were timed with code the kernels no longer "
                     "run (stale): left out")
    slices: dict[str, set[tuple[int, str]]] = {}
    for r in current:
        slices.setdefault(get(r.codebook).execution, set()).add((r.m, r.mode))
    every = set().union(*slices.values())
    for cb, have in sorted(slices.items()):
        if have != every:
            missing = ", ".join(f"M={m} {mode}" for m, mode in sorted(every - have))
            raise InputError(f"{corpus.folder}: codebook {cb} has no measured cell at {missing} (partial corpus)")
    return notes


def train(corpus: Corpus, options: TrainOptions | None = None) -> tuple[Policy, list[str]]:
    """The policy of a whole corpus and the warnings to show; see `check_corpus` for what is refused."""
    notes = check_corpus(corpus)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # sklearn's thread-pool notices are not the user's concern
        return fit_policy(Measurements.from_corpus(corpus), options), notes
