"""The dispatch policy (docs/policy.md §6, docs/policy.md): a file, and the normative `select` over it.

A policy is a total fallback (two integer decision trees, or opt-in the compact fallback of compact.py) plus exact
overlays for measured keys. It is
stored as canonical JSON (sorted keys, indent 1, trailing newline) carrying the SHA-256 of its own content
without the "digest" key, so a hand-edited file is refused. This module imports no scikit-learn: loading a
policy and selecting a kernel is plain Python over ints, the same steps the generated module renders.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from functools import cache, cached_property
from pathlib import Path
from typing import Any, Literal, NamedTuple

from ...kernels.codebooks import execution_key, k_error
from ...kernels.errors import InputError
from ...kernels.registry import BY_ID, CANDIDATES, Candidate, shape_error
from ..common.contract import SERVED_MS
from ..common.digests import canonical_bytes, content_digest, read_digested
from ..common.files import read_input, write_atomic
from .compact import KIND as COMPACT
from .compact import Compact, available
from .features import (
    IDENTITY_FEATURES,
    LAUNCH_FEATURES,
    MODES,
    identity_features,
    launch_features,
)

FORMAT = "gemv-dispatch-policy/1"
CANONICAL_WIDE = "wide.s1.t128.c1"  # canonical(1, k): valid for every shape and M
IDENTITIES: tuple[int, ...] = tuple(sorted({c.ksplit for c in CANDIDATES}))  # every identity a shape can get
# docs/policy.md §6 default: weight 0.5 on M = 1, the other 0.5 spread evenly over {2..16, 31}: 16 : 1 x 16.
DEFAULT_PROFILE: Mapping[int, int] = {1: len(SERVED_MS) - 1, **dict.fromkeys(SERVED_MS[1:], 1)}

IdentityKey = tuple[str, int, int]  # (codebook, n, k)
LaunchKey = tuple[str, int, int, int, str]  # (codebook, m, n, k, mode)


# ---------------------------------------------------------------------------------------------------------
# Candidates


def candidate_table() -> list[dict[str, Any]]:
    """kernels.registry.CANDIDATES as data, in registry order (what a policy was made for)."""
    return [{"id": c.id, "family": c.family, "ksplit": c.ksplit, "threads": c.threads, "cpt": c.cpt,
             "mma_tiles": c.mma_tiles, "staged": c.staged} for c in CANDIDATES]


def canonical_kpar(c: Candidate) -> bool:
    """A canonical launch of an identity > 1: dp4a kpar of 128 threads, one output each, unstaged (valid at every M)."""
    return c.family == "kpar" and c.threads == 128 and c.cpt == 1 and not c.mma_tiles and not c.staged


def canonical(identity: int, n: int, k: int) -> Candidate | None:
    """The canonical candidate of an identity for (N, K), or None when the identity is not available there.

    Identity 1: the wide t128 c1 launch. Otherwise the dp4a kpar t128 c1 launch whose identity for K equals
    it and that is valid for (1, n, k); a kpar launch needs no shared memory, so it is valid for every M."""
    if identity == 1:
        return BY_ID[CANONICAL_WIDE]
    for c in CANDIDATES:
        if canonical_kpar(c) and c.identity(k) == identity and c.valid(1, n, k):
            return c
    return None


def fits(candidate: Candidate, identity: int, m: int, n: int, k: int) -> bool:
    """The candidate may serve (M, N, K) under this identity: valid there, and of exactly that identity."""
    return candidate.valid(m, n, k) and candidate.identity(k) == identity


@cache
def serving(m: int, n: int, k: int) -> Mapping[str, int]:
    """Candidate id -> identity, for the candidates valid at (M, N, K) (`fits`, memoized: hot in training)."""
    return {c.id: c.identity(k) for c in CANDIDATES if c.valid(m, n, k)}


def tie_key(candidate: Candidate, m: int, n: int, k: int) -> tuple[int, str]:
    """docs/policy.md §6 tie order inside the noise band: no workspace, then smaller id. (The contract's first
    key, fewer launches, never separates two candidates: every candidate is one launch, kpar included.)"""
    return int(candidate.workspace_bytes(m, n, k) > 0), candidate.id


# ---------------------------------------------------------------------------------------------------------
# Profiles


def parse_profile(text: str) -> dict[int, int]:
    """"1:0.5,2:0.25,31:0.25" -> {1: 2, 2: 1, 31: 1}: M -> integer weight, scaled to the smallest integers.

    Weights may be integers or decimals (exact: decimal strings are read as fractions); InputError names the
    first bad entry."""
    weights: dict[int, Fraction] = {}
    for entry in (e.strip() for e in text.split(",")):
        m_text, sep, w_text = entry.partition(":")
        try:
            m, w = int(m_text), Fraction(w_text.strip())
        except (ValueError, ZeroDivisionError):
            m, w = 0, Fraction(-1)
        if not sep or m < 1 or w < 0:
            raise InputError(f"profile entry {entry!r} is not M:WEIGHT with M >= 1 and WEIGHT >= 0 "
                             "(e.g. --profile 1:0.5,4:0.25,16:0.25)")
        if m in weights:
            raise InputError(f"profile names M={m} twice")
        weights[m] = w
    scale = math.lcm(*(w.denominator for w in weights.values()))
    ints = {m: int(w * scale) for m, w in weights.items()}
    return validate_profile(ints)


def validate_profile(profile: Mapping[Any, Any]) -> dict[int, int]:
    """A profile as {M: weight} with int M >= 1 and int weight >= 0 (some positive), reduced by their gcd,
    zero weights dropped, sorted by M. Accepts the JSON form (M as strings)."""
    out: dict[int, int] = {}
    for key, weight in profile.items():
        try:
            m = int(key)
        except (TypeError, ValueError):
            m = 0
        if m < 1 or str(m) != str(key).strip() or not isinstance(weight, int) or isinstance(weight, bool) \
                or weight < 0:
            raise InputError(f"profile entry {key!r}: {weight!r} is not M >= 1 with an integer weight >= 0")
        if weight:
            out[m] = weight
    if not out:
        raise InputError("profile has no positive weight")
    g = math.gcd(*out.values())
    return {m: w // g for m, w in sorted(out.items())}


# ---------------------------------------------------------------------------------------------------------
# Trees


@dataclass(frozen=True)
class Tree:
    """An integer decision tree: node = (feature_index, threshold, left, right, leaf); feature_index -1 marks a
    leaf whose payload is leaves[leaf] (an ordered preference list); else go left when value <= threshold."""

    features: tuple[str, ...]
    nodes: tuple[tuple[int, int, int, int, int], ...]
    leaves: tuple[tuple[int | str, ...], ...]

    def leaf(self, values: Mapping[str, int]) -> tuple[int | str, ...]:
        """The preference list of the leaf `values` (a feature dict) falls in."""
        i = 0
        while True:
            f, threshold, left, right, leaf = self.nodes[i]
            if f == -1:
                return self.leaves[leaf]
            i = left if values[self.features[f]] <= threshold else right

    def to_dict(self) -> dict[str, Any]:
        return {"features": list(self.features), "nodes": [list(n) for n in self.nodes],
                "leaves": [list(leaf) for leaf in self.leaves]}

    @classmethod
    def from_dict(cls, data: Any, where: str, allowed: tuple[str, ...], choice: type) -> Tree:
        """Validate a tree: known features, int thresholds, child indexes pointing forward (no cycles), leaf
        indexes in range, leaves of `choice` (int identities or str candidate ids)."""
        if not isinstance(data, dict) or set(data) != {"features", "nodes", "leaves"}:
            raise InputError(f"{where}: a tree needs exactly the keys features, nodes, leaves")
        features, nodes, leaves = data["features"], data["nodes"], data["leaves"]
        if not isinstance(features, list) or any(f not in allowed for f in features):
            raise InputError(f"{where}: features must be names from {', '.join(allowed)}")
        if not isinstance(leaves, list) or not all(isinstance(leaf, list) and all(
                isinstance(c, choice) and not isinstance(c, bool) for c in leaf) for leaf in leaves):
            raise InputError(f"{where}: leaves must be lists of {choice.__name__}")
        if not isinstance(nodes, list) or not nodes:
            raise InputError(f"{where}: nodes must be a non-empty list")
        for i, node in enumerate(nodes):
            if not (isinstance(node, list) and len(node) == 5 and all(isinstance(v, int) and not isinstance(v, bool)
                                                                        for v in node)):
                raise InputError(f"{where}: node {i} must be 5 integers")
            f, _, left, right, leaf = node
            if f == -1:
                if not 0 <= leaf < len(leaves):
                    raise InputError(f"{where}: node {i} names leaf {leaf} of {len(leaves)}")
            elif not (0 <= f < len(features) and i < left < len(nodes) and i < right < len(nodes)):
                raise InputError(f"{where}: node {i} has a bad feature index or children")
        return cls(tuple(features), tuple(tuple(n) for n in nodes), tuple(tuple(leaf) for leaf in leaves))


# ---------------------------------------------------------------------------------------------------------
# The policy


def check_arguments(codebook: str, m: int, n: int, k: int, mode: str) -> str:
    """The execution key of `codebook` (any case); InputError, one line naming the argument, unless (codebook, M, N,
    K, mode) is something a policy's select answers: a known codebook, M, N, K integers >= 1, K a multiple of 32
    and of the codebook's super-block, the planes within 32-bit indexes, a known mode."""
    key = execution_key(codebook)
    for name, value in (("M", m), ("N", n), ("K", k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(f"{name}={value!r} must be an integer >= 1")
    if reason := shape_error(m, n, k) or k_error(key, k):
        raise InputError(reason)
    if mode not in MODES:
        raise InputError(f"mode {mode!r} must be one of {', '.join(MODES)}")
    return key


class Choice(NamedTuple):
    candidate: str
    identity: int
    source: Literal["overlay", "fallback"]


@dataclass(frozen=True)
class Policy:
    """A dispatch policy. `source` and `options` are free-form provenance (see docs/policy.md); `shapes` lists the
    measured (codebook, n, k) it was trained on (what certification covers at least). The fallback is either the
    two trees or, with `compact` set, the compact fallback (its trees are then None)."""

    source: Mapping[str, Any]
    options: Mapping[str, Any]
    codebooks: tuple[str, ...]
    identity_tree: Tree | None
    launch_tree: Tree | None
    identity_overlays: Mapping[IdentityKey, int]
    launch_overlays: Mapping[LaunchKey, str]
    shapes: tuple[IdentityKey, ...]
    compact: Compact | None = None

    def __post_init__(self) -> None:
        if (self.compact is None) != (self.identity_tree is not None and self.launch_tree is not None):
            raise ValueError("a policy's fallback is both trees or the compact fallback, not both or neither")

    @cached_property
    def digest(self) -> str:
        """SHA-256 of the policy file's content: derived, so a policy built or `replace`d in code has its own."""
        return self.to_dict()["digest"]

    @property
    def sm_count(self) -> int:
        return int(self.source["sm_count"])

    @property
    def profile(self) -> dict[int, int]:
        return validate_profile(self.options["profile"])

    # -- select (normative, docs/policy.md) ------------------------------------------------------------------------

    def check(self, codebook: str, m: int, n: int, k: int, mode: str) -> str:
        """The execution key of `codebook` (any case, a source format or a key); InputError unless (codebook, M,
        N, K, mode) is something select answers."""
        key = check_arguments(codebook, m, n, k, mode)
        if key not in self.codebooks:
            raise InputError(f"codebook {codebook!r} is not in this policy ({', '.join(self.codebooks)})")
        return key

    def identity(self, codebook: str, n: int, k: int) -> tuple[int, bool]:
        """(identity, decided by an overlay) for (codebook, N, K); arguments already checked."""
        if (codebook, n, k) in self.identity_overlays:
            return self.identity_overlays[(codebook, n, k)], True
        if self.compact is not None:
            return self.compact.pick_identity(codebook, n, k, self.sm_count, available(n, k)), False
        assert self.identity_tree is not None
        prefs = self.identity_tree.leaf(identity_features(codebook, n, k, self.sm_count))
        return next((i for i in prefs if canonical(i, n, k) is not None), 1), False

    def select(self, codebook: str, m: int, n: int, k: int, mode: str = "graph") -> Choice:
        """The candidate for (codebook, M, N, K, mode): total over valid arguments, and batch-invariant (the
        identity depends on (codebook, N, K) only). InputError for invalid arguments."""
        codebook = self.check(codebook, m, n, k, mode)
        ident, overlay = self.identity(codebook, n, k)
        pick = self.launch_overlays.get((codebook, m, n, k, mode))
        if pick is not None and fits(BY_ID[pick], ident, m, n, k):
            return Choice(pick, ident, "overlay")
        if self.compact is not None:  # every launch of the identity valid here: the canonical one among them
            options = [i for i, c in enumerate(CANDIDATES) if fits(c, ident, m, n, k)]
            pick = CANDIDATES[self.compact.pick_launch(codebook, m, n, k, mode, self.sm_count, options)].id
            return Choice(pick, ident, "overlay" if overlay else "fallback")
        assert self.launch_tree is not None
        prefs = self.launch_tree.leaf(launch_features(codebook, ident, m, n, k, mode, self.sm_count))
        pick = next((c for c in prefs if fits(BY_ID[c], ident, m, n, k)), None)
        if pick is None:
            pick = canonical(ident, n, k).id  # type: ignore[union-attr]  # ident is available by construction
        return Choice(pick, ident, "overlay" if overlay else "fallback")

    # -- table keys (certification) ------------------------------------------------------------------------

    def table_shapes(self) -> list[IdentityKey]:
        """Every (codebook, n, k) the table knows: trained shapes and the keys of both overlays, sorted."""
        keys = set(self.shapes) | set(self.identity_overlays)
        keys |= {(cb, n, k) for cb, _, n, k, _ in self.launch_overlays}
        return sorted(keys)

    # -- file ------------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the file, "digest" included."""
        by_cb: dict[str, list[list[Any]]] = {cb: [] for cb in self.codebooks}
        for (cb, n, k), ident in sorted(self.identity_overlays.items()):
            by_cb[cb].append([n, k, ident])
        launches: dict[str, list[list[Any]]] = {cb: [] for cb in self.codebooks}
        for (cb, m, n, k, mode), cand in sorted(self.launch_overlays.items()):
            launches[cb].append([m, n, k, mode, cand])
        shapes: dict[str, list[list[int]]] = {cb: [] for cb in self.codebooks}
        for cb, n, k in sorted(self.shapes):
            shapes[cb].append([n, k])
        obj = {
            "format": FORMAT, "source": dict(self.source), "options": dict(self.options),
            "candidates": candidate_table(), "codebooks": list(self.codebooks),
            "fallback": self._fallback_dict(),
            "identity_overlays": by_cb, "launch_overlays": launches, "shapes": shapes,
        }
        obj["digest"] = content_digest(obj)
        return obj

    def _fallback_dict(self) -> dict[str, Any]:
        """The trees as they always were (no "kind" key: a default policy's bytes are unchanged), or the compact
        fallback with "kind": "compact"."""
        if self.compact is not None:
            return self.compact.to_dict()
        assert self.identity_tree is not None and self.launch_tree is not None
        return {"identity_tree": self.identity_tree.to_dict(), "launch_tree": self.launch_tree.to_dict()}

    def to_bytes(self) -> bytes:
        return canonical_bytes(self.to_dict())

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "policy") -> Policy:
        """Parse and validate a policy file's bytes; InputError (one line, naming `where`) on any defect."""
        return _parse(read_digested(data, where, FORMAT, "policy", "train"), where)

    def save(self, path: str | Path) -> None:
        """Write the file atomically (common.files.write_atomic): a reader sees the old file or the new one."""
        write_atomic(Path(path), self.to_bytes())


def load(path: str | Path) -> Policy:
    """Read and validate a policy file; InputError for a missing, malformed or hand-edited file."""
    path = Path(path)
    return Policy.from_bytes(read_input(path, "policy"), str(path))


def _parse(obj: dict[str, Any], where: str) -> Policy:
    expected = {"format", "digest", "source", "options", "candidates", "codebooks", "fallback",
                "identity_overlays", "launch_overlays", "shapes"}
    if set(obj) != expected:
        raise InputError(f"{where}: keys {sorted(set(obj) ^ expected)} missing or unexpected")
    if obj["candidates"] != candidate_table():
        raise InputError(f"{where}: made for another candidate registry than the installed kernels")
    source, options, codebooks = obj["source"], obj["options"], obj["codebooks"]
    if not (isinstance(source, dict) and isinstance(source.get("sm_count"), int) and source["sm_count"] >= 1):
        raise InputError(f"{where}: source must carry an integer sm_count >= 1")
    if not isinstance(options, dict) or not isinstance(options.get("profile"), dict):
        raise InputError(f"{where}: options must carry a profile")
    validate_profile(options["profile"])
    if not (isinstance(codebooks, list) and codebooks == sorted(set(codebooks))
            and all(isinstance(c, str) for c in codebooks)):
        raise InputError(f"{where}: codebooks must be a sorted list of distinct names")
    fallback = obj["fallback"]
    if not isinstance(fallback, dict):
        raise InputError(f"{where}: fallback must be an object")
    kind = fallback.get("kind", "trees")
    identity_tree = launch_tree = compact = None
    if kind == COMPACT:
        compact = Compact.from_dict(fallback, f"{where}: fallback")
    elif kind != "trees" or "kind" in fallback:  # the trees are written without a kind
        raise InputError(f"{where}: fallback kind {kind!r} is not known "
                         f"(this tool reads {COMPACT!r}, or the trees without a kind)")
    elif set(fallback) != {"identity_tree", "launch_tree"}:
        raise InputError(f"{where}: fallback must hold identity_tree and launch_tree")
    else:
        identity_tree = Tree.from_dict(fallback["identity_tree"], f"{where}: identity_tree", IDENTITY_FEATURES, int)
        launch_tree = Tree.from_dict(fallback["launch_tree"], f"{where}: launch_tree", LAUNCH_FEATURES, str)
        if any(c not in BY_ID for leaf in launch_tree.leaves for c in leaf):
            raise InputError(f"{where}: launch_tree names an unknown candidate")
    ident = _rows(obj["identity_overlays"], codebooks, (int, int, int), f"{where}: identity_overlays")
    launch = _rows(obj["launch_overlays"], codebooks, (int, int, int, str, str), f"{where}: launch_overlays")
    shapes = _rows(obj["shapes"], codebooks, (int, int), f"{where}: shapes")
    if any(row[3] not in MODES or row[4] not in BY_ID for _, row in launch):
        raise InputError(f"{where}: launch_overlays has an unknown mode or candidate")
    policy = Policy(
        source=source, options=options, codebooks=tuple(codebooks), identity_tree=identity_tree,
        launch_tree=launch_tree,
        identity_overlays={(cb, n, k): i for cb, (n, k, i) in ident},
        launch_overlays={(cb, m, n, k, mode): c for cb, (m, n, k, mode, c) in launch},
        shapes=tuple((cb, n, k) for cb, (n, k) in shapes), compact=compact,
    )
    if policy.digest != obj["digest"]:  # valid, but not as `train` writes it (e.g. overlays out of order)
        raise InputError(f"{where}: not in the canonical form `train` writes (rewrite it with `train`)")
    return policy


def _rows(data: Any, codebooks: list[str], types: tuple[type, ...], where: str) -> Iterable[tuple[str, list[Any]]]:
    """(codebook, row) of a {codebook: [[...], ...]} table whose rows match `types`."""
    if not isinstance(data, dict) or not set(data) <= set(codebooks):
        raise InputError(f"{where}: must map policy codebooks to lists of rows")
    out = []
    for cb, rows in sorted(data.items()):
        for row in rows if isinstance(rows, list) else [None]:
            if not (isinstance(row, list) and len(row) == len(types)
                    and all(isinstance(v, t) and not isinstance(v, bool) for v, t in zip(row, types, strict=True))):
                raise InputError(f"{where}: {cb} row {row!r} does not match {[t.__name__ for t in types]}")
            out.append((cb, row))
    return out
