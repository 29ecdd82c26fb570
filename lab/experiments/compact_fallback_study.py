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
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fallback_study as fs
from gemv_dispatch.dispatch.common.contract import MODES
from gemv_dispatch.dispatch.common.paths import shapes_dir
from gemv_dispatch.dispatch.learn import evaluate as ev
from gemv_dispatch.dispatch.learn.policy import IDENTITIES, SERVED_MS, validate_profile
from gemv_dispatch.dispatch.learn.train import (
    FAMILIES,
    Measurements,
    TimeModel,
    TrainOptions,
    score,
    serving,
)
from gemv_dispatch.dispatch.measure.corpus import load
from gemv_dispatch.dispatch.measure.shapes import load_inventories
from gemv_dispatch.kernels.codebooks import formats_of, get
from gemv_dispatch.kernels.errors import BLOCK
from gemv_dispatch.kernels.registry import BY_ID, Candidate, mma_row_tiles, row_tile

Geometry = tuple[str, int, int]
LEAF_SCALE = 1 << 24  # leaf values (natural log of µs) as ints: a tree rounds by <= 2^-25, 200 trees by < 1e-5
# The grid the teacher labels: N and K at every octave and half octave (3·2^e) over the inventories' range.
GRID_N = tuple(sorted({v for e in range(7, 19) for v in (1 << e, 3 << (e - 1))}))
GRID_K = tuple(sorted({v for e in range(8, 16) for v in (1 << e, 3 << (e - 1))} | {1 << 16}))

LAUNCH_FEATURES = ("lg_wbytes", "lg_n", "lg_k", "lg_m", "bpw_x64", "asymmetric", "high_bits", "table", "superblock",
                   "family", "split", "lg_width", "threads", "cta_threads", "cpt", "mma_tiles", "staged", "tile",
                   "passes", "lg_ctas", "waves_x64", "whole_waves", "last_fill_x64", "lg_bytes_per_cta",
                   "lg_outputs_per_cta", "lg_bytes_passes", "mode")
# Equal across the options of one launch argmin (one key, one identity): trees over these alone are dropped. Not the
# split or the width: identity 1 holds every launch whose partitions are one block wide, whatever its split.
LAUNCH_CONSTANT = {"lg_wbytes", "lg_n", "lg_k", "lg_m", "bpw_x64", "asymmetric", "high_bits", "table", "superblock",
                   "mode"}
IDENTITY_FEATURES = ("lg_wbytes", "lg_n", "lg_k", "bpw_x64", "asymmetric", "high_bits", "table", "superblock",
                     "split", "lg_width", "lg_ctas", "waves_x64", "lg_bytes_per_cta")
IDENTITY_CONSTANT = {"lg_wbytes", "lg_n", "lg_k", "bpw_x64", "asymmetric", "high_bits", "table", "superblock"}


# ---------------------------------------------------------------------------------------------------------
# Integer features


def ilog2(x: int) -> int:
    """64·log2(x), rounded down bit by bit, for an int x >= 1: the octave from bit_length, six fractional bits by
    squaring a 17-bit mantissa (m·m < 2^34: exact in uint64). C: the same loop, bit for bit."""
    e = x.bit_length() - 1
    mant = x >> (e - 16) if e >= 16 else x << (16 - e)  # [2^16, 2^17): 1.0 .. 2.0 in 16 fractional bits
    out = e
    for _ in range(6):
        mant = mant * mant >> 16
        out <<= 1
        if mant >= 1 << 17:
            mant >>= 1
            out |= 1
    return out


