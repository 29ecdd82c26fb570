"""The compact fallback (docs/policy.md §6, "The compact fallback"): integer features, boosted oblivious trees with
integer leaves, an identity model and a launch model. Opt-in (`train --fallback compact`).

Why this form: a fallback that models log time over what a launch physically does generalizes to unseen model
families far better than preference-list trees (lab/results/compact-fallback-study-*), and an *oblivious* tree
(every node of a level shares feature and threshold) is d compares forming a leaf index, so a generated module
and a C header evaluate it exactly with integer sums. Every feature is an int; logs are `ilog2` (64ths of an
octave, bit for bit the same in C's uint64); leaves are ints (x LEAF_SCALE): an argmin is the same everywhere.

Evaluation (`CompactModel`, `Compact`) is plain Python: `policy.select` uses it. Fitting (`fit_compact`) needs
numpy, imported inside the fitting functions so that loading a policy stays standard library only.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from ...kernels.codebooks import formats_of, get
from ...kernels.errors import BLOCK, InputError
from ...kernels.registry import BY_ID, CANDIDATES, Candidate, mma_row_tiles, row_tile
from ..common.contract import MODES, SERVED_MS
from .features import codebook_features

if TYPE_CHECKING:
    import numpy as np

KIND = "compact"
FAMILIES = ("wide", "direct", "kpar")
LEAF_SCALE = 1 << 24  # leaves (natural log of µs) as ints: a leaf rounds by <= 2^-25, 200 trees by < 1e-5
# The grid the teacher labels: N and K at every octave and half octave (3·2^e) over the inventories' range.
GRID_N = tuple(sorted({v for e in range(7, 19) for v in (1 << e, 3 << (e - 1))}))
GRID_K = tuple(sorted({v for e in range(8, 16) for v in (1 << e, 3 << (e - 1))} | {1 << 16}))

LAUNCH_FEATURES = ("lg_wbytes", "lg_n", "lg_k", "lg_m", "bpw_x64", "asymmetric", "high_bits", "table", "superblock",
                   "family", "split", "lg_width", "threads", "cta_threads", "cpt", "mma_tiles", "staged", "tile",
                   "passes", "lg_ctas", "waves_x64", "whole_waves", "last_fill_x64", "lg_bytes_per_cta",
                   "lg_outputs_per_cta", "lg_bytes_passes", "mode")
# Equal across the options of one launch argmin (one key, one identity): a tree over these alone adds the same
# integer to every option, so the fit drops it. Not the split or the width: identity 1 holds every launch whose
# partitions are one block wide, whatever its split.
LAUNCH_CONSTANT = frozenset({"lg_wbytes", "lg_n", "lg_k", "lg_m", "bpw_x64", "asymmetric", "high_bits", "table",
                             "superblock", "mode"})
IDENTITY_FEATURES = ("lg_wbytes", "lg_n", "lg_k", "bpw_x64", "asymmetric", "high_bits", "table", "superblock",
                     "split", "lg_width", "lg_ctas", "waves_x64", "lg_bytes_per_cta")
IDENTITY_CONSTANT = frozenset({"lg_wbytes", "lg_n", "lg_k", "bpw_x64", "asymmetric", "high_bits", "table",
                               "superblock"})

Geometry = tuple[str, int, int]


# ---------------------------------------------------------------------------------------------------------
# Integer features


def ilog2(x: int) -> int:
    """64·log2(x) rounded down bit by bit, for an int 1 <= x < 2^63: the octave from bit_length, six fractional
    bits by squaring a 17-bit mantissa (m·m < 2^34: exact in uint64). The C header runs the same loop."""
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
    """A codebook's integer decode facts (aliases of one execution key share them)."""

    weights: int  # per GGUF block
    block_bytes: int
    asymmetric: int
    high_bits: int
    table: int

    @classmethod
    @cache
    def of(cls, codebook: str) -> Traits:
        """The decode flags as the trees' features define them (features.codebook_features), with the block's
        weights, which a super-block format's true byte count needs."""
        return cls(get(formats_of(codebook)[0]).weights, **codebook_features(codebook))

    def shape(self, n: int, k: int) -> list[int]:
        """lg_wbytes .. superblock: what the launch and identity features share (weight bytes true)."""
        wbytes = n * (k // self.weights) * self.block_bytes
        return [ilog2(wbytes), ilog2(n), ilog2(k), 64 * 8 * self.block_bytes // self.weights, self.asymmetric,
                self.high_bits, self.table, int(self.weights > BLOCK)]


@cache  # select's hot path: a fact of the candidate
def cta_threads(c: Candidate) -> int:
    """Threads of one CTA: the registry's block (a direct CTA holds its S partitions, a kpar CTA one)."""
    return math.prod(c.launch_geometry(1, 1, BLOCK)[1])


def launch_row(tr: Traits, c: Candidate, m: int, n: int, k: int, mode: int, sm: int) -> list[int]:
    """LAUNCH_FEATURES of a launch valid at (M, N, K); mode as its index in MODES."""
    lg_w, lg_n, lg_k, bpw, asym, high, table, sb = tr.shape(n, k)
    width = -(-(k // BLOCK) // c.ksplit)
    outputs = c.outputs_per_cta
    ctas = -(-n // outputs) * (c.ksplit if c.family == "kpar" else 1)
    tile = mma_row_tiles(m) * 16 if c.mma_tiles else row_tile(m, c.cpt)
    passes = -(-m // tile)
    lg_ctas = ilog2(ctas)
    return [lg_w, lg_n, lg_k, ilog2(m), bpw, asym, high, table, sb, FAMILIES.index(c.family), c.ksplit,
            ilog2(width), c.threads, cta_threads(c), c.cpt, c.mma_tiles, int(c.staged), tile, passes, lg_ctas,
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
# The models as a policy holds them


@dataclass(frozen=True)
class CompactModel:
    """Boosted oblivious trees in integer form: score(x) = Σ_t leaves[t][index_t(x)], where index_t's bit d (most
    significant first) is x[feature] > threshold of level d. No base: it is the same for every option of an
    argmin. Only trees that can change an argmin are kept (the fit drops the others)."""

    features: tuple[str, ...]
    depth: int
    scale: int
    trees: tuple[tuple[tuple[tuple[int, int], ...], tuple[int, ...]], ...]  # ((feature, threshold) per level, leaves)

    def score(self, x: Sequence[int]) -> int:
        total = 0
        for levels, leaves in self.trees:
            i = 0
            for f, t in levels:
                i = 2 * i + (x[f] > t)
            total += leaves[i]
        return total

    def to_dict(self) -> dict[str, Any]:
        return {"features": list(self.features), "depth": self.depth, "leaf_scale": self.scale,
                "trees": [{"levels": [list(lv) for lv in levels], "leaves": list(leaves)}
                          for levels, leaves in self.trees]}

    @classmethod
    def from_dict(cls, data: Any, where: str, names: tuple[str, ...]) -> CompactModel:
        """Validate: exactly the features `names` in order, depth 1..8, per tree `depth` levels of (feature index,
        int threshold) and 2^depth int leaves."""
        if not isinstance(data, dict) or set(data) != {"features", "depth", "leaf_scale", "trees"}:
            raise InputError(f"{where}: a compact model needs exactly the keys depth, features, leaf_scale, trees")
        depth, trees = data["depth"], data["trees"]
        if data["features"] != list(names):
            raise InputError(f"{where}: features must be {', '.join(names)} in this order")
        if not (_is_int(depth) and 1 <= depth <= 8 and _is_int(data["leaf_scale"]) and data["leaf_scale"] >= 1):
            raise InputError(f"{where}: depth must be an integer 1..8 and leaf_scale an integer >= 1")
        if not isinstance(trees, list):
            raise InputError(f"{where}: trees must be a list")
        out = []
        for t, tree in enumerate(trees):
            ok = isinstance(tree, dict) and set(tree) == {"levels", "leaves"}
            levels = tree.get("levels") if ok else None
            leaves = tree.get("leaves") if ok else None
            ok = ok and isinstance(levels, list) and len(levels) == depth and all(
                isinstance(lv, list) and len(lv) == 2 and all(map(_is_int, lv)) and 0 <= lv[0] < len(names)
                and abs(lv[1]) < 1 << 62 for lv in levels)
            ok = ok and isinstance(leaves, list) and len(leaves) == 1 << depth and all(
                _is_int(v) and abs(v) < 1 << 40 for v in leaves)
            if not ok:
                raise InputError(f"{where}: tree {t} must hold {depth} levels [feature, threshold] and "
                                 f"{1 << depth} integer leaves")
            out.append((tuple((f, v) for f, v in levels), tuple(leaves)))
        return cls(tuple(names), depth, data["leaf_scale"], tuple(out))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class Compact:
    """The compact fallback: the identity model over a shape's available identities, the launch model over the
    launches of that identity valid at the key. Arguments are checked by the caller (policy.select)."""

    identity: CompactModel
    launch: CompactModel

    def pick_identity(self, codebook: str, n: int, k: int, sm: int, available: Sequence[int]) -> int:
        """The available identity of least score; ties: the smaller S."""
        tr = Traits.of(codebook)
        return min((self.identity.score(identity_row(tr, n, k, s, sm)), s) for s in available)[1]

    def pick_launch(self, codebook: str, m: int, n: int, k: int, mode: str, sm: int,
                    options: Sequence[int]) -> int:
        """The option (indexes into CANDIDATES) of least score; ties: registry order."""
        tr, mi = Traits.of(codebook), MODES.index(mode)
        return min((self.launch.score(launch_row(tr, CANDIDATES[c], m, n, k, mi, sm)), c) for c in options)[1]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": KIND, "identity_model": self.identity.to_dict(), "launch_model": self.launch.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> Compact:
        if set(data) != {"kind", "identity_model", "launch_model"}:
            raise InputError(f"{where}: a compact fallback holds exactly kind, identity_model, launch_model")
        return cls(CompactModel.from_dict(data["identity_model"], f"{where}: identity_model", IDENTITY_FEATURES),
                   CompactModel.from_dict(data["launch_model"], f"{where}: launch_model", LAUNCH_FEATURES))


# ---------------------------------------------------------------------------------------------------------
# Boosted oblivious trees (numpy, offline)


@dataclass
class Oblivious:
    """base + Σ_t leaves[t][index_t(x)], index_t's bit d (most significant first) = x[feats[t,d]] > thr[t,d]."""

    base: float
    feats: np.ndarray  # [T, D] feature indices
    thr: np.ndarray  # [T, D] int64 thresholds
    leaves: np.ndarray  # [T, 2^D] float

    def index(self, x: np.ndarray) -> np.ndarray:
        import numpy as np

        idx = np.zeros((x.shape[0], len(self.feats)), dtype=np.int64)
        for d in range(self.feats.shape[1]):
            idx = idx * 2 + (x[:, self.feats[:, d]] > self.thr[:, d])
        return idx

    def predict(self, x: np.ndarray, integer: bool = False) -> np.ndarray:
        """Float prediction, or the integer one (base and leaves rounded to LEAF_SCALE units), in row chunks."""
        import numpy as np

        leaves = np.rint(self.leaves * LEAF_SCALE).astype(np.int64) if integer else self.leaves
        base = round(self.base * LEAF_SCALE) if integer else self.base
        out = np.empty(len(x), dtype=np.int64 if integer else np.float64)
        cols = np.arange(len(self.feats))
        for lo in range(0, len(x), 20000):
            out[lo:lo + 20000] = base + leaves[cols, self.index(x[lo:lo + 20000])].sum(axis=1)
        return out

    def live(self, constant: set[int]) -> np.ndarray:
        """Trees that split on some feature outside `constant`: only they can change an argmin."""
        import numpy as np

        return np.array([any(int(f) not in constant for f in fs_) for fs_ in self.feats], dtype=bool)

    def integer(self, names: tuple[str, ...], constant: frozenset[str]) -> CompactModel:
        """The live trees with leaves rounded to ints (x LEAF_SCALE), as a policy stores them."""
        import numpy as np

        live = self.live({names.index(f) for f in constant})
        leaves = np.rint(self.leaves[live] * LEAF_SCALE).astype(np.int64).tolist()
        trees = tuple((tuple(zip(map(int, fs_), map(int, ts), strict=True)), tuple(lv))
                      for fs_, ts, lv in zip(self.feats[live], self.thr[live], leaves, strict=True))
        return CompactModel(names, int(self.feats.shape[1]), LEAF_SCALE, trees)


def fit_oblivious(x: np.ndarray, y: np.ndarray, trees: int, depth: int, rate: float, borders: int = 64,
                  l2: float = 1.0, weight: np.ndarray | None = None) -> Oblivious:
    """Greedy least-squares boosting: per level the (feature, threshold) of largest gain summed over the current
    2^level leaves, thresholds among up to `borders` quantiles of each feature's values (values that occur, so
    ints). One bincount over (leaf, feature, bin) per level scores every split at once. Deterministic."""
    import numpy as np

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
            if not np.isfinite(gain[f, b]):  # no feature varies: a level that splits nothing (lg_wbytes < 64·63)
                feats[t, d], thr[t, d] = 0, 32766
                leaf = leaf * 2
                continue
            feats[t, d], thr[t, d] = f, cuts[f][b]
            leaf = leaf * 2 + (bins[:, f] > b)
        s = np.bincount(leaf, weights=w * r, minlength=1 << depth)
        c = np.bincount(leaf, weights=w, minlength=1 << depth)
        leaves[t] = rate * s / (c + l2)
        pred += leaves[t][leaf]
    return Oblivious(base, feats, thr, leaves)


# ---------------------------------------------------------------------------------------------------------
# Training: the launch model, a teacher, the identity model distilled from both measured and taught shapes


def available(n: int, k: int) -> list[int]:
    """The identities a shape can get (policy.canonical is not None), smallest first."""
    from .policy import IDENTITIES, canonical  # policy imports this module: a late import breaks the cycle

    return [i for i in IDENTITIES if canonical(i, n, k) is not None]


@dataclass
class Launches:
    """Every launch valid at (M, N, K) for each geometry, M in the profile ∪ SERVED_MS, and mode: features and
    the group each belongs to, so per-(geometry, identity, M, mode) minima are array operations."""

    geos: list[Geometry]
    keys: list[tuple[int, str, int, str]]  # (geometry index, candidate id, m, mode)
    ident: np.ndarray  # identity of each launch
    x: np.ndarray  # [rows, LAUNCH_FEATURES]

    @classmethod
    def build(cls, geos: Sequence[Geometry], ms: Sequence[int], modes: Sequence[str], sm: int) -> Launches:
        import numpy as np

        from .policy import serving

        keys, ident, x = [], [], []
        for g, (cb, n, k) in enumerate(geos):
            tr = Traits.of(cb)
            for mode in modes:
                for m in ms:
                    for cid, i in serving(m, n, k).items():
                        keys.append((g, cid, m, mode))
                        ident.append(i)
                        x.append(launch_row(tr, BY_ID[cid], m, n, k, MODES.index(mode), sm))
        return cls(list(geos), keys, np.asarray(ident), np.asarray(x, dtype=np.int64).reshape(-1, len(LAUNCH_FEATURES)))

    def profile_times(self, logt: np.ndarray, profile: Mapping[int, int], modes: Sequence[str]) -> np.ndarray:
        """[geometries, IDENTITIES] profile-weighted best time per identity (inf where not available)."""
        import numpy as np

        from .policy import IDENTITIES

        best: dict[tuple[int, int, int, str], float] = {}
        for (g, _, m, mode), i, t in zip(self.keys, self.ident, np.exp(logt), strict=True):
            if m in profile:
                key = (g, int(i), m, mode)
                best[key] = min(best.get(key, math.inf), float(t))
        out = np.full((len(self.geos), len(IDENTITIES)), math.inf)
        for g in sorted({key[0] for key in self.keys}):  # the geometries these rows hold
            _, n, k = self.geos[g]
            for i in available(n, k):
                out[g, IDENTITIES.index(i)] = sum(w * best[(g, i, m, mode)] for m, w in profile.items()
                                                  for mode in modes)
        return out


def identity_table(geos: Sequence[Geometry], sm: int) -> tuple[list[tuple[int, int]], np.ndarray]:
    """(geometry index, identity) of every available identity and its IDENTITY_FEATURES."""
    import numpy as np

    pairs, x = [], []
    for g, (cb, n, k) in enumerate(geos):
        tr = Traits.of(cb)
        for i in available(n, k):
            pairs.append((g, i))
            x.append(identity_row(tr, n, k, i, sm))
    return pairs, np.asarray(x, dtype=np.int64).reshape(-1, len(IDENTITY_FEATURES))


def grid_geometries(codebooks: Sequence[str], exclude: set[Geometry], size: int) -> list[Geometry]:
    """A seeded sample of `size` grid shapes (the whole grid, ~4,000 shapes of ~700 launches each, costs
    gigabytes of features for little: neighbouring half octaves teach much the same)."""
    every = [(cb, n, k) for cb in codebooks for n in GRID_N for k in GRID_K
             if (cb, n, k) not in exclude and k % Traits.of(cb).weights == 0 and available(n, k)]
    return sorted(random.Random(0).sample(every, min(size, len(every))))


@dataclass(frozen=True)
class CompactParams:
    """The study's choices (lab/experiments/compact_fallback_study.py)."""

    launch_trees: int = 200
    launch_depth: int = 6
    identity_trees: int = 100
    identity_depth: int = 6
    rate: float = 0.15  # shrinkage of every model
    teacher_trees: int = 400
    teacher_depth: int = 8
    grid: int = 600  # grid shapes the teacher labels
    grid_weight: float = 1.0  # weight of a grid shape's rows beside a measured training shape's


def centered(y: np.ndarray, keys: Sequence[tuple], cell: bool) -> np.ndarray:
    """log time less its group's mean: the (codebook, N, K, mode) of a launch (the teacher: M values stay
    comparable) or also its M (the launch model: one argmin compares one cell). An argmin never sees the mean, and
    the trees spend no split on the shape's scale. keys: (codebook, m, n, k, mode, candidate)."""
    import numpy as np

    group = np.unique([f"{cb}/{n}/{k}/{mode}/{m if cell else 0}" for cb, m, n, k, mode, _ in keys],
                      return_inverse=True)[1].reshape(-1)
    return y - (np.bincount(group, weights=y) / np.bincount(group))[group]


def launch_data(times: Mapping[tuple[str, int, int, int, str], Mapping[str, float]],
                sm: int) -> tuple[list[tuple], np.ndarray, np.ndarray]:
    """(keys, features, log µs) of every measured (cell, candidate), sorted."""
    import numpy as np

    keys = [(cb, m, n, k, mode, cid) for (cb, m, n, k, mode), cell in sorted(times.items()) for cid in sorted(cell)]
    x = np.asarray([launch_row(Traits.of(cb), BY_ID[cid], m, n, k, MODES.index(mode), sm)
                    for cb, m, n, k, mode, cid in keys], dtype=np.int64).reshape(-1, len(LAUNCH_FEATURES))
    y = np.asarray([math.log(times[key[:5]][key[5]]) for key in keys])
    return keys, x, y


def fit_identity(expected: Mapping[Geometry, Mapping[int, float]], grid: Launches, teacher: Oblivious,
                 profile: Mapping[int, int], modes: Sequence[str], sm: int, params: CompactParams) -> Oblivious:
    """The student: log(E_i / E_1) per available identity i (E: profile-weighted time of the identity's best
    launch; identity 1 is available for every shape) of the measured training shapes (`expected`, the harness's
    profile times) beside the teacher's over the grid."""
    import numpy as np

    from .policy import IDENTITIES

    labels = grid.profile_times(teacher.predict(grid.x), profile, modes)
    grid_pairs, grid_x = identity_table(grid.geos, sm)
    geos = sorted(expected)
    pairs, x = identity_table(geos, sm)
    y = np.asarray([math.log(expected[geos[g]][i] / expected[geos[g]][1]) if i in expected[geos[g]] else math.nan
                    for g, i in pairs])
    yg = np.asarray([math.log(labels[g, IDENTITIES.index(i)] / labels[g, 0]) for g, i in grid_pairs])
    keep = ~np.isnan(y)  # an identity the harness could not score on a training shape
    xs = np.concatenate([x[keep], grid_x])
    ys = np.concatenate([y[keep], yg])
    ws = np.concatenate([np.ones(int(keep.sum())), np.full(len(yg), params.grid_weight)])
    return fit_oblivious(xs, ys, params.identity_trees, params.identity_depth, params.rate, weight=ws)


def fit_compact(times: Mapping[tuple[str, int, int, int, str], Mapping[str, float]],
                expected: Mapping[Geometry, Mapping[int, float]], codebooks: Sequence[str], modes: Sequence[str],
                profile: Mapping[int, int], sm: int, params: CompactParams | None = None) -> Compact:
    """The compact fallback of measured `times` (cell -> {candidate: µs}) and the training shapes' profile times
    (`expected`, train.Scores.expected): launch model, teacher, grid, identity model; integer form."""
    params = params or CompactParams()
    keys, x, y = launch_data(times, sm)
    launch = fit_oblivious(x, centered(y, keys, cell=True), params.launch_trees, params.launch_depth, params.rate)
    teacher = fit_oblivious(x, centered(y, keys, cell=False), params.teacher_trees, params.teacher_depth,
                            params.rate)
    ms = sorted(set(profile) | set(SERVED_MS))
    measured = {(cb, n, k) for cb, _, n, k, _ in times}
    grid = Launches.build(grid_geometries(codebooks, measured, params.grid), ms, modes, sm)
    student = fit_identity(expected, grid, teacher, profile, modes, sm, params)
    return Compact(student.integer(IDENTITY_FEATURES, IDENTITY_CONSTANT),
                   launch.integer(LAUNCH_FEATURES, LAUNCH_CONSTANT))
