"""What the compact fallback costs per uncached key, rendered as select would render it (compact_fallback_study.py).

Both evaluators take, per key, what select already computes before its fallback (the served codebook's traits,
the available identities, the candidates valid at (M, N, K) with their identities: the product's validity code,
0.13 µs of C today) and do the rest: the identity model over every available identity (features and trees),
the argmin, then the launch model over the valid candidates of that identity, the argmin. Only trees that can
change an argmin are kept (Oblivious.live). Leaves are ints; every sum and compare is integer, so the pure-Python
evaluator, the C one (cc -O2, in a temporary folder) and numpy's integer prediction must pick alike on every key.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gemv_dispatch.dispatch.learn.compact import (
    FAMILIES,
    IDENTITY_CONSTANT,
    IDENTITY_FEATURES,
    LAUNCH_CONSTANT,
    LAUNCH_FEATURES,
    LEAF_SCALE,
    Oblivious,
    Traits,
    available,
    identity_row,
    launch_row,
)
from gemv_dispatch.dispatch.learn.features import execution_codebooks
from gemv_dispatch.dispatch.learn.policy import SERVED_MS, serving
from gemv_dispatch.kernels.registry import BY_ID, CANDIDATES

KEYS = 1000
LANES = 8  # options per block of the C evaluator: a key has about 5 identities and 8 launches of one identity
MAX_OPTIONS = 64  # launches of one identity at one key, at most (the registry has 63 candidates)


class IntModel:
    """An Oblivious model as select would hold it: the live trees, thresholds and leaves as Python ints."""

    def __init__(self, model: Oblivious, names: tuple[str, ...], constant: set[str]) -> None:
        live = model.live({names.index(f) for f in constant})
        self.depth = model.feats.shape[1]
        self.feats = model.feats[live].tolist()
        self.thr = model.thr[live].tolist()
        self.leaves = np.rint(model.leaves[live] * LEAF_SCALE).astype(np.int64).tolist()
        self.trees = len(self.feats)
        self.total = len(model.feats)

        self.predict = self.rendered()

    def rendered(self) -> Callable[[list[int]], int]:
        """The trees as a generated module would spell them: one sum of leaf-table lookups, each index d compares
        shifted into place (a walk loop in Python costs about three times as much)."""
        terms = []
        for t, (fs_, ts) in enumerate(zip(self.feats, self.thr, strict=True)):
            bits = " | ".join(f"((x[{f}] > {v}) << {self.depth - 1 - d})"
                              for d, (f, v) in enumerate(zip(fs_, ts, strict=True)))
            terms.append(f"V[{t}][{bits}]")
        scope = {"V": self.leaves}
        self.py_source = f"V = {self.leaves!r}\ndef predict(x):\n    return 0 + {' + '.join(terms) or '0'}\n"
        exec(self.py_source, scope)
        return scope["predict"]

    def c_code(self, tag: str) -> str:
        """The leaf tables and predict_<tag>(X, options, acc): X[feature][option], LANES options at a time. Each tree
        is spelled out with its features and thresholds as immediates (as a renderer would write it): per level one
        compare over a contiguous row of LANES ints, which -O2 vectorizes; the leaf lookups are the only gathers."""
        assert all(-(1 << 15) < v < (1 << 15) - 1 for r in self.thr for v in r), "thresholds beyond int16"
        leaves = ",\n".join("{" + ",".join(map(str, r)) + "}" for r in self.leaves) or "{0}"
        lines = [f"static const int32_t {tag}_V[{max(1, self.trees)}][{1 << self.depth}] = {{{leaves}}};",
                 f"static void predict_{tag}(int16_t (*X)[MAXO + LANES], int nopt, int64_t *acc) {{",
                 "  for (int j0 = 0; j0 < nopt; j0 += LANES) {",
                 "    int64_t s[LANES] = {0}; int16_t i[LANES];"]
        for t, (fs_, ts) in enumerate(zip(self.feats, self.thr, strict=True)):
            bits = " | ".join(f"((X[{f}][j0 + j] > {v}) << {self.depth - 1 - d})"
                              for d, (f, v) in enumerate(zip(fs_, ts, strict=True)))
            lines.append(f"    for (int j = 0; j < LANES; j++) i[j] = {bits};")
            lines.append(f"    for (int j = 0; j < LANES; j++) s[j] += {tag}_V[{t}][i[j]];")
        lines += ["    for (int j = 0; j < LANES; j++) acc[j0 + j] = s[j];", "  }", "}"]
        return "\n".join(lines) + "\n"

    def nbytes(self) -> int:
        """As integer arrays: a byte per feature index, 4 per threshold and per leaf (both fit int32)."""
        return self.trees * self.depth * (1 + 4) + self.trees * (1 << self.depth) * 4


def random_keys(rng: random.Random) -> list[tuple]:
    """Seeded valid keys: a served codebook, M of SERVED_MS, N log-uniform in 64 .. 256 Ki (a multiple of 8),
    K log-uniform in 256 .. 64 Ki (a multiple of 256), graph mode; with what select knows before the fallback."""
    keys = []
    books = execution_codebooks()
    while len(keys) < KEYS:
        cb, m = rng.choice(books), rng.choice(SERVED_MS)
        n = max(64, round(2 ** rng.uniform(6, 18) / 8) * 8)
        k = max(256, round(2 ** rng.uniform(8, 16) / 256) * 256)
        cands = [(list(BY_ID).index(c), i) for c, i in serving(m, n, k).items()]
        keys.append((cb, Traits.of(cb), m, n, k, 0, available(n, k), cands))
    return keys


def select_py(key: tuple, ident: IntModel, launch: IntModel, sm: int) -> tuple[int, int]:
    """The fallback as the generated module would run it: (identity, candidate index)."""
    _, tr, m, n, k, mode, avail, cands = key
    best = min((ident.predict(identity_row(tr, n, k, s, sm)), s) for s in avail)[1]
    pick = min((launch.predict(launch_row(tr, CANDIDATES[c], m, n, k, mode, sm)), c) for c, i in cands if i == best)[1]
    return best, pick


C_TEMPLATE = Path(__file__).with_name("compact_select.c.in")  # a %-format template of the C evaluator


def c_source(ident: IntModel, launch: IntModel, sm: int) -> str:
    col = lambda f: ",".join(str(int(f(c))) for c in CANDIDATES)  # noqa: E731
    head = (f"#include <stdint.h>\n#define SM {sm}\n#define LANES {LANES}\n#define MAXO {MAX_OPTIONS}\n"
            + ident.c_code("ID") + launch.c_code("LA"))
    return head + C_TEMPLATE.read_text() % {"fam": col(lambda c: FAMILIES.index(c.family)),
                                            "ks": col(lambda c: c.ksplit),
                            "th": col(lambda c: c.threads), "cpt": col(lambda c: c.cpt),
                            "mma": col(lambda c: c.mma_tiles), "st": col(lambda c: c.staged),
                            "out": col(lambda c: c.outputs_per_cta), "nkeys": KEYS}


def measure(launch_model: Oblivious, identity_model: Oblivious, sm: int, say: Callable[[str], None]) -> dict:
    """Sizes, compares and times per uncached key; Python, C and numpy must pick alike."""
    assert launch_model.feats.shape[1] == identity_model.feats.shape[1], "one DEPTH in the C evaluator"
    ident = IntModel(identity_model, IDENTITY_FEATURES, IDENTITY_CONSTANT)
    launch = IntModel(launch_model, LAUNCH_FEATURES, LAUNCH_CONSTANT)
    keys = random_keys(random.Random(0))
    py_times, picks = [], []
    for _ in range(3):
        t = time.perf_counter()
        picks = [select_py(key, ident, launch, sm) for key in keys]
        py_times.append((time.perf_counter() - t) / len(keys) * 1e6)
    # numpy's integer prediction over every tree (the dropped ones add one constant per argmin)
    agree_np = 0
    for key, (pi, pc) in zip(keys, picks, strict=True):
        _, tr, m, n, k, mode, avail, cands = key
        si = identity_model.predict(np.asarray([identity_row(tr, n, k, s, sm) for s in avail]), integer=True)
        bi = min(zip(si.tolist(), avail, strict=True))[1]
        mine = [c for c, i in cands if i == bi]
        sl = launch_model.predict(np.asarray([launch_row(tr, CANDIDATES[c], m, n, k, mode, sm) for c in mine]),
                                  integer=True)
        agree_np += (bi, min(zip(sl.tolist(), mine, strict=True))[1]) == (pi, pc)
    compares = [len(key[6]) * ident.trees * ident.depth + sum(i == pi for _, i in key[7]) * launch.trees * launch.depth
                for key, (pi, _) in zip(keys, picks, strict=True)]
    out = {"keys": len(keys), "python_us": round(min(py_times), 1), "numpy_agreement": agree_np,
           "compares_mean": round(float(np.mean(compares))), "compares_max": int(max(compares)),
           "identity_trees_live": ident.trees, "identity_trees": ident.total,
           "launch_trees_live": launch.trees, "launch_trees": launch.total,
           "launches_per_key_mean": round(float(np.mean([sum(i == pi for _, i in key[7])
                                                          for key, (pi, _) in zip(keys, picks, strict=True)])), 2),
           "identities_per_key_mean": round(float(np.mean([len(key[6]) for key in keys])), 2),
           "model_bytes": {"identity": ident.nbytes(), "launch": launch.nbytes()},
           "python_source_bytes": len(ident.py_source) + len(launch.py_source)}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "compact.c")
        src.write_text(c_source(ident, launch, sm))
        out["c_source_bytes"] = src.stat().st_size
        subprocess.run(["cc", "-O2", "-std=gnu99", "-o", f"{tmp}/compact", str(src)], check=True)
        lines = []
        for _, tr, m, n, k, mode, avail, cands in keys:
            lines.append(" ".join(map(str, [tr.weights, tr.block_bytes, tr.asymmetric, tr.high_bits, tr.table, m, n,
                                            k, mode, len(avail), *avail, len(cands), *(v for p in cands for v in p)])))
        runs = [subprocess.run([f"{tmp}/compact"], input="\n".join(lines) + "\n", capture_output=True, text=True,
                               check=True) for _ in range(3)]
        out["c_us"] = round(min(float(r.stderr.split()[0]) for r in runs), 3)
        c_picks = [tuple(map(int, line.split())) for line in runs[0].stdout.split("\n") if line]
        out["c_agreement"] = sum(a == b for a, b in zip(c_picks, picks, strict=True))
    say(f"cost: {json.dumps(out)}")
    return out


def save(path: Path, launch_model: Oblivious, identity_model: Oblivious, sm: int) -> None:
    np.savez(path, sm=sm, **{f"{tag}_{part}": getattr(model, part) for tag, model in
                             (("launch", launch_model), ("identity", identity_model))
                             for part in ("base", "feats", "thr", "leaves")})


def main() -> None:
    """Measure saved models again (a quieter machine, a changed evaluator) and store the figures in the study's
    result: compact_render.py MODELS.npz [RESULT.json]"""
    data = np.load(sys.argv[1])
    launch_model, identity_model = (Oblivious(float(data[f"{tag}_base"]), data[f"{tag}_feats"], data[f"{tag}_thr"],
                                              data[f"{tag}_leaves"]) for tag in ("launch", "identity"))
    cost = measure(launch_model, identity_model, int(data["sm"]), print)
    if len(sys.argv) > 2:
        path = Path(sys.argv[2])
        result = json.loads(path.read_text())
        result["cost"] = cost
        path.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