@dataclass(frozen=True)
class Traits:
    """A codebook's integer decode facts."""

    weights: int  # per GGUF block
    block_bytes: int
    asymmetric: int
    high_bits: int
    table: int

    @classmethod
    def of(cls, codebook: str) -> Traits:
        book = get(formats_of(codebook)[0])
        return cls(book.weights, book.block_bytes, int(book.asymmetric), int(book.high_bits),
                   int(book.name.startswith("IQ")))

    def shape(self, n: int, k: int) -> list[int]:
        """lg_wbytes .. superblock: what the launch and identity features share."""
        wbytes = n * (k // self.weights) * self.block_bytes
        return [ilog2(wbytes), ilog2(n), ilog2(k), 64 * 8 * self.block_bytes // self.weights, self.asymmetric,
                self.high_bits, self.table, int(self.weights > BLOCK)]


def launch_row(tr: Traits, c: Candidate, m: int, n: int, k: int, mode: int, sm: int) -> list[int]:
    """LAUNCH_FEATURES of a valid launch (its ksplit effective for K, as candidates_for keeps it)."""
    lg_w, lg_n, lg_k, bpw, asym, high, table, sb = tr.shape(n, k)
    kb = k // BLOCK
    width = -(-kb // c.ksplit)
    outputs = c.outputs_per_cta
    ctas = -(-n // outputs) * (c.ksplit if c.family == "kpar" else 1)
    cta_threads = c.threads * (1 if c.family == "kpar" else c.ksplit)
    tile = mma_row_tiles(m) * 16 if c.mma_tiles else row_tile(m, c.cpt)
    passes = -(-m // tile)
    lg_ctas = ilog2(ctas)
    return [lg_w, lg_n, lg_k, ilog2(m), bpw, asym, high, table, sb, FAMILIES.index(c.family), c.ksplit,
            ilog2(width), c.threads, cta_threads, c.cpt, c.mma_tiles, int(c.staged), tile, passes, lg_ctas,
            64 * ctas // sm, -(-ctas // sm), 64 * ((ctas - 1) % sm + 1) // sm, lg_w - lg_ctas, ilog2(outputs),
            lg_w + ilog2(passes), mode]


def identity_row(tr: Traits, n: int, k: int, s: int, sm: int) -> list[int]:
    """IDENTITY_FEATURES of identity S for (N, K): its partition width and the canonical grid (128 outputs per
    CTA column, S partitions)."""
    head = tr.shape(n, k)
    ctas = -(-n // 128) * s
    lg_ctas = ilog2(ctas)
    return [*head, s, ilog2(-(-(k // BLOCK) // s)), lg_ctas, 64 * ctas // sm, head[0] - lg_ctas]


# ---------------------------------------------------------------------------------------------------------
# Boosted oblivious trees


@dataclass
class Oblivious:
    """base + Σ_t leaves[t][index_t(x)], index_t's bit d (most significant first) = x[feats[t,d]] > thr[t,d]."""

    base: float
    feats: np.ndarray  # [T, D] feature indices
    thr: np.ndarray  # [T, D] int64 thresholds
    leaves: np.ndarray  # [T, 2^D] float

    def index(self, x: np.ndarray) -> np.ndarray:
        idx = np.zeros((x.shape[0], len(self.feats)), dtype=np.int64)
        for d in range(self.feats.shape[1]):
            idx = idx * 2 + (x[:, self.feats[:, d]] > self.thr[:, d])
        return idx

    def predict(self, x: np.ndarray, integer: bool = False) -> np.ndarray:
        """Float prediction, or the integer one (base and leaves rounded to LEAF_SCALE units), in row chunks."""
        leaves = np.rint(self.leaves * LEAF_SCALE).astype(np.int64) if integer else self.leaves
        base = round(self.base * LEAF_SCALE) if integer else self.base
        out = np.empty(len(x), dtype=np.int64 if integer else np.float64)
        cols = np.arange(len(self.feats))
        for lo in range(0, len(x), 20000):
            out[lo:lo + 20000] = base + leaves[cols, self.index(x[lo:lo + 20000])].sum(axis=1)
        return out

    def live(self, constant: set[int]) -> np.ndarray:
        """Trees that split on some feature outside `constant`: only they can change an argmin."""
        return np.array([any(int(f) not in constant for f in fs_) for fs_ in self.feats], dtype=bool)


def fit_oblivious(x: np.ndarray, y: np.ndarray, trees: int, depth: int, rate: float, borders: int = 64,
                  l2: float = 1.0, weight: np.ndarray | None = None) -> Oblivious:
    """Greedy least-squares boosting: per level the (feature, threshold) of largest gain summed over the current
    2^level leaves, thresholds among up to `borders` quantiles of each feature's values (values that occur, so
    ints). One bincount over (leaf, feature, bin) per level scores every split at once."""
    n, nf = x.shape
    w = np.ones(n) if weight is None else weight.astype(np.float64)
    cuts = []
    for f in range(nf):
        u = np.unique(x[:, f])[:-1]  # a threshold at the maximum splits nothing
        if len(u) > borders:
            u = np.unique(np.quantile(x[:, f], np.linspace(0, 1, borders + 2)[1:-1], method="lower"))
        cuts.append(u.astype(np.int64))
    nb = borders + 1
    # x <= cuts[f][b] <=> bin <= b
    bins = np.stack([np.searchsorted(cuts[f], x[:, f], side="left") for f in range(nf)], axis=1)
    flat = (bins + np.arange(nf) * nb).astype(np.int64)
    valid = np.zeros((nf, nb), dtype=bool)
    for f in range(nf):
        valid[f, :len(cuts[f])] = True
    base = float(np.average(y, weights=w))
    pred = np.full(n, base)
    feats = np.zeros((trees, depth), dtype=np.int64)
    thr = np.zeros((trees, depth), dtype=np.int64)
    leaves = np.zeros((trees, 1 << depth))
    for t in range(trees):
        r = y - pred
        leaf = np.zeros(n, dtype=np.int64)
        for d in range(depth):
            size = (1 << d) * nf * nb
            idx = (leaf[:, None] * (nf * nb) + flat).ravel()
            s = np.bincount(idx, weights=np.repeat(w * r, nf), minlength=size).reshape(1 << d, nf, nb)
            c = np.bincount(idx, weights=np.repeat(w, nf), minlength=size).reshape(1 << d, nf, nb)
            sl, cl = np.cumsum(s, axis=2), np.cumsum(c, axis=2)
            sr, cr = sl[:, :, -1:] - sl, cl[:, :, -1:] - cl
            gain = (sl * sl / (cl + l2) + sr * sr / (cr + l2)).sum(axis=0)
            gain[~valid] = -np.inf
            f, b = np.unravel_index(int(np.argmax(gain)), gain.shape)
            feats[t, d], thr[t, d] = f, cuts[f][b]
            leaf = leaf * 2 + (bins[:, f] > b)
        s = np.bincount(leaf, weights=w * r, minlength=1 << depth)
        c = np.bincount(leaf, weights=w, minlength=1 << depth)
        leaves[t] = rate * s / (c + l2)
        pred += leaves[t][leaf]
    return Oblivious(base, feats, thr, leaves)


# ---------------------------------------------------------------------------------------------------------
# Rows: every served launch of a set of geometries, at every M of the profile


@dataclass
class Launches:
    """Every launch valid at (M, N, K) for each geometry, M in the profile ∪ SERVED_MS, and mode: features and
    the group each belongs to, so per-(geometry, identity, M, mode) minima and argmins are array operations."""

    geos: list[Geometry]
    keys: list[tuple[int, str, int, str]]  # (geometry index, candidate id, m, mode)
    ident: np.ndarray  # identity of each launch
    x: np.ndarray  # [rows, LAUNCH_FEATURES]

    @classmethod
    def build(cls, geos: Sequence[Geometry], ms: Sequence[int], modes: Sequence[str], sm: int) -> Launches:
        keys, ident, x = [], [], []
        for g, (cb, n, k) in enumerate(geos):
            tr = Traits.of(cb)
            for mode in modes:
                for m in ms:
                    for cid, i in serving(m, n, k).items():
                        keys.append((g, cid, m, mode))
                        ident.append(i)
                        x.append(launch_row(tr, BY_ID[cid], m, n, k, MODES.index(mode), sm))
        return cls(list(geos), keys, np.asarray(ident), np.asarray(x, dtype=np.int64))

    def profile_times(self, logt: np.ndarray, profile: Mapping[int, int], modes: Sequence[str]) -> np.ndarray:
        """[geometries, IDENTITIES] profile-weighted best time per identity (inf where not available)."""
        best: dict[tuple[int, int, int, str], float] = {}
        for (g, _, m, mode), i, t in zip(self.keys, self.ident, np.exp(logt), strict=True):
            if m in profile:
                key = (g, int(i), m, mode)
                best[key] = min(best.get(key, math.inf), float(t))
        out = np.full((len(self.geos), len(IDENTITIES)), math.inf)
        for g in sorted({key[0] for key in self.keys}):  # the geometries these rows hold
            _, n, k = self.geos[g]
            for i in fs.available(n, k):
                out[g, IDENTITIES.index(i)] = sum(w * best[(g, i, m, mode)] for m, w in profile.items()
                                                  for mode in modes)
        return out

    def argmins(self, score: np.ndarray, identity: Mapping[Geometry, int]) -> dict[tuple[str, int, int, int, str], str]:
        """Per (geometry, M, mode): the launch of least score among those of the geometry's identity (ties: id)."""
        out: dict[tuple[str, int, int, int, str], tuple[float, str]] = {}
        for (g, cid, m, mode), i, s in zip(self.keys, self.ident, score, strict=True):
            cb, n, k = self.geos[g]
            if i == identity[(cb, n, k)]:
                key = (cb, m, n, k, mode)
                if key not in out or (s, cid) < out[key]:
                    out[key] = (s, cid)
        return {key: cid for key, (_, cid) in out.items()}


def identity_table(geos: Sequence[Geometry], sm: int) -> tuple[list[tuple[int, int]], np.ndarray]:
    """(geometry index, identity) of every available identity and its IDENTITY_FEATURES."""
    pairs, x = [], []
    for g, (cb, n, k) in enumerate(geos):
        tr = Traits.of(cb)
        for i in fs.available(n, k):
            pairs.append((g, i))
            x.append(identity_row(tr, n, k, i, sm))
    return pairs, np.asarray(x, dtype=np.int64)


def pick_identities(geos: Sequence[Geometry], pairs: Sequence[tuple[int, int]],
                    score: np.ndarray) -> dict[Geometry, int]:
    best: dict[int, tuple[float, int]] = {}
    for (g, i), s in zip(pairs, score, strict=True):
        if g not in best or (s, i) < best[g]:
            best[g] = (s, i)
    return {geos[g]: i for g, (_, i) in best.items()}


def log_ratio_to_one(expected: Mapping[int, float]) -> dict[int, float]:
    """The identity model's target: log(E_i / E_1); identity 1 (the wide launch) is available for every shape."""
    return {i: math.log(e / expected[1]) for i, e in expected.items()}


# ---------------------------------------------------------------------------------------------------------
# Leave-one-family-out


@dataclass(frozen=True)
class Params:
    launch_trees: int = 200
    launch_depth: int = 6
    launch_rate: float = 0.15
    identity_trees: int = 100
    identity_depth: int = 6
    identity_rate: float = 0.15
    grid_weight: float = 1.0  # weight of a grid shape's rows beside a measured training shape's


def fit_identity(train_expected: Mapping[Geometry, Mapping[int, float]], grid: Launches, grid_pairs, grid_x,
                 teacher: Oblivious, profile: Mapping[int, int], modes: Sequence[str], sm: int,
                 params: Params) -> Oblivious:
    """The student: measured training shapes' profile times beside the teacher's over the grid."""
    labels = grid.profile_times(teacher.predict(grid.x), profile, modes)
    geos = sorted(train_expected)
    pairs, x = identity_table(geos, sm)
    y = [log_ratio_to_one(train_expected[geos[g]]).get(i, math.nan) for g, i in pairs]
    yg = [math.log(labels[g, IDENTITIES.index(i)] / labels[g, 0]) for g, i in grid_pairs]
    keep = ~np.isnan(np.asarray(y))  # an identity the harness could not score on a training shape
    xs = np.concatenate([x[keep], grid_x])
    ys = np.concatenate([np.asarray(y)[keep], yg])
    ws = np.concatenate([np.ones(int(keep.sum())), np.full(len(yg), params.grid_weight)])
    return fit_oblivious(xs, ys, params.identity_trees, params.identity_depth, params.identity_rate, weight=ws)


def grid_geometries(codebooks: Sequence[str], exclude: set[Geometry], size: int) -> list[Geometry]:
    """A seeded sample of `size` grid shapes (the whole grid, ~4,000 shapes of ~700 launches each, costs
    gigabytes of features for little: neighbouring half octaves teach much the same)."""
    every = [(cb, n, k) for cb in codebooks for n in GRID_N for k in GRID_K
             if (cb, n, k) not in exclude and k % Traits.of(cb).weights == 0 and fs.available(n, k)]
    return sorted(random.Random(0).sample(every, min(size, len(every))))


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
    parser.add_argument("--launch-trees", type=int, default=Params.launch_trees)
    parser.add_argument("--identity-trees", type=int, default=Params.identity_trees)
    parser.add_argument("--depth", type=int, default=Params.launch_depth)
    parser.add_argument("--rate", type=float, default=Params.launch_rate, help="shrinkage of both runtime models")
    parser.add_argument("--grid", type=int, default=600, help="grid shapes the teacher labels")
    parser.add_argument("--grid-weight", type=float, default=Params.grid_weight)
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
    params = Params(launch_trees=args.launch_trees, identity_trees=args.identity_trees, launch_depth=args.depth,
                    identity_depth=args.depth, grid_weight=args.grid_weight, launch_rate=args.rate,
                    identity_rate=args.rate)
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
    mkeys = [(cb, m, n, k, mode, cid) for (cb, m, n, k, mode), cell in sorted(meas.times.items())
             for cid in sorted(cell)]
    mx = np.asarray([launch_row(Traits.of(cb), BY_ID[cid], m, n, k, MODES.index(mode), sm)
                     for cb, m, n, k, mode, cid in mkeys], dtype=np.int64)
    my = np.asarray([math.log(meas.times[key[:5]][key[5]]) for key in mkeys])
    mnk = np.asarray([(key[2], key[3]) for key in mkeys])

    def centered(cell: bool) -> np.ndarray:
        """A launch decision compares the launches of one (codebook, N, K, mode), each M weighted by the profile
        (identity) or of one cell (launch): subtracting that group's mean log time changes no argmin, and frees
        the trees from modelling the shape's scale."""
        group = np.unique([f"{cb}/{n}/{k}/{mode}/{m if cell else 0}" for cb, m, n, k, mode, _ in mkeys],
                          return_inverse=True)[1]
        return my - (np.bincount(group, weights=my) / np.bincount(group))[group]

    y_launch = {"none": my, "shape": centered(False), "cell": centered(True)}[args.center]
    y_teacher = centered(False)
    separate = bool(args.teacher_trees) or args.center == "cell"
    teacher_trees = args.teacher_trees or params.launch_trees

    def fit_pair(mask: np.ndarray | slice) -> tuple[Oblivious, Oblivious]:
        """(launch model, teacher): one model unless a separate teacher is asked for or the launch target
        cannot compare M values (cell-centered)."""
        launch = fit_oblivious(mx[mask], y_launch[mask], params.launch_trees, params.launch_depth,
                               params.launch_rate)
        if not separate:
            return launch, launch
        return launch, fit_oblivious(mx[mask], y_teacher[mask], teacher_trees, args.teacher_depth,
                                     params.launch_rate)
    every = Launches.build(meas.geometries(), ms, modes, sm)  # the measured geometries at every profile M
    grid = Launches.build(grid_geometries(meas.codebooks, set(meas.geometries()), args.grid), ms, modes, sm)
    grid_pairs, grid_x = identity_table(grid.geos, sm)
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
        student = fit_identity(train_expected, grid, grid_pairs, grid_x, teacher, profile, modes, sm, params)
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
            pick = sub.argmins(lt_int, ids)
            if name == "compact":
                pick_f = sub.argmins(lt_float, ids)
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
        "params": params.__dict__ | {"center": args.center, "grid": args.grid, "teacher_trees": teacher_trees,
                                      "teacher_depth": args.teacher_depth if separate else params.launch_depth},
        "methods": summarize(results, invariant),
        "agreement": {k: {"agree": a, "of": b, "rate": a / b if b else None} for k, (a, b) in agree.items()}}
    oracle = {fk: invariant[fk[1]] for fk in results["compact"] if fk[1] in invariant}
    out["invariant-oracle"] = ev.breakdown(oracle, key_of=lambda fk: fk[1], family_of=lambda fk: fk[0])
    if not args.no_cost:
        say("full-corpus fit for the cost")
        launch, teacher = fit_pair(slice(None))
        student = fit_identity(dict(scores.expected), grid, grid_pairs, grid_x, teacher, profile, modes, sm, params)
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
